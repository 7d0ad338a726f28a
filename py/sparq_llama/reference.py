"""Float64 numpy reference of the SparQ attention op: the oracle every CPU/CUDA kernel test compares against.

It implements, slowly and plainly, the semantics written down in docs/design.md, "SparQ: op semantics",
for one stream: per KV head h and query row t, with G the query heads that read h (GQA group),
sigma the kq scale (default 1/sqrt(d)) and V_t the visible cells of row t:

1. |V_t| <= k2: exact attention over V_t, no mean reallocation, whatever the policy.
2. ``policy="sparq"``: a = sum_g |q_g| (``select="q"``) or a_i = spread_i * sum_g |q_g,i| (``"qsigma"``,
   spread = the std of the visible keys per component); I1 = the k1 largest a (ties: lower component
   index); s_hat_g = q_g[I1] . Kx[V_t, I1] with Kx the index's keys (K in f16, or K^T in q8_0 blocks);
   p_hat_g = softmax_{V_t}(sigma * s_hat_g / sqrt(rho_g)) with rho_g = ||q_g[I1]||_1 / ||q_g||_1 (q) or
   sum_I1 (q_g,i spread_i)^2 / sum_i (q_g,i spread_i)^2 (qsigma).
   With the q4 index (``index="q4"``, k1 = d) every component is scored, rho_g = 1, and s_hat_g is the index's
   integer dot product computed in float32 exactly as the op computes it (`sparq_llama.index.q4_block_scores`).
3. I2 = last ``window`` visible cells  U  first ``sinks`` visible cells  U  top of sum_g p_hat_g over the
   rest, up to k2 cells in all; ties go to the lower cell index.
   ``policy="exact"`` ranks by the true probabilities instead (reads all of K: the FlexGen baseline);
   ``policy="window"`` keeps sinks + the most recent cells only (LM-Infinite).
4. y3_g = softmax_{I2}(sigma * q_g . K[I2], softcapped) . V[I2], optionally Sparse-V thresholded.
5. Mean-value reallocation: y_g = alpha_g * y3_g + (1 - alpha_g) * v_bar, alpha_g = sum_{I2} p_hat_g.

Choices this module makes where the design leaves room (kernels must match them):

* The logit soft-cap (``softcap > 0``: logit -> softcap * tanh(logit / softcap)) applies to the exact
  logits (step 4, the ``exact`` policy's ranking scores and the true probabilities used for alpha), but
  NOT to SparQ's approximate scores s_hat: those are a ranking proxy built from r of d components, and
  capping them would only compress the ranking signal.
* rho_g is taken as 1 when ||q_g[I1]||_1 == 0 (which includes q_g == 0): then s_hat_g is identically
  zero and p_hat_g is uniform over V_t for any temperature.
* The Sparse-V threshold theta (``sparse_v_thresh``) acts on the final softmax weights over the selected
  set, also when that set is all of V_t (step 1), so ``k2 >= n_kv`` with ``theta > 0`` is the pure
  Sparse-V baseline: weights < theta are dropped and the rest renormalised to sum 1; a weight equal to
  the row's maximum is always kept. The selection reported by ``return_selection`` is I2 before the
  threshold, and alpha (step 5) is computed over I2, not over the thresholded subset.
* A query row with no visible cell gets an all-zero output (and an empty selection).
"""
from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike, NDArray

# The transfer model and the enum names live in the numpy-free settings module (one implementation).
from .index import INDEXES, SELECTS, q4_block_scores, q4_index_quantize, q4_index_values, q4_scores, q8_index_values
from .sparq import MEAN_MODES, POLICIES, _as_int, check_q4_k1, transfer_ratio
from .sparq import _finite_float as _as_float

__all__ = ["MEAN_MODES", "POLICIES", "approx_top_cells", "dense_attn", "exact_top_cells", "sparq_attn",
           "transfer_ratio"]

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]


# ---------------------------------------------------------------------------------------------------
# Validation helpers


