"""Refresh/reuse layer schedules and their compilation to static `lax.scan` segments (DESIGN.md, mechanism 2).

A schedule is a tuple of L flags, True for a refresh layer (R: computes routing) and False for a reuse layer (U:
inherits the selection of the last R layer). It is split into *runs* (one R followed by its U layers); runs of equal
length that follow each other form a *segment*, executed as an outer `lax.scan` over the runs whose body is the
refresh layer followed by an inner `lax.scan` over the reuse layers. A periodic schedule with P | L is one segment.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import numpy as np

from ssv_jax.config import is_int


class Segment(NamedTuple):
    """`count` consecutive runs of one refresh layer and `run - 1` reuse layers, from layer `start`: one static
    `lax.scan` over the runs."""

    start: int  # first layer
    run: int  # layers per run (1 refresh + run-1 reuse)
    count: int  # runs in this segment


def periodic(n_layers: int, period: int, offset: int = 0) -> tuple[bool, ...]:
    """Refresh at layer 0 and at every layer i >= offset with (i - offset) % period == 0."""
    if not (isinstance(period, int) and 1 <= period <= n_layers):
        raise ValueError(f"refresh period P={period!r} is invalid; accepted: an integer in [1, {n_layers}]")
    if not (isinstance(offset, int) and 0 <= offset < n_layers):
        raise ValueError(f"schedule offset={offset!r} is invalid; accepted: an integer in [0, {n_layers})")
    return tuple(i == 0 or (i >= offset and (i - offset) % period == 0) for i in range(n_layers))


def canonical(schedule):
    """A schedule in the one hashable form that policies, profiles and the jitted paths use, checked as far as
    it can be without the layer count: None (refresh every layer), a refresh period P >= 1 (int), or a string of
    "R"/"U" per layer that starts with "R" (from a string, or a list/tuple of "R"/"U" characters or bools)."""
    if schedule is None:
        return None
    if is_int(schedule):
        if schedule < 1:
            raise ValueError(f"refresh period P={schedule!r} is invalid; accepted: an integer >= 1")
        return int(schedule)
    if not isinstance(schedule, (str, list, tuple)) or len(schedule) == 0:
        raise ValueError(f"schedule={schedule!r} is invalid; accepted: None (refresh every layer), a refresh period "
                         "P >= 1, or one 'R' (refresh) / 'U' (reuse) per layer as a string or a list of 'R'/'U'/bools")
    flags = []
    for s in schedule:
        if isinstance(s, (bool, np.bool_)):
            flags.append(bool(s))
        elif s in ("R", "U"):
            flags.append(s == "R")
        else:
            raise ValueError(f"schedule entry {s!r} is invalid; accepted: 'R', 'U' or a bool")
    if not flags[0]:
        raise ValueError("schedule[0]='U' is invalid; accepted: the first layer must be a refresh layer 'R'")
    return to_string(tuple(flags))


def parse(schedule, n_layers: int) -> tuple[bool, ...]:
    """Per-layer refresh flags of a schedule in any form `canonical` takes; a period must be at most L and an
    R/U sequence exactly L long."""
    schedule = canonical(schedule)
    if schedule is None:
        return (True,) * n_layers
    if isinstance(schedule, int):
        return periodic(n_layers, schedule)
    if len(schedule) != n_layers:
        raise ValueError(f"schedule length {len(schedule)} is invalid; accepted: exactly n_layers={n_layers}")
    return tuple(c == "R" for c in schedule)


def to_string(flags: tuple[bool, ...]) -> str:
    """Per-layer flags as a string of R (refresh) and U (reuse), e.g. "RUUURUUU"."""
    return "".join("R" if f else "U" for f in flags)


def segments(flags: tuple[bool, ...]) -> tuple[Segment, ...]:
    """Static segmentation of a schedule into runs of equal length."""
    starts = [i for i, f in enumerate(flags) if f] + [len(flags)]
    runs = [(starts[i], starts[i + 1] - starts[i]) for i in range(len(starts) - 1)]
    segs: list[Segment] = []
    for s, r in runs:
        if segs and segs[-1].run == r:
            segs[-1] = segs[-1]._replace(count=segs[-1].count + 1)
        else:
            segs.append(Segment(s, r, 1))
    return tuple(segs)


def run_layers(layer_fn: Callable, carry, layer_xs, flags: tuple[bool, ...], *, unroll: bool):
    """Run `layer_fn(carry, xs, refresh: bool) -> (carry, ys)` over stacked per-layer inputs `layer_xs` (a pytree
    with a leading L axis) following the schedule `flags`. Returns (carry, ys stacked on a leading L axis).

    Each segment is an outer scan over its runs; inside, the refresh layer is followed by an inner scan over the
    reuse layers. `unroll=True` unrolls both so that layer slices are static (weight-bound paths)."""
    ys_parts = []
    for seg in segments(flags):
        xs = jax.tree.map(
            lambda a: a[seg.start: seg.start + seg.run * seg.count].reshape((seg.count, seg.run) + a.shape[1:]),
            layer_xs)

        def run_body(c, xs_run, seg=seg):
            c, y0 = layer_fn(c, jax.tree.map(lambda a: a[0], xs_run), True)
            if seg.run == 1:
                return c, jax.tree.map(lambda a: a[None], y0)
            c, ys = jax.lax.scan(lambda cc, xx: layer_fn(cc, xx, False), c,
                                 jax.tree.map(lambda a: a[1:], xs_run), unroll=unroll)
            return c, jax.tree.map(lambda a, b: jax.numpy.concatenate([a[None], b]), y0, ys)

        carry, ys = jax.lax.scan(run_body, carry, xs, unroll=unroll)
        ys_parts.append(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), ys))
    if len(ys_parts) == 1:
        return carry, ys_parts[0]
    return carry, jax.tree.map(lambda *a: jax.numpy.concatenate(a), *ys_parts)


def run_layer_list(layer_fn: Callable, carry, xs_list, flags: tuple[bool, ...]):
    """`run_layers`' contract over a Python list of per-layer inputs, unrolled at trace time. Each layer's weights
    are then their own buffers: nothing is sliced out of a stacked array (see `model.split_layers`)."""
    if len(xs_list) != len(flags):
        raise ValueError(f"{len(xs_list)} per-layer inputs for a schedule of {len(flags)} layers; accepted: equal")
    ys = []
    for xs, refresh in zip(xs_list, flags):
        carry, y = layer_fn(carry, xs, refresh)
        ys.append(y)
    return carry, jax.tree.map(lambda *a: jax.numpy.stack(a), *ys)
