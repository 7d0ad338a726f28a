"""Tests of the float64 SparQ reference (sparq_llama.reference) against independent oracles.

Needs only numpy and pytest: no native library, no model.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest

try:
    from sparq_llama.reference import dense_attn, sparq_attn, transfer_ratio
except ImportError:  # the package __init__ could not load its native libraries: load the source modules alone
    import importlib
    import sys
    import types

    _pkg = types.ModuleType("sparq_llama_src")  # a package over py/sparq_llama whose __init__ never runs
    _pkg.__path__ = [str(Path(__file__).resolve().parents[1] / "py" / "sparq_llama")]
    sys.modules[_pkg.__name__] = _pkg
    _mod = importlib.import_module("sparq_llama_src.reference")
    dense_attn, sparq_attn, transfer_ratio = _mod.dense_attn, _mod.sparq_attn, _mod.transfer_ratio


# ---------------------------------------------------------------------------------------------------
# Data and independent oracles (plain loops, written without the module's helpers)


def make_qkv(rng: np.random.Generator, n_head: int, n_head_kv: int, n_q: int, n_kv: int, d: int,
             d_v: int | None = None, n_strong: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Heavy-tailed queries (student-t, df=3) and keys with a few strong cells, so top-k is meaningful."""
    d_v = d if d_v is None else d_v
    q = rng.standard_t(3, size=(n_head, n_q, d))
    k = rng.standard_normal((n_head_kv, n_kv, d))
    v = rng.standard_normal((n_head_kv, n_kv, d_v))
    group = n_head // n_head_kv
    for h in range(n_head_kv):
        strong = rng.choice(n_kv, size=min(n_strong, n_kv), replace=False)
        direction = q[h * group:(h + 1) * group].mean(axis=(0, 1))
        k[h, strong] += 3.0 * direction / np.linalg.norm(direction) * math.sqrt(d)
    return q, k, v


def causal_mask(n_q: int, n_kv: int) -> np.ndarray:
    """Row t sees cells 0 .. n_kv - n_q + t (the last n_q cells are the rows' own tokens)."""
    return np.arange(n_kv)[None, :] <= (n_kv - n_q + np.arange(n_q))[:, None]


def holey_causal_mask(rng: np.random.Generator, n_q: int, n_kv: int, p_hole: float = 0.3) -> np.ndarray:
    m = causal_mask(n_q, n_kv) & (rng.random((n_q, n_kv)) > p_hole)
    m[np.arange(n_q), n_kv - n_q + np.arange(n_q)] = True  # each row sees itself
    return m


def naive_dense(q, k, v, mask=None, scale=None, softcap=0.0):
    n_head, n_q, d = q.shape
    n_head_kv, n_kv, d_v = v.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((n_head, n_q, d_v))
    for i in range(n_head):
        h = i // (n_head // n_head_kv)
        for t in range(n_q):
            cells = [j for j in range(n_kv) if mask is None or mask[t, j]]
            if not cells:
                continue
            logits = []
            for j in cells:
                x = scale * sum(q[i, t, c] * k[h, j, c] for c in range(d))
                if softcap > 0:
                    x = softcap * math.tanh(x / softcap)
                logits.append(x)
            mx = max(logits)
            e = [math.exp(x - mx) for x in logits]
            z = sum(e)
            for w, j in zip(e, cells):
                out[i, t] += (w / z) * v[h, j]
    return out


def naive_softmax(x):
    mx = max(x)
    e = [math.exp(a - mx) for a in x]
    z = sum(e)
    return [a / z for a in e]