def _check_qkv(q: ArrayLike, k: ArrayLike, v: ArrayLike) -> tuple[F64, F64, F64]:
    """q, k, v as float64 arrays with consistent shapes (ValueError otherwise)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    for name, arr, layout in (("q", q, "[n_head, n_q, d]"), ("k", k, "[n_head_kv, n_kv, d]"),
                              ("v", v, "[n_head_kv, n_kv, d_v]")):
        if arr.ndim != 3:
            raise ValueError(f"{name} must be 3-D {layout}, got shape {arr.shape}")
    n_head, _, d = q.shape
    n_head_kv, n_kv, dk = k.shape
    if n_head < 1 or n_head_kv < 1 or d < 1:
        raise ValueError(f"need at least one head and d >= 1: q {q.shape}, k {k.shape}")
    if dk != d:
        raise ValueError(f"q and k must share the head dim d: q {q.shape} has d={d}, k {k.shape} has d={dk}")
    if v.shape[:2] != (n_head_kv, n_kv):
        raise ValueError(f"v must be [n_head_kv, n_kv, d_v] = [{n_head_kv}, {n_kv}, d_v] like k, got {v.shape}")
    if n_head % n_head_kv != 0:
        raise ValueError(f"n_head ({n_head}) must be a multiple of n_head_kv ({n_head_kv}): query head i "
                         f"reads KV head i // (n_head // n_head_kv)")
    return q, k, v


def _check_mask(mask: ArrayLike | None, n_q: int, n_kv: int) -> NDArray[np.bool_]:
    """The boolean visibility mask [n_q, n_kv] (all True when None)."""
    if mask is None:
        return np.ones((n_q, n_kv), dtype=bool)
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise ValueError(f"mask must be boolean (True = visible), got dtype {m.dtype}; for an additive "
                         f"llama.cpp-style mask (0 / -inf) pass `mask == 0`")
    if m.shape != (n_q, n_kv):
        raise ValueError(f"mask must have shape [n_q, n_kv] = [{n_q}, {n_kv}], got {m.shape}")
    return m


def _check_scale_softcap(scale: float | None, softcap: float, d: int) -> tuple[float, float]:
    if scale is None:
        sigma = 1.0 / math.sqrt(d)
    else:
        sigma = _as_float("scale", scale)
        if sigma <= 0:
            raise ValueError(f"scale must be > 0 (usually 1/sqrt(d)), got {scale!r}")
    cap = _as_float("softcap", softcap)
    if cap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap!r}")
    return sigma, cap


# ---------------------------------------------------------------------------------------------------
# Numeric building blocks


def _softmax(x: F64) -> F64:
    """Softmax along the last axis (max-subtracted)."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _cap(logits: F64, softcap: float) -> F64:
    """Logit soft-cap: softcap * tanh(logits / softcap); identity when softcap == 0."""
    return softcap * np.tanh(logits / softcap) if softcap > 0 else logits


def _exact_logits(qg: F64, kt: F64, sigma: float, softcap: float) -> F64:
    """Exact (soft-capped) logits [G, n] of queries qg [G, d] against keys kt [n, d]."""
    return _cap(sigma * (qg @ kt.T), softcap)


def _sparse_v(w: F64, theta: float) -> F64:
    """Sparse-V: drop weights < theta per row (keeping at least the row max) and renormalise."""
    if theta <= 0:
        return w
    keep = w >= np.minimum(theta, w.max(axis=-1, keepdims=True))
    w = np.where(keep, w, 0.0)
    return w / w.sum(axis=-1, keepdims=True)


def _top_components(a: F64, k1: int) -> I64:
    """Indices of the k1 largest entries of a (ties -> lower index), in ascending index order."""
    order = np.argsort(-a, kind="stable")
    return np.sort(order[:k1])


def _top_cells(score: F64, cells: I64, m: int) -> I64:
    """The m cells of `cells` (ascending) with the largest score, ties -> lower cell index."""
    if m <= 0:
        return cells[:0]
    order = np.lexsort((cells, -score))  # primary: -score, secondary: cell index
    return cells[order[:m]]


def _approx_logits(qg: F64, kt: F64, i1: I64, sigma: float, spread: F64 | None = None) -> F64:
    """The logits [G, n] SparQ's p_hat softmaxes over the index keys kt [n, d] (no softcap): sigma s_hat / sqrt(rho).
    rho, the temperature's share, is that of |q_g| on I1 (select q), or with the keys' spread [d] of the score's
    variance, sum_I1 (q_g,i spread_i)^2 / sum_i (q_g,i spread_i)^2 (select qsigma)."""
    s_hat = qg[:, i1] @ kt[:, i1].T
    return sigma * s_hat / np.sqrt(_rho(qg, i1, spread))[:, None]


def _rho(qg: F64, i1: I64, spread: F64 | None = None) -> F64:
    """Per head the temperature's share rho [G] that _approx_logits divides by the square root of."""
    weight = np.abs(qg) if spread is None else (qg * spread) ** 2
    full = weight.sum(axis=1)
    part = weight[:, i1].sum(axis=1)
    rho = np.divide(part, full, out=np.ones_like(full), where=full > 0)
    return np.where(rho > 0, rho, 1.0)  # s_hat's spread is 0 there: p_hat uniform for any temperature


