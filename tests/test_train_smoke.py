"""CPU smoke paths of both training scripts (`--tiny --steps 3`), resume, and the EAGLE-3 training-time test
matching what the draft head computes at inference."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def _run(script, *args):
    cmd = [sys.executable, str(ROOT / "scripts" / script), "--tiny", "--no-progress", *map(str, args)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = [ln for ln in out.stdout.splitlines() if ln.startswith("[")][-1]
    return json.loads(last.split("] ", 1)[1])


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    res = _run("train_target.py", "--steps", 3, "--out", d / "bundle", "--ckpt-dir", d / "ckpt",
               "--data-dir", d / "data")
    return d, res


def test_target_smoke_and_resume(tiny_bundle):
    from ssv_jax.checkpoint import load_bundle

    d, res = tiny_bundle
    assert res["steps"] == 3 and res["run_steps"] == 3 and res["tokens_seen"] == 3 * 2 * 128
    assert np.isfinite(res["val_loss"]) and np.isfinite(res["test_ppl"])
    assert res["val_loss"] < np.log(512) + 0.5  # sane scale: about uniform over the 512-token vocabulary
    b = load_bundle(d / "bundle", dtype=None)
    assert b.cfg.name == "tiny" and b.cfg.vocab_size == b.tokenizer.vocab_size == 512
    assert b.params["embed"].dtype == jnp.bfloat16
    res2 = _run("train_target.py", "--steps", 5, "--out", d / "bundle2", "--ckpt-dir", d / "ckpt",
                "--data-dir", d / "data")
    assert res2["steps"] == 5 and res2["run_steps"] == 2  # resumed from the orbax checkpoint at step 3


def test_eagle3_smoke(tiny_bundle):
    from ssv_jax.checkpoint import load_bundle
    from ssv_jax.draft import draft_to_target

    d, _ = tiny_bundle
    res = _run("train_eagle3.py", "--steps", 3, "--bundle", d / "bundle", "--out", d / "full",
               "--data-dir", d / "data", "--ttt-steps", 3)
    assert res["steps"] == 3 and res["ttt_steps"] == 3 and len(res["val_ce_per_step"]) == 3
    assert all(np.isfinite(res["val_ce_per_step"]))
    b = load_bundle(d / "full")
    assert b.draft_cfg.draft_vocab == res["draft_vocab"] and b.draft_cfg.feature_layers == b.cfg.features
    assert b.draft_cfg.window == res["seq_len"]  # the head drafts within the distances it was trained on
    ids = draft_to_target(b.draft_params, jnp.arange(b.draft_cfg.draft_vocab))
    assert bool(jnp.all(jnp.diff(ids) > 0)) and int(ids[0]) == b.tokenizer.eos_id  # sorted, EOS included
    assert bool(jnp.all(b.draft_params["t2d"][ids]))


def _full_bundle(d):
    if not (d / "full").exists():
        _run("train_eagle3.py", "--steps", 3, "--bundle", d / "bundle", "--out", d / "full",
             "--data-dir", d / "data", "--ttt-steps", 3)
    return d / "full"


def test_continued_training_starts_from_the_bundle_and_keeps_its_record(tiny_bundle):
    """--init-bundle / --init-draft: a continuation at a longer sequence starts from the bundle's weights (with a
    vanishing learning rate one step leaves them as they were, to the bf16 they are stored in), keeps the
    tokenizer and config, and records both trainings in the new bundle's meta."""
    from ssv_jax.checkpoint import load_bundle, read_bundle_meta

    d, _ = tiny_bundle
    full = _full_bundle(d)
    res = _run("train_target.py", "--steps", 1, "--lr", 1e-12, "--seq-len", 256, "--batch", 1,
               "--init-bundle", full, "--out", d / "cont", "--data-dir", d / "data")
    assert res["seq_len"] == 256 and res["init_bundle"] == str(full)
    res_d = _run("train_eagle3.py", "--steps", 1, "--lr", 1e-12, "--bundle", d / "cont", "--init-draft", full,
                 "--data-dir", d / "data", "--ttt-steps", 3)
    assert res_d["init_draft"] == str(full)
    old, new = load_bundle(full, dtype=None), load_bundle(d / "cont", dtype=None)
    assert new.cfg == old.cfg and new.tokenizer.to_str() == old.tokenizer.to_str()
    for tree_old, tree_new in ((old.params, new.params), (old.draft_params, new.draft_params)):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tree_old), jax.tree.leaves(tree_new)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    meta = read_bundle_meta(d / "cont")["meta"]
    assert meta["target_training"] == read_bundle_meta(full)["meta"]["target_training"]
    assert meta["target_finetune"]["steps"] == 1 and meta["draft_finetune"]["steps"] == 1
    assert meta["draft_training"] == read_bundle_meta(full)["meta"]["draft_training"]


