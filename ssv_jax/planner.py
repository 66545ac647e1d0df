"""The host-side adaptive planner (DESIGN.md, mechanism 3).

Offline, `scripts/profile_policies.py` writes a versioned ranking JSON: per context bucket, the candidate policies
with their accepted tokens/s, mean acceptance length tau and verify ms, plus the hardware and the prompts used.
Online, `Planner` starts from the bucket's best policy within the user's precision class; after each chunk of
rounds it compares the observed mean acceptance over a window with the profile's prediction. When
|tau_obs - tau_pred| > eps it re-ranks the bucket's candidates by the tokens/s predicted under the observed
acceptance (`predict_tokens_per_s`) and switches to the best one if it beats the current policy by `min_gain`
(a profile without tokens/s falls back to the next-ranked policy). Every switch is recorded.
"""

from __future__ import annotations

import functools
import json
import os
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from ssv_jax.config import ModelConfig, is_finite_real, is_int
from ssv_jax.policy import PRECISIONS, SSVPolicy

PROFILE_VERSION = 1
BUCKETS = (8192, 16384, 32768, 65536, None)  # <=8K, <=16K, <=32K, <=64K, >64K
# the bundled model's profile on the H200 with its current head (16K bucket: session 42; 8K: session 45); the
# previous head's, `policy_profile.json`, was the default before session 45 (docs/DESIGN_NOTES.md)
DEFAULT_PROFILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results",
                               "policy_profile_s45_h200.json")
_CLASS_RANK = {"exact": 0, "strict": 1, "approx": 2}


def bucket_of(context: int) -> str:
    """The bucket key of a context length: "8K", "16K", "32K", "64K" or ">64K"."""
    for b in BUCKETS[:-1]:
        if context <= b:
            return f"{b // 1024}K"
    return ">64K"


class ProfileError(ValueError):
    """A profile file that cannot be used (missing, corrupt, wrong version)."""


def check_model(prof: dict, cfg: ModelConfig, where: str = "the profile"):
    """Raise `ProfileError` unless `prof` was measured on `cfg`'s model (a profile naming no model fits any)."""
    if prof.get("model") not in (None, cfg.name):
        raise ProfileError(f"{where} is for model {prof.get('model')!r}, not {cfg.name!r}")


def load_profile(path: str) -> dict:
    """Read and validate a ranking JSON (see module docstring; `check_profile`). Raises `ProfileError` naming the
    problem."""
    if not isinstance(path, (str, os.PathLike)):
        raise ProfileError(f"policy profile path={path!r} is invalid; accepted: a file path (str or os.PathLike)")
    if not os.path.exists(path):
        raise ProfileError(f"policy profile {path!r} does not exist; create it with scripts/profile_policies.py")
    try:
        with open(path) as f:
            prof = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"policy profile {path!r} is not valid JSON: {e}") from e
    check_profile(prof, f"policy profile {path!r}")
    return prof


def check_profile(prof, where: str = "policy profile") -> None:
    """Raise `ProfileError` unless `prof` is a valid ranking: the right version, and `buckets` a non-empty dict
    from bucket keys (`bucket_of`: "8K" ... ">64K") to lists of entries, each a dict with a valid `policy`
    (`SSVPolicy.from_dict`), a finite `tokens_per_s` > 0 and a finite `tau` >= 1 (a round emits at least the
    target's own token)."""
    if not isinstance(prof, dict) or prof.get("version") != PROFILE_VERSION:
        got = prof.get("version") if isinstance(prof, dict) else type(prof).__name__
        raise ProfileError(f"{where} has version {got!r}; accepted: {PROFILE_VERSION}")
    buckets = prof.get("buckets")
    if not isinstance(buckets, dict) or not buckets:
        raise ProfileError(f"{where} has no 'buckets'; accepted: a dict bucket -> ranked list")
    for b, rows in buckets.items():
        if b not in BUCKET_KEYS:
            raise ProfileError(f"{where}: bucket {b!r} is invalid; accepted: {list(BUCKET_KEYS)}")
        if not isinstance(rows, list):
            raise ProfileError(f"{where}: bucket {b!r} holds a {type(rows).__name__}; accepted: a list of entries")
        for i, r in enumerate(rows):
            at = f"{where}, bucket {b!r}, entry {i}"
            if not isinstance(r, dict):
                raise ProfileError(f"{at} is a {type(r).__name__}; accepted: a dict with policy, tokens_per_s, tau")
            missing = {"policy", "tokens_per_s", "tau"} - set(r)
            if missing:
                raise ProfileError(f"{at}: an entry lacks {sorted(missing)}")
            tps, tau = r["tokens_per_s"], r["tau"]
            if not (is_finite_real(tps) and tps > 0):
                raise ProfileError(f"{at}: tokens_per_s={tps!r} is invalid; accepted: a finite number > 0")
            if not (is_finite_real(tau) and tau >= 1):
                raise ProfileError(f"{at}: tau={tau!r} is invalid; accepted: a finite number >= 1")
            try:
                SSVPolicy.from_dict(r["policy"])
            except (ValueError, TypeError) as e:  # SSVPolicy / TreeSpec validation
                raise ProfileError(f"{at}: policy is invalid ({e})") from e