def _approx_probs(qg: F64, kt: F64, i1: I64, sigma: float, spread: F64 | None = None) -> F64:
    """SparQ's approximate probabilities p_hat [G, n] over the index keys kt [n, d]: the softmax of _approx_logits."""
    return _softmax(_approx_logits(qg, kt, i1, sigma, spread))


def _index_keys(keys: F64, index: str | None) -> F64:
    """The keys [n, d] as the index holds them: rounded to f16, K^T in q8_0 blocks of 32 cells, in the q4 index's
    blocks (read back: its scores are not products with these, see `_q4_logits`), or (None: no index, the scores
    gather from K) the keys themselves."""
    if index is None:
        return keys
    if index == "q4":
        return q4_index_values(keys)
    return q8_index_values(keys) if index == "q8" else keys.astype(np.float16).astype(np.float64)


def _q4_logits(scores: NDArray[np.float32], sigma: float) -> F64:
    """The logits [G, n] SparQ's p_hat softmaxes over with the q4 index: sigma * s_hat from its float32 scores
    [G, n] (every component scored: rho = 1)."""
    return sigma * scores.astype(np.float64)


def _check_q4(k1: int, d: int) -> None:
    """ValueError unless the q4 index can score head dim d at this k1 (k1 = d, d a multiple of 8)."""
    check_q4_k1(k1, d)
    if d % 8 != 0:
        raise ValueError(f"the q4 index packs 8 key components a word: the head dim must be a multiple of 8, got {d}")


def _components(qg: F64, keys: F64, k1: int, select: str) -> tuple[I64, F64 | None]:
    """I1 for one group [G, d] over its visible keys [n, d], and the keys' spread (std per component) for qsigma."""
    weight = np.abs(qg).sum(axis=0)
    spread = None
    if select == "qsigma":
        spread = keys.std(axis=0)
        weight = weight * spread
    return _top_components(weight, k1), spread


def _select(policy: str, vis: I64, rank_score: F64 | None, k2: int, window: int, sinks: int,
            pos: I64 | None = None) -> I64:
    """I2 (sorted cell indices) for one group and row with |vis| > k2.

    `rank_score` is the group-summed probability over `vis` (unused for the window policy). Sinks and
    window are the visible cells of smallest / largest (position, cell); no `pos`: cell order."""
    by_pos = vis if pos is None else vis[np.lexsort((vis, pos[vis]))]
    sink_cells = by_pos[:sinks]
    if policy == "window":
        recent = by_pos[len(by_pos) - (k2 - sinks):] if k2 > sinks else by_pos[:0]
        return np.union1d(sink_cells, recent)
    forced = np.union1d(sink_cells, by_pos[len(by_pos) - window:] if window > 0 else by_pos[:0])
    rest = ~np.isin(vis, forced)
    assert rank_score is not None
    chosen = _top_cells(rank_score[rest], vis[rest], k2 - len(forced))
    return np.union1d(forced, chosen)


# ---------------------------------------------------------------------------------------------------
# Public API


def dense_attn(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
               scale: float | None = None, softcap: float = 0.0) -> F64:
    """Plain float64 attention, softmax(cap(scale * q.K)) . V over each row's visible cells.

    Shapes: q [n_head, n_q, d], k [n_head_kv, n_kv, d], v [n_head_kv, n_kv, d_v], mask [n_q, n_kv] bool
    (True = visible) or None. Query head i reads KV head i // (n_head // n_head_kv). Returns
    [n_head, n_q, d_v]; a row with no visible cell is all zeros.
    """
    q, k, v = _check_qkv(q, k, v)
    n_head, n_q, d = q.shape
    n_head_kv, n_kv, d_v = v.shape
    m = _check_mask(mask, n_q, n_kv)
    sigma, cap = _check_scale_softcap(scale, softcap, d)
    group = n_head // n_head_kv

    kv_of_head = np.arange(n_head) // group
    logits = _cap(sigma * np.einsum("hqd,hkd->hqk", q, k[kv_of_head]), cap)
    logits = np.where(m[None], logits, -np.inf)
    out = np.zeros((n_head, n_q, d_v))
    rows = m.any(axis=1)
    if rows.any():
        w = _softmax(logits[:, rows])
        out[:, rows] = np.einsum("hqk,hkv->hqv", w, v[kv_of_head])
    return out


