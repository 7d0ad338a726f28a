"""Float64 numpy reference of centroid-sparse ("Squeezed") attention: the oracle for the ``ggml_centroid_attn``
kernels and for the clustering and calibration that prepare a fixed prefix (docs/design.md, "Centroid-sparse: op
semantics").

Offline, once per fixed prefix, per layer and KV head, over the *clustered* cells (the prefix without its
last ``n_calib`` cells, which stay exact and whose queries calibrate the two-level rule's coarse threshold):

* :func:`kmeans_cosine`: spherical k-means on the L2-normalised keys. Initial centroids (``init``):
  ``"even"``, the keys at evenly spaced cells (``(i * P) // c``); or ``"kpp"``, k-means++ seeding
  (:func:`kpp_seed_rows`: each next seed drawn with probability proportional to its squared distance from the
  seeds so far, in rounds of :func:`kpp_round_size` seeds, by a counter-based generator: every backend and run
  draws alike).
  An iteration assigns each key to the centroid of largest cosine similarity (ties: the higher cluster, as
  ggml_argmax, which the graph version uses) and moves
  each centroid to the normalised mean of its members (an empty cluster keeps its centroid); it stops after
  ``n_iter`` iterations or when no assignment changes. The result's centroids are the means of the members'
  *unnormalised* keys (what the attention scores use) with the cluster sizes N_i (0: empty, never read) and
  the members' per-component variances about them, D_i[e] = sum_k (k_e - C_i[e])^2 / N_i.
* :func:`calibrate_threshold`: two levels, one global coarse threshold such that, over the calibration queries of
  every layer and KV head, the mean fraction of clustered keys under kept coarse clusters equals ``keep_coarse``.

Online, per KV head h, query row t, G the query heads reading h and sigma the kq scale (:func:`centroid_attn`):

1. z_g[i] = sigma * q_g . C_i for the clusters with N_i > 0, and the estimated attention weight of one key
   of cluster i, S_g[i] = exp(z_g[i] + v_g[i]) / sum_j N_j exp(z_g[j]), with the variance term
   v_g[i] = var_weight * sigma^2 / 2 * sum_e q_g[e]^2 D_i[e] (0 without var_weight: the paper's rule, the
   exponential of the mean logit). For keys Gaussian about C_i with those variances, exp(z + v) at var_weight 1 is
   E_k exp(sigma q.k): the term credits a spread-out cluster with the high-scoring members its mean hides.
2. The group decides together (one selection per KV head, as the kernels gather K and V rows once per group):
   s[i] = max_g S_g[i] (``group="max"``: a cluster is read when any head wants it; the default) or the mean
   over g (``group="mean"``).
3. Kept clusters, a budget per row (:func:`keep_budget`): the clusters in order of s (larger first, equal scores
   by lower index), each kept while the sizes of those before it sum to less than B = max(1, ceil(keep * N)), N
   the clustered cells (the sum of the sizes; keep * N a float32 product, as the kernels compute it). The best
   cluster is always kept, so that no row loses its whole prefix; keep >= 1 keeps every cluster (then the op is
   dense attention).
4. Selected cells: the row's visible cells that are not clustered (cluster -1: the question, generated
   tokens, the prefix's exact tail) or whose cluster is kept.
5. Exact attention over the selected cells: softmax(cap(sigma * q_g . k_j)) . v_j per head g.

Two levels (optional): coarse centroids over the fine ones, each fine cluster linked to its parent. The
coarse level runs steps 1-2 with the coarse sizes and keeps the coarse clusters whose score >= ``threshold_coarse``
(<= 0: all), the best always; fine clusters are scored only under kept parents, against the coarse normaliser
Z = sum_c N_c exp(z_c) (the fine one would read every fine centroid, which is what the coarse level avoids), and
kept by step 3's budget (N: all the clustered cells). Here S_g[i] = exp(z_g[i] + v_g[i]) / Z_g; the coarse level's variances are those of the coarse
cluster's keys about the coarse centroid (:func:`coarse_level` computes them exactly from the fine table).
"""
from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .reference import _check_mask
from .squeeze import GROUPS as GROUP_RULES
from .squeeze import INITS as KMEANS_INITS
from .squeeze import Clusters

__all__ = ["Clusters", "calibrate_threshold", "centroid_attn", "coarse_level", "fine_scores", "group_scores",
           "keep_budget",
           "kept_by_budget", "kept_fraction", "kmeans_cosine", "kpp_round_size", "kpp_seed_rows", "kpp_uniform", "variance_term"]

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]
KPP_SEED = 0x5EED5EED5EED5EED   # the generator's fixed seed
_M64 = (1 << 64) - 1


