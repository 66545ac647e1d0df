"""Greedy and stochastic acceptance (issue 4, tests (b), (e), (f))."""

import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ssv_jax.acceptance import accepted_inputs, greedy_accept, stochastic_accept
from ssv_jax.tree import TreeSpec, build_tree_with, tree_from_parents

#        0 (root, token 5)
#      /   |   \
#     1(2) 2(3) 3(4)
#    / \         |
#  4(0) 5(1)    6(2)
#   |
#  7(3)
PARENTS = [-1, 0, 0, 0, 1, 1, 3, 4]
TOKENS = [5, 2, 3, 4, 0, 1, 2, 3]
V = 8


def _logits_with_argmax(argmaxes):
    """Logits [1, N, V] whose argmax at node i is argmaxes[i]."""
    lg = np.zeros((1, len(argmaxes), V), np.float32)
    for i, a in enumerate(argmaxes):
        lg[0, i, a] = 5.0
    return jnp.asarray(lg)


@pytest.mark.parametrize("argmaxes,path,n,bonus", [
    # root wants 2 (node 1), node 1 wants 0 (node 4), node 4 wants 3 (node 7), leaf 7 -> bonus 6
    ([2, 0, 0, 0, 3, 0, 0, 6], [0, 1, 4, 7], 3, 6),
    # root wants 4 (node 3), node 3 wants 7 (no such child) -> bonus 7
    ([4, 0, 0, 7, 0, 0, 0, 0], [0, 3, -1, -1], 1, 7),
    # root wants 6: nothing accepted, bonus 6
    ([6, 0, 0, 0, 0, 0, 0, 0], [0, -1, -1, -1], 0, 6),
    # node 1 wants 1 (node 5, a leaf) -> bonus from node 5
    ([2, 1, 0, 0, 0, 4, 0, 0], [0, 1, 5, -1], 2, 4),
])
def test_greedy_golden(argmaxes, path, n, bonus):
    t = tree_from_parents(TOKENS, PARENTS)
    idx, na, b = jax.jit(greedy_accept, static_argnums=2)(t, _logits_with_argmax(argmaxes), 3)
    np.testing.assert_array_equal(idx[0], path)
    assert int(na[0]) == n and int(b[0]) == bonus
    # default max_depth = N - 1 pads further
    idx2, na2, b2 = greedy_accept(t, _logits_with_argmax(argmaxes))
    assert idx2.shape == (1, 8)
    np.testing.assert_array_equal(idx2[0, :4], path)
    assert int(na2[0]) == n and int(b2[0]) == bonus


def _walk(parents, tokens, best, max_depth):
    """The greedy rule as written in its definition: from the root, step to the first child (node-index order)
    whose token is the target argmax at the current node, at most max_depth times."""
    path, cur = [0], 0
    for _ in range(max_depth):
        kids = [i for i, p in enumerate(parents) if p == cur and tokens[i] == best[cur]]
        if not kids:
            break
        cur = kids[0]
        path.append(cur)
    return path + [-1] * (max_depth + 1 - len(path)), len(path) - 1, best[cur]


@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_the_walk_on_random_trees(seed):
    """Random trees (parents before children, repeated sibling tokens), random logits over a small vocabulary so
    that paths run deep; every row must match the walk, also when max_depth cuts it."""
    rng = np.random.default_rng(seed)
    rows, N, Vs = 16, 12, 3
    parents = np.array([[-1] + [int(rng.integers(0, i)) for i in range(1, N)] for _ in range(rows)])
    tokens = rng.integers(0, Vs, (rows, N))
    logits = rng.normal(size=(rows, N, Vs)).astype(np.float32)
    best = logits.argmax(-1)
    t = tree_from_parents(tokens, parents)
    for md in (N - 1, 2):
        idx, n, bonus = jax.jit(greedy_accept, static_argnums=2)(t, jnp.asarray(logits), md)
        for r in range(rows):
            want = _walk(parents[r], tokens[r], best[r], md)
            np.testing.assert_array_equal(np.asarray(idx[r]), want[0])
            assert int(n[r]) == want[1] and int(bonus[r]) == want[2]


def test_greedy_max_depth_truncates():
    t = tree_from_parents(TOKENS, PARENTS)
    idx, n, b = greedy_accept(t, _logits_with_argmax([2, 0, 0, 0, 3, 0, 0, 6]), max_depth=2)
    np.testing.assert_array_equal(idx[0], [0, 1, 4])
    assert int(n[0]) == 2 and int(b[0]) == 3  # argmax at node 4


def test_bad_max_depth():
    t = tree_from_parents(TOKENS, PARENTS)
    with pytest.raises(ValueError, match="max_depth=-1"):
        greedy_accept(t, _logits_with_argmax([0] * 8), max_depth=-1)


def test_stochastic_cold_equals_greedy():
    """At a tiny temperature the target is one-hot, so stochastic acceptance must reproduce greedy."""
    t = tree_from_parents(TOKENS, PARENTS)
    greedy = jax.jit(greedy_accept, static_argnums=2)
    stoch = jax.jit(stochastic_accept, static_argnums=4)
    for argmaxes in ([2, 0, 0, 0, 3, 0, 0, 6], [4, 0, 0, 7, 0, 0, 0, 0], [2, 1, 0, 0, 0, 4, 0, 0]):
        lg = _logits_with_argmax(argmaxes)
        g = greedy(t, lg, 3)
        for seed in range(3):
            s = stoch(t, lg, 1e-3, jax.random.key(seed), 3)
            for a, b in zip(g, s):
                np.testing.assert_array_equal(a, b)