def sparq_attn(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None, *,
               k1: int, k2: int, window: int | None = None, sinks: int = 0, mean: str = "auto",
               scale: float | None = None, softcap: float = 0.0, policy: str = "sparq",
               sparse_v_thresh: float = 0.0, pos: ArrayLike | None = None, return_selection: bool = False,
               select: str = "q", index: str | None = None) -> F64 | tuple[F64, list[list[I64]]]:
    """SparQ attention in float64 (the oracle), with the `exact` and `window` selection policies.

    Shapes as in `dense_attn`. Parameters:
      k1: r, the number of query components used for the approximate scores (1..d).
      k2: k, the number of cells kept per KV head and query row (>= 1).
      window: the last `window` visible cells are always kept (default k2 // 4).
      sinks: the first `sinks` visible cells are always kept (default 0). window + sinks <= k2.
      mean: "on" / "off" / "auto" mean-value reallocation; auto = on iff n_head == n_head_kv (MHA).
      scale: sigma, the kq scale (default 1/sqrt(d)).
      softcap: logit soft-cap of the exact logits (0 = off); never applied to the approximate scores.
      policy: "sparq" (approximate scores), "exact" (true probabilities: reads all of K), "window"
        (sinks + the k2 - sinks most recent visible cells; `window` is then only validated).
        alpha for mean reallocation sums p_hat over I2 for "sparq", the true p for the others.
      sparse_v_thresh: theta in [0, 1); drop final weights < theta and renormalise (see module doc).
      pos: [n_kv] integer position of each cell; sinks and window are then the visible cells with the
        smallest / largest positions (ties: lower / higher cell), as in a KV cache whose holes were refilled.
        None: cell order is position order.
      return_selection: also return I2 as sorted int64 arrays, indexed [kv_head][query_row].
      select: "q" (I1 = top-k1 of sum_g |q_g|, the paper) or "qsigma" (of sigma_i * sum_g |q_g,i|, sigma the std
        of the row's visible keys per component; rho becomes the share of the score's variance).
      index: what the approximate scores read: "f16" (the keys rounded to f16), "q8" (each component row of K^T,
        over all n_kv cells, in q8_0 blocks of 32 cells: `sparq_llama.index.q8_index_values`), "q4" (every
        component of the keys, blocks of 32 of the n_kv cells, scored by int8 query coefficients against 4-bit
        keys in float32 as the op does: `sparq_llama.index.q4_block_scores` of q rounded to f32; k1 must be d,
        select and rho play no part), or None (no index: the scores read K itself, as the op's default layout
        does).

    Rows are independent; a row with at most k2 visible cells gets exact attention over them (no mean
    reallocation), and a row with none gets zeros. Returns [n_head, n_q, d_v] (and the selection).
    """
    q, k, v = _check_qkv(q, k, v)
    n_head, n_q, d = q.shape
    n_head_kv, n_kv, d_v = v.shape
    m = _check_mask(mask, n_q, n_kv)
    sigma, cap = _check_scale_softcap(scale, softcap, d)

    k1 = _as_int("k1", k1)
    k2 = _as_int("k2", k2)
    if not 1 <= k1 <= d:
        raise ValueError(f"k1 (r, query components) must be in 1..d = 1..{d}, got {k1}")
    if k2 < 1:
        raise ValueError(f"k2 (k, cells kept) must be >= 1, got {k2}")
    window = k2 // 4 if window is None else _as_int("window", window)
    sinks = _as_int("sinks", sinks)
    if window < 0 or sinks < 0:
        raise ValueError(f"window and sinks must be >= 0, got window={window}, sinks={sinks}")
    if window + sinks > k2:
        raise ValueError(f"window + sinks ({window} + {sinks}) must be <= k2 ({k2}): they are part of the "
                         f"k2 kept cells")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if mean not in MEAN_MODES:
        raise ValueError(f"mean must be one of {MEAN_MODES}, got {mean!r}")
    if select not in SELECTS:
        raise ValueError(f"select must be one of {SELECTS}, got {select!r}")
    if index is not None and index not in INDEXES:
        raise ValueError(f"index must be one of {INDEXES} or None, got {index!r}")
    if index == "q4":
        _check_q4(k1, d)
    theta = _as_float("sparse_v_thresh", sparse_v_thresh)
    if not 0 <= theta < 1:
        raise ValueError(f"sparse_v_thresh must be in [0, 1) (0 disables Sparse-V), got {sparse_v_thresh!r}")
    use_mean = mean == "on" or (mean == "auto" and n_head == n_head_kv)
    cell_pos = None
    if pos is not None:
        cell_pos = np.asarray(pos)
        if cell_pos.shape != (n_kv,) or not np.issubdtype(cell_pos.dtype, np.integer):
            raise ValueError(f"pos must be [n_kv={n_kv}] integers, got {cell_pos.shape} {cell_pos.dtype}")
        cell_pos = cell_pos.astype(np.int64)

    group = n_head // n_head_kv
    # the index over all n_kv cells of each KV head, as the op's holds it: the q4 blocks, or the keys it reads back
    q4_blocks = q4_index_quantize(k) if index == "q4" else None
    k_index = None if index == "q4" else np.stack([_index_keys(k[h], index) for h in range(n_head_kv)])
    out = np.zeros((n_head, n_q, d_v))
    selection: list[list[I64]] = [[np.zeros(0, dtype=np.int64) for _ in range(n_q)] for _ in range(n_head_kv)]

    for h in range(n_head_kv):
        heads = slice(h * group, (h + 1) * group)
        for t in range(n_q):
            vis = np.flatnonzero(m[t]).astype(np.int64)
            if len(vis) == 0:
                continue
            qg = q[heads, t]                       # [G, d]
            k_vis, v_vis = k[h, vis], v[h, vis]   # [n_vis, d], [n_vis, d_v]

            if len(vis) <= k2:                     # step 1: exact attention over V_t
                w = _sparse_v(_softmax(_exact_logits(qg, k_vis, sigma, cap)), theta)
                out[heads, t] = w @ v_vis
                selection[h][t] = vis
                continue

            if policy == "sparq" and q4_blocks is not None:
                scores = q4_block_scores(qg, q4_blocks[0][h], q4_blocks[1][h])[:, vis]
                p_alpha = _softmax(_q4_logits(scores, sigma))                  # p_hat over V_t
            elif policy == "sparq":
                i1, spread = _components(qg, k_vis, k1, select)
                p_alpha = _approx_probs(qg, k_index[h, vis], i1, sigma, spread)  # p_hat over V_t
            else:
                p_alpha = _softmax(_exact_logits(qg, k_vis, sigma, cap))  # true p over V_t
            i2 = _select(policy, vis, p_alpha.sum(axis=0), k2, window, sinks, cell_pos)
            pos = np.searchsorted(vis, i2)                                # positions of I2 in vis

            w = _sparse_v(_softmax(_exact_logits(qg, k_vis[pos], sigma, cap)), theta)
            y3 = w @ v_vis[pos]                                           # [G, d_v]
            if use_mean:
                alpha = p_alpha[:, pos].sum(axis=1, keepdims=True)
                y3 = alpha * y3 + (1.0 - alpha) * v_vis.mean(axis=0)
            out[heads, t] = y3
            selection[h][t] = i2

    return (out, selection) if return_selection else out


