"""The bundled ssv-small: greedy SSV (class exact) is greedy AR NSA on it, token for token, in fp32."""

from pathlib import Path

import numpy as np
import pytest

from ssv_jax import checkpoint as ck
from ssv_jax.generate import ar_generate
from ssv_jax.generate_cli import default_prompt
from ssv_jax.policy import SSVPolicy
from ssv_jax.speculative import ssv_generate

BUNDLE = Path(__file__).resolve().parents[1] / "checkpoints" / "ssv-small"


@pytest.fixture(scope="module")
def bundle():
    return ck.load_bundle(BUNDLE)  # fp32


def test_greedy_ssv_equals_greedy_ar_on_the_bundled_model_for_128_tokens(bundle):
    _, text = default_prompt(bundle.tokenizer, 600)
    prompt = np.asarray(bundle.tokenizer.encode(text), np.int32)
    ar = ar_generate(bundle, prompt, 128, prefill_chunk=256).tokens
    res = ssv_generate(bundle, prompt, max_new_tokens=128, prefill_chunk=256,
                       policy=SSVPolicy(top_k=4, depth=5, budget=16, order="dfs"))
    np.testing.assert_array_equal(res.tokens, ar)
    assert res.stats["tau"] > 1.0  # the trained head gets some drafts accepted