def _normalise(x: F64) -> F64:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norm > 0.0, norm, 1.0)


def _mix64(z: int) -> int:
    """splitmix64's step: the state advanced by the golden gamma, then finalised (a 64-bit bijection)."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def kpp_uniform(head: int, rnd: int, j: int) -> float:
    """Draw j of round rnd for problem (KV head) `head`: a uniform double in (0, 1), a pure function of the three
    counters (the C++ seeding computes the same bits)."""
    z = _mix64(_mix64(_mix64(KPP_SEED ^ head) ^ rnd) ^ j)
    return ((z >> 11) + 0.5) * 2.0 ** -53


def kpp_round_size(n_clusters: int) -> int:
    """Seeds drawn per round of :func:`kpp_seed_rows`: 64, or ceil((n_clusters - 1) / 16) for more clusters (at most
    ~16 rounds: each is a pass over the keys and, on a GPU, a read-back)."""
    return max(64, (n_clusters - 1 + 15) // 16)


def kpp_seed_rows(keys_normalised: ArrayLike, n_clusters: int, head: int = 0) -> I64:
    """k-means++ seeding of unit rows [P, d]: the rows of the n_clusters initial centroids, in order.

    Row 0 first. Then rounds r = 1, 2, ... of b = min(kpp_round_size(n_clusters), n_clusters - chosen) draws:
    with m_p the largest similarity of row p to a seed so far, D_p = max(0, 2 - 2 m_p) (the squared chord distance)
    and c its running sum, draw j takes the first row p with c_p > u_j c_{P-1} (u_j = kpp_uniform(head, r, j)),
    skipped when already a seed. A round that adds none (or a total of 0: fewer distinct rows than clusters) fills
    the rest with the lowest rows not yet seeds."""
    xn = np.asarray(keys_normalised, dtype=np.float64)
    p = xn.shape[0]
    chosen = [0]
    is_seed = np.zeros(p, dtype=bool)
    is_seed[0] = True
    best = xn @ xn[0]
    rnd = 0
    while len(chosen) < n_clusters:
        rnd += 1
        b = min(kpp_round_size(n_clusters), n_clusters - len(chosen))
        cum = np.cumsum(np.maximum(0.0, 2.0 - 2.0 * best))
        added: list[int] = []
        if cum[-1] > 0.0:
            for j in range(b):
                i = int(np.searchsorted(cum, kpp_uniform(head, rnd, j) * cum[-1], side="right"))
                i = min(i, p - 1)
                if not is_seed[i]:
                    is_seed[i] = True
                    added.append(i)
        if not added:
            rest = np.flatnonzero(~is_seed)[:n_clusters - len(chosen)]
            is_seed[rest] = True
            chosen.extend(int(i) for i in rest)
            break
        chosen.extend(added)
        best = np.maximum(best, (xn @ xn[added].T).max(axis=1))
    return np.asarray(chosen, dtype=np.int64)


def query_norm_weights(gamma: ArrayLike) -> F64:
    """The weights with which a QK-norm layer's queries weigh each key component (a prepared prefix's k-means
    weights): the query norm's weights gamma [d] (one head; NEOX rotary over every component), each rotary pair
    (c, c + d/2) given the pair's rms, as RoPE mixes the pair. The library's query_weights
    (sparq-squeeze-cluster.cpp) also takes norms per head (the rms over a KV head's query heads), NORM rotary and
    partial rotation."""
    g = np.asarray(gamma, dtype=np.float64)
    if g.ndim != 1 or len(g) % 2:
        raise ValueError(f"gamma must be [d] with d even, got shape {g.shape}")
    half = len(g) // 2
    pair = np.sqrt((g[:half] ** 2 + g[half:] ** 2) / 2)
    return np.concatenate([pair, pair])


def kmeans_cosine(keys: ArrayLike, n_clusters: int, n_iter: int = 8, init: str | ArrayLike = "even",
                  head: int = 0, center: bool = False, weights: ArrayLike | None = None) -> Clusters:
    """Spherical k-means of keys [P, d] into n_clusters (1..P) clusters; deterministic (see the module doc). `head`
    numbers the problem for the k-means++ generator (the KV head: the graph version draws per head). `init` may also
    be the n_clusters initial rows themselves (studies of other seedings). center: the directions compared are
    those of the keys minus their mean key (the table is of the keys themselves). weights [d]: the directions
    compared are those of the (centred) keys times these per-component weights (a prefix's keys weighted as its
    queries weigh them: query_norm_weights)."""
    x = np.asarray(keys, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"keys must be [P, d] with P, d >= 1, got shape {x.shape}")
    p = x.shape[0]
    if not isinstance(n_clusters, (int, np.integer)) or not 1 <= n_clusters <= p:
        raise ValueError(f"n_clusters must be an integer in [1, P = {p}], got {n_clusters!r}")
    if not isinstance(n_iter, (int, np.integer)) or n_iter < 1:
        raise ValueError(f"n_iter must be an integer >= 1, got {n_iter!r}")
    if weights is not None and np.shape(weights) != (x.shape[1],):
        raise ValueError(f"weights must have the keys' {x.shape[1]} components, got shape {np.shape(weights)}")
    y = x - x.mean(axis=0) if center else x
    xn = _normalise(y if weights is None else y * np.asarray(weights, dtype=np.float64))
    if not isinstance(init, str):
        rows = np.asarray(init, dtype=np.int64)
        if rows.shape != (n_clusters,) or rows.min() < 0 or rows.max() >= p:
            raise ValueError(f"init rows must be {n_clusters} row indices in [0, {p})")
    elif init not in KMEANS_INITS:
        raise ValueError(f"init must be one of {KMEANS_INITS} or row indices, got {init!r}")
    else:
        rows = (np.arange(n_clusters) * p) // n_clusters if init == "even" else kpp_seed_rows(xn, n_clusters, head)
    cn = xn[rows].copy()
    assignment = np.full(p, -1, dtype=np.int64)
    done = 0
    for done in range(1, n_iter + 1):
        sim = xn @ cn.T
        new = (n_clusters - 1 - np.argmax(sim[:, ::-1], axis=1)).astype(np.int64)  # ties: the highest index
        changed = not np.array_equal(new, assignment)
        assignment = new
        sums = np.zeros_like(cn)
        np.add.at(sums, assignment, xn)
        nonempty = np.bincount(assignment, minlength=n_clusters) > 0
        cn[nonempty] = _normalise(sums[nonempty])
        if not changed:
            break
    sizes = np.bincount(assignment, minlength=n_clusters).astype(np.int64)
    centroids = np.zeros((n_clusters, x.shape[1]))
    np.add.at(centroids, assignment, x)
    centroids[sizes > 0] /= sizes[sizes > 0, None]
    variances = np.zeros_like(centroids)
    np.add.at(variances, assignment, (x - centroids[assignment]) ** 2)
    variances[sizes > 0] /= sizes[sizes > 0, None]
    return Clusters(centroids, sizes, assignment, done, variances)


def coarse_level(centroids: ArrayLike, sizes: ArrayLike, variances: ArrayLike, parent: ArrayLike,
                 n_coarse: int) -> tuple[F64, F64, F64]:
    """The coarse table of one KV head from its fine one: (centroids [n_coarse, d], sizes, variances) of the
    coarse clusters, each the union of the fine clusters whose parent it is: the size-weighted mean of their
    centroids (= the mean of their keys), the summed sizes, and the keys' variances about the coarse centroid,
    sum_f N_f (D_f + (C_f - C)^2) / N (exact: the law of total variance)."""
    c = np.asarray(centroids, dtype=np.float64)
    n = np.asarray(sizes, dtype=np.float64)
    var = np.asarray(variances, dtype=np.float64)
    par = np.asarray(parent, dtype=np.int64)
    size_c = np.bincount(par, weights=n, minlength=n_coarse)
    cent_c = np.zeros((n_coarse, c.shape[1]))
    np.add.at(cent_c, par, n[:, None] * c)
    live = size_c > 0
    cent_c[live] /= size_c[live, None]
    var_c = np.zeros_like(cent_c)
    np.add.at(var_c, par, n[:, None] * (var + (c - cent_c[par]) ** 2))
    var_c[live] /= size_c[live, None]
    return cent_c, size_c, var_c


def variance_term(q: ArrayLike, variances: ArrayLike | None, scale: float, var_weight: float) -> F64 | float:
    """v [G, n] = var_weight * scale^2 / 2 * sum_e q_g[e]^2 D_i[e] for queries q [G, d] and variances [n, d] (0.0
    without var_weight)."""
    if var_weight == 0.0:
        return 0.0
    if variances is None:
        raise ValueError("var_weight > 0 needs the clusters' variances")
    q = np.asarray(q, dtype=np.float64)
    return 0.5 * var_weight * scale * scale * ((q * q) @ np.asarray(variances, dtype=np.float64).T)


def _log_normaliser(z: F64, n: F64) -> F64:
    """log Z_g = log sum_j N_j exp(z_g[j]) over the live clusters, from the logits z [G, n]."""
    live = n > 0
    zl = np.where(live, z + np.log(np.where(live, n, 1.0)), -np.inf)
    m = zl.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(zl - m).sum(axis=1, keepdims=True)))[:, 0]


def group_scores(q: ArrayLike, centroids: ArrayLike, sizes: ArrayLike, scale: float, group: str = "max",
                 log_norm: F64 | None = None, variances: ArrayLike | None = None, var_weight: float = 0.0) -> F64:
    """Group scores s [n] of one group's queries q [G, d] for the clusters (centroids [n, d], sizes [n],
    variances [n, d]): the max or mean over g of S_g[i] = exp(scale q_g . C_i + v_g[i]) / Z_g (v: the variance
    term, :func:`variance_term`), 0 for empty clusters. Z_g is sum_j N_j exp(scale q_g . C_j) unless log_norm [G]
    (log Z_g) is given (the two-level lookup)."""
    if group not in GROUP_RULES:
        raise ValueError(f"group must be one of {GROUP_RULES}, got {group!r}")
    if not (math.isfinite(var_weight) and var_weight >= 0.0):
        raise ValueError(f"var_weight must be finite and >= 0, got {var_weight!r}")
    q = np.asarray(q, dtype=np.float64)
    c = np.asarray(centroids, dtype=np.float64)
    n = np.asarray(sizes, dtype=np.float64)
    z = scale * (q @ c.T)  # [G, n]
    live = n > 0
    if log_norm is None:
        log_norm = _log_normaliser(z, n)
    rule = z + variance_term(q, variances, scale, var_weight)
    s = np.where(live, np.exp(rule - np.asarray(log_norm)[:, None]), 0.0)
    return s.max(axis=0) if group == "max" else s.mean(axis=0)


def _kept(s: F64, live: NDArray[np.bool_], threshold: float) -> NDArray[np.bool_]:
    """Clusters with score >= threshold, plus the best live one (ties: lower index)."""
    kept = live & (s >= threshold)
    if live.any():
        kept[int(np.argmax(np.where(live, s, -np.inf)))] = True
    return kept


def keep_budget(keep: float, n_clustered: float) -> int:
    """B = max(1, ceil(keep * N)) with keep * N a float32 product (as the kernels compute it)."""
    return max(1, int(math.ceil(float(np.float32(keep) * np.float32(n_clustered)))))


def kept_by_budget(s: ArrayLike, scored: ArrayLike, sizes: ArrayLike, budget: float) -> NDArray[np.bool_]:
    """The budget rule: the scored clusters in order of s (larger first, equal scores by lower index), each kept while
    the sizes of those before it sum to less than `budget` (the first always)."""
    s = np.asarray(s, dtype=np.float64)
    n = np.asarray(sizes, dtype=np.float64)
    idx = np.flatnonzero(np.asarray(scored, dtype=bool))
    order = idx[np.lexsort((idx, -s[idx]))]
    before = np.cumsum(n[order]) - n[order]
    kept = np.zeros(s.shape[0], dtype=bool)
    kept[order[before < budget]] = True
    return kept


def fine_scores(qg: ArrayLike, cent: ArrayLike, sizes: ArrayLike, var: ArrayLike | None, scale: float, group: str,
                coarse: tuple[ArrayLike, ...] | None, threshold_coarse: float,
                var_weight: float) -> tuple[F64, NDArray[np.bool_]]:
    """The fine group scores [n_cent] of one group's queries qg [G, d] and which clusters are scored: the live ones,
    with two levels (coarse = (centroids, sizes, parent, variances or None) of this KV head) those under kept coarse
    clusters, scored against the coarse normaliser."""
    qg, cent, sizes = (np.asarray(x, dtype=np.float64) for x in (qg, cent, sizes))
    if coarse is None:
        return group_scores(qg, cent, sizes, scale, group, None, var, var_weight), sizes > 0
    c_cent, c_sizes, parent, c_var = coarse
    c_cent, c_sizes = np.asarray(c_cent, dtype=np.float64), np.asarray(c_sizes, dtype=np.float64)
    log_z = _log_normaliser(scale * (qg @ c_cent.T), c_sizes)
    kept_c = _kept(group_scores(qg, c_cent, c_sizes, scale, group, log_z, c_var, var_weight), c_sizes > 0,
                   threshold_coarse)
    scored = (sizes > 0) & kept_c[np.asarray(parent, dtype=np.int64)]
    return group_scores(qg, cent, sizes, scale, group, log_z, var, var_weight), scored


def _kept_clusters(qg: F64, cent: F64, sizes: F64, var: F64 | None, scale: float, keep: float, group: str,
                   coarse: tuple[F64, F64, I64, F64 | None] | None, threshold_coarse: float,
                   var_weight: float) -> NDArray[np.bool_]:
    """Kept fine clusters of one group's queries qg [G, d] (one or two levels)."""
    s, scored = fine_scores(qg, cent, sizes, var, scale, group, coarse, threshold_coarse, var_weight)
    return kept_by_budget(s, scored, sizes, keep_budget(keep, sizes.sum()))