def test_stochastic_seeded_determinism():
    t = tree_from_parents(np.tile(TOKENS, (64, 1)), np.tile(PARENTS, (64, 1)))
    lg = jax.random.normal(jax.random.key(0), (64, 8, V))
    fn = jax.jit(stochastic_accept, static_argnums=4)
    a = fn(t, lg, 1.0, jax.random.key(7), 3)
    b = fn(t, lg, 1.0, jax.random.key(7), 3)
    c = fn(t, lg, 1.0, jax.random.key(8), 3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(a, c))
    # path consistency: accepted nodes are a root path, padded with -1 after n_accepted
    idx, n = np.asarray(a[0]), np.asarray(a[1])
    for r in range(64):
        assert idx[r, 0] == 0
        for j in range(1, 4):
            if j <= n[r]:
                assert PARENTS[idx[r, j]] == idx[r, j - 1]
            else:
                assert idx[r, j] == -1


def test_accepted_inputs():
    t = tree_from_parents(TOKENS, PARENTS, root_pos=40)
    idx, n, b = greedy_accept(t, _logits_with_argmax([2, 0, 0, 0, 3, 0, 0, 6]), 3)
    node, toks, pos, valid = accepted_inputs(t, idx, n, b)
    np.testing.assert_array_equal(node[0], [0, 1, 4, 7])
    np.testing.assert_array_equal(toks[0], [2, 0, 3, 6])  # accepted drafted tokens, then the bonus
    np.testing.assert_array_equal(pos[0], [40, 41, 42, 43])
    np.testing.assert_array_equal(valid[0], [True] * 4)
    idx, n, b = greedy_accept(t, _logits_with_argmax([4, 0, 0, 7, 0, 0, 0, 0]), 3)
    node, toks, pos, valid = accepted_inputs(t, idx, n, b)
    np.testing.assert_array_equal(node[0], [0, 3, 0, 0])
    np.testing.assert_array_equal(toks[0], [4, 7, -1, -1])
    np.testing.assert_array_equal(pos[0, :2], [40, 41])
    np.testing.assert_array_equal(valid[0], [True, True, False, False])


# -- (b) lossless sampling ----------------------------------------------------------------------------------------
VOC, X0, TEMP, NSAMP = 6, 1, 0.8, 40000
SPEC_B = TreeSpec(top_k=2, depth=3, budget=6)


def _toy_tables(draft_noise):
    rng = np.random.default_rng(1234)
    target = rng.normal(0, 1.5, (VOC, VOC)).astype(np.float32)  # bigram logits: row = previous token
    draft = (target + rng.normal(0, draft_noise, (VOC, VOC))).astype(np.float32)
    return jnp.asarray(target), jnp.asarray(draft)


@partial(jax.jit, static_argnums=(0,))
def _generate3(spec, target, draft, key):
    """NSAMP independent speculative generations of 3 tokens after X0 over the toy bigram models: each round
    drafts a top-k tree from the draft table, verifies it with the target table and accepts stochastically."""
    B, A = NSAMP, spec.depth + 1
    out = jnp.full((B, 3 + A), -1, jnp.int32)
    count = jnp.zeros((B,), jnp.int32)
    last = jnp.full((B,), X0, jnp.int32)
    dlogp = jax.nn.log_softmax(draft, -1)
    for r in range(3):  # every round emits >= 1 token
        tree = build_tree_with(lambda s, lvl, tok, rows, anc: (s, dlogp[tok]), None, dlogp[last], last,
                               jnp.zeros((B,), jnp.int32), spec)
        idx, n, bonus = stochastic_accept(tree, target[tree.tokens], TEMP, jax.random.fold_in(key, r), spec.depth)
        _, new, _, valid = accepted_inputs(tree, idx, n, bonus)
        slot = jnp.where(valid, count[:, None] + jnp.arange(A)[None], out.shape[1])
        out = out.at[jnp.arange(B)[:, None], slot].set(new, mode="drop")
        count = count + n + 1
        last = bonus
    return out[:, :3]


@pytest.mark.parametrize("draft_noise", [0.3, 3.0])
def test_lossless_three_token_chi_square(draft_noise):
    target, draft = _toy_tables(draft_noise)
    seqs = np.asarray(_generate3(SPEC_B, target, draft, jax.random.key(2024)))
    assert (seqs >= 0).all()
    p = np.asarray(jax.nn.softmax(target / TEMP, -1), np.float64)
    cells = list(itertools.product(range(VOC), repeat=3))
    exp = np.array([p[X0, a] * p[a, b] * p[b, c] for a, b, c in cells]) * NSAMP
    code = seqs[:, 0] * VOC * VOC + seqs[:, 1] * VOC + seqs[:, 2]
    obs = np.bincount(code, minlength=VOC ** 3).astype(np.float64)
    # pool the cells expected below 5 into one bin
    small = exp < 5
    obs = np.append(obs[~small], obs[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    res = stats.chisquare(obs, exp)
    assert res.pvalue > 1e-3, (res, draft_noise)
    assert len(obs) > 50  # the test has real resolution


def test_lossless_tree_actually_accepts():
    """The close draft must get long accepted paths, so the chi-square test exercises the tree walk."""
    target, draft = _toy_tables(0.3)

    @jax.jit
    def one_round(target, draft):
        dlogp = jax.nn.log_softmax(draft, -1)
        last = jnp.full((4096,), X0, jnp.int32)
        tree = build_tree_with(lambda s, lvl, tok, rows, anc: (s, dlogp[tok]), None, dlogp[last], last,
                               jnp.zeros((4096,), jnp.int32), SPEC_B)
        return stochastic_accept(tree, target[tree.tokens], TEMP, jax.random.key(0), SPEC_B.depth)[1]

    B = 4096
    n = one_round(target, draft)
    hist = np.bincount(np.asarray(n), minlength=4)
    assert hist[2:].sum() > 0.2 * B and hist[0] > 0, hist