def naive_sparq_selection(q, k, mask, k1, k2, window, sinks, scale=None, select="q"):
    """SparQ's I2 per (kv head, row), by loops: group-summed |q| (times the keys' spread for qsigma) -> I1,
    temperature, group-summed p_hat."""
    n_head, n_q, d = q.shape
    n_head_kv, n_kv, _ = k.shape
    g = n_head // n_head_kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    sel = []
    for h in range(n_head_kv):
        rows = []
        for t in range(n_q):
            vis = [j for j in range(n_kv) if mask[t, j]]
            if len(vis) <= k2:
                rows.append(vis)
                continue
            heads = range(h * g, (h + 1) * g)
            spread = [1.0] * d
            if select == "qsigma":
                for c in range(d):
                    mean = sum(k[h, j, c] for j in vis) / len(vis)
                    spread[c] = math.sqrt(sum((k[h, j, c] - mean) ** 2 for j in vis) / len(vis))
            a = [spread[c] * sum(abs(q[i, t, c]) for i in heads) for c in range(d)]
            i1 = sorted(range(d), key=lambda c: (-a[c], c))[:k1]
            total = {j: 0.0 for j in vis}
            for i in heads:
                if select == "qsigma":
                    w = [(q[i, t, c] * spread[c]) ** 2 for c in range(d)]
                else:
                    w = [abs(q[i, t, c]) for c in range(d)]
                rho = sum(w[c] for c in i1) / sum(w)
                s_hat = [scale * sum(q[i, t, c] * k[h, j, c] for c in i1) / math.sqrt(rho) for j in vis]
                for j, p in zip(vis, naive_softmax(s_hat)):
                    total[j] += p
            forced = set(vis[:sinks]) | set(vis[len(vis) - window:] if window else [])
            rest = sorted((j for j in vis if j not in forced), key=lambda j: (-total[j], j))
            rows.append(sorted(forced | set(rest[:k2 - len(forced)])))
        sel.append(rows)
    return sel


@pytest.mark.parametrize("n_head,n_head_kv", [(2, 2), (6, 2), (4, 1)])
def test_qsigma_selection_matches_naive_loop(n_head, n_head_kv):
    rng = np.random.default_rng(18)
    n_q, n_kv, d, k1, k2 = 3, 30, 8, 3, 7
    q, k, v = make_qkv(rng, n_head, n_head_kv, n_q, n_kv, d)
    k[:, :, :3] += rng.standard_normal(3) * 4.0  # components every key shares: qsigma must rank them low
    mask = holey_causal_mask(rng, n_q, n_kv, 0.2)
    _, sel = sparq_attn(q, k, v, mask, k1=k1, k2=k2, window=1, sinks=0, mean="off", return_selection=True,
                        select="qsigma")
    assert as_lists(sel) == naive_sparq_selection(q, k, mask, k1, k2, 1, 0, select="qsigma")
    assert as_lists(sel) != naive_sparq_selection(q, k, mask, k1, k2, 1, 0, select="q")


def test_q8_0_quantizer_matches_ggml_reference_bytes():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize
    from sparq_llama.index import q8_0_bytes, q8_0_dequantize, q8_0_quantize

    rng = np.random.default_rng(4)
    x = (rng.standard_t(3, size=(7, 256)) * rng.uniform(0.01, 100, size=(7, 1))).astype(np.float32)
    x[3, :32] = 0.0  # an all-zero block: scale 0, values 0
    ours = q8_0_bytes(*q8_0_quantize(x))
    np.testing.assert_array_equal(ours, quantize(x, gguf.GGMLQuantizationType.Q8_0))
    back = q8_0_dequantize(*q8_0_quantize(x))
    step = np.abs(x).reshape(7, 8, 32).max(axis=-1).repeat(32, axis=-1) / 127  # half a step, plus the f16 scale's
    assert np.all(np.abs(back - x) <= 0.6 * step)                             # rounding times up to 127


def test_q8_index_quantizes_component_rows_over_cells():
    from sparq_llama.index import q8_index_values

    rng = np.random.default_rng(5)
    keys = rng.standard_normal((70, 16))
    keys[40, 2] = 500.0  # one large value: only its own block (cells 32..63) of component 2 loses precision
    got = q8_index_values(keys)
    err = np.abs(got - keys)
    assert err[32:64, 2].max() > 0.5 and err[:32, 2].max() < 0.05 and err[64:, 2].max() < 0.05
    assert err[:, 3].max() < 0.05


def as_lists(selection):
    return [[list(map(int, s)) for s in rows] for rows in selection]


def restricted_mask(n_q: int, n_kv: int, cells_per_row) -> np.ndarray:
    m = np.zeros((n_q, n_kv), dtype=bool)
    for t, cells in enumerate(cells_per_row):
        m[t, list(cells)] = True
    return m


# ---------------------------------------------------------------------------------------------------
# dense_attn


@pytest.mark.parametrize("n_head,n_head_kv", [(2, 2), (6, 2), (3, 1)])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_dense_matches_naive_loop(n_head, n_head_kv, softcap):
    rng = np.random.default_rng(1)
    q, k, v = make_qkv(rng, n_head, n_head_kv, 3, 7, 4, d_v=5)
    mask = holey_causal_mask(rng, 3, 7)
    got = dense_attn(q, k, v, mask, softcap=softcap)
    np.testing.assert_allclose(got, naive_dense(q, k, v, mask, softcap=softcap), rtol=1e-12, atol=1e-13)
    got = dense_attn(q, k, v, None, scale=0.3, softcap=softcap)
    np.testing.assert_allclose(got, naive_dense(q, k, v, None, scale=0.3, softcap=softcap),
                               rtol=1e-12, atol=1e-13)
    assert got.dtype == np.float64 and got.shape == (n_head, 3, 5)


