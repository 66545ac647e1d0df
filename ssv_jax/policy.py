"""`SSVPolicy`: everything static about one way of running SSV rounds (DESIGN.md, "Planner").

A policy is frozen and hashable, so each distinct policy is one compiled variant of the round loop. It is
validated on construction; the checks that need the model (budget vs cache room, C vs rows) run in
`SSVPolicy.check_for(cfg)`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ssv_jax import schedule as sched
from ssv_jax.config import ModelConfig, check_known_fields, is_int
from ssv_jax.tree import TreeSpec

PRECISIONS = ("exact", "strict", "approx")
BACKENDS = ("reference", "kernel", "naive", "dense")
ORDERS = ("bfs", "dfs")


@dataclass(frozen=True)
class SSVPolicy:
    """A tree shape, a flattening order, a verify mode and group size, a refresh/reuse schedule.

    - `top_k`, `depth`, `budget`: the dynamic draft tree (budget counts the root).
    - `order`: "bfs" (EAGLE order) or "dfs" (pre-order, siblings adjacent): how tree queries are flattened
      before being packed into groups of `group_size` (C).
    - `mode`: "A" (exact merge) or "B" (shared index: an approximation).
    - `schedule`: None (refresh every layer), a refresh period P, or an R/U string / tuple of length L; stored
      in `schedule.canonical` form (None, P, or an "R"/"U" string), so equal schedules make equal policies.
    - `precision`: "exact" (mode A, refresh every layer), "strict" (mode A, any schedule), "approx" (mode B).
    - `backend`: "reference" (jnp NSA), "kernel" (Pallas grouped kernels), "naive" (per-query kernel: the
      naive SD+NSA baseline), "dense" (dense attention over the same weights: the dense EAGLE-3 SD baseline).
    """

    top_k: int = 4
    depth: int = 4
    budget: int = 16
    order: str = "bfs"
    mode: str = "A"
    group_size: int = 4
    schedule: object = None
    precision: str = "exact"
    backend: str = "reference"

    def __post_init__(self):
        TreeSpec(self.top_k, self.depth, self.budget)  # validates the tree shape
        if self.order not in ORDERS:
            raise ValueError(f"SSVPolicy.order={self.order!r} is invalid; accepted: {ORDERS}")
        if self.mode not in ("A", "B"):
            raise ValueError(f"SSVPolicy.mode={self.mode!r} is invalid; accepted: 'A' (exact merge) or 'B' "
                             "(shared index)")
        if not (is_int(self.group_size) and self.group_size >= 1):
            raise ValueError(f"SSVPolicy.group_size={self.group_size!r} is invalid; accepted: an integer >= 1")
        for f in ("top_k", "depth", "budget", "group_size"):
            object.__setattr__(self, f, int(getattr(self, f)))  # np.int64 from a config file: one hashable form
        if self.precision not in PRECISIONS:
            raise ValueError(f"SSVPolicy.precision={self.precision!r} is invalid; accepted: {PRECISIONS}")
        if self.backend not in BACKENDS:
            raise ValueError(f"SSVPolicy.backend={self.backend!r} is invalid; accepted: {BACKENDS}")
        object.__setattr__(self, "schedule", sched.canonical(self.schedule))
        if self.mode == "B" and self.precision != "approx":
            raise ValueError(f"SSVPolicy.mode='B' with precision={self.precision!r} is invalid; accepted: mode 'B' "
                             "only in precision class 'approx'")
        if self.precision == "exact" and not _all_refresh(self.schedule):
            raise ValueError(f"SSVPolicy.schedule={self.schedule!r} with precision='exact' is invalid; accepted: "
                             "None or period 1 (refresh every layer); use precision='strict' for reuse layers")

    @property
    def tree(self) -> TreeSpec:
        """The draft tree's static shape."""
        return TreeSpec(self.top_k, self.depth, self.budget)

    def replace(self, **kw) -> "SSVPolicy":
        """A copy with the given fields changed (validated again)."""
        return dataclasses.replace(self, **kw)

    def flags(self, cfg: ModelConfig) -> tuple[bool, ...]:
        """Per layer of `cfg`, whether it refreshes routing (True) or reuses the previous selection."""
        return sched.parse(self.schedule, cfg.n_layers)

    def check_for(self, cfg: ModelConfig) -> None:
        """Checks that need the model: the schedule's length, and C dividing the verify rows."""
        self.flags(cfg)
        if self.backend in ("kernel",) and self.budget % self.group_size:
            raise ValueError(f"SSVPolicy.group_size={self.group_size} does not divide the {self.budget} tree "
                             f"rows; accepted: a divisor of budget={self.budget}")

    def describe(self) -> str:
        """One line naming every field, as the benchmarks and the planner's trace print it."""
        s = "R*" if self.schedule is None else (f"P={self.schedule}" if isinstance(self.schedule, int)
                                               else self.schedule)
        return (f"tree(k={self.top_k}, depth={self.depth}, budget={self.budget}) order={self.order} "
                f"mode={self.mode} C={self.group_size} schedule={s} class={self.precision} backend={self.backend}")

    def to_dict(self) -> dict:
        """JSON-ready fields (profiles store policies this way); `from_dict` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SSVPolicy":
        """The policy of `to_dict`'s output; raises ValueError naming unknown or invalid fields."""
        check_known_fields(cls, d)
        return cls(**d)


def _all_refresh(schedule) -> bool:
    """Whether a canonical schedule refreshes every layer."""
    return schedule is None or schedule == 1 or (isinstance(schedule, str) and "U" not in schedule)


@functools.lru_cache(maxsize=None)
def attention_for(backend: str, mode: str, group_size: int, interpret: bool):
    """The attention callable (signature of `nsa.nsa_attention`) for a backend; cached, so that one policy is
    one compiled variant."""
    from ssv_jax import nsa

    if backend == "reference" and mode == "A":
        return nsa.nsa_attention
    if backend == "dense":
        from ssv_jax.baselines import dense_attention
        return dense_attention
    if backend == "reference":  # mode B on the jnp path: the shared-index selection, then the reference
        from ssv_jax.baselines import shared_index_reference
        return functools.partial(shared_index_reference, group_size=group_size)
    from pallas_kernels import nsa_attention_kernel
    kmode = "naive" if backend == "naive" else mode
    return functools.partial(nsa_attention_kernel, mode=kmode, group_size=group_size, interpret=interpret)
