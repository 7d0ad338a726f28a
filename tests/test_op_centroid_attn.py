"""ggml_centroid_attn (CPU) against the float64 reference
(sparq_llama.reference_squeeze) over a random case set: shapes, GQA, masks, streams, KV types, softcap, the
group rule, the two-level lookup, the kept rule's variance term and the per-row budget. Each case's keep is moved
(by at most a few percent) until every row's budget boundary lies in a wide gap between cluster scores, and the
coarse threshold is placed in such a gap, so that the float32 kernels and the float64 reference keep the same
clusters; a different selection moves the output far more than the tolerance. Ties, empty clusters, keep 1 and
keep 0 have their own tests."""
from __future__ import annotations

import math

import numpy as np
import pytest
from sparq_llama import ops
from sparq_llama.reference import dense_attn
from sparq_llama.reference_squeeze import (
    centroid_attn,
    coarse_level,
    fine_scores,
    group_scores,
    keep_budget,
    kmeans_cosine,
)

BACKENDS = ["cpu"]  # the CUDA kernel runs these cases in tests/test_op_centroid_attn_cuda.py (against this CPU op too)
TOL = {"f32": 2e-5, "f16": 2e-5, "bf16": 2e-5}  # on values rounded to the KV type first


def make_case(rng: np.random.Generator, *, ns: int, n_head: int, n_head_kv: int, d: int, d_v: int, n_kv: int,
              n_prefix: int, frac: float, kv_dtype: str, levels: int):
    q = rng.standard_normal((ns, n_head, rng.integers(1, 4), d)) * 1.5
    k = ops.kv_round(rng.standard_normal((ns, n_head_kv, n_kv, d)), kv_dtype)
    v = ops.kv_round(rng.standard_normal((ns, n_head_kv, n_kv, d_v)), kv_dtype)
    n_cent = max(1, int(frac * n_prefix))
    cent = np.zeros((ns, n_head_kv, n_cent, d))
    var = np.zeros((ns, n_head_kv, n_cent, d))
    sizes = np.zeros((ns, n_head_kv, n_cent), dtype=np.int64)
    cell = np.full((ns, n_head_kv, n_kv), -1, dtype=np.int64)
    start = rng.integers(0, n_kv - n_prefix + 1)  # the prefix need not start at cell 0
    for s in range(ns):
        for h in range(n_head_kv):
            cl = kmeans_cosine(k[s, h, start:start + n_prefix], n_cent, n_iter=4)
            cent[s, h], sizes[s, h], var[s, h] = cl.centroids, cl.sizes, cl.variances
            cell[s, h, start:start + n_prefix] = cl.assignment
    cent = cent.astype(np.float32).astype(np.float64)  # what the op stores
    var = var.astype(np.float32).astype(np.float64)
    coarse = None
    if levels == 2:
        n_c = max(1, n_cent // 4)
        c_cent = np.zeros((ns, n_head_kv, n_c, d))
        c_var = np.zeros((ns, n_head_kv, n_c, d))
        c_sizes = np.zeros((ns, n_head_kv, n_c), dtype=np.int64)
        parent = np.zeros((ns, n_head_kv, n_cent), dtype=np.int64)
        for s in range(ns):
            for h in range(n_head_kv):
                parent[s, h] = kmeans_cosine(cent[s, h], n_c, n_iter=4).assignment
                c_cent[s, h], c_sizes[s, h], c_var[s, h] = coarse_level(cent[s, h], sizes[s, h], var[s, h], parent[s, h],
                                                                        n_c)
        coarse = (c_cent.astype(np.float32).astype(np.float64), c_sizes, parent,
                  c_var.astype(np.float32).astype(np.float64))
    return q, k, v, cent, sizes, cell, coarse, var


def gap_threshold(scores: np.ndarray, keep: float) -> float:
    """A threshold near the `keep` quantile of the scores, in the widest relative gap close to it."""
    s = np.sort(scores[scores > 0])[::-1]
    if s.size < 2:
        return 0.0
    at = int(keep * s.size)
    lo, hi = max(0, at - 8), min(s.size - 1, at + 8)
    ratios = s[lo:hi] / s[lo + 1:hi + 1]
    i = lo + int(np.argmax(ratios))
    assert s[i] / s[i + 1] > 1.001, "no usable gap between cluster scores"
    return float(math.sqrt(s[i] * s[i + 1]))


def all_scores(q, cent, sizes, scale, group, coarse, var, var_weight):
    """Every row's group scores (fine, and coarse when two levels): where thresholds must not fall."""
    ns, n_head, n_q, _ = q.shape
    n_head_kv = cent.shape[1]
    G = n_head // n_head_kv
    fine, coarse_s = [], []
    for s in range(ns):
        for h in range(n_head_kv):
            for t in range(n_q):
                qg = q[s, h*G:(h + 1)*G, t]
                fine.append(group_scores(qg, cent[s, h], sizes[s, h], scale, group, None,
                                         None if var is None else var[s, h], var_weight))
                if coarse is not None:
                    coarse_s.append(group_scores(qg, coarse[0][s, h], coarse[1][s, h], scale, group, None,
                                                 coarse[3][s, h] if len(coarse) > 3 else None, var_weight))
    return np.concatenate(fine), (np.concatenate(coarse_s) if coarse_s else None)


def budget_margin(s: np.ndarray, scored: np.ndarray, sizes: np.ndarray, keep: float) -> float:
    """The smallest score ratio across a row's budget boundary: between the last kept cluster and its neighbours in
    the order (a swap of either pair would move the boundary); inf where there is no neighbour."""
    idx = np.flatnonzero(scored)
    order = idx[np.lexsort((idx, -s[idx]))]
    n = np.asarray(sizes, dtype=np.float64)[order]
    b = int(((np.cumsum(n) - n) < keep_budget(keep, np.sum(sizes))).sum()) - 1
    ratios = []
    with np.errstate(divide="ignore", invalid="ignore"):
        if b >= 1:
            ratios.append(s[order[b - 1]] / s[order[b]])
        if b + 1 < order.size:
            ratios.append(s[order[b]] / s[order[b + 1]])
    return min((1.0 if np.isnan(r) else r for r in ratios), default=math.inf)


def rows_fine_scores(q, cent, sizes, scale, group, coarse, thr_c, var, var_weight):
    """(fine scores, scored, sizes) of every (stream, KV head, query row), as the reference computes them."""
    ns, n_head, n_q, _ = q.shape
    n_head_kv = cent.shape[1]
    G = n_head // n_head_kv
    rows = []
    for s in range(ns):
        for h in range(n_head_kv):
            lv = None
            if coarse is not None:
                lv = (coarse[0][s, h], coarse[1][s, h], coarse[2][s, h],
                      coarse[3][s, h] if len(coarse) > 3 and var_weight > 0.0 else None)
            for t in range(n_q):
                sc, scored = fine_scores(q[s, h*G:(h + 1)*G, t], cent[s, h], sizes[s, h],
                                         None if var is None or var_weight == 0.0 else var[s, h], scale, group, lv,
                                         thr_c, var_weight)
                rows.append((sc, scored, sizes[s, h]))
    return rows


def gap_keep(rows, keep: float, margin: float = 1.001) -> float:
    """The first keep of keep * (1 + 0.015 j), j = 0, 1, ... whose budget boundary lies in a score gap wider than
    `margin` on every row (so float32 and float64 scores keep the same clusters)."""
    for j in range(80):
        k = keep * (1.0 + 0.015 * j)
        if all(budget_margin(s, scored, n, k) > margin for s, scored, n in rows):
            return k
    raise AssertionError(f"no keep near {keep} with every boundary in a gap")


CASES = [
    # ns, n_head, n_head_kv, d, d_v, n_kv, n_prefix, frac, kv, levels, masked, softcap, group
    (1, 4, 4, 64, 64, 300, 256, 0.05, "f16", 1, False, 0.0, "max"),
    (1, 8, 2, 64, 64, 500, 400, 0.05, "f16", 1, True, 0.0, "max"),
    (1, 9, 3, 64, 64, 700, 640, 0.05, "bf16", 1, True, 0.0, "mean"),
    (2, 4, 1, 128, 128, 400, 300, 0.1, "f32", 1, True, 0.0, "max"),
    (1, 4, 1, 256, 256, 350, 300, 0.05, "f16", 1, False, 30.0, "max"),
    (1, 8, 8, 32, 48, 200, 200, 0.1, "f32", 1, True, 0.0, "mean"),
    (1, 8, 2, 64, 64, 900, 800, 0.05, "f16", 2, True, 0.0, "max"),
    (2, 6, 3, 64, 64, 600, 512, 0.05, "bf16", 2, False, 0.0, "mean"),
    (1, 16, 2, 128, 128, 1200, 1024, 0.05, "f16", 2, True, 50.0, "max"),
]


def case_inputs(case: int, keep: float, var_weight: float = 0.0):
    """CASES[case] near `keep` (seeded by both): q, k, v, cent, sizes, cell, the gap keep (gap_keep), mask, KV type
    and the op's other keywords (softcap, group, coarse, the gap threshold_coarse; with var_weight > 0 the variances
    and var_weight: the kept rule's variance term)."""
    ns, n_head, n_head_kv, d, d_v, n_kv, n_prefix, frac, kv, levels, masked, softcap, group = CASES[case]
    rng = np.random.default_rng(1000 * case + int(keep * 10))
    q, k, v, cent, sizes, cell, coarse, var = make_case(rng, ns=ns, n_head=n_head, n_head_kv=n_head_kv, d=d, d_v=d_v,
                                                        n_kv=n_kv, n_prefix=n_prefix, frac=frac, kv_dtype=kv,
                                                        levels=levels)
    q = q.astype(np.float32).astype(np.float64)
    mask = rng.random((ns, q.shape[2], n_kv)) > 0.15 if masked else None
    scale = 1.0 / math.sqrt(d)
    _, coarse_scores = all_scores(q, cent, sizes, scale, group, coarse, var, var_weight)
    thr_c = gap_threshold(coarse_scores, 0.5) if coarse is not None else 0.0
    keep = gap_keep(rows_fine_scores(q, cent, sizes, scale, group, coarse, thr_c, var, var_weight), keep)
    if var_weight == 0.0 and coarse is not None:
        coarse = coarse[:3]  # tables without variances
    kw = {"softcap": softcap, "group": group, "coarse": coarse, "threshold_coarse": thr_c}
    if var_weight > 0.0:
        kw |= {"variances": var, "var_weight": var_weight}
    return q, k, v, cent, sizes, cell, keep, mask, kv, kw


def reference_outputs(q, k, v, cent, sizes, cell, thr, mask, kw) -> np.ndarray:
    """The float64 reference per stream, on case_inputs' values."""
    coarse, var = kw["coarse"], kw.get("variances")
    rest = {key: val for key, val in kw.items() if key not in ("coarse", "variances")}
    return np.stack([centroid_attn(q[s], k[s], v[s], cent[s], sizes[s], cell[s], thr,
                                   None if mask is None else mask[s],
                                   coarse=None if coarse is None else tuple(x[s] for x in coarse),
                                   variances=None if var is None else var[s], **rest)
                     for s in range(q.shape[0])])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("var_weight", [0.0, 0.5])
@pytest.mark.parametrize("keep", [0.1, 0.3])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_op_matches_reference(case: int, keep: float, var_weight: float, backend: str) -> None:
    q, k, v, cent, sizes, cell, thr, mask, kv, kw = case_inputs(case, keep, var_weight)
    got = ops.centroid_attn(q, k, v, cent, sizes, cell, thr, mask, kv_dtype=kv, backend=backend, **kw)
    want = reference_outputs(q, k, v, cent, sizes, cell, thr, mask, kw)
    np.testing.assert_allclose(got, want, rtol=TOL[kv], atol=TOL[kv])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_threads", [1, 2, 5])
def test_keep_one_is_dense(n_threads: int, backend: str) -> None:
    rng = np.random.default_rng(7)
    q, k, v, cent, sizes, cell, _, _ = make_case(rng, ns=1, n_head=8, n_head_kv=2, d=64, d_v=64, n_kv=2000,
                                              n_prefix=1900, frac=0.05, kv_dtype="f16", levels=1)
    mask = rng.random((q.shape[2], 2000)) > 0.1
    want = dense_attn(q[0], k[0], v[0], mask)
    for keep in (1.0, 1.5):
        got = ops.centroid_attn(q[0], k[0], v[0], cent[0], sizes[0], cell[0], keep, mask, n_threads=n_threads,
                                backend=backend)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # a keep just under 1 drops the last cluster in the order: no longer dense
    got = ops.centroid_attn(q[0], k[0], v[0], cent[0], sizes[0], cell[0], 0.95, mask, n_threads=n_threads,
                            backend=backend)
    assert np.abs(got - want).max() > 1e-3


def tie_case(rng: np.random.Generator, n_cent: int = 8, size: int = 10):
    """One KV head whose n_cent clusters share one centroid and one size (every score ties), n_cent * size clustered
    cells in runs, then 7 unclustered ones; two more clusters are empty (size 0, no cells)."""
    d, n_head = 32, 4
    n_prefix = n_cent * size
    n_kv = n_prefix + 7
    k = rng.standard_normal((1, n_kv, d))
    v = rng.standard_normal((1, n_kv, d))
    q = rng.standard_normal((n_head, 2, d))
    cent = np.zeros((1, n_cent + 2, d))
    cent[0, :n_cent] = rng.standard_normal(d)
    cent[0, n_cent:] = 5.0 * rng.standard_normal((2, d))  # empty: never scored, whatever their score would be
    sizes = np.zeros((1, n_cent + 2), dtype=np.int64)
    sizes[0, :n_cent] = size
    cell = np.full((1, n_kv), -1)
    cell[0, :n_prefix] = np.arange(n_prefix) // size
    return q, k, v, cent, sizes, cell


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group", ["max", "mean"])
def test_equal_scores_keep_the_lower_clusters(group: str, backend: str) -> None:
    rng = np.random.default_rng(11)
    q, k, v, cent, sizes, cell = tie_case(rng)
    # 80 clustered cells, keep 0.25: B = 20 -> clusters 0 and 1 (10 + 10), then the 7 unclustered cells
    got = ops.centroid_attn(q, k, v, cent, sizes, cell, 0.25, kv_dtype="f32", group=group, backend=backend)
    want, sel = centroid_attn(q, k, v, cent, sizes, cell, 0.25, group=group, return_selection=True)
    assert sel[0][0].tolist() == list(range(20)) + list(range(80, 87))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # the same cells read through other clusters give another output: the test sees which clusters were kept
    other = centroid_attn(q, k, v, cent, sizes, np.where(cell >= 0, 7 - cell, -1), 0.25, group=group)
    assert np.abs(other - want).max() > 1e-3
    # 0.26: B = ceil(20.8) = 21 -> a third cluster
    _, sel = centroid_attn(q, k, v, cent, sizes, cell, 0.26, group=group, return_selection=True)
    assert sel[0][0].tolist() == list(range(30)) + list(range(80, 87))
    got = ops.centroid_attn(q, k, v, cent, sizes, cell, 0.26, kv_dtype="f32", group=group, backend=backend)
    np.testing.assert_allclose(got, centroid_attn(q, k, v, cent, sizes, cell, 0.26, group=group), rtol=2e-5,
                               atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keep", [0.0, -1.0, 1e-6])
def test_a_tiny_budget_keeps_the_best_cluster(keep: float, backend: str) -> None:
    rng = np.random.default_rng(12)
    q, k, v, cent, sizes, cell, _, _ = make_case(rng, ns=1, n_head=4, n_head_kv=2, d=32, d_v=32, n_kv=300,
                                              n_prefix=280, frac=0.1, kv_dtype="f32", levels=1)
    got = ops.centroid_attn(q[0], k[0], v[0], cent[0], sizes[0], cell[0], keep, kv_dtype="f32", backend=backend)
    want, sel = centroid_attn(q[0], k[0], v[0], cent[0], sizes[0], cell[0], keep, return_selection=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    for h in range(2):
        for cells in sel[h]:
            clusters = set(cell[0, h, cells].tolist()) - {-1}
            assert len(clusters) == 1  # the best one, and the 20 unclustered cells
            assert (cell[0, h, cells] == -1).sum() == 20


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_visible_cells_are_zero(backend: str) -> None:
    rng = np.random.default_rng(8)
    q, k, v, cent, sizes, cell, _, _ = make_case(rng, ns=1, n_head=4, n_head_kv=2, d=32, d_v=32, n_kv=100,
                                              n_prefix=80, frac=0.1, kv_dtype="f32", levels=1)
    mask = np.ones((q.shape[2], 100), dtype=bool)
    mask[0] = False
    got = ops.centroid_attn(q[0], k[0], v[0], cent[0], sizes[0], cell[0], 0.5, mask, kv_dtype="f32", backend=backend)
    assert (got[:, 0] == 0).all()


def test_bad_arguments_fail_clearly() -> None:
    rng = np.random.default_rng(9)
    q, k, v, cent, sizes, cell, _, _ = make_case(rng, ns=1, n_head=4, n_head_kv=2, d=32, d_v=32, n_kv=60,
                                              n_prefix=50, frac=0.1, kv_dtype="f16", levels=1)
    q, k, v, cent, sizes, cell = q[0], k[0], v[0], cent[0], sizes[0], cell[0]
    with pytest.raises(ValueError, match="centroids"):
        ops.centroid_attn(q, k, v, cent[:, :, :16], sizes, cell, 0.1)
    with pytest.raises(ValueError, match="cell_cluster"):
        ops.centroid_attn(q, k, v, cent, sizes, cell[:, :10], 0.1)
    with pytest.raises(ValueError, match="keep and threshold_coarse must be finite"):
        ops.centroid_attn(q, k, v, cent, sizes, cell, math.inf)
    with pytest.raises(ValueError, match="keep and threshold_coarse must be finite"):
        ops.centroid_attn(q, k, v, cent, sizes, cell, math.nan)
    with pytest.raises(ValueError, match="group"):
        ops.centroid_attn(q, k, v, cent, sizes, cell, 0.1, group="min")
    with pytest.raises(ValueError, match="softcap"):
        ops.centroid_attn(q, k, v, cent, sizes, cell, 0.1, softcap=-1.0)
    with pytest.raises(ValueError, match="n_head"):
        ops.centroid_attn(q[:3], k, v, cent, sizes, cell, 0.1)
    bad = cell.copy()
    bad[0, 0] = cent.shape[1]
    with pytest.raises(ValueError, match="cell_cluster entries"):
        ops.centroid_attn(q, k, v, cent, sizes, bad, 0.1)
