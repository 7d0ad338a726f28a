"""ggml_sparq_attn on the CPU against the float64 reference (sparq_llama.reference).

The reference sees exactly what the op sees (q rounded to f32, K/V rounded to the KV type), so the only
differences are float32 arithmetic: results must agree to ~1e-4, and any difference in the selected set
would show as an error far larger than that.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from sparq_llama import ops, reference

TOL = {"f32": 2e-5, "f16": 2e-4, "bf16": 2e-4}  # abs+rel, on inputs already rounded to the KV type
QUANT = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # llama.cpp's quantized KV cache types
TOL.update({t: 2e-4 for t in QUANT})  # the op dequantizes exactly; f32 arithmetic after


def make_case(rng: np.random.Generator, *, n_head_kv: int, group: int, n_q: int, n_kv: int, d: int, d_v: int,
              ns: int = 1):
    """Heavy-tailed queries, a few strong keys per KV head (as real models have), distinct scores."""
    q = rng.standard_t(3, size=(ns, n_head_kv * group, n_q, d))
    k = rng.standard_normal((ns, n_head_kv, n_kv, d))
    v = rng.standard_normal((ns, n_head_kv, n_kv, d_v))
    for s in range(ns):
        for h in range(n_head_kv):
            strong = rng.choice(n_kv, size=min(6, n_kv), replace=False)
            k[s, h, strong] += 2.0 * np.sign(q[s, h * group, 0]) * rng.uniform(0.5, 1.5, size=(len(strong), 1))
    return q, k, v


def make_mask(rng: np.random.Generator, kind: str, n_q: int, n_kv: int) -> np.ndarray | None:
    if kind == "none":
        return None
    if kind == "holes":
        m = rng.random((n_q, n_kv)) > 0.3
        m[:, -1] = True
        return m
    # causal: the last n_q cells are the query rows themselves, earlier cells all visible; plus holes
    m = np.ones((n_q, n_kv), dtype=bool)
    for t in range(n_q):
        m[t, n_kv - n_q + t + 1:] = False
    m[:, : n_kv // 10] &= rng.random((n_q, n_kv // 10)) > 0.5
    return m


def run_both(q, k, v, mask, kv_dtype, **kw):
    """(op, reference) outputs, [ns, n_head, n_q, d_v] each; the reference runs stream by stream."""
    qr = q.astype(np.float32).astype(np.float64)
    kr, vr = ops.kv_round(k, kv_dtype), ops.kv_round(v, kv_dtype)
    op_only = {key: kw.pop(key) for key in ("layout", "n_threads", "backend", "kstat") if key in kw}
    got = ops.sparq_attn(q, k, v, mask, kv_dtype=kv_dtype, **op_only, **kw)
    # the index the op scores from: K^T in f16 (or q8_0 blocks), or none with the default layout (K itself)
    kw["index"] = None if op_only.get("layout") == "default" else kw.get("index", "f16")
    masks = [None] * q.shape[0] if mask is None else (
        [mask] * q.shape[0] if mask.ndim == 2 else list(mask))
    want = np.stack([reference.sparq_attn(qr[s], kr[s], vr[s], masks[s], **kw) for s in range(q.shape[0])])
    return got, want


def assert_close(got, want, kv_dtype, ctx):
    tol = TOL[kv_dtype]
    err = np.abs(got - want) / (tol + tol * np.abs(want))
    assert err.max() <= 1.0, f"{ctx}: max scaled error {err.max():.3g}, max abs diff {np.abs(got - want).max():.3g}"


# ------------------------------------------------------------------------------------------------
# ≥ 500 random cases: every option, policy, layout and KV type


def _random_cases(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for i in range(n):
        d = int(rng.choice([64, 80, 128, 256]))
        group = int(rng.choice([1, 3, 4, 8]))
        n_head_kv = int(rng.choice([1, 2]))
        n_kv = int(rng.integers(40, 1400))
        n_kv += (n_kv % 256 == 0)  # never a multiple of 256
        k2 = int(rng.choice([8, 32, 64, 128, 2000]))  # 2000: k2 >= visible, must be dense
        window = int(rng.choice([-1, 0, min(5, k2)]))
        sinks = int(rng.choice([0, 0, min(3, k2 - max(window, 0))]))
        case = dict(
            seed=i, d=d, d_v=int(rng.choice([d, 64])), group=group, n_head_kv=n_head_kv, n_kv=n_kv,
            n_q=int(rng.choice([1, 1, 2, 4])), ns=int(rng.choice([1, 1, 2])),
            mask=str(rng.choice(["none", "holes", "causal"])),
            kv_dtype=str(rng.choice(["f16", "bf16", "f32"])), layout=str(rng.choice(["kt", "default"])),
            k1=int(rng.integers(1, d + 1)) if rng.random() < 0.3 else int(rng.choice([d // 8, d // 4])),
            k2=k2, window=None if window < 0 else window, sinks=sinks,
            mean=str(rng.choice(["auto", "on", "off"])), policy=str(rng.choice(["sparq", "sparq", "exact", "window"])),
            softcap=float(rng.choice([0.0, 0.0, 30.0])), sparse_v_thresh=float(rng.choice([0.0, 0.0, 0.01])),
            scale=None if rng.random() < 0.8 else float(rng.uniform(0.05, 0.2)),
            select=str(rng.choice(["q", "qsigma"])), index=str(rng.choice(["f16", "q8"])),
        )
        if case["layout"] == "default":
            case["index"] = "f16"  # no index: the op gathers from K itself
        if case["d"] % 32 == 0 and case["d_v"] % 32 == 0 and rng.random() < 0.35:
            case["kv_dtype"] = str(rng.choice(QUANT))
        yield case


CASES = list(_random_cases(520))


def case_inputs(case: dict):
    """(q, k, v, mask, op keyword arguments) of a random case, deterministic in its seed."""
    rng = np.random.default_rng(1000 + case["seed"])
    q, k, v = make_case(rng, n_head_kv=case["n_head_kv"], group=case["group"], n_q=case["n_q"],
                        n_kv=case["n_kv"], d=case["d"], d_v=case["d_v"], ns=case["ns"])
    mask = make_mask(rng, case["mask"], case["n_q"], case["n_kv"])
    kw = {key: case[key] for key in ("k1", "k2", "window", "sinks", "mean", "policy", "softcap",
                                     "sparse_v_thresh", "scale", "layout", "select", "index")}
    return q, k, v, mask, kw


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['seed']}")
def test_random_case_matches_reference(case):
    q, k, v, mask, kw = case_inputs(case)
    got, want = run_both(q, k, v, mask, case["kv_dtype"], n_threads=2, **kw)
    assert_close(got, want, case["kv_dtype"], case)


def _q4_cases(n: int):
    """The random generator's cases (another run of it, other data seeds) with the q4 index: every component scored
    (k1 = d), the K^T layout. Its head dims (64, 80, 128, 256) are multiples of 8, as the index needs."""
    for case in _random_cases(n, seed=1):
        yield dict(case, seed=20000 + case["seed"], index="q4", layout="kt", k1=case["d"])


Q4_CASES = list(_q4_cases(160))


@pytest.mark.parametrize("case", Q4_CASES, ids=lambda c: f"{c['seed']}")
def test_random_q4_index_case_matches_reference(case):
    # the op's scores are the reference's float32 integer dot products bit for bit, so the selections are the same: a
    # different set would show as an error far above the tolerance
    q, k, v, mask, kw = case_inputs(case)
    got, want = run_both(q, k, v, mask, case["kv_dtype"], n_threads=2, **kw)
    assert_close(got, want, case["kv_dtype"], case)


# ------------------------------------------------------------------------------------------------
# Targeted properties


@pytest.mark.parametrize("kv_dtype,layout", list(itertools.product(["f16", "bf16", "f32"], ["kt", "default"])))
def test_k2_covering_the_context_equals_dense_attention(kv_dtype, layout):
    rng = np.random.default_rng(7)
    q, k, v = make_case(rng, n_head_kv=3, group=3, n_q=2, n_kv=300, d=64, d_v=64)
    mask = make_mask(rng, "causal", 2, 300)
    got = ops.sparq_attn(q, k, v, mask, k1=8, k2=300, kv_dtype=kv_dtype, layout=layout)
    dense = reference.dense_attn(q[0].astype(np.float32).astype(np.float64), ops.kv_round(k[0], kv_dtype),
                                 ops.kv_round(v[0], kv_dtype), mask)
    assert_close(got[0], dense, kv_dtype, "k2 >= visible")


@pytest.mark.parametrize("n_threads", [1, 2, 3, 8])
def test_thread_count_does_not_change_the_result(n_threads):
    rng = np.random.default_rng(3)
    q, k, v = make_case(rng, n_head_kv=1, group=4, n_q=1, n_kv=5000, d=128, d_v=128)
    base = ops.sparq_attn(q, k, v, k1=32, k2=128, n_threads=1)
    got = ops.sparq_attn(q, k, v, k1=32, k2=128, n_threads=n_threads)
    np.testing.assert_array_equal(got, base)


def test_long_context_single_kv_head_gemma_shape():
    # Gemma-3: one KV head, d = 256; both threads must split along the sequence, result unchanged
    rng = np.random.default_rng(11)
    q, k, v = make_case(rng, n_head_kv=1, group=4, n_q=1, n_kv=9000, d=256, d_v=256)
    got, want = run_both(q, k, v, None, "f16", k1=64, k2=128, n_threads=2)
    assert_close(got, want, "f16", "gemma shape")


def test_vsum_input_gives_the_same_mean_as_computing_it():
    rng = np.random.default_rng(5)
    q, k, v = make_case(rng, n_head_kv=2, group=1, n_q=2, n_kv=700, d=64, d_v=64)
    mask = make_mask(rng, "causal", 2, 700)
    vr = ops.kv_round(v, "f16")
    vsum = np.zeros((1, 2, 2, 65))
    for t in range(2):
        for h in range(2):
            vsum[0, t, h, :64] = vr[0, h, mask[t]].sum(axis=0)
            vsum[0, t, h, 64] = mask[t].sum()
    with_sum = ops.sparq_attn(q, k, v, mask, k1=16, k2=64, mean="on", vsum=vsum)
    without = ops.sparq_attn(q, k, v, mask, k1=16, k2=64, mean="on")
    np.testing.assert_allclose(with_sum, without, rtol=1e-4, atol=1e-5)
    # and a wrong vsum visibly changes the result: the op does use it
    doubled = vsum.copy()
    doubled[..., :64] *= 2  # twice the sums, same counts: twice the mean
    wrong = ops.sparq_attn(q, k, v, mask, k1=16, k2=64, mean="on", vsum=doubled)
    assert np.abs(wrong - without).max() > 1e-3


def key_sums(k: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """kstat [1, n_q, n_head_kv, 2d + 1] of keys [1, n_head_kv, n_kv, d] under a mask [n_q, n_kv]."""
    _, n_head_kv, _, d = k.shape
    out = np.zeros((1, mask.shape[0], n_head_kv, 2 * d + 1))
    for t in range(mask.shape[0]):
        for h in range(n_head_kv):
            vis = k[0, h, mask[t]]
            out[0, t, h] = np.concatenate([vis.sum(axis=0), (vis * vis).sum(axis=0), [mask[t].sum()]])
    return out


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0", "q4_0"])
def test_kstat_input_gives_the_same_selection_as_computing_it(kv_dtype):
    rng = np.random.default_rng(15)
    q, k, v = make_case(rng, n_head_kv=2, group=4, n_q=3, n_kv=900, d=128, d_v=128)
    k[..., :40] += rng.standard_normal(40) * 3.0   # a shared mean in some components: qsigma ranks them low
    mask = make_mask(rng, "causal", 3, 900)
    kstat = key_sums(ops.kv_round(k, kv_dtype), mask)
    kw = dict(k1=16, k2=64, select="qsigma", kv_dtype=kv_dtype, n_threads=2)
    with_sums = ops.sparq_attn(q, k, v, mask, kstat=kstat, **kw)
    without = ops.sparq_attn(q, k, v, mask, **kw)
    np.testing.assert_allclose(with_sums, without, rtol=1e-4, atol=1e-5)
    got, want = run_both(q, k, v, mask, kv_dtype, kstat=kstat, k1=16, k2=64, select="qsigma", n_threads=2)
    assert_close(got, want, kv_dtype, "kstat")
    # the op does read them: sums that give every component the same spread choose I1 as select q does, and
    # for one query head without the mean the temperature does not change the ranking: the result of select q
    q1, k1_, v1 = make_case(rng, n_head_kv=2, group=1, n_q=3, n_kv=900, d=128, d_v=128)
    k1_[..., :40] += rng.standard_normal(40) * 3.0
    flat = key_sums(ops.kv_round(k1_, kv_dtype), mask)
    flat[..., 128:256] = flat[..., :128] ** 2 / flat[..., 256:] + flat[..., 256:]  # variance 1 everywhere
    kw1 = dict(kw, mean="off")
    as_q = ops.sparq_attn(q1, k1_, v1, mask, kstat=flat, **kw1)
    np.testing.assert_allclose(as_q, ops.sparq_attn(q1, k1_, v1, mask, **dict(kw1, select="q")), rtol=1e-4, atol=1e-5)
    assert np.abs(as_q - ops.sparq_attn(q1, k1_, v1, mask, **kw1)).max() > 1e-3


def dense_of_stream0(q, k, v, mask, kv_dtype: str) -> np.ndarray:
    """Dense attention (the reference) of stream 0 over K and V as a kv_dtype cache holds them."""
    return reference.dense_attn(q[0].astype(np.float32).astype(np.float64), ops.kv_round(k[0], kv_dtype),
                                ops.kv_round(v[0], kv_dtype), mask)


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_quantized_cache_with_k2_covering_the_context_equals_dense_attention(kv_dtype):
    rng = np.random.default_rng(8)
    q, k, v = make_case(rng, n_head_kv=2, group=2, n_q=2, n_kv=300, d=64, d_v=64)
    mask = make_mask(rng, "causal", 2, 300)
    got = ops.sparq_attn(q, k, v, mask, k1=16, k2=300, kv_dtype=kv_dtype, index="q8", select="qsigma")
    assert_close(got[0], dense_of_stream0(q, k, v, mask, kv_dtype), kv_dtype, "k2 >= visible")


def test_q8_index_scores_from_its_own_values():
    # an index whose blocks hold one huge key: its block's other cells lose their precision, and the op's
    # selection follows the quantized values (as the reference models them), not K's
    rng = np.random.default_rng(21)
    q, k, v = make_case(rng, n_head_kv=1, group=1, n_q=1, n_kv=512, d=64, d_v=64)
    k[0, 0, 64] *= 200.0
    kw = dict(k1=16, k2=32, mean="off", return_selection=True)
    qr, kr, vr = q[0].astype(np.float32).astype(np.float64), ops.kv_round(k[0], "f32"), ops.kv_round(v[0], "f32")
    _, sel_q8 = reference.sparq_attn(qr, kr, vr, index="q8", **kw)
    _, sel_f = reference.sparq_attn(qr, kr, vr, index="f16", **kw)
    assert not np.array_equal(sel_q8[0][0], sel_f[0][0])
    kw.pop("return_selection")
    got = ops.sparq_attn(q, k, v, kv_dtype="f32", index="q8", **kw)
    assert_close(got[0], reference.sparq_attn(qr, kr, vr, index="q8", **kw), "f32", "q8 index")


def test_q4_index_selects_by_its_integer_scores():
    # one huge key in a block of 32 cells: every other cell of that block keeps a few levels of each component, so
    # the q4 index ranks them otherwise than the keys do (at k1 = d the f16 index ranks as the keys); the op selects
    # as the reference's q4 scores do, for one head and for a GQA group, over several streams and a cell count that
    # leaves the last block partial
    rng = np.random.default_rng(22)
    q, k, v = make_case(rng, n_head_kv=2, group=3, n_q=2, n_kv=517, d=64, d_v=64, ns=2)
    k[:, :, 64] *= 40.0
    mask = make_mask(rng, "causal", 2, 517)
    kw = dict(k1=64, k2=32, mean="off", return_selection=True)
    qr, kr, vr = q[0].astype(np.float32).astype(np.float64), ops.kv_round(k[0], "f32"), ops.kv_round(v[0], "f32")
    _, sel_q4 = reference.sparq_attn(qr, kr, vr, mask, index="q4", **kw)
    _, sel_f = reference.sparq_attn(qr, kr, vr, mask, index="f16", **kw)
    assert any(not np.array_equal(a, b) for ra, rb in zip(sel_q4, sel_f) for a, b in zip(ra, rb))
    kw.pop("return_selection")
    for group in (3, 1):
        heads = slice(0, 6, 3 // group)  # the whole group, or one query head per KV head
        got, want = run_both(q[:, heads], k, v, mask, "f32", index="q4", n_threads=2, **kw)
        assert_close(got, want, "f32", f"q4 index, group {group}")


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_q4_index_over_a_quantized_cache_matches_reference(kv_dtype):
    # the index quantizes the keys as the cache holds them (dequantized); k2 covering the context is dense attention
    rng = np.random.default_rng(9)
    q, k, v = make_case(rng, n_head_kv=2, group=2, n_q=2, n_kv=300, d=64, d_v=64)
    mask = make_mask(rng, "causal", 2, 300)
    got, want = run_both(q, k, v, mask, kv_dtype, k1=64, k2=40, index="q4", n_threads=2)
    assert_close(got, want, kv_dtype, f"q4 index over {kv_dtype}")
    got = ops.sparq_attn(q, k, v, mask, k1=64, k2=300, kv_dtype=kv_dtype, index="q4")
    assert_close(got[0], dense_of_stream0(q, k, v, mask, kv_dtype), kv_dtype, "k2 >= visible")


def test_q4_index_needs_every_component_and_the_kt_layout():
    rng = np.random.default_rng(0)
    q, k, v = make_case(rng, n_head_kv=1, group=2, n_q=1, n_kv=50, d=64, d_v=64)
    with pytest.raises(ValueError, match="ggml_sparq_attn: .*k1 must be head_dim"):
        ops.sparq_attn(q, k, v, k1=32, k2=16, index="q4")
    with pytest.raises(ValueError, match="layout='default' keeps none"):
        ops.sparq_attn(q, k, v, k1=64, k2=16, index="q4", layout="default")


def test_empty_rows_give_zeros():
    rng = np.random.default_rng(2)
    q, k, v = make_case(rng, n_head_kv=1, group=2, n_q=2, n_kv=100, d=64, d_v=64)
    mask = np.ones((2, 100), dtype=bool)
    mask[1] = False
    got = ops.sparq_attn(q, k, v, mask, k1=8, k2=16)
    assert np.all(got[0, :, 1] == 0.0) and np.abs(got[0, :, 0]).max() > 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(k1=0, k2=16), "k1 = 0 must be in 1..head_dim"),
    (dict(k1=65, k2=16), "k1 = 65 must be in 1..head_dim"),
    (dict(k1=8, k2=0), "k2 = 0 must be >= 1"),
    (dict(k1=8, k2=16, window=10, sinks=10), "window (10) + sinks (10) must be <= k2 (16)"),
    (dict(k1=8, k2=16, sinks=-1), "both >= 0"),
    (dict(k1=8, k2=16, scale=-1.0), "scale"),
    (dict(k1=8, k2=16, softcap=-1.0), "softcap"),
    (dict(k1=8, k2=16, sparse_v_thresh=1.0), "sparse_v_thresh"),
])
def test_bad_parameters_raise_with_the_ops_message(kwargs, message):
    rng = np.random.default_rng(0)
    q, k, v = make_case(rng, n_head_kv=1, group=1, n_q=1, n_kv=50, d=64, d_v=64)
    with pytest.raises(ValueError, match="ggml_sparq_attn: .*" + __import__("re").escape(message)):
        ops.sparq_attn(q, k, v, **kwargs)


def test_unknown_backend_is_a_clear_error():
    rng = np.random.default_rng(0)
    q, k, v = make_case(rng, n_head_kv=1, group=1, n_q=1, n_kv=50, d=64, d_v=64)
    with pytest.raises(ValueError, match="no ggml device CUDA7"):
        ops.sparq_attn(q, k, v, k1=8, k2=16, backend="cuda:7")
    with pytest.raises(ValueError, match="backend must be"):
        ops.sparq_attn(q, k, v, k1=8, k2=16, backend="gpu")


def test_bad_shapes_and_types_raise():
    rng = np.random.default_rng(0)
    q, k, v = make_case(rng, n_head_kv=2, group=1, n_q=1, n_kv=50, d=64, d_v=64)
    with pytest.raises(ValueError, match="multiple of n_head_kv"):
        ops.sparq_attn(q[:, :1].repeat(3, axis=1), k, v, k1=8, k2=16)
    with pytest.raises(ValueError, match="head dim"):
        ops.sparq_attn(q, k[..., :32], v, k1=8, k2=16)
    with pytest.raises(ValueError, match="kv_dtype"):
        ops.sparq_attn(q, k, v, k1=8, k2=16, kv_dtype="q4_k")
    with pytest.raises(ValueError, match="select"):
        ops.sparq_attn(q, k, v, k1=8, k2=16, select="sigma")
    with pytest.raises(ValueError, match="index"):
        ops.sparq_attn(q, k, v, k1=8, k2=16, index="q2")
    with pytest.raises(ValueError, match="multiples of 32"):
        ops.sparq_attn(q[..., :48], k[..., :48], v, k1=8, k2=16, kv_dtype="q8_0")
    with pytest.raises(ValueError, match="mask"):
        ops.sparq_attn(q, k, v, np.ones((2, 50), dtype=bool), k1=8, k2=16)
    with pytest.raises(ValueError, match="policy"):
        ops.sparq_attn(q, k, v, k1=8, k2=16, policy="topk")


# ------------------------------------------------------------------------------------------------
# Cell positions (a KV cache refills holes, so cell order is not position order)


@pytest.mark.parametrize("seed", range(40))
def test_window_and_sinks_follow_cell_positions(seed):
    rng = np.random.default_rng(5000 + seed)
    ns, n_kv, d = int(rng.choice([1, 2])), int(rng.integers(200, 900)), int(rng.choice([64, 128]))
    q, k, v = make_case(rng, n_head_kv=2, group=int(rng.choice([1, 4])), n_q=int(rng.choice([1, 2])),
                        n_kv=n_kv, d=d, d_v=d, ns=ns)
    mask = make_mask(rng, str(rng.choice(["none", "holes"])), q.shape[2], n_kv)
    if seed % 2:  # repeated positions (ties go to the higher cell for the window, the lower for sinks)
        pos = rng.integers(0, n_kv // 3, size=(ns, n_kv)).astype(np.int32)
    else:         # distinct positions, as within one sequence
        pos = np.stack([rng.permutation(n_kv) + int(rng.integers(0, 1000)) for _ in range(ns)]).astype(np.int32)
    kv_dtype = str(rng.choice(["f16", "f32"]))
    kw = dict(k1=d // 4, k2=int(rng.choice([16, 64])), sinks=int(rng.choice([0, 3])),
              policy=str(rng.choice(["sparq", "exact", "window"])), mean=str(rng.choice(["on", "off"])))
    layout = str(rng.choice(["kt", "default"]))
    got = ops.sparq_attn(q, k, v, mask, kv_dtype=kv_dtype, n_threads=2, pos=pos, layout=layout, **kw)
    qr = q.astype(np.float32).astype(np.float64)
    kr, vr = ops.kv_round(k, kv_dtype), ops.kv_round(v, kv_dtype)
    index = "f16" if layout == "kt" else None
    want = np.stack([reference.sparq_attn(qr[s], kr[s], vr[s], mask, pos=pos[s], index=index, **kw)
                     for s in range(ns)])
    assert_close(got, want, kv_dtype, dict(seed=seed, **kw))
    # the positions matter: by position the window policy keeps other cells than in cell order
    wkw = dict(kw, policy="window", return_selection=True)
    _, by_pos = reference.sparq_attn(qr[0], kr[0], vr[0], mask, pos=pos[0], **wkw)
    _, by_cell = reference.sparq_attn(qr[0], kr[0], vr[0], mask, **wkw)
    assert not np.array_equal(by_pos[0][0], by_cell[0][0])


def test_positions_in_cell_order_change_nothing():
    rng = np.random.default_rng(7)
    q, k, v = make_case(rng, n_head_kv=2, group=3, n_q=1, n_kv=700, d=64, d_v=64)
    kw = dict(k1=16, k2=64, sinks=2, kv_dtype="f32", n_threads=2)
    with_pos = ops.sparq_attn(q, k, v, None, pos=np.arange(700, dtype=np.int32) + 40, **kw)
    assert np.array_equal(with_pos, ops.sparq_attn(q, k, v, None, **kw))