def test_a_second_continuation_keeps_the_first_ones_record(tiny_bundle):
    """Continuing a continued target, or refitting a refitted head, nests the earlier continuation's record under
    the new one's `previous`, so a bundle's meta holds its whole training history."""
    from ssv_jax.checkpoint import read_bundle_meta

    d, _ = tiny_bundle
    full = _full_bundle(d)
    _run("train_target.py", "--steps", 1, "--init-bundle", full, "--out", d / "once", "--data-dir", d / "data")
    _run("train_eagle3.py", "--steps", 1, "--bundle", d / "once", "--init-draft", full, "--data-dir", d / "data",
         "--ttt-steps", 3)
    first = read_bundle_meta(d / "once")["meta"]
    assert "previous" not in first["target_finetune"] and "previous" not in first["draft_finetune"]
    _run("train_target.py", "--steps", 1, "--init-bundle", d / "once", "--out", d / "twice", "--data-dir", d / "data")
    _run("train_eagle3.py", "--steps", 1, "--bundle", d / "twice", "--init-draft", d / "once", "--data-dir",
         d / "data", "--ttt-steps", 3)
    second = read_bundle_meta(d / "twice")["meta"]
    assert second["target_finetune"]["init_bundle"] == str(d / "once")
    assert second["target_finetune"]["previous"] == first["target_finetune"]
    assert second["draft_finetune"]["previous"] == first["draft_finetune"]
    assert second["target_training"] == first["target_training"]
    assert second["draft_training"] == first["draft_training"]


