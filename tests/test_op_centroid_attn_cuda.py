"""ggml_centroid_attn and the graph k-means (ggml_cluster_update) on CUDA, against the CPU op and the float64
reference (sparq_llama.reference_squeeze).

Runs where our library was built with CUDA and sees a device (bench/device.sh runs it on a GPU machine);
elsewhere the module is skipped as a whole. The op cases are the CPU test's (tests/test_op_centroid_attn.py),
plus what only the GPU kernels split: long sequences over many blocks, prefill batches in waves of rows, wide
groups in several passes, repeated runs giving identical bits, and the budget rule's radix select (ties among
thousands of clusters, which only the index bits of the keys order). Selections are compared directly with V = the
identity: the output of a head is then its softmax weights over the cells, nonzero exactly on the cells read.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import sparq_llama
from sparq_llama import ops
from sparq_llama.reference import dense_attn
from sparq_llama.reference_squeeze import centroid_attn, kmeans_cosine
from test_op_centroid_attn import (
    CASES,
    TOL,
    all_scores,
    case_inputs,
    gap_keep,
    gap_threshold,
    make_case,
    reference_outputs,
    rows_fine_scores,
    tie_case,
)
from test_reference_squeeze import blobs

pytestmark = pytest.mark.skipif("CUDA0" not in [dev["name"] for dev in sparq_llama.devices()],
                                reason="no CUDA device in this build (the GPU run is bench/device.sh)")


@pytest.mark.parametrize("var_weight", [0.0, 0.5])
@pytest.mark.parametrize("keep", [0.1, 0.3])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_op_matches_reference_and_cpu(case: int, keep: float, var_weight: float) -> None:
    q, k, v, cent, sizes, cell, keep, mask, kv, kw = case_inputs(case, keep, var_weight)
    got = ops.centroid_attn(q, k, v, cent, sizes, cell, keep, mask, kv_dtype=kv, backend="cuda", **kw)
    cpu = ops.centroid_attn(q, k, v, cent, sizes, cell, keep, mask, kv_dtype=kv, n_threads=2, **kw)
    np.testing.assert_allclose(got, cpu, rtol=TOL[kv], atol=TOL[kv])
    want = reference_outputs(q, k, v, cent, sizes, cell, keep, mask, kw)
    np.testing.assert_allclose(got, want, rtol=TOL[kv], atol=TOL[kv])


# The case set's selections, cell by cell: V = I (d_v = n_kv) makes each output row the head's softmax weights.
SELECTION_CASES = [
    # n_head, n_head_kv, d, n_kv, frac, levels, masked, group
    (4, 4, 64, 256, 0.05, 1, False, "max"),
    (8, 2, 64, 256, 0.1, 1, True, "max"),
    (9, 3, 32, 200, 0.1, 1, True, "mean"),
    (16, 2, 128, 480, 0.05, 2, True, "max"),
    (6, 3, 64, 320, 0.1, 2, False, "mean"),
    (32, 1, 128, 512, 0.05, 1, True, "max"),
]


@pytest.mark.parametrize("var_weight", [0.0, 0.5])
@pytest.mark.parametrize("keep", [0.1, 0.3])
@pytest.mark.parametrize("case", range(len(SELECTION_CASES)))
def test_selected_cells_are_identical(case: int, keep: float, var_weight: float) -> None:
    n_head, n_head_kv, d, n_kv, frac, levels, masked, group = SELECTION_CASES[case]
    rng = np.random.default_rng(300 + case)
    n_prefix = n_kv - 16
    q, k, _, cent, sizes, cell, coarse, var = make_case(rng, ns=1, n_head=n_head, n_head_kv=n_head_kv, d=d, d_v=8,
                                                        n_kv=n_kv, n_prefix=n_prefix, frac=frac, kv_dtype="f32",
                                                        levels=levels)
    q = q.astype(np.float32).astype(np.float64) * 0.3  # moderate logits: no selected weight underflows
    v = np.broadcast_to(np.eye(n_kv), (1, n_head_kv, n_kv, n_kv)).copy()
    mask = rng.random((1, q.shape[2], n_kv)) > 0.15 if masked else None
    _, coarse_scores = all_scores(q, cent, sizes, 1.0 / math.sqrt(d), group, coarse, var, var_weight)
    thr_c = gap_threshold(coarse_scores, 0.5) if coarse is not None else 0.0
    keep = gap_keep(rows_fine_scores(q, cent, sizes, 1.0 / math.sqrt(d), group, coarse, thr_c, var, var_weight), keep)
    if var_weight == 0.0 and coarse is not None:
        coarse = coarse[:3]
    kw = {"group": group, "coarse": coarse, "threshold_coarse": thr_c, "kv_dtype": "f32"}
    if var_weight > 0.0:
        kw |= {"variances": var, "var_weight": var_weight}
    got = ops.centroid_attn(q, k, v, cent, sizes, cell, keep, mask, backend="cuda", **kw)
    cpu = ops.centroid_attn(q, k, v, cent, sizes, cell, keep, mask, n_threads=2, **kw)
    kw.pop("kv_dtype")
    coarse = kw.pop("coarse")
    var = kw.pop("variances", None)
    want = centroid_attn(q[0], k[0], v[0], cent[0], sizes[0], cell[0], keep, None if mask is None else mask[0],
                         coarse=None if coarse is None else tuple(x[0] for x in coarse),
                         variances=None if var is None else var[0], **kw)
    read = got[0] > 0
    assert np.array_equal(read, cpu[0] > 0)
    assert np.array_equal(read, want > 0)
    assert 0 < read.sum() < read.size  # a real selection: some cells read, some skipped
    np.testing.assert_allclose(got[0], want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("shape", [
    # Llama-2 heads; Llama-3 heads; one KV head with d = 256; G = 32 (four passes over the group)
    {"n_head": 32, "n_head_kv": 32, "d": 128, "n_kv": 33000, "n_prefix": 32768, "group": "max", "kv": "f16"},
    {"n_head": 32, "n_head_kv": 8, "d": 128, "n_kv": 20000, "n_prefix": 19000, "group": "mean", "kv": "bf16"},
    {"n_head": 8, "n_head_kv": 1, "d": 256, "n_kv": 12000, "n_prefix": 11000, "group": "max", "kv": "f32"},
    {"n_head": 64, "n_head_kv": 2, "d": 64, "n_kv": 9000, "n_prefix": 8500, "group": "max", "kv": "f16"},
])
def test_long_sequences_match_cpu(shape) -> None:
    rng = np.random.default_rng(shape["n_kv"])
    n_head, n_head_kv, d, n_kv, n_prefix = (shape[x] for x in ("n_head", "n_head_kv", "d", "n_kv", "n_prefix"))
    n_cent = n_prefix // 20
    k = ops.kv_round(rng.standard_normal((n_head_kv, n_kv, d)), shape["kv"]).astype(np.float32)
    v = ops.kv_round(rng.standard_normal((n_head_kv, n_kv, d)), shape["kv"]).astype(np.float32)
    # contiguous runs as clusters, centroids the runs' means; queries near some centroids
    run = (np.arange(n_prefix) * n_cent) // n_prefix
    cell = np.full((n_head_kv, n_kv), -1)
    cell[:, :n_prefix] = run
    sizes = np.tile(np.bincount(run, minlength=n_cent), (n_head_kv, 1))
    starts = np.flatnonzero(np.diff(run, prepend=-1))
    cent = (np.add.reduceat(k[:, :n_prefix].astype(np.float64), starts, axis=1) / sizes[:, :, None])
    cent = cent.astype(np.float32).astype(np.float64)
    near = np.repeat(cent[:, rng.integers(0, n_cent, 2)], n_head // n_head_kv, axis=0)
    q = (rng.standard_normal((n_head, 2, d)) + 20.0 * near).astype(np.float32)
    mask = np.ones((2, n_kv), dtype=bool)
    mask[0, -5:] = False
    rows = rows_fine_scores(q[None].astype(np.float64), cent[None], sizes[None], 1.0 / math.sqrt(d), shape["group"],
                            None, 0.0, None, 0.0)
    for keep in (0.1, 0.3):
        keep = gap_keep(rows, keep, margin=1.0 + 2e-5)  # far wider than float32's error on a score
        kw = {"group": shape["group"], "kv_dtype": shape["kv"]}
        got = ops.centroid_attn(q, k, v, cent, sizes, cell, keep, mask, backend="cuda", **kw)
        cpu = ops.centroid_attn(q, k, v, cent, sizes, cell, keep, mask, **kw)
        np.testing.assert_allclose(got, cpu, rtol=5e-5, atol=5e-5)


def test_prefill_rows_run_in_waves_and_repeat_bit_for_bit() -> None:
    # more rows (KV heads x query rows) than one wave takes: 2 x 4500 > 8192
    rng = np.random.default_rng(31)
    n_q, n_kv, n_prefix, d = 4500, 400, 360, 32
    q, k, v, cent, sizes, cell, _, _ = make_case(rng, ns=1, n_head=4, n_head_kv=2, d=d, d_v=d, n_kv=n_kv,
                                              n_prefix=n_prefix, frac=0.1, kv_dtype="f16", levels=1)
    q = rng.standard_normal((4, n_q, d)) * 1.5
    mask = np.tril(np.ones((n_q, n_kv), dtype=bool), k=n_kv - n_q) if n_q <= n_kv else rng.random((n_q, n_kv)) > 0.2
    keep = 0.1
    first = ops.centroid_attn(q, k[0], v[0], cent[0], sizes[0], cell[0], keep, mask, backend="cuda")
    np.testing.assert_array_equal(first, ops.centroid_attn(q, k[0], v[0], cent[0], sizes[0], cell[0], keep, mask,
                                                           backend="cuda"))
    cpu = ops.centroid_attn(q, k[0], v[0], cent[0], sizes[0], cell[0], keep, mask)
    # budget boundaries are not in a gap here: rows with a near tie there may differ; nearly all must agree
    close = np.isclose(first, cpu, rtol=2e-5, atol=2e-5).all(axis=-1)
    assert close.mean() > 0.99


@pytest.mark.parametrize("n_q", [1, 3])
def test_keep_one_is_dense(n_q: int) -> None:
    rng = np.random.default_rng(7)
    q, k, v, cent, sizes, cell, _, _ = make_case(rng, ns=1, n_head=8, n_head_kv=2, d=64, d_v=64, n_kv=5000,
                                              n_prefix=4900, frac=0.05, kv_dtype="f16", levels=1)
    q = q[:, :, :1].repeat(n_q, axis=2)
    mask = rng.random((n_q, 5000)) > 0.1
    got = ops.centroid_attn(q[0], k[0], v[0], cent[0], sizes[0], cell[0], 1.0, mask, backend="cuda")
    np.testing.assert_allclose(got, dense_attn(q[0], k[0], v[0], mask), rtol=2e-5, atol=2e-5)


def test_rows_without_visible_cells_are_zero() -> None:
    rng = np.random.default_rng(8)
    q, k, v, cent, sizes, cell, _, _ = make_case(rng, ns=1, n_head=4, n_head_kv=2, d=32, d_v=32, n_kv=100,
                                              n_prefix=80, frac=0.1, kv_dtype="f32", levels=1)
    mask = np.ones((q.shape[2], 100), dtype=bool)
    mask[0] = False
    got = ops.centroid_attn(q[0], k[0], v[0], cent[0], sizes[0], cell[0], 0.5, mask, kv_dtype="f32", backend="cuda")
    assert (got[:, 0] == 0).all() and np.abs(got[:, 1:]).max() > 0


# ---- the budget rule's selection (kernel S2's radix select) -------------------------------------------------

@pytest.mark.parametrize("group", ["max", "mean"])
@pytest.mark.parametrize("keep", [0.25, 0.26, 0.0, 1.0])
def test_budget_ties_and_empty_clusters_match_cpu_and_reference(keep: float, group: str) -> None:
    rng = np.random.default_rng(13)
    q, k, v, cent, sizes, cell = tie_case(rng)  # every score ties: the lower clusters are kept
    got = ops.centroid_attn(q, k, v, cent, sizes, cell, keep, kv_dtype="f32", group=group, backend="cuda")
    cpu = ops.centroid_attn(q, k, v, cent, sizes, cell, keep, kv_dtype="f32", group=group, n_threads=2)
    np.testing.assert_allclose(got, cpu, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got, centroid_attn(q, k, v, cent, sizes, cell, keep, group=group), rtol=2e-5,
                               atol=2e-5)


@pytest.mark.parametrize("n_cent", [300, 5000])
@pytest.mark.parametrize("keep", [0.013, 0.1, 0.37, 0.9])
def test_budget_radix_select_over_many_tied_clusters(n_cent: int, keep: float) -> None:
    # n_cent clusters sharing 12 centroids (12 well-separated scores, each tied across many clusters) with sizes
    # 1..9: the boundary falls inside a tie, which only the index bits of the keys order (every radix pass runs)
    rng = np.random.default_rng(n_cent + int(1000 * keep))
    d, n_head, n_head_kv = 64, 8, 2
    q = rng.standard_normal((n_head, 2, d)).astype(np.float32)
    which = rng.integers(0, 12, size=(n_head_kv, n_cent))
    sizes = rng.integers(1, 10, size=(n_head_kv, n_cent))
    sizes[:, rng.integers(0, n_cent, size=n_cent // 10)] = 0  # some empty clusters
    n_prefix = int(sizes[0].sum())
    sizes[1] = np.roll(sizes[0], 7)  # both heads cluster the same cells (the same count)
    n_kv = n_prefix + 40
    cell = np.full((n_head_kv, n_kv), -1)
    for h in range(n_head_kv):
        cell[h, :n_prefix] = np.repeat(np.arange(n_cent), sizes[h])
    k = rng.standard_normal((n_head_kv, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n_head_kv, n_kv, d)).astype(np.float32)

    def separated(cent: np.ndarray) -> bool:  # the 12 distinct scores far apart: only the ties order by index
        rows = rows_fine_scores(q[None].astype(np.float64), cent[None], sizes[None], 1.0 / math.sqrt(d), "max", None,
                                0.0, None, 0.0)
        return all((np.diff(np.log(np.unique(sc[scored]))) > 1e-3).all() for sc, scored, _ in rows)

    for _ in range(50):
        base = rng.standard_normal((n_head_kv, 12, d))
        cent = np.take_along_axis(base, which[:, :, None], axis=1).astype(np.float32).astype(np.float64)
        if separated(cent):
            break
    assert separated(cent)
    got = ops.centroid_attn(q, k, v, cent, sizes, cell, keep, kv_dtype="f32", backend="cuda")
    cpu = ops.centroid_attn(q, k, v, cent, sizes, cell, keep, kv_dtype="f32", n_threads=2)
    want = centroid_attn(q, k, v, cent, sizes, cell, keep)
    np.testing.assert_allclose(got, cpu, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


# ---- k-means (ggml_mul_mat + ggml_argmax + ggml_cluster_update) on CUDA -------------------------------------

@pytest.mark.parametrize("d", [32, 128, 300])
def test_kmeans_matches_cpu_and_reference_on_separated_blobs(d: int) -> None:
    rng = np.random.default_rng(40 + d)
    problems = []
    for h in range(3):
        keys, _ = blobs(rng, 12, 40 + 7 * h, d, spread=0.3 / math.sqrt(d))  # noise norm 0.3: well separated
        problems.append(keys[:400])
    x = np.stack(problems).astype(np.float32)
    got = ops.kmeans_cosine(x, 12, n_iter=10, backend="cuda")
    cpu = ops.kmeans_cosine(x, 12, n_iter=10, n_threads=2)
    for h in range(3):
        want = kmeans_cosine(x[h].astype(np.float64), 12, n_iter=10)
        assert got[h].assignment.tolist() == cpu[h].assignment.tolist() == want.assignment.tolist()
        assert got[h].sizes.tolist() == cpu[h].sizes.tolist()
        # no n_iter check: ggml-cuda's f32 mul_mat runs in TF32 (its cuBLAS handles' math mode), so an
        # intermediate iteration can move a point at a near-tie the CPU does not move (seen with spread 0.1 at
        # d = 32, noise norm 0.57: the same fixed point in 8 iterations against the CPU's 5 on one machine,
        # another fixed point on the next)
        np.testing.assert_allclose(got[h].centroids, cpu[h].centroids, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[h].centroids, want.centroids, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[h].variances, cpu[h].variances, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got[h].variances, want.variances, rtol=1e-4, atol=1e-6)


def test_centred_kmeans_matches_cpu_and_reference() -> None:
    # a prefix's keys are clustered minus their mean key (a permute, mean and sub before the normalisation): blobs
    # around a shared offset, the same assignment as the CPU and the float64 reference, the table of the raw keys
    rng = np.random.default_rng(41)
    problems = []
    for h in range(3):
        keys, truth = blobs(rng, 12, 40, 64, spread=0.3 / math.sqrt(64))
        problems.append(keys[np.argsort(truth, kind="stable")] + 4.0 * rng.standard_normal(64))
    x = np.stack(problems).astype(np.float32)
    got = ops.kmeans_cosine(x, 12, n_iter=10, center=True, backend="cuda")
    cpu = ops.kmeans_cosine(x, 12, n_iter=10, center=True, n_threads=2)
    for h in range(3):
        want = kmeans_cosine(x[h].astype(np.float64), 12, n_iter=10, center=True)
        assert got[h].assignment.tolist() == cpu[h].assignment.tolist() == want.assignment.tolist()
        np.testing.assert_allclose(got[h].centroids, want.centroids, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(got[h].variances, want.variances, rtol=1e-4, atol=1e-6)


def test_weighted_kmeans_matches_cpu_and_reference() -> None:
    # a QK-norm model's prefix keys: centred, then times per-component weights (a broadcast mul before the
    # normalisation), each problem its own; the same assignment as the CPU and the float64 reference
    rng = np.random.default_rng(42)
    problems, weights = [], []
    for h in range(3):
        keys, truth = blobs(rng, 12, 40, 64, spread=0.3 / math.sqrt(64))
        problems.append(keys[np.argsort(truth, kind="stable")] + 4.0 * rng.standard_normal(64))
        weights.append(rng.uniform(0.25, 4.0, 64))
    x = np.stack(problems).astype(np.float32)
    w = np.stack(weights).astype(np.float32)
    got = ops.kmeans_cosine(x, 12, n_iter=10, center=True, weights=w, backend="cuda")
    cpu = ops.kmeans_cosine(x, 12, n_iter=10, center=True, weights=w, n_threads=2)
    for h in range(3):
        want = kmeans_cosine(x[h].astype(np.float64), 12, n_iter=10, center=True, weights=w[h].astype(np.float64))
        assert got[h].assignment.tolist() == cpu[h].assignment.tolist() == want.assignment.tolist()
        np.testing.assert_allclose(got[h].centroids, want.centroids, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n_iter", [1, 2, 4])
def test_kmeans_iterations_match_cpu_on_a_7b_head_shape(n_iter: int) -> None:
    # d = 128, 150 clusters per head, each iteration count: the same assignments and sizes as the CPU, the
    # centroids to float tolerance (blobs: no near-tie in the argmax, where the GPU's TF32 similarities could
    # part from the CPU's float32 ones)
    rng = np.random.default_rng(50)
    x = np.stack([blobs(rng, 150, 20, 128, spread=0.05)[0] for _ in range(4)]).astype(np.float32)
    got = ops.kmeans_cosine(x, 150, n_iter=n_iter, backend="cuda")
    cpu = ops.kmeans_cosine(x, 150, n_iter=n_iter, n_threads=2)
    for h in range(4):
        assert np.array_equal(got[h].assignment, cpu[h].assignment)
        assert np.array_equal(got[h].sizes, cpu[h].sizes)
        np.testing.assert_allclose(got[h].centroids, cpu[h].centroids, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[h].variances, cpu[h].variances, rtol=1e-4, atol=1e-6)


def test_kmeans_on_cuda_is_deterministic_and_a_fixed_point() -> None:
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 2000, 64)).astype(np.float32)
    a = ops.kmeans_cosine(x, 100, n_iter=60, backend="cuda")
    b = ops.kmeans_cosine(x, 100, n_iter=60, backend="cuda")
    for h in range(3):
        assert np.array_equal(a[h].assignment, b[h].assignment) and np.array_equal(a[h].centroids, b[h].centroids)
        assert a[h].sizes.sum() == 2000
        for c in np.flatnonzero(a[h].sizes)[:20]:
            np.testing.assert_allclose(a[h].centroids[c], x[h][a[h].assignment == c].mean(0), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(a[h].variances[c], x[h][a[h].assignment == c].astype(np.float64).var(0),
                                       rtol=1e-4, atol=1e-6)
        assert np.array_equal(a[h].variances, b[h].variances)


def test_kmeans_assignment_ties_go_to_the_higher_cluster_as_on_the_cpu() -> None:
    # rows from 5 directions and 12 clusters: several centroids start (and stay) equal, so rows tie exactly between
    # clusters; ggml_cluster_assign gives them the higher one, as the CPU and the reference do (ggml_argmax's CUDA
    # kernel left them to its reduction order)
    rng = np.random.default_rng(14)
    dirs = rng.standard_normal((5, 16))
    x = np.stack([dirs[rng.integers(0, 5, size=300)] for _ in range(2)])  # exact copies: exact ties in f32 and f64
    x = x.astype(np.float32)
    got = ops.kmeans_cosine(x, 12, n_iter=6, backend="cuda")
    cpu = ops.kmeans_cosine(x, 12, n_iter=6, n_threads=2)
    for h in range(2):
        want = kmeans_cosine(x[h].astype(np.float64), 12, n_iter=6)
        assert got[h].assignment.tolist() == cpu[h].assignment.tolist() == want.assignment.tolist()
        assert got[h].sizes.tolist() == cpu[h].sizes.tolist() == want.sizes.tolist()
    dup = ops.kmeans_cosine(np.ones((5, 3)), 3, backend="cuda")
    assert dup.sizes.tolist() == [0, 0, 5] and (dup.variances == 0).all()  # identical members: exactly no spread


def test_kmeans_variances_of_tight_clusters_far_from_the_origin() -> None:
    # the CUDA table takes the variances in its one scan from the deviations to each cluster's first member; keys at
    # 300 +- 0.01 per component would lose every digit to cancellation in E[x^2] - mean^2 (float32)
    rng = np.random.default_rng(15)
    centers = 300.0 * rng.standard_normal((6, 32))
    x = (centers[rng.integers(0, 6, size=(2, 600))] + 0.01 * rng.standard_normal((2, 600, 32))).astype(np.float32)
    got = ops.kmeans_cosine(x, 6, n_iter=5, backend="cuda")
    for h in range(2):  # the float64 variances of the members it chose (which blob a near-tie joins does not matter)
        for c in np.flatnonzero(got[h].sizes):
            want = x[h][got[h].assignment == c].astype(np.float64).var(0)
            np.testing.assert_allclose(got[h].variances[c], want, rtol=2e-2, atol=1e-7)


def test_kpp_seeding_on_cuda_matches_cpu_where_the_similarities_are_exact() -> None:
    # distinct one-hot directions (scaled): every similarity between two keys is exactly 0 in TF32 too, so the draws
    # weigh the same distances as the CPU's and the reference's, draw for draw, over two and three rounds
    rng = np.random.default_rng(60)
    d = 128
    x = np.stack([np.eye(d)[rng.permutation(d)] * rng.uniform(0.5, 3.0, size=(d, 1)) for _ in range(3)])
    x = x.astype(np.float32)
    for n in (65, 120):
        got = ops.kmeans_cosine(x, n, n_iter=1, init="kpp", backend="cuda")
        cpu = ops.kmeans_cosine(x, n, n_iter=1, init="kpp", n_threads=2)
        for h in range(3):
            want = kmeans_cosine(x[h].astype(np.float64), n, n_iter=1, init="kpp", head=h)
            assert got[h].assignment.tolist() == cpu[h].assignment.tolist() == want.assignment.tolist()


def test_kpp_seeding_on_cuda_is_deterministic() -> None:
    # on real-valued keys the GPU's TF32 similarities weigh the draws slightly otherwise than the CPU's, so its seeds
    # may differ from the CPU's; they are the same from run to run, and the clustering converges as from any seeds
    rng = np.random.default_rng(61)
    x = np.stack([blobs(rng, 40, 25, 128, spread=0.05)[0] for _ in range(4)]).astype(np.float32)
    a = ops.kmeans_cosine(x, 130, n_iter=30, init="kpp", backend="cuda")
    b = ops.kmeans_cosine(x, 130, n_iter=30, init="kpp", backend="cuda")
    for h in range(4):
        assert np.array_equal(a[h].assignment, b[h].assignment) and np.array_equal(a[h].centroids, b[h].centroids)
        assert a[h].n_iter < 30 and a[h].sizes.sum() == 1000
