"""Static-trip-count chunks (what generation runs on a GPU): the host sizes each chunk so that it cannot run past the
end, and decoding emits exactly what the early-stopping while_loop emits: the same tokens, rounds and acceptance."""

import jax
import numpy as np
import pytest

from ssv_jax import draft as dr
from ssv_jax import model as M
from ssv_jax.config import get_config
from ssv_jax.generate import ar_generate, static_chunk_size
from ssv_jax.policy import SSVPolicy
from ssv_jax.speculative import SSVModel, ssv_generate

CFG = get_config("tiny", max_seq_len=512)
PARAMS = M.init_params(CFG, jax.random.key(0))
DCFG = dr.DraftConfig.for_target(CFG)
MODEL = SSVModel(CFG, PARAMS, DCFG, dr.init_draft_params(DCFG, jax.random.key(1)))
PROMPT = np.asarray(jax.random.randint(jax.random.key(3), (1, 100), 0, CFG.vocab_size))
TREE = SSVPolicy(top_k=4, depth=4, budget=16)


def test_chunk_size_is_the_largest_power_of_two_that_cannot_overrun():
    rng = np.random.default_rng()
    for remaining, per_step, cap in rng.integers(1, 200, size=(300, 3)):
        n = static_chunk_size(int(remaining), int(per_step), int(cap))
        need = -(-remaining // per_step)  # steps before the row with `remaining` to go can finish
        assert n & (n - 1) == 0 and 1 <= n <= min(cap, need)
        assert 2 * n > min(cap, need)  # the largest such power of two
        assert (n - 1) * per_step < remaining  # the chunk's last step still has a token to emit


@pytest.mark.parametrize("args", [(0, 1, 4), (5, 0, 4), (5, 1, 0)])
def test_chunk_size_rejects_non_positive_arguments(args):
    with pytest.raises(ValueError, match="accepted: integers >= 1"):
        static_chunk_size(*args)


def _eos_of(tokens, i):
    """An id that the greedy sequence first emits at step i (so that generation with it as EOS stops there)."""
    return int(tokens[i]) if int(np.argmax(tokens == tokens[i])) == i else None


def test_ar_static_chunks_emit_what_the_while_loop_emits():
    run = lambda **kw: ar_generate((CFG, PARAMS), PROMPT, 37, chunk_steps=8, prefill_chunk=64, **kw).tokens
    greedy = run(static_chunks=False)
    np.testing.assert_array_equal(run(static_chunks=True), greedy)
    eos = next(e for e in (_eos_of(greedy[0], i) for i in range(9, 30)) if e is not None)
    with_eos = run(static_chunks=False, eos_id=eos)
    assert with_eos.shape[1] < greedy.shape[1]  # the while_loop stopped early
    np.testing.assert_array_equal(run(static_chunks=True, eos_id=eos), with_eos)


def test_ssv_static_chunks_emit_what_the_while_loop_emits():
    def run(static, **kw):
        return ssv_generate(MODEL, PROMPT, max_new_tokens=45, policy=TREE, prefill_chunk=64, chunk_rounds=4,
                            static_chunks=static, **kw)

    ref, got = run(False), run(True)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    assert got.stats["rounds"] == ref.stats["rounds"]
    assert got.stats["accepted_per_round"] == ref.stats["accepted_per_round"]
    # the chunks never grow: fewer tokens are left after each
    sizes = [c["rounds"] for c in got.stats["policy_trace"]]
    assert sum(sizes) == got.stats["rounds"] and sizes == sorted(sizes, reverse=True)
    greedy = ref.tokens[0]
    eos = next(e for e in (_eos_of(greedy, i) for i in range(5, 30)) if e is not None)
    with_eos = run(False, eos_id=eos)
    np.testing.assert_array_equal(run(True, eos_id=eos).tokens, with_eos.tokens)