def test_init_draft_rejects_a_head_of_another_shape(tiny_bundle):
    d, _ = tiny_bundle
    full = _full_bundle(d)
    cmd = [sys.executable, str(ROOT / "scripts" / "train_eagle3.py"), "--tiny", "--no-progress", "--steps", "1",
           "--bundle", str(full), "--out", str(d / "other"), "--init-draft", str(full), "--data-dir",
           str(d / "data"), "--ttt-steps", "3", "--draft-vocab", "100"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "--init-draft=" in out.stderr and "accepted: the head" in out.stderr


def test_eval_reports_tau_per_prompt_and_its_summary(tiny_bundle, tmp_path):
    """eval_model on the tiny bundle with its head: tau rows for the stream tail and a held-out file, and a summary
    whose mean lies between the prompts' extremes."""
    import eval_model

    d, _ = tiny_bundle
    out = eval_model.main(["--bundle", str(_full_bundle(d)), "--out", str(tmp_path / "eval.json"),
                           "--seq-len", "128", "--ppl-windows", "1", "--position-buckets", "4", "--contexts", "128",
                           "--temperatures", "0", "--new-tokens", "4", "--tau-files", "1", "--no-progress"])
    assert {r["prompt"] for r in out["tau"]} >= {"test stream tail"} and len(out["tau"]) == 4  # 2 prompts x 2
    for s in out["tau_summary"]:
        assert s["prompts"] == 2 and s["tau_min"] <= s["tau_mean"] <= s["tau_max"] and s["tau_min"] >= 1.0
    assert json.loads((tmp_path / "eval.json").read_text())["tau_summary"] == out["tau_summary"]
    ppl = out["perplexity"]  # the position buckets tile the scored positions and average to the total loss
    spans = [b["positions"] for b in ppl["loss_by_position"]]
    assert spans[0][0] == 0 and spans[-1][1] == 127 and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    mean = sum(b["loss"] * (b["positions"][1] - b["positions"][0]) for b in ppl["loss_by_position"]) / 127
    assert np.isclose(mean, ppl["loss"], rtol=1e-6)


def test_draft_vocab_ids():
    from train_eagle3 import draft_vocab_ids

    toks = np.array([5, 5, 5, 3, 3, 7, 1, 1, 1, 1])
    assert draft_vocab_ids(toks, 8, 3, eos_id=0).tolist() == [0, 1, 5]
    with pytest.raises(ValueError, match="draft-vocab"):
        draft_vocab_ids(toks, 8, 9, eos_id=0)


def test_ttt_matches_inference_chain():
    """Step k of the training-time test for base position i equals drafting k steps at inference from a cache
    holding entries 0..i (draft_extend on the prefix, then draft_tree_step along the chain)."""
    from train_eagle3 import ttt_loss

    from ssv_jax import draft as DR
    from ssv_jax import model as M
    from ssv_jax.config import get_config

    cfg = get_config("tiny")
    tp = M.init_params(cfg, jax.random.key(0))
    dcfg = DR.DraftConfig.for_target(cfg, draft_vocab=cfg.vocab_size)
    dp = DR.init_draft_params(dcfg, jax.random.key(1))
    S, K = 24, 3
    tokens = jax.random.randint(jax.random.key(2), (1, S), 0, cfg.vocab_size)
    sel = jnp.arange(cfg.vocab_size)
    logits_t, feats = M.forward_train(tp, cfg, tokens)

    # Reference: for base i, commit entries 0..i (the whole prefix passed, entries after i marked invalid, so one
    # compiled program serves every i), then draft the chain with ground-truth tokens.
    @jax.jit
    def chain_logits(i):
        cache = DR.init_draft_cache(dcfg, 1, max_len=S)
        nxt = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
        pos = jnp.arange(S)[None]
        h, lg, cache = DR.draft_extend(dp, dcfg, tp["embed"], feats, nxt, pos, pos <= i, cache)
        out, hid = [lg[:, i]], jax.lax.dynamic_slice_in_dim(h, i, 1, axis=1)
        ek = jnp.zeros((1, 0, dcfg.n_kv_heads, dcfg.head_dim))
        ev = ek
        for k in range(1, K):
            tok = jax.lax.dynamic_slice_in_dim(tokens, i + k + 1, 1, axis=1)
            mask = jnp.ones((1, 1, ek.shape[1]), bool)
            hid, lg, kk, vv = DR.draft_tree_step(dp, dcfg, tp["embed"], hid, tok, jnp.reshape(i + k, (1, 1)), cache,
                                                 ek, ev, mask)
            ek, ev = jnp.concatenate([ek, kk], 1), jnp.concatenate([ev, vv], 1)
            out.append(lg[:, 0])
        return jnp.stack(out, 0)[:, 0]  # [K, Vd]

    # Compare per-step soft cross-entropies: ttt_loss's aux against the same quantity from the reference chains.
    _, aux = ttt_loss(dp, dcfg, tp, cfg, tokens, sel, K, 0.8, jnp.float32)
    p_t = jax.nn.softmax(logits_t[0], -1)
    in_draft = dp["t2d"][jnp.argmax(logits_t[0], -1)]
    ce = np.zeros(K)
    n = np.zeros(K)
    for i in range(S - K):  # every base with a full chain: the bases ttt_loss scores at step K-1
        lg = chain_logits(i)
        for k in range(K):
            p = i + k + 1
            if p <= S - 1 and bool(in_draft[p]):
                ce[k] += float(-jnp.sum(p_t[p] * jax.nn.log_softmax(lg[k])))
                n[k] += 1
    # At step K-1 both score exactly the bases 0..S-K-1; earlier steps score more bases in ttt_loss.
    np.testing.assert_allclose(float(aux[K - 1, 0]), ce[K - 1] / n[K - 1], rtol=2e-4)


def test_dense_training_attention_equals_reference():
    """The dense-masked training attention gives the reference NSA forward and gradients (tiny preset)."""
    from ssv_jax.nsa import nsa_attention_dense as dense_nsa_attention

    from ssv_jax import model as M
    from ssv_jax.config import get_config

    cfg = get_config("tiny")
    p = M.init_params(cfg, jax.random.key(0))
    for S in (256, 200):  # 200: the keys are padded past the queries
        toks = jax.random.randint(jax.random.key(S), (2, S), 0, cfg.vocab_size)
        fast = lambda x, **kw: dense_nsa_attention(*x, q_block=64, **kw)
        run_ref = lambda p: M.forward_train(p, cfg, toks, q_chunk=S)
        run_fast = lambda p: M.forward_train(p, cfg, toks, q_chunk=S, attn=lambda *x, **kw: fast(x, **kw))
        (a, fa), (b, fb) = run_ref(p), run_fast(p)
        np.testing.assert_allclose(b, a, atol=2e-5 * float(jnp.max(jnp.abs(a))))
        np.testing.assert_allclose(fb, fa, atol=1e-5)
        g1 = jax.grad(lambda p: jnp.sum(run_ref(p)[0] ** 2))(p)
        g2 = jax.grad(lambda p: jnp.sum(run_fast(p)[0] ** 2))(p)
        for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
            np.testing.assert_allclose(y, x, atol=1e-4 * float(jnp.max(jnp.abs(x))) + 1e-7)
    with pytest.raises(ValueError, match="extra"):
        dense_nsa_attention(*([None] * 8), cfg, extra=object())


def test_ttt_gradients_are_finite_with_chunked_draft_attention(monkeypatch):
    """Chunked draft attention (long sequences) and the empty cache part have fully masked rows; the training
    loss must still give finite gradients."""
    from train_eagle3 import ttt_loss

    from ssv_jax import draft as DR
    from ssv_jax import model as M
    from ssv_jax.config import get_config

    monkeypatch.setattr(DR, "DENSE_SCORES_MAX", 1 << 10, raising=False)  # force key chunks at S=64
    cfg = get_config("tiny")
    tp = M.init_params(cfg, jax.random.key(0))
    dcfg = DR.DraftConfig.for_target(cfg, draft_vocab=128)
    dp = DR.init_draft_params(dcfg, jax.random.key(1))
    buf = {k: dp.pop(k) for k in DR.BUFFER_NAMES}
    toks = jax.random.randint(jax.random.key(2), (1, 64), 0, cfg.vocab_size)
    loss, g = jax.value_and_grad(
        lambda p: ttt_loss({**p, **buf}, dcfg, tp, cfg, toks, jnp.arange(128), 3, 0.8, jnp.float32)[0])(dp)
    assert np.isfinite(float(loss))
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in g.values())
