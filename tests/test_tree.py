"""Tree builder, flattening orders and tree structure (issue 4, tests (c), (e), (f))."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssv_jax.config import get_config
from ssv_jax.draft import (DraftConfig, draft_extend, draft_logits, draft_tree_step, init_draft_cache,
                           init_draft_params)
from pallas_kernels.topn import top_n_log_softmax
from ssv_jax.tree import (Tree, TreeSpec, build_tree, build_tree_with, flatten_order, lex_order, mask_from_parents,
                          permute_tree, tree_from_parents)

# -- (c) golden fixture ------------------------------------------------------------------------------------------
# A toy drafter whose log-probs depend only on the input (target) token. Draft vocabulary 4, target vocabulary 8,
# d2t = [0, 1, 2, 3], so draft id i is target id 2i. top_k = 2, depth = 3, budget = 7.
#
# Batch 0, root probs [.6, .3, .08, .02]:
#   level 1: c0 = tgt0 (.6), c1 = tgt2 (.3); frontier [c0, c1]
#   level 2 (token 0 -> [.05, .55, .35, .05], token 2 -> [.75, .05, .15, .05]):
#     c2 = tgt2 (.6*.55 = .33, parent c0), c3 = tgt4 (.6*.35 = .21, c0), c4 = tgt0 (.3*.75 = .225, c1),
#     c5 = tgt4 (.3*.15 = .045, c1); frontier [c2, c4] (rows 0, 1)
#   level 3: c6 = tgt0 (.33*.75 = .2475, c2), c7 = tgt4 (.33*.15 = .0495, c2), c8 = tgt2 (.225*.55 = .12375, c4),
#     c9 = tgt4 (.225*.35 = .07875, c4)
#   keep 6 by score: c0 .6, c2 .33, c1 .3, c6 .2475, c4 .225, c3 .21; bfs: c0 c1 | c2 c4 c3 | c6
# Batch 1, root probs [.3, .6, .08, .02]:
#   level 1: c0 = tgt2 (.6), c1 = tgt0 (.3)
#   level 2: c2 = tgt0 (.45, c0), c3 = tgt4 (.09, c0), c4 = tgt2 (.165, c1), c5 = tgt4 (.105, c1); frontier [c2, c4]
#   level 3: c6 = tgt2 (.45*.55 = .2475, c2), c7 = tgt4 (.45*.35 = .1575, c2), c8 = tgt0 (.12375, c4), c9 (.02475)
#   keep: c0 .6, c2 .45, c1 .3, c6 .2475, c4 .165, c7 .1575; bfs: c0 c1 | c2 c4 | c6 c7
TABLE = np.full((8, 4), 0.25)
TABLE[0] = [0.05, 0.55, 0.35, 0.05]
TABLE[2] = [0.75, 0.05, 0.15, 0.05]
ROOT_P = np.array([[0.6, 0.3, 0.08, 0.02], [0.3, 0.6, 0.08, 0.02]])
GOLD_TOKENS = [[7, 0, 2, 2, 0, 4, 0], [5, 2, 0, 0, 2, 2, 4]]
GOLD_PARENTS = [[-1, 0, 0, 1, 2, 1, 3], [-1, 0, 0, 1, 2, 3, 3]]
GOLD_DEPTH = [[0, 1, 1, 2, 2, 2, 3], [0, 1, 1, 2, 2, 3, 3]]
GOLD_P = [[1, .6, .3, .33, .225, .21, .2475], [1, .6, .3, .45, .165, .2475, .1575]]
GOLD_DFS = [[0, 1, 3, 6, 5, 2, 4], [0, 1, 3, 5, 6, 2, 4]]


def _ancestor_sets(parents):
    out = []
    for i in range(len(parents)):
        s, j = {i}, parents[i]
        while j >= 0:
            s.add(j)
            j = parents[j]
        out.append(s)
    return out


def _golden_tree(record=None):
    """The fixture tree; jitted unless `record` (a list) is given, which then collects what the drafter saw."""
    table = jnp.log(jnp.asarray(TABLE, jnp.float32))

    def step(state, level, tokens, rows, anc):
        if record is not None:
            record.append((level, np.asarray(tokens), np.asarray(rows), np.asarray(anc)))
        return state, table[tokens]

    def run():
        return build_tree_with(step, None, jnp.log(jnp.asarray(ROOT_P, jnp.float32)), jnp.array([7, 5]),
                               jnp.array([10, 20]), TreeSpec(top_k=2, depth=3, budget=7),
                               d2t=jnp.array([0, 1, 2, 3], jnp.int32))

    return run() if record is not None else jax.jit(run)()


def test_golden_tree_fixture():
    rec = []
    t = _golden_tree(rec)
    for a, b in zip(t, _golden_tree()):  # eager and jitted agree
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(t.tokens, GOLD_TOKENS)
    np.testing.assert_array_equal(t.parents, GOLD_PARENTS)
    np.testing.assert_array_equal(t.depth, GOLD_DEPTH)
    np.testing.assert_array_equal(t.positions, np.array([[10], [20]]) + np.array(GOLD_DEPTH))
    np.testing.assert_allclose(t.scores, np.log(GOLD_P), atol=1e-5)
    for b in range(2):
        want = np.zeros((7, 7), bool)
        for i, s in enumerate(_ancestor_sets(GOLD_PARENTS[b])):
            want[i, list(s)] = True
        np.testing.assert_array_equal(t.mask[b], want)
    # the drafter saw the frontiers: level 1 = the root's children, level 2 = [c2, c4] descending from rows 0, 1
    assert [r[0] for r in rec] == [1, 2]
    np.testing.assert_array_equal(rec[0][1], [[0, 2], [2, 0]])
    np.testing.assert_array_equal(rec[0][3], np.zeros((2, 2, 4), bool))
    np.testing.assert_array_equal(rec[1][1], [[2, 0], [0, 2]])
    np.testing.assert_array_equal(rec[1][2], [[0, 1], [0, 1]])
    np.testing.assert_array_equal(rec[1][3], np.broadcast_to([[1, 0, 0, 0], [0, 1, 0, 0]], (2, 2, 4)).astype(bool))


def test_golden_orders_and_permute():
    t = _golden_tree()
    perm, inv = flatten_order(t, "bfs")
    np.testing.assert_array_equal(perm, np.broadcast_to(np.arange(7), (2, 7)))  # builder output is bfs
    perm, inv = flatten_order(t, "dfs")
    np.testing.assert_array_equal(perm, GOLD_DFS)
    np.testing.assert_array_equal(jnp.take_along_axis(inv, perm, 1), np.broadcast_to(np.arange(7), (2, 7)))
    d = permute_tree(t, perm, inv)
    np.testing.assert_array_equal(d.parents, [[-1, 0, 1, 2, 1, 0, 5], [-1, 0, 1, 2, 2, 0, 5]])
    np.testing.assert_array_equal(d.tokens, np.take_along_axis(np.array(GOLD_TOKENS), np.array(GOLD_DFS), 1))
    np.testing.assert_array_equal(d.mask, mask_from_parents(d.parents))
    # back to the original
    back = permute_tree(d, inv)
    for a, b in zip(back, t):
        np.testing.assert_array_equal(a, b)


def test_tree_from_parents_golden():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    t = tree_from_parents([9, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 1, 2, 3], root_pos=100)
    assert t.tokens.shape == (1, 7)
    np.testing.assert_array_equal(t.depth[0], [0, 1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(t.positions[0], [100, 101, 101, 102, 102, 102, 103])
    want = np.array([[1, 0, 0, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0, 0, 0],
                     [1, 0, 1, 0, 0, 0, 0],
                     [1, 1, 0, 1, 0, 0, 0],
                     [1, 1, 0, 0, 1, 0, 0],
                     [1, 0, 1, 0, 0, 1, 0],
                     [1, 1, 0, 1, 0, 0, 1]], bool)
    np.testing.assert_array_equal(t.mask[0], want)
    perm, _ = flatten_order(t, "dfs")
    np.testing.assert_array_equal(perm[0], [0, 1, 3, 6, 4, 2, 5])
    # bfs sorts by depth then score: give node 2 the better score at depth 1 and node 5 the best at depth 2
    t2 = t._replace(scores=jnp.array([[0.0, -2.0, -1.0, -4.0, -5.0, -3.0, -6.0]]))
    perm, _ = flatten_order(t2, "bfs")
    np.testing.assert_array_equal(perm[0], [0, 2, 1, 5, 3, 4, 6])
    p2 = permute_tree(t2, perm)
    assert all(int(p2.parents[0, i]) < i for i in range(1, 7))


@pytest.mark.parametrize("parents", [[0, 0, 1], [-1, 2, 0], [-1, 0, 1, 5]])
def test_tree_from_parents_rejects_bad_parents(parents):
    with pytest.raises(ValueError, match="parents"):
        tree_from_parents(list(range(len(parents))), parents)


# -- (f) validation ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,field,rng", [
    (dict(top_k=2, depth=0, budget=3), "depth=0", ">= 1"),
    (dict(top_k=0, depth=2, budget=3), "top_k=0", ">= 1"),
    (dict(top_k=2, depth=2, budget=1), "budget=1", r"\[2, 7\]"),
    (dict(top_k=2, depth=2, budget=8), "budget=8", r"\[2, 7\]"),
    (dict(top_k=1, depth=4, budget=6), "budget=6", r"\[2, 5\]"),
    (dict(top_k=2.0, depth=2, budget=3), "top_k=2.0", "integer"),
])
def test_treespec_validation(kw, field, rng):
    with pytest.raises(ValueError, match=field) as e:
        TreeSpec(**kw)
    assert e.match(rng)


def test_treespec_takes_numpy_integers_as_plain_ints():
    t = TreeSpec(np.int64(4), np.int32(6), np.int64(32))
    assert t == TreeSpec(4, 6, 32) and hash(t) == hash(TreeSpec(4, 6, 32)) and type(t.top_k) is int
    with pytest.raises(ValueError, match="top_k=True is invalid; accepted: an integer"):
        TreeSpec(True, 2, 3)


def test_treespec_parse_list_reads_the_command_line_form():
    assert TreeSpec.parse_list("4,6,32;8, 6,64") == [TreeSpec(4, 6, 32), TreeSpec(8, 6, 64)]
    with pytest.raises(ValueError, match=r"trees=None is invalid; accepted: a string"):
        TreeSpec.parse_list(None)
    for bad in ("4,6", "4,6,32;", "a,6,32", "4,6,32,1", "--4,6,32", "4-,6,32"):
        with pytest.raises(ValueError, match="top_k,depth,budget") as e:
            TreeSpec.parse_list(bad)
        assert repr(bad) in str(e.value)
    with pytest.raises(ValueError, match="budget=99"):
        TreeSpec.parse_list("4,6,32;2,2,99")


@pytest.mark.parametrize("n", [1, 7, 32])
def test_lex_order_is_the_lexicographic_sort(n):
    """`lex_order` (all-pairs ranks, no sort) gives the permutation of `jax.lax.sort` over the same keys, on fresh
    random keys with many ties in the leading ones (int and float keys, the last one distinct), and its inverse."""
    rng = np.random.default_rng()
    B = 3
    keys = (jnp.asarray(rng.integers(0, 3, (B, n)), jnp.int32),
            jnp.asarray(rng.integers(-2, 2, (B, n)) / 2, jnp.float32),
            jnp.asarray(np.stack([rng.permutation(n) for _ in range(B)]), jnp.int32))
    iota = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))
    want = jax.lax.sort(keys + (iota,), dimension=1, num_keys=len(keys))[-1]
    perm, rank = jax.jit(lex_order)(keys)
    np.testing.assert_array_equal(perm, want)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(rank), np.asarray(perm), 1), iota)


def test_unknown_order():
    t = tree_from_parents([1, 2], [-1, 0])
    with pytest.raises(ValueError, match="order='zigzag'.*bfs.*dfs"):
        flatten_order(t, "zigzag")


def test_top_k_above_draft_vocab():
    with pytest.raises(ValueError, match="top_k=5"):
        build_tree_with(lambda s, *a: (s, None), None, jnp.zeros((1, 4)), jnp.zeros((1,), jnp.int32),
                        jnp.zeros((1,), jnp.int32), TreeSpec(5, 1, 3))


# -- the head-driven builder --------------------------------------------------------------------------------------
CFG = get_config("tiny")
DCFG = DraftConfig.for_target(CFG, draft_vocab=96, max_seq_len=32)
SPEC = TreeSpec(top_k=3, depth=3, budget=9)


def _head_setup(T=11, B=2):
    params = init_draft_params(DCFG, jax.random.key(0), d2t=jnp.arange(96, dtype=jnp.int32) % 3)
    # sharpen the draft so the tree grows deeper than one level
    params["lm_head"] = params["lm_head"] * 4.0
    embed = jax.random.normal(jax.random.key(1), (CFG.vocab_size, CFG.hidden))
    feats = jax.random.normal(jax.random.key(2), (B, T, 3 * CFG.hidden))
    nxt = jax.random.randint(jax.random.key(3), (B, T), 0, CFG.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    h, _, cache = jax.jit(draft_extend, static_argnums=1)(params, DCFG, embed, feats, nxt, pos,
                                                          jnp.ones((B, T), bool), init_draft_cache(DCFG, B))
    return params, embed, h[:, -1], nxt[:, -1], cache


@pytest.fixture(scope="module")
def head_tree():
    params, embed, root_h, root_tok, cache = _head_setup()
    fn = jax.jit(build_tree, static_argnums=(1, 7))
    tree = fn(params, DCFG, embed, root_h, root_tok, cache.length, cache, SPEC)
    return params, embed, root_h, root_tok, cache, tree, fn


def test_build_tree_structure(head_tree):
    params, embed, root_h, root_tok, cache, t, _ = head_tree
    B, N = t.tokens.shape
    assert N == SPEC.budget and t.mask.shape == (B, N, N)
    np.testing.assert_array_equal(t.tokens[:, 0], root_tok)
    for b in range(B):
        par = np.asarray(t.parents[b])
        assert par[0] == -1 and all(0 <= par[i] < i for i in range(1, N))
        want = np.zeros((N, N), bool)
        for i, s in enumerate(_ancestor_sets(par.tolist())):
            want[i, list(s)] = True
        np.testing.assert_array_equal(t.mask[b], want)
        dep = np.asarray(t.depth[b])
        assert all(dep[i] == dep[par[i]] + 1 for i in range(1, N)) and dep.max() <= SPEC.depth
        assert all(dep[i] <= dep[i + 1] for i in range(N - 1))  # bfs
        sc = np.asarray(t.scores[b])
        assert all(sc[i] <= sc[par[i]] + 1e-6 for i in range(1, N))  # a child never outscores its parent
    np.testing.assert_array_equal(t.positions, cache.length[:, None] + t.depth)
    assert int(t.depth.max()) >= 2, "fixture should exercise tree steps"
    # every drafted token is in the draft vocabulary's image under d2t
    img = np.asarray(jnp.arange(96) + params["d2t"])
    assert np.isin(np.asarray(t.tokens[:, 1:]), img).all()


def test_build_tree_with_the_top_n_kernel_drafts_the_same_tree(head_tree):
    """The GPU rounds select with the Pallas kernel (`speculative.draft_select`: `top_n_log_softmax`, the
    log-softmax formed in the kernel): the same tree, scores included."""
    params, embed, root_h, root_tok, cache, t, _ = head_tree
    fn = jax.jit(build_tree, static_argnums=(1, 7), static_argnames=("select",))
    kt = fn(params, DCFG, embed, root_h, root_tok, cache.length, cache, SPEC,
            select=functools.partial(top_n_log_softmax, interpret=True))
    for a, b in zip(kt, t):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_build_tree_matches_per_path_recompute(head_tree):
    """Each node's score equals the head re-run along the node's own root path alone (M = 1, only the path's
    entries in flight); each node is among the top_k of its parent there. Checks the tree-step masks."""
    params, embed, root_h, root_tok, cache, t, _ = head_tree
    step = jax.jit(draft_tree_step, static_argnums=1)
    d2t = np.asarray(params["d2t"])
    t2d = {int(i + d2t[i]): i for i in range(96)}
    for b in range(t.tokens.shape[0]):
        cb = jax.tree.map(lambda x: x[b:b + 1], cache)
        par = np.asarray(t.parents[b]).tolist()
        for n in range(1, SPEC.budget):
            path = sorted(_ancestor_sets(par)[n], key=lambda i: int(t.depth[b, i]))
            h = root_h[b:b + 1, None]
            logp = jax.nn.log_softmax(draft_logits(params, DCFG, root_h[b:b + 1]))[0]
            ks, vs, score = [], [], 0.0
            for j, a in enumerate(path[1:]):
                dtok = t2d[int(t.tokens[b, a])]
                assert dtok in np.asarray(jax.lax.top_k(logp, SPEC.top_k)[1])
                score += float(logp[dtok])
                if j + 1 == len(path) - 1:
                    break
                ek = jnp.concatenate(ks, 1) if ks else jnp.zeros((1, 0, DCFG.n_kv_heads, DCFG.head_dim))
                ev = jnp.concatenate(vs, 1) if vs else ek
                out, lg, k, v = step(params, DCFG, embed, h, t.tokens[b:b + 1, a:a + 1],
                                                cache.length[b:b + 1, None] + j, cb, ek, ev,
                                                jnp.ones((1, 1, len(ks)), bool))
                h, logp = out, jax.nn.log_softmax(lg[0, 0])
                ks.append(k)
                vs.append(v)
            np.testing.assert_allclose(score, float(t.scores[b, n]), atol=2e-4, rtol=1e-5)


def test_build_tree_deterministic(head_tree):
    params, embed, root_h, root_tok, cache, t, fn = head_tree
    t2 = fn(params, DCFG, embed, root_h, root_tok, cache.length, cache, SPEC)
    for a, b in zip(t, t2):
        np.testing.assert_array_equal(a, b)


def test_dfs_siblings_adjacent(head_tree):
    t = head_tree[5]
    perm, inv = flatten_order(t, "dfs")
    d = permute_tree(t, perm, inv)
    N = SPEC.budget
    for b in range(t.tokens.shape[0]):
        par = np.asarray(d.parents[b]).tolist()
        assert all(0 <= par[i] < i for i in range(1, N))
        # pre-order: each subtree occupies a contiguous slot range starting at its root
        for i in range(N):
            sub = sorted(j for j, s in enumerate(_ancestor_sets(par)) if i in s)
            assert sub == list(range(i, i + len(sub)))
        np.testing.assert_array_equal(d.mask[b], mask_from_parents(d.parents)[b])
    assert isinstance(d, Tree)