def save_profile(path: str, buckets: dict, *, hardware: str, model: str, prompts: list, extra: dict | None = None):
    """Write a ranking JSON; each bucket's rows are sorted by tokens_per_s, best first."""
    ranked = {b: sorted(rows, key=lambda r: -r["tokens_per_s"]) for b, rows in buckets.items()}
    prof = dict(version=PROFILE_VERSION, hardware=hardware, model=model, created=time.strftime("%Y-%m-%d %H:%M:%S"),
                prompts=prompts, buckets=ranked, **(extra or {}))
    with open(path, "w") as f:
        json.dump(prof, f, indent=2)
    return prof


def card_of(prof: dict) -> str:
    """The GPU a profile was measured on, from its `hardware` field ("NVIDIA H200 (x86_64, jax ...)" ->
    "NVIDIA H200")."""
    return str(prof.get("hardware", "")).split(" (")[0]


def merge_profiles(sources: list) -> dict:
    """One profile from buckets profiled in separate runs (each context in its own call, say).

    `sources`: a list of (name, profile, buckets) where `buckets` is None (take every bucket of that profile) or a
    list of its bucket keys to take. Every profile must be valid (`check_profile`), of one model and one card:
    profiles of different cards rank policies differently (docs/RESULTS.md), so a merge across cards raises. A bucket
    taken from two sources raises too; name the one to keep (`buckets`). Returns the merged profile: its buckets in
    the order taken (the first is `best_fixed_policy`'s tie-break, as in a profile of several contexts, which
    lists them in the order profiled), the prompts of the buckets taken, and `merged_from`: each source's name,
    buckets and metadata (its command, creation time, ...). Raises `ProfileError` naming the source and the
    problem."""
    if not sources:
        raise ProfileError("nothing to merge; accepted: one or more (name, profile, buckets) sources")
    first_name, first = sources[0][:2]
    buckets, taken_from, prompts, merged_from = {}, {}, [], []
    for name, prof, want in sources:
        check_profile(prof, f"policy profile {name!r}")
        have = list(prof["buckets"])
        want = have if want is None else list(want)
        missing = [b for b in want if b not in have]
        if missing:
            raise ProfileError(f"policy profile {name!r} has no bucket {missing[0]!r}; accepted: one of {have}")
        if card_of(prof) != card_of(first):
            raise ProfileError(f"policy profile {name!r} was measured on {card_of(prof)!r}, {first_name!r} on "
                               f"{card_of(first)!r}; accepted: profiles of one card (cards rank policies differently)")
        if prof.get("model") != first.get("model"):
            raise ProfileError(f"policy profile {name!r} is for model {prof.get('model')!r}, {first_name!r} for "
                               f"{first.get('model')!r}; accepted: profiles of one model")
        for b in want:
            if b in buckets:
                raise ProfileError(f"bucket {b!r} is in both {taken_from[b]!r} and {name!r}; accepted: each bucket "
                                   f"from one source (name the buckets to take from each)")
            buckets[b], taken_from[b] = prof["buckets"][b], name
        prompts += [p for p in prof.get("prompts", [])
                    if isinstance(p, dict) and is_int(p.get("context")) and bucket_of(p["context"]) in want]
        meta = {k: v for k, v in prof.items() if k not in ("version", "hardware", "model", "buckets", "prompts")}
        merged_from.append(dict(source=name, buckets=want, **meta))
    return dict(version=PROFILE_VERSION, hardware=first.get("hardware"), model=first.get("model"),
                created=time.strftime("%Y-%m-%d %H:%M:%S"), prompts=prompts, buckets=buckets,
                merged_from=merged_from)