def exact_top_cells(q_group: ArrayLike, keys: ArrayLike, k2: int, *, scale: float) -> I64:
    """The k2 cells of keys [n, d] with the largest true probability summed over one GQA group's queries
    q_group [G, d] (ties: the lower cell), in rank order: the ``exact`` policy's ranking, no window or sinks."""
    qg = np.asarray(q_group, dtype=np.float64)
    kt = np.asarray(keys, dtype=np.float64)
    score = _softmax(_exact_logits(qg, kt, scale, 0.0)).sum(axis=0)
    return _top_cells(score, np.arange(kt.shape[0], dtype=np.int64), k2)


def approx_top_cells(q_group: ArrayLike, keys: ArrayLike, k1: int, k2: int, *, scale: float, select: str = "q",
                     index: str | None = None) -> I64:
    """The k2 cells of keys [n, d] with the largest approximate probability p_hat (from the k1 components chosen by
    `select`, scored from `index`'s keys) summed over the group's queries q_group [G, d] (ties: the lower cell), in
    rank order: SparQ's ranking (step 2 and the scored part of step 3 of the module doc), no window or sinks.
    With index "q4" k1 must be d: the keys (their blocks of 32 from cell 0) scored as `sparq_attn` does."""
    qg = np.asarray(q_group, dtype=np.float64)
    kt = np.asarray(keys, dtype=np.float64)
    if select not in SELECTS or (index is not None and index not in INDEXES):
        raise ValueError(f"select must be one of {SELECTS} and index one of {INDEXES} or None, got {select!r}, "
                         f"{index!r}")
    if index == "q4":
        _check_q4(_as_int("k1", k1), kt.shape[1])
        probs = _softmax(_q4_logits(q4_scores(qg, kt), scale))
        return _top_cells(probs.sum(axis=0), np.arange(kt.shape[0], dtype=np.int64), k2)
    i1, spread = _components(qg, kt, k1, select)
    k_index = _index_keys(kt, index)
    probs = _approx_probs(qg, k_index, i1, scale, spread)
    return _top_cells(probs.sum(axis=0), np.arange(kt.shape[0], dtype=np.int64), k2)