def _check_inputs(q: F64, k: F64, v: F64, centroids: F64, sizes: F64, cell_cluster: I64, variances: F64 | None,
                  var_weight: float) -> None:
    for name, arr in (("q", q), ("k", k), ("v", v), ("centroids", centroids)):
        if arr.ndim != 3:
            raise ValueError(f"{name} must be 3-D, got shape {arr.shape}")
    n_head, _, d = q.shape
    n_head_kv, n_kv, _ = k.shape
    if k.shape[2] != d or v.shape[:2] != (n_head_kv, n_kv) or n_head % n_head_kv != 0:
        raise ValueError(f"inconsistent shapes: q {q.shape}, k {k.shape}, v {v.shape}")
    if centroids.shape[0] != n_head_kv or centroids.shape[2] != d:
        raise ValueError(f"centroids must be [n_head_kv, n_cent, d] = [{n_head_kv}, n_cent, {d}], got {centroids.shape}")
    if sizes.shape != centroids.shape[:2] or (sizes < 0).any():
        raise ValueError(f"sizes must be [n_head_kv, n_cent] = {centroids.shape[:2]} and >= 0, got {sizes.shape}")
    if cell_cluster.shape != (n_head_kv, n_kv):
        raise ValueError(f"cell_cluster must be [n_head_kv, n_kv] = [{n_head_kv}, {n_kv}], got {cell_cluster.shape}")
    if ((cell_cluster < -1) | (cell_cluster >= centroids.shape[1])).any():
        raise ValueError("cell_cluster entries must be -1 (not clustered) or a cluster index < n_cent")
    if not (math.isfinite(var_weight) and var_weight >= 0.0):
        raise ValueError(f"var_weight must be finite and >= 0, got {var_weight!r}")
    if var_weight > 0.0 and variances is None:
        raise ValueError("var_weight > 0 needs the clusters' variances")
    if variances is not None and (variances.shape != centroids.shape or (variances < 0).any()):
        raise ValueError(f"variances must be [n_head_kv, n_cent, d] = {centroids.shape} and >= 0, got {variances.shape}")