def test_row_without_visible_cell_is_zero():
    rng = np.random.default_rng(2)
    q, k, v = make_qkv(rng, 2, 1, 3, 20, 8)
    mask = np.ones((3, 20), dtype=bool)
    mask[1] = False
    dense = dense_attn(q, k, v, mask)
    assert np.all(dense[:, 1] == 0)
    for policy in ("sparq", "exact", "window"):
        out, sel = sparq_attn(q, k, v, mask, k1=2, k2=4, policy=policy, mean="on", return_selection=True)
        assert np.all(out[:, 1] == 0)
        assert len(sel[0][1]) == 0
        assert np.all(np.isfinite(out))


# ---------------------------------------------------------------------------------------------------
# Step 1: few visible cells -> dense, whatever the policy


@pytest.mark.parametrize("policy", ["sparq", "exact", "window"])
@pytest.mark.parametrize("mean", ["auto", "on", "off"])
def test_k2_covering_visible_equals_dense(policy, mean):
    rng = np.random.default_rng(3)
    n_q, n_kv = 5, 24
    q, k, v = make_qkv(rng, 4, 2, n_q, n_kv, 8)
    for mask in (None, causal_mask(n_q, n_kv), holey_causal_mask(rng, n_q, n_kv)):
        n_vis_max = n_kv if mask is None else int(mask.sum(axis=1).max())
        for k2 in (n_vis_max, n_kv + 3):
            out, sel = sparq_attn(q, k, v, mask, k1=2, k2=k2, window=0, policy=policy, mean=mean,
                                  softcap=2.0, return_selection=True)
            np.testing.assert_allclose(out, dense_attn(q, k, v, mask, softcap=2.0), rtol=1e-12, atol=1e-13)
            m = np.ones((n_q, n_kv), bool) if mask is None else mask
            for h in range(2):
                for t in range(n_q):
                    assert list(sel[h][t]) == list(np.flatnonzero(m[t]))


def test_rows_are_independent_under_causal_mask():
    """Rows with <= k2 visible cells are dense; the others are sparse; each row as if computed alone."""
    rng = np.random.default_rng(4)
    n_q, n_kv, k2 = 6, 12, 9
    q, k, v = make_qkv(rng, 2, 2, n_q, n_kv, 8)
    mask = causal_mask(n_q, n_kv)  # rows see 7..12 cells
    out = sparq_attn(q, k, v, mask, k1=3, k2=k2)
    dense = dense_attn(q, k, v, mask)
    for t in range(n_q):
        alone = sparq_attn(q[:, t:t + 1], k, v, mask[t:t + 1], k1=3, k2=k2)
        np.testing.assert_allclose(out[:, t:t + 1], alone, rtol=1e-14, atol=1e-15)
        if mask[t].sum() <= k2:
            np.testing.assert_allclose(out[:, t], dense[:, t], rtol=1e-12, atol=1e-13)
        else:
            assert not np.allclose(out[:, t], dense[:, t])


# ---------------------------------------------------------------------------------------------------
# Policies


@pytest.mark.parametrize("n_head,n_head_kv", [(3, 3), (4, 1)])
def test_exact_policy_equals_dense_over_true_topk(n_head, n_head_kv):
    rng = np.random.default_rng(5)
    n_q, n_kv, d, k2 = 3, 40, 8, 6
    q, k, v = make_qkv(rng, n_head, n_head_kv, n_q, n_kv, d)
    mask = holey_causal_mask(rng, n_q, n_kv, 0.2)
    g = n_head // n_head_kv
    out, sel = sparq_attn(q, k, v, mask, k1=1, k2=k2, window=0, policy="exact", mean="off",
                          return_selection=True)
    for h in range(n_head_kv):
        heads = list(range(h * g, (h + 1) * g))
        topk = []
        for t in range(n_q):
            vis = np.flatnonzero(mask[t])
            score = np.zeros(len(vis))
            for i in heads:  # group-summed true probabilities
                logits = (k[h, vis] @ q[i, t]) / math.sqrt(d)
                e = np.exp(logits - logits.max())
                score += e / e.sum()
            order = sorted(range(len(vis)), key=lambda j: (-score[j], vis[j]))
            topk.append(sorted(int(vis[j]) for j in order[:k2]))
        assert as_lists(sel)[h] == topk
        ref = naive_dense(q[heads], k[h:h + 1], v[h:h + 1], restricted_mask(n_q, n_kv, topk))
        np.testing.assert_allclose(out[heads], ref, rtol=1e-12, atol=1e-13)


