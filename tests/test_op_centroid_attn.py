"""ggml_centroid_attn (CPU) against the float64 reference
(sparq_llama.reference_squeeze) over a random case set: shapes, GQA, masks, streams, KV types, softcap, the
group rule, the two-level lookup and the kept rule's variance term. Thresholds are placed in a wide gap between the rows' cluster scores, so
that the float32 kernels and the float64 reference keep the same clusters; a different selection moves the
output far more than the tolerance."""
from __future__ import annotations

import math

import numpy as np
import pytest
from sparq_llama import ops
from sparq_llama.reference import dense_attn
from sparq_llama.reference_squeeze import (
    centroid_attn,
    coarse_level,
    group_scores,
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
    """CASES[case] at `keep` (seeded by both): q, k, v, cent, sizes, cell, the gap threshold, mask, KV type and the
    op's other keywords (softcap, group, coarse, threshold_coarse; with var_weight > 0 the variances and
    var_weight: the kept rule's variance term)."""
    ns, n_head, n_head_kv, d, d_v, n_kv, n_prefix, frac, kv, levels, masked, softcap, group = CASES[case]
    rng = np.random.default_rng(1000 * case + int(keep * 10))
    q, k, v, cent, sizes, cell, coarse, var = make_case(rng, ns=ns, n_head=n_head, n_head_kv=n_head_kv, d=d, d_v=d_v,
                                                        n_kv=n_kv, n_prefix=n_prefix, frac=frac, kv_dtype=kv,
                                                        levels=levels)
    q = q.astype(np.float32).astype(np.float64)
    mask = rng.random((ns, q.shape[2], n_kv)) > 0.15 if masked else None
    scale = 1.0 / math.sqrt(d)
    fine, coarse_scores = all_scores(q, cent, sizes, scale, group, coarse, var, var_weight)
    thr = gap_threshold(fine, keep)
    thr_c = gap_threshold(coarse_scores, 0.5) if coarse is not None else 0.0
    if var_weight == 0.0 and coarse is not None:
        coarse = coarse[:3]  # tables without variances
    kw = {"softcap": softcap, "group": group, "coarse": coarse, "threshold_coarse": thr_c}
    if var_weight > 0.0:
        kw |= {"variances": var, "var_weight": var_weight}
    return q, k, v, cent, sizes, cell, thr, mask, kv, kw


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
def test_threshold_zero_is_dense(n_threads: int, backend: str) -> None:
    rng = np.random.default_rng(7)
    q, k, v, cent, sizes, cell, _, _ = make_case(rng, ns=1, n_head=8, n_head_kv=2, d=64, d_v=64, n_kv=2000,
                                              n_prefix=1900, frac=0.05, kv_dtype="f16", levels=1)
    mask = rng.random((q.shape[2], 2000)) > 0.1
    got = ops.centroid_attn(q[0], k[0], v[0], cent[0], sizes[0], cell[0], 0.0, mask, n_threads=n_threads,
                            backend=backend)
    np.testing.assert_allclose(got, dense_attn(q[0], k[0], v[0], mask), rtol=2e-5, atol=2e-5)


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
    with pytest.raises(ValueError, match="thresholds must be finite"):
        ops.centroid_attn(q, k, v, cent, sizes, cell, math.inf)
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
