"""ggml_sparq_attn on CUDA against the float64 reference and against the CPU op.

Runs where our library was built with CUDA and sees a device (bench/device.sh runs it on a GPU machine);
elsewhere the module is skipped as a whole. The cases are the CPU op's cases (tests/test_op_sparq_attn.py)
plus long sequences that split every kernel over many blocks, and the paths only a GPU kernel has: the
sampled candidate threshold, its exact fallback, waves of rows, and repeated runs giving identical bits.

The kernel selects I2 with one of three kernel families, chosen from the shapes and the device: kernel BS (one
block per row, scoring the cells that per-block bounds keep), kernel PBS (a thread-block cluster per row, Hopper) or
kernels P, B, S. A plain run takes each where the choice puts it; the testing switch
SPARQ_CUDA_SELECT=cluster|sweep|bound forces one (see ggml_ops/src/cuda/sparq-attn.cu). The library reads it once per process, so
test_cases_pass_with_each_selection_kernel_forced runs this file's selection cases again in a subprocess under each
value; the whole file runs under one value with e.g.
`SPARQ_CUDA_SELECT=sweep python -m pytest tests/test_op_sparq_attn_cuda.py`.

The random cases draw the index (f16, q8_0 blocks, none), the selection (q, qsigma) and quantized caches; the
matrix below runs every combination of K/V type, index and selection (qsigma with and without the key sums) on
cases of the same generator, and mixed K/V types, the exact and window policies and long rows on quantized caches.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sparq_llama
from sparq_llama import ops, reference
from test_op_sparq_attn import (
    CASES,
    Q4_CASES,
    QUANT,
    TOL,
    assert_close,
    case_inputs,
    make_case,
    make_mask,
    run_both,
)
from test_op_index_write import INDEX_WRITE_CASES, Q4_WRITE_CASES, check_index_write, index_write_case, q4_index_after
from test_op_vsum_rows import (KSTAT_CASES, VSUM_CASES, assert_kstat_equal, expected, kstat_case, kstat_rows_reference,
                               vsum_case, written_back)

pytestmark = pytest.mark.skipif("CUDA0" not in [dev["name"] for dev in sparq_llama.devices()],
                                reason="no CUDA device in this build (the GPU run is bench/device.sh)")


def both_backends(q, k, v, mask, kv_dtype, **kw):
    """(cuda, cpu, reference) outputs on the same inputs."""
    got, want = run_both(q, k, v, mask, kv_dtype, backend="cuda", **kw)
    cpu = ops.sparq_attn(q, k, v, mask, kv_dtype=kv_dtype, n_threads=2,
                         **{key: val for key, val in kw.items() if key != "backend"})
    return got, cpu, want


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['seed']}")
def test_random_case_matches_reference_and_cpu(case):
    q, k, v, mask, kw = case_inputs(case)
    got, cpu, want = both_backends(q, k, v, mask, case["kv_dtype"], **kw)
    assert_close(got, want, case["kv_dtype"], case)
    assert_close(got, cpu, case["kv_dtype"], case)


# The q4 index on CUDA: a thread takes a quarter of a head's components in whole nibble words, its scales in registers
# (head dims multiples of 32, at most 256); other head dims are refused, so a graph would keep that layer elsewhere.
def q4_on_cuda(case: dict) -> bool:
    return case["d"] % 32 == 0 and case["d"] <= 256


@pytest.mark.parametrize("case", [c for c in Q4_CASES if q4_on_cuda(c)], ids=lambda c: f"{c['seed']}")
def test_random_q4_index_case_matches_reference_and_cpu(case):
    # the same int8 coefficients, integer sums and float roundings as the CPU and the reference: the same selections
    q, k, v, mask, kw = case_inputs(case)
    got, cpu, want = both_backends(q, k, v, mask, case["kv_dtype"], **kw)
    assert_close(got, want, case["kv_dtype"], case)
    assert_close(got, cpu, case["kv_dtype"], case)


def test_q4_index_head_dims_the_kernel_cannot_take_are_refused():
    case = next(c for c in Q4_CASES if not q4_on_cuda(c))
    q, k, v, mask, kw = case_inputs(case)
    kw.pop("layout")
    with pytest.raises(ValueError, match="does not support"):
        ops.sparq_attn(q, k, v, mask, kv_dtype=case["kv_dtype"], backend="cuda", layout="kt", **kw)


@pytest.mark.parametrize("kv_dtype", ["f16", *QUANT])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_q4_index_long_rows_match_reference_and_cpu(kv_dtype, group):
    """Rows over several of kernel A's chunks, a cell count that ends inside a block, GQA groups of 4 and 8 heads a
    pass: the q4 scores select as the CPU's and the reference's."""
    rng = np.random.default_rng(41 + group)
    q, k, v = make_case(rng, n_head_kv=2, group=group, n_q=1, n_kv=5000, d=128, d_v=128, ns=1)
    mask = make_mask(rng, "holes", 1, 5000)
    got, cpu, want = both_backends(q, k, v, mask, kv_dtype, k1=128, k2=96, index="q4", layout="kt")
    assert_close(got, want, kv_dtype, f"q4 index over {kv_dtype}, group {group}")
    assert_close(got, cpu, kv_dtype, f"q4 index over {kv_dtype}, group {group}")


@pytest.mark.parametrize("group", [1, 4])
def test_q4_index_rows_beyond_one_wave_match_reference_and_cpu(group):
    """40 rows of 17 chunks: 680 blocks of kernel A, more than one wave (16 warps an SM) on any current GPU (the other
    q4 cases fit in one)."""
    rng = np.random.default_rng(77 + group)
    q, k, v = make_case(rng, n_head_kv=40, group=group, n_q=1, n_kv=16400, d=128, d_v=64, ns=1)
    mask = make_mask(rng, "holes", 1, 16400)
    got, cpu, want = both_backends(q, k, v, mask, "f16", k1=128, k2=64, index="q4", layout="kt")
    assert_close(got, want, "f16", f"q4 index, 40 rows, group {group}")
    assert_close(got, cpu, "f16", f"q4 index, 40 rows, group {group}")


@pytest.mark.parametrize("index", ["q4", "q8", "exact"])
@pytest.mark.parametrize("n_head_kv", [1, 10, 20, 30])
def test_gqa_rows_split_over_head_groups_match_reference_and_cpu(n_head_kv, index):
    """Groups of 6 heads on rows of 9 chunks: with 9, 90, 180 and 270 blocks of chunks and rows, kernel A splits each
    chunk's heads over 6, 3, 2 and 1 blocks on a 132-SM GPU (its grid within one wave of 16 warps an SM: 528 blocks of
    4 warps), so passes of 1 head, of 2, of 4 holding 3 (one past the group), and of 8 holding 6."""
    rng = np.random.default_rng(300 + n_head_kv)
    q, k, v = make_case(rng, n_head_kv=n_head_kv, group=6, n_q=1, n_kv=9000, d=64, d_v=64, ns=1)
    mask = make_mask(rng, "holes", 1, 9000)
    kw = dict(k1=64, k2=64, index="q4", layout="kt") if index == "q4" else \
        dict(k1=32, k2=64, index="q8", layout="kt") if index == "q8" else dict(k1=16, k2=64, policy="exact")
    got, cpu, want = both_backends(q, k, v, mask, "f16", **kw)
    assert_close(got, want, "f16", f"{index}, {n_head_kv} rows of 6 heads")
    assert_close(got, cpu, "f16", f"{index}, {n_head_kv} rows of 6 heads")


def key_sums(k: np.ndarray, mask: np.ndarray | None, kv_dtype: str, n_q: int) -> np.ndarray:
    """kstat [ns, n_q, n_head_kv, 2d + 1] (sum of the visible keys as the cache holds them, of their squares, their
    count) of keys [ns, n_head_kv, n_kv, d] under a mask [n_q, n_kv] or [ns, n_q, n_kv] (None: all visible)."""
    kr = ops.kv_round(k, kv_dtype)
    ns, n_head_kv, n_kv, d = kr.shape
    m = np.ones((1, n_q, n_kv), dtype=bool) if mask is None else (mask[None] if mask.ndim == 2 else mask)
    out = np.zeros((ns, n_q, n_head_kv, 2 * d + 1))
    for s in range(ns):
        for t in range(n_q):
            vis = m[s % m.shape[0], t]
            out[s, t, :, :d] = kr[s][:, vis].sum(axis=1)
            out[s, t, :, d:2 * d] = (kr[s][:, vis] ** 2).sum(axis=1)
            out[s, t, :, 2 * d] = vis.sum()
    return out


def cuda_cpu_reference(q, k, v, mask, kv_dtype, *, v_dtype=None, **kw):
    """(cuda, cpu, reference) outputs with K and V of their own types (v_dtype None: kv_dtype)."""
    v_dtype = kv_dtype if v_dtype is None else v_dtype
    got = ops.sparq_attn(q, k, v, mask, kv_dtype=kv_dtype, v_dtype=v_dtype, backend="cuda", **kw)
    cpu = ops.sparq_attn(q, k, v, mask, kv_dtype=kv_dtype, v_dtype=v_dtype, n_threads=2, **kw)
    ref_kw = {key: val for key, val in kw.items() if key not in ("layout", "kstat")}
    ref_kw["index"] = None if kw.get("layout") == "default" else kw.get("index", "f16")
    qr = q.astype(np.float32).astype(np.float64)
    kr, vr = ops.kv_round(k, kv_dtype), ops.kv_round(v, v_dtype)
    masks = [None] * q.shape[0] if mask is None else ([mask] * q.shape[0] if mask.ndim == 2 else list(mask))
    want = np.stack([reference.sparq_attn(qr[s], kr[s], vr[s], masks[s], **ref_kw) for s in range(q.shape[0])])
    return got, cpu, want


def assert_close_types(got, want, kv_dtype, v_dtype, ctx):
    assert_close(got, want, max((kv_dtype, v_dtype), key=TOL.get), ctx)


# Every K/V type x index (f16, q8_0 blocks, none: the default layout gathers from K) x selection (q, qsigma from the
# key sums, qsigma computed from K), each on cases of the random generator that select (policy sparq, more visible
# cells than k2) and allow the type (quantized: head dims multiples of 32).
KV_TYPES = ("f32", "f16", "bf16") + QUANT
INDEXES = ("f16", "q8", "none")
SELECTS = ("q", "qsigma_kstat", "qsigma")
N_MATRIX_CASES = 3


def matrix_cases(kv_dtype: str, index: str, select: str) -> list[dict]:
    """N_MATRIX_CASES random cases that suit the combination, a different run of them for each combination."""
    start = (KV_TYPES.index(kv_dtype) * 9 + INDEXES.index(index) * 3 + SELECTS.index(select)) * 7 % len(CASES)
    picked = []
    for i in range(len(CASES)):
        case = CASES[(start + i) % len(CASES)]
        quant_ok = case["d"] % 32 == 0 and case["d_v"] % 32 == 0
        if case["policy"] == "sparq" and case["k2"] < case["n_kv"] // 2 and (kv_dtype not in QUANT or quant_ok):
            picked.append(case)
        if len(picked) == N_MATRIX_CASES:
            break
    return picked


@pytest.mark.parametrize("select", SELECTS)
@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("kv_dtype", KV_TYPES)
def test_index_select_and_kv_type_match_reference_and_cpu(kv_dtype, index, select):
    for case in matrix_cases(kv_dtype, index, select):
        q, k, v, mask, kw = case_inputs(case)
        kw.update(layout="default" if index == "none" else "kt", index="f16" if index == "none" else index,
                  select="q" if select == "q" else "qsigma")
        if select == "qsigma_kstat":
            kw["kstat"] = key_sums(k, mask, kv_dtype, q.shape[2])
        got, cpu, want = cuda_cpu_reference(q, k, v, mask, kv_dtype, **kw)
        ctx = dict(case, kv_dtype=kv_dtype, index=index, select=select)
        assert_close(got, want, kv_dtype, ctx)
        assert_close(got, cpu, kv_dtype, ctx)


@pytest.mark.parametrize("k_dtype,v_dtype", [("f16", "q8_0"), ("q8_0", "f16"), ("q4_0", "q8_0"), ("q5_1", "q4_1"),
                                             ("f32", "bf16"), ("bf16", "q5_0")])
@pytest.mark.parametrize("mean", ["on", "off"])
def test_mixed_k_and_v_types_match_reference_and_cpu(k_dtype, v_dtype, mean):
    # K and V of different types read through the kernels' run-time types (the scores, the values, the mean over V)
    rng = np.random.default_rng(300 + QUANT.index(v_dtype) if v_dtype in QUANT else 301)
    q, k, v = make_case(rng, n_head_kv=2, group=2, n_q=2, n_kv=1500, d=128, d_v=64)
    mask = make_mask(rng, "causal", 2, 1500)
    for layout, select in (("kt", "qsigma"), ("default", "q")):
        got, cpu, want = cuda_cpu_reference(q, k, v, mask, k_dtype, v_dtype=v_dtype, k1=32, k2=64, mean=mean,
                                            layout=layout, select=select, index="q8" if layout == "kt" else "f16")
        ctx = dict(k_dtype=k_dtype, v_dtype=v_dtype, mean=mean, layout=layout)
        assert_close_types(got, want, k_dtype, v_dtype, ctx)
        assert_close_types(got, cpu, k_dtype, v_dtype, ctx)


@pytest.mark.parametrize("policy", ["exact", "window"])
@pytest.mark.parametrize("kv_dtype", QUANT)
def test_exact_and_window_policies_on_quantized_caches_match_reference_and_cpu(kv_dtype, policy):
    # the exact scores dequantize whole K rows; the window policy's mean averages quantized V (no vsum)
    rng = np.random.default_rng(400 + QUANT.index(kv_dtype))
    q, k, v = make_case(rng, n_head_kv=2, group=1, n_q=2, n_kv=3000, d=64, d_v=64)
    mask = make_mask(rng, "holes", 2, 3000)
    got, cpu, want = cuda_cpu_reference(q, k, v, mask, kv_dtype, k1=16, k2=96, sinks=2, mean="on", policy=policy,
                                        softcap=30.0 if policy == "exact" else 0.0)
    assert_close(got, want, kv_dtype, dict(kv_dtype=kv_dtype, policy=policy))
    assert_close(got, cpu, kv_dtype, dict(kv_dtype=kv_dtype, policy=policy))


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_quantized_cache_with_k2_covering_the_context_equals_dense_attention(kv_dtype):
    rng = np.random.default_rng(8)
    q, k, v = make_case(rng, n_head_kv=2, group=2, n_q=2, n_kv=300, d=64, d_v=64)
    mask = make_mask(rng, "causal", 2, 300)
    got = ops.sparq_attn(q, k, v, mask, k1=16, k2=300, kv_dtype=kv_dtype, index="q8", select="qsigma", backend="cuda")
    dense = reference.dense_attn(q[0].astype(np.float32).astype(np.float64), ops.kv_round(k[0], kv_dtype),
                                 ops.kv_round(v[0], kv_dtype), mask)
    assert_close(got[0], dense, kv_dtype, "k2 >= visible")


@pytest.mark.parametrize("shape", [
    dict(n_head_kv=4, group=1, d=128, n_kv=33000, k1=32, k2=128, kv_dtype="q8_0"),   # Llama-2 heads, q8_0 cache
    dict(n_head_kv=2, group=4, d=128, n_kv=40001, k1=16, k2=256, kv_dtype="q4_0"),   # Llama-3 heads, n_kv % 32 != 0
    dict(n_head_kv=1, group=2, d=256, n_kv=20000, k1=64, k2=128, kv_dtype="f16"),    # d = 256: one thread per component
    dict(n_head_kv=2, group=1, d=512, n_kv=9000, k1=64, k2=128, kv_dtype="q5_1"),    # d = 512: more components than threads
    dict(n_head_kv=2, group=1, d=128, n_kv=70000, k1=32, k2=128, kv_dtype="q8_0"),   # past the cluster kernel's rows
])
@pytest.mark.parametrize("select", ["qsigma", "qsigma_kstat"])
def test_long_rows_with_q8_index_and_qsigma_match_reference_and_cpu(shape, select):
    # the q8_0 index over many chunks (its last block padded), sigma from K over every visible cell, or from kstat
    rng = np.random.default_rng(shape["n_kv"] + 1)
    q, k, v = make_case(rng, n_head_kv=shape["n_head_kv"], group=shape["group"], n_q=2, n_kv=shape["n_kv"],
                        d=shape["d"], d_v=shape["d"])
    k[..., : shape["d"] // 4] += rng.standard_normal(shape["d"] // 4) * 3.0  # a shared offset: qsigma ranks these low
    mask = make_mask(rng, "causal", 2, shape["n_kv"])
    kv_dtype = shape["kv_dtype"]
    kw = dict(k1=shape["k1"], k2=shape["k2"], mean="on", index="q8", select="qsigma")
    if select == "qsigma_kstat":
        kw["kstat"] = key_sums(k, mask, kv_dtype, q.shape[2])
    got, cpu, want = cuda_cpu_reference(q, k, v, mask, kv_dtype, **kw)
    assert_close(got, want, kv_dtype, shape)
    assert_close(got, cpu, kv_dtype, shape)


@pytest.mark.parametrize("seed", range(40))
def test_window_and_sinks_follow_cell_positions(seed):
    # distinct positions take the fast path; repeated ones the exact fallback over all cells
    rng = np.random.default_rng(5000 + seed)
    ns, n_kv, d = int(rng.choice([1, 2])), int(rng.integers(200, 9000)), int(rng.choice([64, 128]))
    q, k, v = make_case(rng, n_head_kv=2, group=int(rng.choice([1, 4])), n_q=int(rng.choice([1, 2])),
                        n_kv=n_kv, d=d, d_v=d, ns=ns)
    mask = make_mask(rng, str(rng.choice(["none", "holes"])), q.shape[2], n_kv)
    if seed % 2:
        pos = rng.integers(0, n_kv // 3, size=(ns, n_kv)).astype(np.int32)
    else:
        pos = np.stack([rng.permutation(n_kv) + int(rng.integers(0, 1000)) for _ in range(ns)]).astype(np.int32)
    kv_dtype = str(rng.choice(["f16", "f32"]))
    kw = dict(k1=d // 4, k2=int(rng.choice([16, 64, 128])), sinks=int(rng.choice([0, 3])),
              policy=str(rng.choice(["sparq", "exact", "window"])), mean=str(rng.choice(["on", "off"])))
    layout = str(rng.choice(["kt", "default"]))
    got = ops.sparq_attn(q, k, v, mask, kv_dtype=kv_dtype, pos=pos, backend="cuda", layout=layout, **kw)
    qr = q.astype(np.float32).astype(np.float64)
    kr, vr = ops.kv_round(k, kv_dtype), ops.kv_round(v, kv_dtype)
    index = "f16" if layout == "kt" else None  # the op's f16 index, or K itself
    want = np.stack([reference.sparq_attn(qr[s], kr[s], vr[s], mask, pos=pos[s], index=index, **kw)
                     for s in range(ns)])
    assert_close(got, want, kv_dtype, dict(seed=seed, **kw))


@pytest.mark.parametrize("shape", [
    dict(n_head_kv=4, group=1, d=128, n_kv=33000, k1=32, k2=128),    # Llama-2 heads (MHA), many chunks
    dict(n_head_kv=2, group=4, d=128, n_kv=40000, k1=16, k2=256),    # Llama-3 heads (GQA 4)
    dict(n_head_kv=1, group=4, d=256, n_kv=20000, k1=64, k2=128),    # Gemma-3: one KV head, d = 256
    dict(n_head_kv=3, group=3, d=64, n_kv=12345, k1=8, k2=1024),     # SmolLM2, large k2 (long candidate list)
    dict(n_head_kv=1, group=16, d=128, n_kv=9000, k1=32, k2=64),     # wide group: several passes over K^T and V
    dict(n_head_kv=1, group=2, d=512, n_kv=5000, k1=128, k2=128),    # d = 512: two vectors per thread
    # kernel P's sample (plan_sample): past 64k the stride keeps the threshold's rank >= 16; past ~212k cells the
    # 4096-cell sample bounds the stride instead (rank 13 here)
    dict(n_head_kv=2, group=1, d=128, n_kv=70000, k1=32, k2=128),
    dict(n_head_kv=1, group=2, d=64, n_kv=260000, k1=16, k2=128),
])
@pytest.mark.parametrize("mean", ["on", "off"])
def test_long_sequences_match_reference_and_cpu(shape, mean):
    rng = np.random.default_rng(shape["n_kv"])
    q, k, v = make_case(rng, n_head_kv=shape["n_head_kv"], group=shape["group"], n_q=2, n_kv=shape["n_kv"],
                        d=shape["d"], d_v=shape["d"])
    mask = make_mask(rng, "causal", 2, shape["n_kv"])
    got, cpu, want = both_backends(q, k, v, mask, "f16", k1=shape["k1"], k2=shape["k2"], mean=mean)
    assert_close(got, want, "f16", shape)
    assert_close(got, cpu, "f16", shape)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("mean", ["on", "off"])
def test_rows_whose_scores_underflow_to_zero_match_reference_and_cpu(group, mean):
    # Three hot cells take all the approximate mass: the other cells' approximate logits are exactly 0, their
    # group scores underflow to 0 in f32 and tie, and ties go to the lower cell, so the selection is the hot
    # cells and the lowest other cells (kernel P's threshold at the zero score; kernel B lists only its first
    # chunk's zero-score cells). The hot cells' other components cancel their exact logits, so every selected
    # cell has an ordinary exact weight and a different choice among the tied cells changes the output.
    rng = np.random.default_rng(31 + group)
    n_head_kv, d, n_kv, n_q = 2, 64, 20000, 2
    q_row = rng.standard_normal(d) * 0.3
    q_row[0] = 60.0                                      # k1 = 1 picks component 0
    q = np.broadcast_to(q_row, (1, n_head_kv * group, n_q, d)).copy()
    k = rng.standard_normal((1, n_head_kv, n_kv, d))
    k[..., 0] = 0.0
    hot = rng.choice(np.arange(100, n_kv - 200), size=3, replace=False)
    k[0, :, hot, 0] = 40.0
    k[0, :, hot, 1:] = -np.sign(q_row[1:]) * (60.0 * 40.0 / np.abs(q_row[1:]).sum())
    v = rng.standard_normal((1, n_head_kv, n_kv, d))
    mask = make_mask(rng, "causal", n_q, n_kv)
    got, cpu, want = both_backends(q, k, v, mask, "f32", k1=1, k2=64, mean=mean)
    assert_close(got, want, "f32", {"group": group, "mean": mean})
    assert_close(got, cpu, "f32", {"group": group, "mean": mean})


# Group-1 rows over many chunks whose selection turns on ties across chunk borders, forced cells among the highest
# scores, and chunks that the mask hides.

@pytest.mark.parametrize("n_distinct", [3, 40])
@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_mha_rows_with_tied_scores_across_chunks_match_reference_and_cpu(n_distinct, dtype):
    # keys drawn from a few distinct rows: every chunk holds many cells of each logit, so the chunk lists cut
    # through ties (the lower cell wins) and left-out cells tie with the boundary, which sends rows to the
    # fallback; V differs per cell, so any other choice among the tied cells changes the output
    rng = np.random.default_rng(700 + n_distinct)
    n_head_kv, d, n_kv, n_q = 2, 64, 10000, 2
    q, _, v = make_case(rng, n_head_kv=n_head_kv, group=1, n_q=n_q, n_kv=n_kv, d=d, d_v=d)
    rows = rng.standard_normal((n_head_kv, n_distinct, d))
    k = np.stack([rows[h][rng.integers(0, n_distinct, size=n_kv)] for h in range(n_head_kv)])[None]
    mask = make_mask(rng, "causal", n_q, n_kv)
    got, cpu, want = both_backends(q, k, v, mask, dtype, k1=16, k2=64, sinks=2)
    assert_close(got, want, dtype, {"n_distinct": n_distinct})
    assert_close(got, cpu, dtype, {"n_distinct": n_distinct})


@pytest.mark.parametrize("layout", ["kt", "default"])
def test_mha_rows_whose_chunk_tops_hold_the_forced_cells_match_reference_and_cpu(layout):
    # the window's and the sinks' cells score highest, so they fill part of their chunks' lists (at most
    # window + sinks of a chunk's top k2 are forced, which the list size allows for); positions are a permutation,
    # so the forced cells are spread over several chunks
    rng = np.random.default_rng(91)
    n_head_kv, d, n_kv, n_q = 2, 128, 9000, 1
    q, k, v = make_case(rng, n_head_kv=n_head_kv, group=1, n_q=n_q, n_kv=n_kv, d=d, d_v=d)
    pos = rng.permutation(n_kv).astype(np.int32)[None]
    window, sinks = 24, 4
    forced = np.concatenate([np.argsort(pos[0])[:sinks], np.argsort(pos[0])[-window:]])
    k[0][:, forced] = 3.0 * q[0, :, 0][:, None, :]  # high scores on every component
    kw = dict(k1=32, k2=64, window=window, sinks=sinks)
    got = ops.sparq_attn(q, k, v, None, kv_dtype="f16", pos=pos, backend="cuda", layout=layout, **kw)
    cpu = ops.sparq_attn(q, k, v, None, kv_dtype="f16", pos=pos, n_threads=2, layout=layout, **kw)
    want = reference.sparq_attn(q[0].astype(np.float32).astype(np.float64), ops.kv_round(k[0], "f16"),
                                ops.kv_round(v[0], "f16"), None, pos=pos[0], **kw)
    assert_close(got[0], want, "f16", kw)
    assert_close(got, cpu, "f16", kw)


def test_mha_rows_with_hidden_chunks_match_reference_and_cpu():
    # whole chunks hidden by the mask list nothing; a chunk with fewer than k2 visible cells lists all of them;
    # one row sees fewer than k2 cells in all (a dense row through the lists)
    rng = np.random.default_rng(17)
    n_head_kv, d, n_kv, n_q = 2, 64, 12000, 3
    q, k, v = make_case(rng, n_head_kv=n_head_kv, group=1, n_q=n_q, n_kv=n_kv, d=d, d_v=d)
    mask = np.ones((n_q, n_kv), dtype=bool)
    mask[:, 2048:6144] = False                 # chunks 1 and 2 hidden
    mask[:, 6144:8192] = False
    mask[:, 6144:6144 + 40] = True             # chunk 3: 40 visible cells (< k2)
    mask[1, :] = False
    mask[1, rng.choice(n_kv, size=50, replace=False)] = True   # row 1: 50 cells, fewer than k2
    got, cpu, want = both_backends(q, k, v, mask, "f16", k1=16, k2=96, mean="on")
    assert_close(got, want, "f16", "hidden chunks")
    assert_close(got, cpu, "f16", "hidden chunks")


@pytest.mark.parametrize("config", [
    dict(n_head_kv=2, group=1, n_kv=33000, index="q8", select="qsigma", mean="on", sinks=0, permuted=False),
    dict(n_head_kv=2, group=4, n_kv=20000, index="q8", select="qsigma", mean="off", sinks=4, permuted=False),
    dict(n_head_kv=1, group=4, n_kv=24001, index="f16", select="q", mean="on", sinks=4, permuted=True),
    dict(n_head_kv=3, group=1, n_kv=9000, index="q8", select="qsigma", mean="on", sinks=0, permuted=True),
], ids=lambda c: f"g{c['group']}-{c['n_kv']}-{c['index']}-sinks{c['sinks']}{'-perm' if c['permuted'] else ''}")
def test_peaked_rows_match_reference_and_cpu(config):
    # attention as real models have it: a few hundred keys per head lie along the queries' direction, the rest is
    # noise. Kernel BS's block bounds then keep only the blocks of those keys and of the window and the sinks, far
    # fewer cells than its shared memory holds, so its bound path decides the selection (flat random rows keep too
    # many blocks and take its exact fallback). Permuted positions scatter the window's and the sinks' cells over
    # the row, so blocks anywhere may hold forced cells.
    rng = np.random.default_rng(config["n_kv"] + 7)
    n_head_kv, group, n_kv, d, n_q = config["n_head_kv"], config["group"], config["n_kv"], 128, 2
    q, k, v = make_case(rng, n_head_kv=n_head_kv, group=group, n_q=n_q, n_kv=n_kv, d=d, d_v=d)
    for h in range(n_head_kv):
        direction = q[0, h * group: (h + 1) * group, 0].mean(axis=0)
        hot = rng.choice(n_kv, size=300, replace=False)
        k[0, h, hot] += rng.uniform(1.0, 2.0, size=(300, 1)) * direction / np.linalg.norm(direction) * 6.0
    mask = make_mask(rng, "causal", n_q, n_kv)
    pos = rng.permutation(n_kv).astype(np.int32)[None] if config["permuted"] else None
    kw = dict(k1=32, k2=128, index=config["index"], select=config["select"], mean=config["mean"],
              sinks=config["sinks"])
    got = ops.sparq_attn(q, k, v, mask, kv_dtype="f16", pos=pos, backend="cuda", **kw)
    cpu = ops.sparq_attn(q, k, v, mask, kv_dtype="f16", pos=pos, n_threads=2, **kw)
    want = reference.sparq_attn(q[0].astype(np.float32).astype(np.float64), ops.kv_round(k[0], "f16"),
                                ops.kv_round(v[0], "f16"), mask, pos=None if pos is None else pos[0], **kw)
    assert_close(got[0], want, "f16", config)
    assert_close(got, cpu, "f16", config)


def test_many_rows_run_in_waves_and_repeat_bit_for_bit():
    # a prefill-sized batch of query rows: more rows than one wave of scratch holds at this length
    rng = np.random.default_rng(21)
    n_q, n_kv = 160, 60000
    q, k, v = make_case(rng, n_head_kv=8, group=1, n_q=n_q, n_kv=n_kv, d=64, d_v=64)
    mask = make_mask(rng, "causal", n_q, n_kv)
    kw = dict(k1=16, k2=64, kv_dtype="f16", backend="cuda")
    first = ops.sparq_attn(q, k, v, mask, **kw)
    np.testing.assert_array_equal(first, ops.sparq_attn(q, k, v, mask, **kw))
    rows = [0, 77, n_q - 1]  # the reference is slow at this size: check rows from the first and last wave
    want = reference.sparq_attn(q[0][:, rows].astype(np.float32).astype(np.float64), ops.kv_round(k[0], "f16"),
                                ops.kv_round(v[0], "f16"), mask[rows], k1=16, k2=64)
    assert_close(first[0][:, rows], want, "f16", "waves")


def test_k2_covering_the_context_equals_dense_attention():
    rng = np.random.default_rng(7)
    q, k, v = make_case(rng, n_head_kv=3, group=3, n_q=2, n_kv=3000, d=64, d_v=64)
    mask = make_mask(rng, "causal", 2, 3000)
    got = ops.sparq_attn(q, k, v, mask, k1=8, k2=3000, backend="cuda")
    dense = reference.dense_attn(q[0].astype(np.float32).astype(np.float64), ops.kv_round(k[0], "f16"),
                                 ops.kv_round(v[0], "f16"), mask)
    assert_close(got[0], dense, "f16", "k2 >= visible")


def test_empty_rows_give_zeros_and_vsum_is_used():
    rng = np.random.default_rng(2)
    q, k, v = make_case(rng, n_head_kv=2, group=2, n_q=2, n_kv=5000, d=64, d_v=64)
    mask = np.ones((2, 5000), dtype=bool)
    mask[1] = False
    got = ops.sparq_attn(q, k, v, mask, k1=8, k2=16, backend="cuda")
    assert np.all(got[0, :, 1] == 0.0) and np.abs(got[0, :, 0]).max() > 0
    vr = ops.kv_round(v, "f16")
    vsum = np.zeros((1, 2, 2, 65))
    for h in range(2):
        vsum[0, 0, h, :64] = vr[0, h].sum(axis=0)
        vsum[0, 0, h, 64] = 5000
    with_sum = ops.sparq_attn(q, k, v, mask, k1=8, k2=64, mean="on", vsum=vsum, backend="cuda")
    without = ops.sparq_attn(q, k, v, mask, k1=8, k2=64, mean="on", backend="cuda")
    np.testing.assert_allclose(with_sum[0, :, 0], without[0, :, 0], rtol=1e-4, atol=1e-5)
    vsum[..., :64] *= 2
    wrong = ops.sparq_attn(q, k, v, mask, k1=8, k2=64, mean="on", vsum=vsum, backend="cuda")
    assert np.abs(wrong - without).max() > 1e-3


@pytest.mark.parametrize("case", VSUM_CASES + [(64, 8, 128, 64, 160, "f16"), (33, 8, 128, 33, None, "bf16")],
                         ids=lambda c: "-".join(map(str, c)))
def test_vsum_rows_equals_reference_and_cpu_bit_for_bit(case):
    n_seq, n_head_kv, d_v, n_tokens, v_ld, v_dtype = case
    rng = np.random.default_rng(n_seq * 1000 + d_v)
    table, v, idx = vsum_case(rng, n_seq, n_head_kv, d_v, n_tokens)
    got, table_after = ops.vsum_rows(table, v, idx, v_dtype=v_dtype, v_ld=v_ld, backend="cuda")
    np.testing.assert_array_equal(got, expected(table, v, idx, v_dtype))
    np.testing.assert_array_equal(table_after, written_back(table, got, idx))
    cpu, cpu_table = ops.vsum_rows(table, v, idx, v_dtype=v_dtype, v_ld=v_ld, n_threads=2)
    np.testing.assert_array_equal(got, cpu)
    np.testing.assert_array_equal(table_after, cpu_table)


@pytest.mark.parametrize("case", KSTAT_CASES + [(64, 8, 128, 64, 80, 1, "f16"), (33, 8, 128, 33, 20, 2, "bf16"),
                                                 (6, 8, 128, 6, 30, 1, "q4_1")],
                         ids=lambda c: "-".join(map(str, c)))
def test_kstat_rows_equals_reference_and_cpu(case):
    n_seq, n_head_kv, d, n_tokens, kv_size, n_stream, kv_dtype = case
    rng = np.random.default_rng(n_seq * 1000 + d + 1)
    table, k, cells, idx = kstat_case(rng, n_seq, n_head_kv, d, n_tokens, kv_size, n_stream)
    got, table_after = ops.kstat_rows(table, k, cells, idx, kv_dtype=kv_dtype, backend="cuda")
    assert_kstat_equal(got, kstat_rows_reference(table, k, cells, idx, kv_dtype), kv_dtype)
    np.testing.assert_array_equal(table_after, written_back(table, got, idx))
    cpu, cpu_table = ops.kstat_rows(table, k, cells, idx, kv_dtype=kv_dtype, n_threads=2)
    assert_kstat_equal(got, cpu, kv_dtype)
    assert_kstat_equal(table_after, cpu_table, kv_dtype)


@pytest.mark.parametrize("seed", range(len(INDEX_WRITE_CASES)),
                         ids=["-".join(map(str, c)) for c in INDEX_WRITE_CASES])
def test_index_write_holds_the_keys_of_its_cells_as_on_the_cpu(seed):
    case = INDEX_WRITE_CASES[seed]
    kt, k, cells, blk, mask = index_write_case(case, seed)
    kw = dict(mask=mask, s0=case[5], kt_dtype=case[0], kv_dtype=case[1])
    got = ops.index_write(kt, k, cells, blk, backend="cuda", **kw)
    check_index_write(got, case, kt, k, cells, blk, mask)
    if case[0] != "q8_0" and case[1] in ("f32", "f16", "bf16"):  # one conversion of exact inputs: the same bits
        np.testing.assert_array_equal(got, ops.index_write(kt, k, cells, blk, n_threads=2, **kw))


# The cases whose selection differs most between the two kernel families (window and sinks by position, the exact
# fallback, ties, underflowing scores, long rows, hidden chunks, waves of many rows), run again under each forced value
# of the testing switch. Under "cluster" kernel PBS takes every row it can hold, however many rows (the waves test
# too); only the 260000-cell rows fall back to P, B, S.
FORCED_SELECTION_CASES = ("window_and_sinks or long_sequences or underflow or mha_rows or waves or covering "
                          "or empty_rows or long_rows_with_q8_index or peaked_rows or random_case")


@pytest.mark.parametrize("seed", range(len(Q4_WRITE_CASES)), ids=["-".join(map(str, c)) for c in Q4_WRITE_CASES])
def test_q4_index_write_equals_the_cpu_and_the_q4_blocks(seed):
    case = Q4_WRITE_CASES[seed]
    kt, k, cells, blk, mask = index_write_case(case, 100 + seed)
    kv_dtype, s0, head_dim = case[1], case[5], case[9]
    kw = dict(mask=mask, s0=s0, kt_dtype="q4", kv_dtype=kv_dtype, head_dim=head_dim)
    got = ops.index_write(kt, k, cells, blk, backend="cuda", **kw)
    np.testing.assert_array_equal(got, ops.index_write(kt, k, cells, blk, n_threads=2, **kw))
    np.testing.assert_array_equal(got, q4_index_after(kt, k, cells, blk, mask, kv_dtype, s0, head_dim))


@pytest.mark.skipif(os.environ.get("SPARQ_CUDA_SELECT", "auto") != "auto",
                    reason="this process already runs under a forced selection kernel")
@pytest.mark.parametrize("select", ["cluster", "sweep", "bound"])
def test_cases_pass_with_each_selection_kernel_forced(select):
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve()),
           "-k", FORCED_SELECTION_CASES]
    env = {**os.environ, "SPARQ_CUDA_SELECT": select, "GGML_NO_BACKTRACE": "1"}  # an abort ends without a debugger
    r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=1800)
    out = r.stdout + r.stderr
    if select == "cluster" and "kernel PBS cannot run on this device" in out:
        pytest.skip("kernel PBS needs a Hopper GPU and a build with sm_90 code")
    assert r.returncode == 0, f"SPARQ_CUDA_SELECT={select}: {' '.join(cmd)}\n{out[-4000:]}"
    assert " passed" in out and " failed" not in out, out[-2000:]