def test_exact_policy_mean_uses_true_mass():
    rng = np.random.default_rng(6)
    n_kv, d, k2 = 30, 8, 5
    q, k, v = make_qkv(rng, 1, 1, 1, n_kv, d)
    out, sel = sparq_attn(q, k, v, k1=1, k2=k2, window=1, policy="exact", mean="on", return_selection=True)
    i2 = list(sel[0][0])
    logits = (k[0] @ q[0, 0]) / math.sqrt(d)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    alpha = p[i2].sum()
    y3 = naive_dense(q, k, v, restricted_mask(1, n_kv, [i2]))[0, 0]
    np.testing.assert_allclose(out[0, 0], alpha * y3 + (1 - alpha) * v[0].mean(axis=0), rtol=1e-12)
    assert n_kv - 1 in i2  # window
    assert set(i2) - {n_kv - 1} == set(np.argsort(-p[:-1])[:k2 - 1])


@pytest.mark.parametrize("n_head,n_head_kv", [(2, 2), (6, 2)])
def test_full_k1_sparq_selects_like_exact(n_head, n_head_kv):
    """k1 = d: rho = 1 and s_hat = q.K, so p_hat = p and SparQ picks the exact policy's set."""
    rng = np.random.default_rng(7)
    n_q, n_kv, d = 4, 64, 16
    q, k, v = make_qkv(rng, n_head, n_head_kv, n_q, n_kv, d)
    mask = holey_causal_mask(rng, n_q, n_kv, 0.25)
    kw = dict(k1=d, k2=10, window=2, sinks=1, mean="on", return_selection=True)
    out_s, sel_s = sparq_attn(q, k, v, mask, policy="sparq", **kw)
    out_e, sel_e = sparq_attn(q, k, v, mask, policy="exact", **kw)
    assert as_lists(sel_s) == as_lists(sel_e)
    np.testing.assert_allclose(out_s, out_e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n_head,n_head_kv", [(2, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("window,sinks", [(0, 0), (2, 0), (1, 2)])
def test_sparq_selection_matches_naive_loop(n_head, n_head_kv, window, sinks):
    """SparQ's group selection against a loop implementation (group-summed |q| and p_hat)."""
    rng = np.random.default_rng(8)
    n_q, n_kv, d, k1, k2 = 3, 30, 8, 3, 7
    q, k, v = make_qkv(rng, n_head, n_head_kv, n_q, n_kv, d)
    mask = holey_causal_mask(rng, n_q, n_kv, 0.2)
    out, sel = sparq_attn(q, k, v, mask, k1=k1, k2=k2, window=window, sinks=sinks, mean="off",
                          return_selection=True)
    naive = naive_sparq_selection(q, k, mask, k1, k2, window, sinks)
    assert as_lists(sel) == naive
    # every head of a group attends (exactly, mean off) over the group's shared I2
    g = n_head // n_head_kv
    for h in range(n_head_kv):
        heads = list(range(h * g, (h + 1) * g))
        ref = naive_dense(q[heads], k[h:h + 1], v[h:h + 1], restricted_mask(n_q, n_kv, naive[h]))
        np.testing.assert_allclose(out[heads], ref, rtol=1e-12, atol=1e-13)


def test_gqa_selection_is_shared_and_uses_group_sum():
    """One head's own top-k differs from the group's: the group sum decides, for all heads of the group."""
    d, n_kv = 4, 12
    q = np.zeros((2, 1, d))
    q[0, 0] = [4.0, 0.0, 0.0, 0.0]
    q[1, 0] = [0.0, 1.0, 0.0, 0.0]
    k = np.zeros((1, n_kv, d))
    k[0, 3, 0] = 2.0        # head 0's favourite
    k[0, 7, 1] = 2.0        # head 1's favourite
    v = np.random.default_rng(9).standard_normal((1, n_kv, 3))
    _, sel = sparq_attn(q, k, v, k1=1, k2=1, window=0, return_selection=True)
    assert list(sel[0][0]) == [3]   # I1 = {0} (group-summed |q|): cell 3 for both heads
    _, sel1 = sparq_attn(q[1:], k, v, k1=1, k2=1, window=0, return_selection=True)
    assert list(sel1[0][0]) == [7]  # head 1 alone would pick cell 7
    out = sparq_attn(q, k, v, k1=1, k2=1, window=0)
    np.testing.assert_allclose(out[:, 0], np.stack([v[0, 3], v[0, 3]]), rtol=1e-14)


def test_mean_auto_on_for_mha_off_for_gqa():
    rng = np.random.default_rng(10)
    kw = dict(k1=2, k2=5, window=1)
    q, k, v = make_qkv(rng, 2, 2, 2, 40, 8)
    auto = sparq_attn(q, k, v, **kw)
    np.testing.assert_array_equal(auto, sparq_attn(q, k, v, mean="on", **kw))
    assert not np.allclose(auto, sparq_attn(q, k, v, mean="off", **kw))
    q, k, v = make_qkv(rng, 4, 2, 2, 40, 8)
    auto = sparq_attn(q, k, v, **kw)
    np.testing.assert_array_equal(auto, sparq_attn(q, k, v, mean="off", **kw))
    assert not np.allclose(auto, sparq_attn(q, k, v, mean="on", **kw))


def test_mean_reallocation_by_hand():
    """A tiny MHA case worked through with explicit formulas (I1, rho, p_hat, alpha, v_bar)."""
    q = np.array([[[3.0, -0.1, -2.0, 0.05]]])          # |q| ranks components 0, 2, 1, 3
    k = np.array([[[1.0, 5.0, 0.0, 0.0],
                   [0.0, 0.0, -1.0, 0.0],
                   [0.5, 0.0, 0.5, 9.0],
                   [2.0, 0.0, 0.0, 0.0],
                   [-1.0, 0.0, 1.0, 0.0],
                   [0.0, 1.0, 0.0, 0.0]]])
    v = np.arange(18, dtype=float).reshape(1, 6, 3) ** 1.5
    mask = np.array([[True, True, True, True, True, False]])   # cell 5 invisible
    scale = 0.5
    out, sel = sparq_attn(q, k, v, mask, k1=2, k2=2, window=0, scale=scale, mean="on", return_selection=True)
    # I1 = {0, 2}; rho = (3 + 2) / 5.15
    s_hat = np.array([3.0 * 1 + 0, 2.0, 1.5 - 1.0, 6.0, -3.0 - 2.0])
    logits = scale * s_hat / math.sqrt(5.0 / 5.15)
    p_hat = np.exp(logits) / np.exp(logits).sum()
    i2 = [0, 3]                                    # two largest s_hat: cells 3 (6.0) and 0 (3.0)
    assert list(sel[0][0]) == i2
    alpha = p_hat[i2].sum()
    true = scale * (k[0, i2] @ q[0, 0])
    w = np.exp(true) / np.exp(true).sum()
    y3 = w @ v[0, i2]
    v_bar = v[0, :5].mean(axis=0)                  # mean over the visible cells only
    np.testing.assert_allclose(out[0, 0], alpha * y3 + (1 - alpha) * v_bar, rtol=1e-13)
    off = sparq_attn(q, k, v, mask, k1=2, k2=2, window=0, scale=scale, mean="off")
    np.testing.assert_allclose(off[0, 0], y3, rtol=1e-13)


def test_zero_query_gives_uniform_p_hat():
    """q = 0: rho is taken as 1, p_hat is uniform; the lowest-index cells win the tie, alpha = k2 / |V|."""
    v = np.random.default_rng(11).standard_normal((1, 10, 2))
    k = np.random.default_rng(12).standard_normal((1, 10, 4))
    q = np.zeros((1, 1, 4))
    out, sel = sparq_attn(q, k, v, k1=2, k2=3, window=0, mean="on", return_selection=True)
    assert list(sel[0][0]) == [0, 1, 2]
    alpha = 3 / 10
    expect = alpha * v[0, :3].mean(axis=0) + (1 - alpha) * v[0].mean(axis=0)
    np.testing.assert_allclose(out[0, 0], expect, rtol=1e-13)


# ---------------------------------------------------------------------------------------------------
# Window, sinks, ties


@pytest.mark.parametrize("policy", ["sparq", "exact"])
def test_window_and_sinks_always_kept(policy):
    rng = np.random.default_rng(13)
    n_kv, d, k2, window, sinks = 50, 8, 8, 3, 2
    q, k, v = make_qkv(rng, 2, 2, 1, n_kv, d, n_strong=0)
    mask = np.ones((1, n_kv), bool)
    mask[0, [0, 2, 48]] = False
    vis = np.flatnonzero(mask[0])
    k[:, vis[:sinks]] = -10 * q[:, 0][:, None] / np.linalg.norm(q[:, 0], axis=-1)[:, None, None]
    k[:, vis[-window:]] = -10 * q[:, 0][:, None] / np.linalg.norm(q[:, 0], axis=-1)[:, None, None]
    k[:, 20] = 10 * q[:, 0] / np.linalg.norm(q[:, 0], axis=-1)[:, None]   # a strong key
    _, sel = sparq_attn(q, k, v, mask, k1=d // 2, k2=k2, window=window, sinks=sinks, policy=policy,
                        return_selection=True)
    for h in range(2):
        s = list(sel[h][0])
        assert len(s) == k2
        assert set(vis[:sinks]) | set(vis[-window:]) | {20} <= set(s)
        assert s == sorted(s) and all(mask[0, s])


def test_window_policy_keeps_sinks_and_recent():
    rng = np.random.default_rng(14)
    n_q, n_kv = 3, 40
    q, k, v = make_qkv(rng, 4, 2, n_q, n_kv, 8)
    mask = holey_causal_mask(rng, n_q, n_kv, 0.3)
    out, sel = sparq_attn(q, k, v, mask, k1=1, k2=7, window=0, sinks=2, policy="window", mean="off",
                          return_selection=True)
    expect = []
    for t in range(n_q):
        vis = list(np.flatnonzero(mask[t]))
        expect.append(sorted(set(vis[:2]) | set(vis[-5:])))
    for h in range(2):
        assert as_lists(sel)[h] == expect
        heads = [2 * h, 2 * h + 1]
        ref = naive_dense(q[heads], k[h:h + 1], v[h:h + 1], restricted_mask(n_q, n_kv, expect))
        np.testing.assert_allclose(out[heads], ref, rtol=1e-12, atol=1e-13)
    # the window argument is ignored by this policy (only validated)
    np.testing.assert_array_equal(out, sparq_attn(q, k, v, mask, k1=1, k2=7, window=4, sinks=2,
                                                  policy="window", mean="off"))
    # alpha uses the true probabilities for this policy
    on = sparq_attn(q[:1], k[:1], v[:1], mask, k1=1, k2=7, window=0, sinks=2, policy="window", mean="on")
    for t in range(n_q):
        vis = np.flatnonzero(mask[t])
        logits = (k[0, vis] @ q[0, t]) / math.sqrt(8)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        alpha = p[np.isin(vis, expect[t])].sum()
        np.testing.assert_allclose(on[0, t], alpha * out[0, t] + (1 - alpha) * v[0, vis].mean(axis=0),
                                   rtol=1e-12)


@pytest.mark.parametrize("policy", ["sparq", "exact"])
def test_score_ties_go_to_lower_cell_index(policy):
    d, n_kv = 4, 16
    q = np.array([[[1.0, 0.5, 0.0, 0.0]]])
    k = np.zeros((1, n_kv, d))
    k[0, [3, 6, 9, 12], 0] = 2.0          # four equal best scores
    v = np.random.default_rng(15).standard_normal((1, n_kv, 2))
    _, sel = sparq_attn(q, k, v, k1=2, k2=3, window=0, policy=policy, return_selection=True)
    assert list(sel[0][0]) == [3, 6, 9]
    _, sel = sparq_attn(q, k, v, k1=2, k2=6, window=0, policy=policy, return_selection=True)
    assert list(sel[0][0]) == [0, 1, 3, 6, 9, 12]   # then the zero-score cells, lowest first


def test_component_ties_go_to_lower_index():
    d, n_kv = 4, 10
    q = np.array([[[0.0, 1.0, -1.0, 0.2]]])   # |q[1]| == |q[2]|: k1=1 must take component 1
    k = np.zeros((1, n_kv, d))
    k[0, 2, 1] = 3.0    # only visible through component 1
    k[0, 5, 2] = -3.0   # only visible through component 2
    v = np.random.default_rng(16).standard_normal((1, n_kv, 2))
    _, sel = sparq_attn(q, k, v, k1=1, k2=1, window=0, return_selection=True)
    assert list(sel[0][0]) == [2]


# ---------------------------------------------------------------------------------------------------
# Softcap and Sparse-V


def test_softcap_is_tanh_capping_of_exact_logits():
    rng = np.random.default_rng(17)
    n_q, n_kv, d, k2 = 2, 30, 8, 6
    q, k, v = make_qkv(rng, 2, 1, n_q, n_kv, d)
    q *= 3.0
    cap = 1.0
    out_c, sel_c = sparq_attn(q, k, v, k1=2, k2=k2, window=1, mean="off", softcap=cap, return_selection=True)
    out_n, sel_n = sparq_attn(q, k, v, k1=2, k2=k2, window=1, mean="off", return_selection=True)
    # the approximate scores are not capped: the same selection
    assert as_lists(sel_c) == as_lists(sel_n)
    sel = as_lists(sel_c)[0]
    ref = naive_dense(q, k, v, restricted_mask(n_q, n_kv, sel), softcap=cap)
    np.testing.assert_allclose(out_c, ref, rtol=1e-12, atol=1e-13)
    assert not np.allclose(out_c, out_n)
    # a huge cap is no cap
    big = sparq_attn(q, k, v, k1=2, k2=k2, window=1, mean="off", softcap=1e9)
    np.testing.assert_allclose(big, out_n, rtol=1e-9, atol=1e-12)
    # the exact policy ranks by the capped probabilities: capping flattens them, and mean-on alpha follows
    out_e, sel_e = sparq_attn(q[:1], k, v, k1=2, k2=k2, window=0, policy="exact", mean="on", softcap=cap,
                              return_selection=True)
    for t in range(n_q):
        logits = cap * np.tanh((k[0] @ q[0, t]) / math.sqrt(d) / cap)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        i2 = list(sel_e[0][t])
        assert set(i2) == set(np.lexsort((np.arange(n_kv), -p))[:k2])
        alpha = p[i2].sum()
        y3 = naive_dense(q[:1, t:t + 1], k, v, restricted_mask(1, n_kv, [i2]), softcap=cap)[0, 0]
        np.testing.assert_allclose(out_e[0, t], alpha * y3 + (1 - alpha) * v[0].mean(axis=0), rtol=1e-12)


def test_sparse_v_threshold_drops_and_renormalises():
    n_kv = 5
    q = np.array([[[1.0, 0.0]]])
    k = np.array([[[2.0, 0], [1.0, 0], [0.0, 0], [-1.0, 0], [-3.0, 0]]])
    v = np.random.default_rng(18).standard_normal((1, n_kv, 3))
    logits = k[0] @ q[0, 0]                # scale 1
    w = np.exp(logits) / np.exp(logits).sum()   # ~ [.64, .23, .09, .03, .002]
    theta = 0.05
    keep = w >= theta
    assert 1 < keep.sum() < n_kv
    expect = (w[keep] / w[keep].sum()) @ v[0, keep]
    for k2 in (n_kv, 4):                   # dense row (step 1) and sparse row (step 4) alike
        out = sparq_attn(q, k, v, k1=1, k2=k2, window=0, scale=1.0, mean="off", policy="exact",
                         sparse_v_thresh=theta)
        if k2 == n_kv:
            np.testing.assert_allclose(out[0, 0], expect, rtol=1e-13)
        else:  # I2 = top 4; the threshold acts on the renormalised weights over I2
            w4 = w[:4] / w[:4].sum()
            keep4 = w4 >= theta
            np.testing.assert_allclose(out[0, 0], (w4[keep4] / w4[keep4].sum()) @ v[0, :4][keep4], rtol=1e-13)
    # a threshold above every weight keeps only the largest
    out = sparq_attn(q, k, v, k1=1, k2=n_kv, scale=1.0, sparse_v_thresh=0.9)
    np.testing.assert_allclose(out[0, 0], v[0, 0], rtol=1e-14)
    # theta = 0 is plain attention
    np.testing.assert_allclose(sparq_attn(q, k, v, k1=1, k2=n_kv, scale=1.0, sparse_v_thresh=0.0),
                               dense_attn(q, k, v, scale=1.0), rtol=1e-14)


# ---------------------------------------------------------------------------------------------------
# Validation


def _small():
    rng = np.random.default_rng(19)
    return make_qkv(rng, 4, 2, 2, 10, 8)


@pytest.mark.parametrize("kwargs,match", [
    (dict(k1=0, k2=4), "k1"),
    (dict(k1=9, k2=4), "k1"),
    (dict(k1=2.5, k2=4), "k1"),
    (dict(k1=2, k2=0), "k2"),
    (dict(k1=2, k2=4, window=-1), "window"),
    (dict(k1=2, k2=4, sinks=-1), "sinks"),
    (dict(k1=2, k2=4, window=3, sinks=2), "window \\+ sinks"),
    (dict(k1=2, k2=4, sinks=4), "window \\+ sinks"),   # default window = k2 // 4 = 1
    (dict(k1=2, k2=4, policy="topk"), "policy"),
    (dict(k1=2, k2=4, mean="yes"), "mean"),
    (dict(k1=2, k2=4, scale=0.0), "scale"),
    (dict(k1=2, k2=4, scale=-1.0), "scale"),
    (dict(k1=2, k2=4, softcap=-1.0), "softcap"),
    (dict(k1=2, k2=4, sparse_v_thresh=-0.1), "sparse_v_thresh"),
    (dict(k1=2, k2=4, sparse_v_thresh=1.0), "sparse_v_thresh"),
])
def test_bad_parameters_raise(kwargs, match):
    q, k, v = _small()
    with pytest.raises(ValueError, match=match):
        sparq_attn(q, k, v, **kwargs)


def test_bad_shapes_raise():
    q, k, v = _small()
    cases = [
        ((q[0], k, v, None), "q must be 3-D"),
        ((q, k[0], v, None), "k must be 3-D"),
        ((q, k, v[..., None], None), "v must be 3-D"),
        ((q, k[..., :4], v, None), "head dim"),
        ((q, k, v[:, :9], None), "v must be"),
        ((q[:3], k, v, None), "multiple"),
        ((q, k, v, np.ones((2, 9), bool)), "mask must have shape"),
        ((q, k, v, np.zeros((2, 10))), "boolean"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            sparq_attn(*args, k1=2, k2=4)
        with pytest.raises(ValueError, match=match):
            dense_attn(*args)
    with pytest.raises(ValueError, match="scale"):
        dense_attn(q, k, v, scale=0.0)
    with pytest.raises(ValueError, match="softcap"):
        dense_attn(q, k, v, softcap=-2.0)


# ---------------------------------------------------------------------------------------------------
# Transfer model and size


def test_transfer_ratio():
    # the f16 index on an f16 cache: the paper's ratio of elements
    s, d, r, k = 65536, 128, 32, 128
    dense = 2 * s * d + 2 * d
    f16 = dict(index="f16")
    assert transfer_ratio(s, d, r, k, **f16) == pytest.approx(dense / (s * r + 2 * k * d + 4 * d), rel=1e-15)
    assert transfer_ratio(s, d, r, k, **f16) == pytest.approx(7.87515, abs=1e-5)
    assert transfer_ratio(s, d, r, k, mean=False, **f16) == pytest.approx(dense / (s * r + 2 * k * d + 2 * d), rel=1e-15)
    assert transfer_ratio(s, d, r, k, mean=False, **f16) > transfer_ratio(s, d, r, k, **f16)
    assert transfer_ratio(1024, 64, 16, 64, **f16) == pytest.approx((2 * 1024 * 64 + 128) / (1024 * 16 + 2 * 64 * 64 + 256))
    # the q8 index (the default): 34 bytes per 32 components of K^T, the rest at the cache's 2 bytes
    assert transfer_ratio(s, d, r, k) == pytest.approx(2 * dense / (s * r * 34 / 32 + 2 * (2 * k * d + 4 * d)))
    with pytest.raises(ValueError):
        transfer_ratio(0, 128, 32, 128)


def test_large_shape_is_fast_and_sane():
    rng = np.random.default_rng(20)
    n_q, n_kv, d = 8, 4096, 64
    q, k, v = make_qkv(rng, 8, 2, n_q, n_kv, d, n_strong=16)
    mask = causal_mask(n_q, n_kv)
    t0 = time.perf_counter()
    out, sel = sparq_attn(q, k, v, mask, k1=16, k2=128, sinks=4, return_selection=True)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0  # generous; typically well under a second
    assert out.shape == (8, n_q, d) and np.all(np.isfinite(out))
    assert all(len(s) == 128 for rows in sel for s in rows)
    # heavy-tailed queries + strong keys: SparQ finds most of the true top cells and beats the recent window
    _, top = sparq_attn(q, k, v, mask, k1=d, k2=16, window=0, policy="exact", return_selection=True)
    recall = np.mean([len(set(top[h][t]) & set(sel[h][t])) / 16 for h in range(2) for t in range(n_q)])
    assert recall > 0.7
    dense = dense_attn(q, k, v, mask)
    window = sparq_attn(q, k, v, mask, k1=16, k2=128, sinks=4, policy="window")
    assert np.linalg.norm(out - dense) < 0.5 * np.linalg.norm(window - dense)
