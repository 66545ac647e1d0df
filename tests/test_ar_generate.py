"""`ar_generate`: greedy decoding is the argmax chain of the full-sequence model, row by row in a batch; sampling is
seeded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssv_jax import model as M
from ssv_jax.config import get_config
from ssv_jax.generate import ar_generate

CFG = get_config("tiny", max_seq_len=512)
PARAMS = M.init_params(CFG, jax.random.key(0))
PROMPT = np.asarray(jax.random.randint(jax.random.key(5), (1, 90), 0, CFG.vocab_size))


def test_greedy_tokens_are_the_argmax_of_the_full_sequence_model():
    res = ar_generate((CFG, PARAMS), PROMPT, max_new_tokens=40, chunk_steps=16, prefill_chunk=64)
    out = res.tokens
    assert out.shape == (1, 40)
    seq = np.concatenate([PROMPT, out], 1)
    logits, _ = M.forward_train(PARAMS, CFG, jnp.asarray(seq[:, :-1]), q_chunk=seq.shape[1] - 1)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits[:, PROMPT.shape[1] - 1:], -1)), out)
    assert res.stats["steps"] == 40 and res.stats["tokens_per_s"] > 0


def test_a_batch_decodes_each_rows_own_greedy_tokens():
    """Batch is a leading axis: two prompts decoded together give what each gives alone."""
    prompts = np.concatenate([PROMPT, np.asarray(jax.random.randint(jax.random.key(6), (1, 90), 0, CFG.vocab_size))])
    both = ar_generate((CFG, PARAMS), prompts, max_new_tokens=24, prefill_chunk=64).tokens
    alone = np.concatenate([ar_generate((CFG, PARAMS), p[None], max_new_tokens=24, prefill_chunk=64).tokens
                            for p in prompts])
    np.testing.assert_array_equal(both, alone)
    assert not np.array_equal(both[0], both[1])


def test_a_generation_traces_one_decode_chunk_however_its_last_chunk_ends(monkeypatch):
    """30 tokens in chunks of 12 run 11 + 12 + 6 steps: the short last chunk stops on its traced limit instead of
    tracing (and compiling) a chunk of its own. Counts the traces of the decode step (one token per row)."""
    traced, forward = [], M.forward

    def counting(params, cfg, tokens, *args, **kw):
        if tokens.shape[1] == 1:
            traced.append(tokens.shape)
        return forward(params, cfg, tokens, *args, **kw)

    monkeypatch.setattr(M, "forward", counting)
    res = ar_generate((CFG, PARAMS), PROMPT, max_new_tokens=30, chunk_steps=12, prefill_chunk=64)
    assert res.tokens.shape == (1, 30)
    assert len(traced) == 1


def test_sampling_is_deterministic_per_seed_and_differs_across_seeds():
    a = ar_generate((CFG, PARAMS), PROMPT, 24, temperature=1.0, seed=3, prefill_chunk=64).tokens
    b = ar_generate((CFG, PARAMS), PROMPT, 24, temperature=1.0, seed=3, prefill_chunk=64).tokens
    c = ar_generate((CFG, PARAMS), PROMPT, 24, temperature=1.0, seed=4, prefill_chunk=64).tokens
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_eos_stops_generation_and_pads():
    greedy = ar_generate((CFG, PARAMS), PROMPT, 30, prefill_chunk=64).tokens[0]
    eos = int(greedy[5])
    first = int(np.argmax(greedy == eos))
    out = ar_generate((CFG, PARAMS), PROMPT, 30, eos_id=eos, prefill_chunk=64).tokens[0]
    np.testing.assert_array_equal(out[: first + 1], greedy[: first + 1])
    assert np.all(out[first:] == eos)


@pytest.mark.parametrize("kw,needle", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=10, temperature=-1.0), "temperature"),
    (dict(max_new_tokens=10, eos_id=999), "eos_id"),
    (dict(max_new_tokens=1000), "exceeds the cache"),
    (dict(max_new_tokens=10, chunk_steps=0), "chunk_steps=0"),
    (dict(max_new_tokens=True), r"max_new_tokens=True is invalid; accepted: an integer >= 1"),
    (dict(max_new_tokens=10, temperature=float("inf")), r"temperature=inf is invalid; accepted: a finite float"),
    (dict(max_new_tokens=10, temperature=True), r"temperature=True is invalid; accepted"),
    (dict(max_new_tokens=10, seed=1.5), r"seed=1.5 is invalid; accepted: an integer in \[-2\*\*63"),
    (dict(max_new_tokens=10, eos_id=1.5), r"eos_id=1.5 is invalid; accepted: None or an id in \[0, 256\)"),
    (dict(max_new_tokens=10, prefill_chunk=0), r"prefill_chunk=0 is invalid; accepted: an integer >= 1"),
    (dict(max_new_tokens=10, prefill_chunk=-32), r"prefill_chunk=-32 is invalid"),
    (dict(max_new_tokens=10, cache_dtype="int8"), r"cache_dtype='int8' is invalid; accepted: None .* floating"),
    (dict(max_new_tokens=10, cache_dtype="foo"), r"cache_dtype='foo' is invalid"),
    (dict(max_new_tokens=10, mesh="tp"), r"mesh='tp' is invalid; accepted: None .* jax.sharding.Mesh"),
    (dict(max_new_tokens=10, split_weights="no"), r"split_weights='no' is invalid; accepted: True or False"),
    (dict(max_new_tokens=10, schedule=2.0), r"schedule=2.0 is invalid; accepted: None"),
])
def test_bad_arguments_raise_clear_errors(kw, needle):
    with pytest.raises(ValueError, match=needle):
        ar_generate((CFG, PARAMS), PROMPT, **kw)


def test_a_schedule_list_or_numpy_period_decodes_as_its_canonical_form():
    """`schedule` is a jit static argument: a list (unhashable) or np.int64 period runs as the string / int."""
    want = ar_generate((CFG, PARAMS), PROMPT, 6, schedule="RURU", prefill_chunk=64).tokens
    np.testing.assert_array_equal(ar_generate((CFG, PARAMS), PROMPT, 6, schedule=["R", "U", "R", "U"],
                                              prefill_chunk=64).tokens, want)
    np.testing.assert_array_equal(ar_generate((CFG, PARAMS), PROMPT, 6, schedule=np.int64(2),
                                              prefill_chunk=64).tokens, want)


def test_unknown_model_type_is_rejected():
    with pytest.raises(ValueError, match="NSATransformer"):
        ar_generate("tiny", PROMPT, 4)


def test_decode_weight_layout_gives_the_same_tokens_as_stacked_weights():
    a = ar_generate((CFG, PARAMS), PROMPT, 20, prefill_chunk=64, split_weights=False).tokens
    b = ar_generate((CFG, PARAMS), PROMPT, 20, prefill_chunk=64).tokens
    np.testing.assert_array_equal(a, b)
