"""The q4 index's numpy side (sparq_llama.index) and the float64 reference with it, against independent oracles: gguf's
q4_0 quantizer (bit for bit), the byte layout decoded by plain loops, the integer scores by a per-cell loop in float32
scalars, dense attention, and the transfer model's bytes worked out by hand.

Needs numpy, pytest and gguf: no native library, no model.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from sparq_llama import reference as ref
from sparq_llama import sparq as sparq_api
from sparq_llama.eval import k1_for_ratio
from test_reference import naive_softmax
from sparq_llama.index import (
    Q4_BLOCK,
    Q4_DIM_BYTES,
    q4_0_dequantize,
    q4_0_quantize,
    q4_block_scores,
    q4_index_bytes,
    q4_index_dequantize,
    q4_index_pack,
    q4_index_quantize,
    q4_index_unpack,
    q4_index_values,
    q4_scores,
)

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

Q4_0 = gguf.GGMLQuantizationType.Q4_0


def block_q4_0_bytes(scales: np.ndarray, nibbles: np.ndarray) -> np.ndarray:
    """ggml's block_q4_0 layout [..., nb, 18]: the f16 scale, then byte j holding value j (low nibble) and value
    j + 16 (high nibble)."""
    packed = nibbles[..., :16] | (nibbles[..., 16:] << np.uint8(4))
    return np.concatenate([np.ascontiguousarray(scales).view(np.uint8).reshape(*scales.shape, 2), packed], axis=-1)


def loop_decode(raw: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """One q4 index block's bytes [18*d] decoded by loops as the layout is written down: (scales [d] f32, nibbles
    [32, d])."""
    nib = np.zeros((Q4_BLOCK, d), dtype=np.int64)
    for c in range(Q4_BLOCK):
        for i in range(d):
            k, t = divmod(i, 8)
            byte = int(raw[4 * (32 * k + c) + t % 4])
            nib[c, i] = (byte & 15) if t < 4 else (byte >> 4)
    scales = np.array([np.frombuffer(bytes(raw[16 * d + 2 * i:16 * d + 2 * i + 2]), dtype=np.float16)[0]
                       for i in range(d)], dtype=np.float32)
    return scales, nib


def loop_scores(q: np.ndarray, scales: np.ndarray, nib: np.ndarray) -> np.ndarray:
    """One block's scores [G, 32] by the integer formula, one cell at a time in float32 scalars (Python's round is
    half to even)."""
    f32 = np.float32
    out = np.zeros((q.shape[0], Q4_BLOCK), dtype=np.float32)
    for g in range(q.shape[0]):
        w = [f32(f32(q[g, i]) * f32(scales[i])) for i in range(len(scales))]
        m = max(abs(x) for x in w)
        if m == 0:
            continue
        inv, c_scale = f32(f32(127.0) / m), f32(m / f32(127.0))
        a = [int(round(float(f32(x * inv)))) for x in w]
        for c in range(Q4_BLOCK):
            dot = sum(a[i] * int(nib[c, i]) for i in range(len(a))) - 8 * sum(a)
            out[g, c] = f32(c_scale * f32(dot))
    return out


# ---------------------------------------------------------------------------------------------------
# The quantizer


def test_q4_0_quantizer_matches_ggml_reference_bytes():
    rng = np.random.default_rng(40)
    x = (rng.standard_t(3, size=(9, 256)) * rng.uniform(0.01, 100, size=(9, 1))).astype(np.float32)
    x[3, :32] = 0.0                                            # an all-zero block: scale -0, every nibble 8
    x[4, :32] = np.resize(np.float32([2.5, -2.5]), 32)         # equal magnitudes: the first one's sign
    x[4, 32:64] = np.resize(np.float32([-2.5, 2.5]), 32)
    x[5, :32] = np.arange(-8.0, 8.0, 0.5, dtype=np.float32)    # scale 1: x*id + 8.5 lands on whole numbers
    x[5, 32:64] = -np.arange(-8.0, 8.0, 0.5, dtype=np.float32)[::-1]
    x[6, :32] = np.float32(1e-6) * np.arange(32)               # tiny values: a subnormal f16 scale
    x[7, 64:96] = 7.0                                          # one value everywhere: nibbles 0 (-8 * s)
    scales, nib = q4_0_quantize(x)
    assert scales.shape == (9, 8) and nib.shape == (9, 8, 32) and nib.max() <= 15
    np.testing.assert_array_equal(block_q4_0_bytes(scales, nib).reshape(9, -1), quantize(x, Q4_0))
    np.testing.assert_array_equal(q4_0_dequantize(scales, nib), dequantize(quantize(x, Q4_0), Q4_0))
    assert scales[5, 0] == 1.0 and scales[5, 1] == -1.0


def test_q4_0_all_zero_block_scale_is_ggml_negative_zero():
    # ggml's loop starts from max = +0 and keeps it when no |x| exceeds 0: s = +0 / -8 = -0 whatever the zeros' signs
    # (a masked cell is a key times 0, a negative key gives -0)
    x = np.zeros((2, 32), dtype=np.float32)
    x[1, ::2] = -0.0
    scales, nib = q4_0_quantize(x)
    assert np.all(scales.view(np.uint16) == 0x8000) and np.all(nib == 8)
    np.testing.assert_array_equal(block_q4_0_bytes(scales, nib)[0, 0], quantize(x[:1], Q4_0)[0])  # +0 zeros: gguf too


# ---------------------------------------------------------------------------------------------------
# The index: blocks of 32 cells, every component, cell-major nibble words


@pytest.mark.parametrize("n_kv,d", [(70, 16), (32, 8), (100, 64), (5, 128)])
def test_q4_index_bytes_follow_the_layout(n_kv, d):
    rng = np.random.default_rng(n_kv + d)
    keys = rng.standard_normal((n_kv, d)) * np.exp2(rng.integers(-4, 4, d))
    raw = q4_index_bytes(keys)
    nb = -(-n_kv // Q4_BLOCK)
    assert raw.shape == (nb, Q4_DIM_BYTES * d) and raw.dtype == np.uint8
    # each component's 32 cells (the cells past n_kv zero) as gguf's q4_0 of K^T's rows holds them
    rows = np.pad(keys.astype(np.float32), ((0, nb * Q4_BLOCK - n_kv), (0, 0))).T
    want = dequantize(quantize(np.ascontiguousarray(rows), Q4_0), Q4_0).reshape(d, nb, Q4_BLOCK)
    want_scales = quantize(np.ascontiguousarray(rows), Q4_0).reshape(d, nb, 18)[..., :2].copy().view(np.float16)
    for b in range(nb):
        scales, nib = loop_decode(raw[b], d)
        np.testing.assert_array_equal(scales, want_scales[:, b, 0].astype(np.float32))
        np.testing.assert_array_equal((nib - 8) * scales, want[:, b].T)
    # unpack inverts pack, and the values read back are the keys' q4_0 values
    s, n = q4_index_quantize(keys)
    s2, n2 = q4_index_unpack(raw)
    assert np.array_equal(s.view(np.uint16), s2.view(np.uint16)) and np.array_equal(n, n2)
    np.testing.assert_array_equal(q4_index_dequantize(s2, n2, n_kv), want.reshape(d, -1)[:, :n_kv].T)
    np.testing.assert_array_equal(q4_index_values(keys), want.reshape(d, -1)[:, :n_kv].T)


def test_q4_index_takes_leading_axes_and_refuses_bad_head_dims():
    rng = np.random.default_rng(41)
    keys = rng.standard_normal((2, 3, 40, 16))
    raw = q4_index_bytes(keys)
    assert raw.shape == (2, 3, 2, 18 * 16)
    for s in range(2):
        for h in range(3):
            np.testing.assert_array_equal(raw[s, h], q4_index_bytes(keys[s, h]))
    with pytest.raises(ValueError, match="multiple of 8"):
        q4_index_pack(*q4_index_quantize(rng.standard_normal((40, 12))))
    with pytest.raises(ValueError, match="18"):
        q4_index_unpack(np.zeros((2, 18 * 12), dtype=np.uint8))


# ---------------------------------------------------------------------------------------------------
# The scores: int8 query coefficients against 4-bit keys


def test_q4_scores_equal_the_integer_formula_cell_by_cell():
    rng = np.random.default_rng(42)
    d = 16
    keys = rng.standard_normal((96, d)) * np.exp2(rng.integers(-3, 3, d))
    keys[32:64] = 0.0                                  # an all-zero block: m = 0, every cell scores 0
    keys[64:96] = rng.integers(-8, 8, (32, d))
    keys[64] = -8.0                                    # scales exactly 1 in the third block
    q = rng.standard_t(3, size=(3, d)).astype(np.float32)
    q[1, 3] = 0.0
    q[2] = np.float32(127.0)                           # head 2: w*inv lands on halves in the third block
    q[2, 1:] = np.arange(1, d, dtype=np.float32) - np.float32(0.5)
    raw = q4_index_bytes(keys)
    scales, nib = q4_index_quantize(keys)
    got = q4_block_scores(q, scales, nib)
    assert got.dtype == np.float32 and got.shape == (3, 96)
    for b in range(3):
        want = loop_scores(q, *loop_decode(raw[b], d))
        np.testing.assert_array_equal(got[:, 32 * b:32 * (b + 1)], want, err_msg=f"block {b}")
    assert np.all(got[:, 32:64] == 0)
    # half to even: the coefficient of 1.5 is 2, of 2.5 also 2 (w = q with scale 1, m = 127, inv = 1)
    a = np.rint(q[2] * np.float32(1.0))
    assert a[2] == 2 and a[3] == 2
    np.testing.assert_array_equal(q4_scores(q, keys[:70]), got[:, :70])


def test_q4_scores_are_the_float_scores_to_the_coefficients_rounding():
    rng = np.random.default_rng(43)
    n_kv, d = 200, 64
    keys = rng.standard_normal((n_kv, d)) * np.linspace(0.1, 4.0, d) + np.where(np.arange(d) % 7 == 0, 3.0, 0.0)
    q = rng.standard_t(3, size=(4, d)).astype(np.float32).astype(np.float64)
    scales, nib = q4_index_quantize(keys)
    got = q4_scores(q, keys).astype(np.float64)
    exact = q @ q4_index_values(keys).T                              # float64 over the 4-bit keys
    w = np.abs(q[:, None, :] * scales.astype(np.float64)[None])      # [G, nb, d]
    c = w.max(axis=-1) / 127                                         # the coefficients' step per head and block
    cells = np.arange(n_kv) // Q4_BLOCK
    spread = np.abs(nib.astype(np.int64) - 8).reshape(-1, d)[:n_kv].sum(axis=1)   # sum_i |n_i,c - 8|
    size = (w[:, cells] * np.abs(nib.astype(np.int64) - 8).reshape(-1, d)[:n_kv][None]).sum(axis=-1)
    bound = 0.5 * c[:, cells] * spread[None] + 1e-5 * size
    err = np.abs(got - exact)
    assert np.all(err <= bound), (err / bound).max()
    assert err.max() > 0 and np.corrcoef(got.ravel(), exact.ravel())[0, 1] > 0.999


# ---------------------------------------------------------------------------------------------------
# The float64 reference with the q4 index


def make_qkv(rng: np.random.Generator, n_head: int, n_head_kv: int, n_q: int, n_kv: int, d: int):
    """f32-exact queries (student-t) and keys with a few strong cells per KV head."""
    q = rng.standard_t(3, size=(n_head, n_q, d)).astype(np.float32).astype(np.float64)
    k = rng.standard_normal((n_head_kv, n_kv, d)).astype(np.float32).astype(np.float64)
    v = rng.standard_normal((n_head_kv, n_kv, d))
    for h in range(n_head_kv):
        strong = rng.choice(n_kv, size=4, replace=False)
        k[h, strong] += np.sign(q[h * (n_head // n_head_kv), 0]) * 2.0
    return q, k, v


def naive_q4_selection(q, k, mask, k2, window, scale):
    """I2 per (KV head, row) with the q4 index, by loops: each block's scores by `loop_scores` over the bytes of the
    head's keys, p_hat = softmax over the row's visible cells of scale * s_hat (rho = 1), summed over the group."""
    n_head, n_q, d = q.shape
    n_head_kv, n_kv, _ = k.shape
    g = n_head // n_head_kv
    out = []
    for h in range(n_head_kv):
        raw = q4_index_bytes(k[h])
        rows = []
        for t in range(n_q):
            vis = [j for j in range(n_kv) if mask[t, j]]
            if len(vis) <= k2:
                rows.append(vis)
                continue
            qg = q[h * g:(h + 1) * g, t].astype(np.float32)
            s_hat = np.concatenate([loop_scores(qg, *loop_decode(raw[b], d)) for b in range(len(raw))], axis=1)
            total = {j: 0.0 for j in vis}
            for i in range(g):
                for j, p in zip(vis, naive_softmax([scale * float(s_hat[i, j]) for j in vis])):
                    total[j] += p
            forced = set(vis[len(vis) - window:]) if window else set()
            rest = sorted((j for j in vis if j not in forced), key=lambda j: (-total[j], j))
            rows.append(sorted(forced | set(rest[:k2 - len(forced)])))
        out.append(rows)
    return out


@pytest.mark.parametrize("n_head,n_head_kv", [(2, 2), (6, 2), (4, 1)])
def test_reference_q4_selection_matches_naive_loop(n_head, n_head_kv):
    rng = np.random.default_rng(44)
    n_q, n_kv, d, k2 = 3, 75, 16, 9
    q, k, v = make_qkv(rng, n_head, n_head_kv, n_q, n_kv, d)
    mask = np.arange(n_kv)[None, :] <= (n_kv - n_q + np.arange(n_q))[:, None]
    mask &= rng.random((n_q, n_kv)) > 0.2
    for select in ("q", "qsigma"):  # every component is scored: the selection rule plays no part
        _, sel = ref.sparq_attn(q, k, v, mask, k1=d, k2=k2, window=2, mean="off", return_selection=True,
                                index="q4", select=select)
        assert [[s.tolist() for s in rows] for rows in sel] == naive_q4_selection(q, k, mask, k2, 2, 1 / math.sqrt(d))


def test_reference_q4_alpha_is_p_hat_over_the_selection():
    # mean reallocation with the q4 index: alpha = sum over I2 of the q4 p_hat (rho = 1), by hand for one MHA head
    rng = np.random.default_rng(45)
    n_kv, d, k2 = 90, 32, 10
    q, k, v = make_qkv(rng, 1, 1, 1, n_kv, d)
    out, sel = ref.sparq_attn(q, k, v, k1=d, k2=k2, window=0, mean="on", return_selection=True, index="q4")
    i2 = sel[0][0]
    sigma = 1 / math.sqrt(d)
    p_hat = ref._softmax(sigma * q4_scores(q[0, 0][None].astype(np.float32), k[0]).astype(np.float64))[0]
    alpha = p_hat[i2].sum()
    w = ref._softmax(sigma * (q[0, 0] @ k[0, i2].T))
    want = alpha * (w @ v[0, i2]) + (1 - alpha) * v[0].mean(axis=0)
    np.testing.assert_allclose(out[0, 0], want, rtol=1e-12, atol=1e-12)
    assert np.array_equal(i2, np.sort(np.argsort(-p_hat, kind="stable")[:k2]))


@pytest.mark.parametrize("policy", ["sparq", "exact", "window"])
def test_reference_q4_with_k2_covering_the_context_equals_dense(policy):
    rng = np.random.default_rng(46)
    q, k, v = make_qkv(rng, 4, 2, 3, 100, 32)
    mask = np.arange(100)[None, :] <= (97 + np.arange(3))[:, None]
    got = ref.sparq_attn(q, k, v, mask, k1=32, k2=100, policy=policy, index="q4")
    np.testing.assert_allclose(got, ref.dense_attn(q, k, v, mask), rtol=1e-12, atol=1e-12)
    # a small k2 really selects, by the q4 scores: other cells than the f16 index at k1 = d picks for some row
    _, sel_q4 = ref.sparq_attn(q, k, v, mask, k1=32, k2=8, window=0, index="q4", return_selection=True)
    _, sel_f16 = ref.sparq_attn(q, k, v, mask, k1=32, k2=8, window=0, index="f16", return_selection=True)
    assert all(len(s) == 8 for rows in sel_q4 for s in rows)
    assert any(not np.array_equal(a, b) for ra, rb in zip(sel_q4, sel_f16) for a, b in zip(ra, rb))


def test_reference_q4_approx_top_cells_is_the_selection_without_window():
    rng = np.random.default_rng(47)
    q, k, v = make_qkv(rng, 3, 1, 1, 150, 32)
    top = ref.approx_top_cells(q[:, 0], k[0], 32, 12, scale=0.2, index="q4")
    _, sel = ref.sparq_attn(q, k, v, k1=32, k2=12, window=0, scale=0.2, index="q4", return_selection=True)
    assert np.array_equal(np.sort(top), sel[0][0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(k1=16, k2=4, index="q4"), "k1 must be head_dim = 32"),
    (dict(k1=1, k2=4, index="q4", policy="exact"), "k1 must be head_dim = 32"),
])
def test_reference_q4_refuses_k1_other_than_d(kwargs, match):
    rng = np.random.default_rng(48)
    q, k, v = make_qkv(rng, 2, 1, 1, 40, 32)
    with pytest.raises(ValueError, match=match):
        ref.sparq_attn(q, k, v, **kwargs)
    with pytest.raises(ValueError, match=match):
        ref.approx_top_cells(q[:, 0], k[0], 16, 4, scale=0.2, index="q4")
    q12, k12, v12 = make_qkv(rng, 2, 1, 1, 40, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        ref.sparq_attn(q12, k12, v12, k1=12, k2=4, index="q4")


# ---------------------------------------------------------------------------------------------------
# The transfer model and the settings


def test_q4_transfer_bytes_and_default_k1():
    assert sparq_api.index_bytes("q4") == Fraction(18, 32)
    assert sparq_api.default_k1(64, "q4") == 64 and sparq_api.default_k1(64, "q8") == 32
    # f16 cache: dense (2*S*d + 2d)*2; q4 SparQ S*d*18/32 + (2*k2*d + 4d)*2
    s, d, k2 = 8192, 64, 128
    dense = (2 * s * d + 2 * d) * 2
    sparq = s * d * 18 / 32 + (2 * k2 * d + 4 * d) * 2
    assert sparq_api.transfer_bytes(s, d, d, k2, index="q4") == (dense, sparq)
    assert sparq_api.transfer_ratio(s, d, d, k2, index="q4") == pytest.approx(dense / sparq, rel=1e-15)
    with pytest.raises(ValueError, match="k1 must be head_dim = 64"):
        sparq_api.transfer_ratio(s, d, 32, k2, index="q4")


def test_q4_k1_recipe_is_head_dim_where_reachable():
    # d = 64, GQA: 1/2 of dense at 2048 cells reads every component at 18/32 bytes; 1/8 cannot (the index alone is
    # 18/32 / (2*2) = 0.14 of dense)
    assert k1_for_ratio(Fraction(1, 2), 2048, 64, index="q4") == 64
    assert k1_for_ratio(Fraction(1, 8), 2048, 64, index="q4") is None
    assert k1_for_ratio(Fraction(1, 8), 1 << 20, 64, index="q4", kv_type="f32") == 64
    cfg = sparq_api.SparqConfig(index="q4")
    assert cfg.k1 is None and cfg.to_c().index == 2 and sparq_api.SparqConfig.from_c(cfg.to_c()) == cfg