def centroid_attn(q: ArrayLike, k: ArrayLike, v: ArrayLike, centroids: ArrayLike, sizes: ArrayLike,
                  cell_cluster: ArrayLike, keep: float, mask: ArrayLike | None = None, *,
                  scale: float | None = None, softcap: float = 0.0, group: str = "max",
                  coarse: tuple[ArrayLike, ...] | None = None, threshold_coarse: float = 0.0,
                  variances: ArrayLike | None = None, var_weight: float = 0.0,
                  return_selection: bool = False) -> F64 | tuple[F64, list[list[I64]]]:
    """Centroid-sparse attention in float64 (the oracle; semantics in the module doc).

    q [n_head, n_q, d]; k [n_head_kv, n_kv, d]; v [n_head_kv, n_kv, d_v]; centroids [n_head_kv, n_cent, d];
    sizes [n_head_kv, n_cent]; cell_cluster [n_head_kv, n_kv] (-1: not clustered); mask [n_q, n_kv] boolean
    (True = visible) or None. coarse = (centroids [n_head_kv, n_coarse, d], sizes [n_head_kv,
    n_coarse], parent [n_head_kv, n_cent][, variances [n_head_kv, n_coarse, d]]) for the two-level lookup.
    variances [n_head_kv, n_cent, d] and var_weight: the variance term of the scores (module doc). Returns out
    [n_head, n_q, d_v] and, with return_selection, the selected cells per KV head and row.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    cent = np.asarray(centroids, dtype=np.float64)
    n_cl = np.asarray(sizes, dtype=np.float64)
    cc = np.asarray(cell_cluster, dtype=np.int64)
    var = None if variances is None else np.asarray(variances, dtype=np.float64)
    _check_inputs(q, k, v, cent, n_cl, cc, var, var_weight)
    if coarse is not None and var_weight > 0.0 and (len(coarse) < 4 or coarse[3] is None):
        raise ValueError("var_weight > 0 with two levels needs the coarse variances (coarse[3])")
    if group not in GROUP_RULES:
        raise ValueError(f"group must be one of {GROUP_RULES}, got {group!r}")
    if not math.isfinite(keep) or not math.isfinite(threshold_coarse):
        raise ValueError("keep and threshold_coarse must be finite")
    n_head, n_q, d = q.shape
    n_head_kv, n_kv, _ = k.shape
    G = n_head // n_head_kv
    sigma = 1.0 / math.sqrt(d) if scale is None else float(scale)
    vis = _check_mask(mask, n_q, n_kv)
    out = np.zeros((n_head, n_q, v.shape[2]))
    selection: list[list[I64]] = []
    for h in range(n_head_kv):
        lv = None
        if coarse is not None:
            c_cent, c_sizes, parent = (np.asarray(x) for x in coarse[:3])
            c_var = np.asarray(coarse[3], dtype=np.float64)[h] if len(coarse) > 3 and coarse[3] is not None else None
            lv = (c_cent[h].astype(np.float64), c_sizes[h].astype(np.float64), parent[h].astype(np.int64), c_var)
        rows = []
        for t in range(n_q):
            qg = q[h*G:(h + 1)*G, t]
            kept = _kept_clusters(qg, cent[h], n_cl[h], None if var is None else var[h], sigma, keep, group, lv,
                                  threshold_coarse, var_weight)
            in_kept = np.where(cc[h] >= 0, kept[np.maximum(cc[h], 0)], True)
            cells = np.flatnonzero(vis[t] & in_kept).astype(np.int64)
            rows.append(cells)
            if cells.size == 0:
                continue
            logits = sigma * (qg @ k[h, cells].T)
            if softcap > 0.0:
                logits = softcap * np.tanh(logits / softcap)
            w = np.exp(logits - logits.max(axis=1, keepdims=True))
            out[h*G:(h + 1)*G, t] = (w / w.sum(axis=1, keepdims=True)) @ v[h, cells]
        selection.append(rows)
    return (out, selection) if return_selection else out


def kept_fraction(scores: F64, sizes: ArrayLike, threshold: float) -> float:
    """Fraction of clustered keys a row keeps: sum of N_i over kept clusters (score >= threshold, plus the
    best one) / sum of N_i."""
    n = np.asarray(sizes, dtype=np.float64)
    kept = _kept(np.asarray(scores, dtype=np.float64), n > 0, threshold)
    return float(n[kept].sum() / n.sum())


def calibrate_threshold(rows: list[tuple[F64, ArrayLike]], keep: float) -> float:
    """The global threshold T at which the mean kept fraction over the calibration rows reaches ``keep``.

    rows: (group scores [n], sizes [n]) per calibration (layer, KV head, query row). Returns the largest T
    whose mean kept fraction is >= keep (0.0 when keep == 1: everything kept)."""
    if not isinstance(keep, (int, float)) or not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep!r}")
    if not rows:
        raise ValueError("no calibration rows")
    if keep == 1.0:
        return 0.0
    scores, weights, base = [], [], 0.0
    for s, n in rows:
        s = np.asarray(s, dtype=np.float64)
        n = np.asarray(n, dtype=np.float64)
        live = n > 0
        best = int(np.argmax(np.where(live, s, -np.inf)))
        frac = n / n.sum()
        base += frac[best]  # the best cluster is always kept
        others = live.copy()
        others[best] = False
        scores.append(s[others])
        weights.append(frac[others])
    s_all = np.concatenate(scores)
    w_all = np.concatenate(weights)
    order = np.argsort(-s_all, kind="stable")
    cum = (base + np.cumsum(w_all[order])) / len(rows)
    if base / len(rows) >= keep:
        return float(np.nextafter(s_all.max(), np.inf)) if s_all.size else 0.0
    at = int(np.searchsorted(cum, keep - 1e-12))
    return float(s_all[order[min(at, s_all.size - 1)]])