@functools.lru_cache(maxsize=4096)
def chain_alpha(tau: float, depth: int) -> float:
    """The per-step acceptance rate a of a depth-`depth` chain whose mean emitted tokens per round is `tau`:
    tau = 1 + a + ... + a**depth (bisection; tau is clipped to [1, depth + 1]). Cached: the planner asks for the
    same profiled taus after every chunk, and it runs on the host between chunks, where the GPU waits."""
    tau = min(max(float(tau), 1.0), depth + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if chain_tau(mid, depth) < tau else (lo, mid)
    return 0.5 * (lo + hi)


def chain_tau(alpha: float, depth: int) -> float:
    """1 + a + ... + a**depth."""
    return float(sum(alpha ** i for i in range(depth + 1)))


def predict_tokens_per_s(rows, current: SSVPolicy, tau_obs: float) -> list[float | None]:
    """Each candidate's tokens/s if the draft accepts as observed under `current`.

    Model: each policy's profiled tau is a depth-d chain with an effective per-step rate a (branching folded in);
    the observation rescales every a by a_obs / a_cur (a_cur from the current policy's profiled tau); the round
    cost is the profiled one, so tokens/s scales with the predicted tau. Deep trees lose more than shallow ones
    when acceptance drops, and gain more when it rises. None where a row lacks tokens/s or tau."""
    cur = next((r for r in rows if r[0] == current), None)
    if cur is None or cur[1] is None:
        return [None] * len(rows)
    a_cur = chain_alpha(cur[1], current.depth)
    r = chain_alpha(tau_obs, current.depth) / a_cur if a_cur > 0 else 1.0
    out = []
    for p, tau, tps in rows:
        if tau is None or tps is None or tau <= 0:
            out.append(None)
            continue
        out.append(tps * chain_tau(min(1.0, chain_alpha(tau, p.depth) * r), p.depth) / tau)
    return out


def _ranking(prof: dict, precision: str, platform: str | None) -> dict:
    """bucket -> [(policy, tau, tokens/s)] of a checked profile, kept to `precision` (see `Planner.from_profile`)."""
    if platform is None:
        import jax
        platform = jax.default_backend()
    ranking = {}
    for b, rows in prof["buckets"].items():
        ok = [(SSVPolicy.from_dict(r["policy"]), float(r["tau"]), float(r["tokens_per_s"])) for r in rows]
        ok = [row for row in ok if _CLASS_RANK[row[0].precision] <= _CLASS_RANK[precision]]
        if platform != "gpu":
            ok = [(p.replace(backend="reference") if p.backend == "kernel" else p, t, v) for p, t, v in ok]
            ok = [row for i, row in enumerate(ok) if row[0] not in [q[0] for q in ok[:i]]]
        if ok:
            ranking[b] = ok
    if not ranking:
        raise ProfileError(f"the profile has no policy in precision class {precision!r}")
    return ranking


def best_fixed_policy(prof: dict, precision: str = "strict", platform: str | None = None):
    """The one policy to run at every context of a checked profile: the best fixed policy, the planner's baseline.

    Eligible are the policies profiled in every bucket within `precision` (exact < strict < approx; kernel
    policies run on the reference path off the GPU, as in `Planner.from_profile`). Each is scored by its
    tokens/s over its bucket's best, and the winner is the policy whose worst bucket loses least; a tie goes to
    the higher mean over buckets, then to the better rank in the first bucket. Returns (policy, {bucket: score}).
    Raises `ProfileError` when no policy is profiled in every bucket."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid; accepted: {PRECISIONS}")
    check_profile(prof)
    ranking = _ranking(prof, precision, platform)
    best = {b: max(tps for _, _, tps in rows) for b, rows in ranking.items()}
    rates = {b: {p: tps / best[b] for p, _, tps in reversed(rows)} for b, rows in ranking.items()}  # first row wins
    first = next(iter(ranking.values()))
    common = [p for p, _, _ in first if all(p in r for r in rates.values())]
    if not common:
        raise ProfileError(f"no policy in precision class {precision!r} is profiled in every bucket "
                           f"{sorted(ranking)}; profile the same candidates at each context")
    score = lambda p: (min(r[p] for r in rates.values()), float(np.mean([r[p] for r in rates.values()])))
    pick = max(common, key=score)  # max keeps the first of equals: the better rank in the first bucket
    return pick, {b: rates[b][pick] for b in ranking}


def bucket_lead(rows: list) -> dict | None:
    """How clearly a profile bucket's first policy leads the next one (`rows`: the bucket's rows as a profile ranks
    them, best first). Returns {"runner_up": its policy dict, "ratio": its tokens/s over the first's, "per_prompt":
    the same ratio on each profiled prompt, "clear": whether the first is faster on every prompt}. When `clear` is
    false some prompt favours the runner-up, so which of the two the bucket ranks first rests on which prompts were
    profiled. None for a bucket of one policy, or rows without matching per-prompt figures."""
    if len(rows) < 2:
        return None
    first, second = rows[0], rows[1]
    a, b = first.get("per_prompt_tokens_per_s"), second.get("per_prompt_tokens_per_s")
    if not a or not b or len(a) != len(b):
        return None
    per_prompt = [float(y) / float(x) for x, y in zip(a, b)]
    return dict(runner_up=second["policy"], ratio=float(second["tokens_per_s"]) / float(first["tokens_per_s"]),
                per_prompt=per_prompt, clear=max(per_prompt) < 1.0)


@dataclass
class Planner:
    """Picks and switches policies between chunks of rounds.

    `ranking`: bucket -> list of (policy, predicted tau, profiled tokens/s), best first, already filtered to the
    precision class. A planner with one candidate per bucket never switches (a fixed policy)."""

    ranking: dict
    eps: float = 0.5
    window: int = 32
    min_gain: float = 1.05
    switches: list = field(default_factory=list)
    _taus: list = field(default_factory=list)
    _bucket: str | None = None

    def __post_init__(self):
        if not (is_int(self.window) and self.window >= 1):
            raise ValueError(f"Planner.window={self.window!r} is invalid; accepted: an integer >= 1")
        if not (is_finite_real(self.eps) and self.eps >= 0):
            raise ValueError(f"Planner.eps={self.eps!r} is invalid; accepted: a finite number >= 0")
        if not (is_finite_real(self.min_gain) and self.min_gain > 0):
            raise ValueError(f"Planner.min_gain={self.min_gain!r} is invalid; accepted: a finite number > 0")
        self.window, self.eps, self.min_gain = int(self.window), float(self.eps), float(self.min_gain)

    @classmethod
    def fixed(cls, policy: SSVPolicy) -> "Planner":
        """A planner that runs `policy` in every bucket and never switches."""
        return cls({b: [(policy, None, None)] for b in BUCKET_KEYS})

    @classmethod
    def from_profile(cls, prof: dict, precision: str = "exact", platform: str | None = None, **kw) -> "Planner":
        """Keep the policies allowed in `precision` (exact < strict < approx), in the profile's rank order.

        Off the GPU (`platform`, default `jax.default_backend()`), Pallas-kernel policies run on the reference
        path instead (same selection and outputs; interpret-mode kernels are for tests, not generation); a
        policy that then repeats a better-ranked one is dropped. An invalid `prof` raises `ProfileError`."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is invalid; accepted: {PRECISIONS}")
        check_profile(prof)
        return cls(_ranking(prof, precision, platform), **kw)

    @classmethod
    def for_policy(cls, policy, cfg: ModelConfig, precision: str = "exact", profile_path: str | None = None):
        """`policy` an SSVPolicy -> a fixed planner; "auto" -> from the profile, falling back (with a warning) to
        the default `SSVPolicy()` when the profile is missing or unusable. `precision` must be one of PRECISIONS
        in either case."""
        if not isinstance(precision, str) or precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is invalid; accepted: {PRECISIONS}")
        if isinstance(policy, SSVPolicy):
            return cls.fixed(policy)
        if policy != "auto":
            raise ValueError(f"policy={policy!r} is invalid; accepted: an SSVPolicy or 'auto'")
        path = profile_path or DEFAULT_PROFILE
        try:
            prof = load_profile(path)  # checked here, with the path in its messages
            check_model(prof, cfg, f"profile {path!r}")
            return cls(_ranking(prof, precision, None))
        except ProfileError as e:
            warnings.warn(f"{e}; falling back to the fixed default policy {SSVPolicy().describe()}", stacklevel=3)
            return cls.fixed(SSVPolicy())

    def candidates(self) -> list[SSVPolicy]:
        """Every policy the planner may run, over all buckets (the ones `ssv_generate` may compile)."""
        return [row[0] for rows in self.ranking.values() for row in rows]

    def _rows(self, context: int):
        b = bucket_of(context)
        if b in self.ranking:
            return b, self.ranking[b]
        # nearest bucket that has a ranking
        keys = list(self.ranking)
        i = BUCKET_KEYS.index(b)
        best = min(keys, key=lambda k: abs(BUCKET_KEYS.index(k) - i) if k in BUCKET_KEYS else 99)
        return best, self.ranking[best]

    def initial(self, prompt_len: int) -> SSVPolicy:
        """The best policy for the prompt's bucket."""
        self._bucket, rows = self._rows(prompt_len)
        self._taus = []
        return rows[0][0]

    def predicted_tau(self, policy: SSVPolicy, context: int):
        """The profiled tau of `policy` in the bucket of `context` (None when the profile has none)."""
        _, rows = self._rows(context)
        return next((t for p, t, _ in rows if p == policy), None)

    def observe(self, policy: SSVPolicy, emitted: np.ndarray, context: int) -> SSVPolicy:
        """Record a chunk's per-round emitted counts ([rounds, B]); return the policy for the next chunk."""
        emitted = np.asarray(emitted)
        if emitted.size:
            self._taus.extend(emitted.mean(axis=-1).tolist())
        self._taus = self._taus[-self.window:]
        b, rows = self._rows(context)
        if b != self._bucket:  # the context grew into another bucket: start from its best policy
            self._bucket, self._taus = b, []
            if rows[0][0] != policy:
                self.switches.append(dict(reason="bucket", bucket=b, frm=policy.describe(), to=rows[0][0].describe()))
            return rows[0][0]
        pred = self.predicted_tau(policy, context)
        if pred is None or len(self._taus) < min(self.window, 4):
            return policy
        obs = float(np.mean(self._taus))
        if abs(obs - pred) <= self.eps:
            return policy
        pred_tps = predict_tokens_per_s(rows, policy, obs)
        idx = next(i for i, row in enumerate(rows) if row[0] == policy)
        if any(v is None for v in pred_tps):  # no tokens/s to compare: the next-ranked policy
            if idx + 1 >= len(rows):
                return policy
            nxt, why = rows[idx + 1][0], {}
        else:
            best = int(np.argmax(pred_tps))
            if best == idx or pred_tps[best] < self.min_gain * pred_tps[idx]:
                return policy
            nxt, why = rows[best][0], dict(tokens_per_s_predicted=pred_tps[best], tokens_per_s_staying=pred_tps[idx])
        self.switches.append(dict(reason="drift", bucket=b, tau_observed=obs, tau_predicted=pred,
                                  frm=policy.describe(), to=nxt.describe(), **why))
        self._taus = []
        return nxt


def _key(b) -> str:
    return ">64K" if b is None else f"{b // 1024}K"


BUCKET_KEYS = tuple(map(_key, BUCKETS))  # "8K", "16K", "32K", "64K", ">64K"
