// Kernel BS of the CUDA SparQ op: the selection of I2 for most rows, one block per row, scoring only the cells that
// per-block bounds cannot rule out (included by sparq-attn.cu only; the op's files: sparq-attn-common.cuh).
// docs/design.md, "CUDA kernels".
#pragma once

#include "sparq-attn-select.cuh"

namespace {

// Kernel A writes, per row, head and block of A_CELLS cells (one thread's cells), the largest logit m_g(b) of the
// block's visible cells. After the chunk statistics are merged, each block bounds the group scores of its cells:
//   U(b) = sum_g exp(m_g(b) - M_g) / Z_g >= s(j) for every cell j of b (the score's own formula, monotone in each
//          logit), and
//   L(b) = max_g exp(m_g(b) - M_g) / Z_g <= s(j*) for the cell j* of b that holds that head's maximum.
// The L(b) of n_top distinct blocks name n_top distinct candidates scoring at least their minimum, so the lower edge T
// of the histogram bin (11 bits of the float) that holds the n_top-th largest L(b) is at most the n_top-th best score:
// a block with U(b) < T holds no selected cell. Blocks that may hold window or sink cells (by their cells' positions,
// where kernel A's chunk range reaches them) give no L(b) and are always kept. Then, for the kept blocks' cells only:
// visibility, forced cells, group scores and keys into shared memory; the exact top n_top by (score, cell) among the
// candidates scoring T or more (one bucket pass and the boundary bucket ranked pairwise, as kernel S's list path);
// I2 in cell order; alpha_g. A study on captured queries and keys (bench/block_bound.py, blocks of 8 cells) keeps
// ~12 n_top cells of a row from 8k to 28k cells.
// The kept cells' keys live in shared memory where they fit (BS_CAP cells), else in this row's scratch: flat rows (a
// model's first layers, random tests) keep most blocks and take the same path, slower. Dense rows list their visible
// cells; rows whose positions make the window or the sinks inexact take kernel S's exact selection over every cell in
// this block (slower, the same result).
constexpr int BS_THREADS = 512;
constexpr int BS_CAP     = 8192;               // kept cells whose keys shared memory holds
constexpr uint32_t BS_FORCED = 0xFFFFFFFFu;    // a forced cell's key (score keys are below 2^31)
constexpr int BS_BINS    = 1024;               // L(b) histogram: its float's bits 29..20 (L(b) <= 1)
constexpr int BS_BIN_SHIFT = 20;
constexpr int64_t BS_MAX_KV = 131072;          // U(b) of every block in shared memory
constexpr int BS_HIST_WORDS = 256 * (BS_THREADS / WARP_SIZE + 1);  // block_select's per-warp histograms
static_assert(BS_BINS == 2*BS_THREADS, "two histogram bins per thread");
static_assert(BS_HIST_WORDS >= BS_BINS && BS_HIST_WORDS >= BUCKETS_PER_THREAD*BS_THREADS,
              "the bound's histogram and bucket_find's share block_select's words");
static_assert(A_CHUNK % A_CELLS == 0 && BS_CAP % A_CELLS == 0, "kept items are whole blocks");
static_assert(A_CELLS == 8, "a block's cells are one thread's of kernel A, and the kept list is indexed by i / 8");
// T is lowered by this factor before the comparison: __expf is an approximation whose monotonicity is not
// documented, and U(b) and s(j) take different logits through it (relative error ~2^-21 per term).
constexpr float BS_T_MARGIN = 1.0f - 1.0f/1024;

constexpr int BS_BATCH = 4;  // blocks or cells of a thread whose loads are in flight together, per head
constexpr int BS_HEADS = 4;  // heads whose block maxima are loaded together (the bounds)

// U(b) and L(b) of the blocks b0 + u*BS_THREADS (u < BS_BATCH; those past n_bb are not read), the terms in
// group_scores' order and formula
__device__ __forceinline__ void bs_bounds(const float * bmax, int64_t n_bb_a, int64_t n_bb, int64_t G, const float * rst,
                                          int64_t b0, float (&up)[BS_BATCH], float (&lo)[BS_BATCH]) {
#pragma unroll
    for (int u = 0; u < BS_BATCH; ++u) {
        up[u] = 0.0f;
        lo[u] = 0.0f;
    }
    for (int64_t g0 = 0; g0 < G; g0 += BS_HEADS) {
        float x[BS_HEADS][BS_BATCH];
#pragma unroll
        for (int h = 0; h < BS_HEADS; ++h) {
#pragma unroll
            for (int u = 0; u < BS_BATCH; ++u) {
                const int64_t b = b0 + u*BS_THREADS;
                x[h][u] = g0 + h < G && b < n_bb ? bmax[(g0 + h)*n_bb_a + b] : -INFINITY;
            }
        }
#pragma unroll
        for (int h = 0; h < BS_HEADS; ++h) {
            if (g0 + h < G) {
#pragma unroll
                for (int u = 0; u < BS_BATCH; ++u) {
                    const float t = __expf(x[h][u] - rst[g0 + h]) * rst[G + g0 + h];
                    up[u] += t;
                    lo[u] = fmaxf(lo[u], t);
                }
            }
        }
    }
}

// Blocks of A_CELLS cells per row in kernel A's output (every chunk's threads), and in the row
__host__ __device__ inline int64_t bs_blocks_a(int64_t n_chunks_a) { return n_chunks_a*A_THREADS; }
__host__ __device__ inline int64_t bs_blocks(int64_t n_kv) { return (n_kv + A_CELLS - 1) / A_CELLS; }
// Dynamic shared memory: U(b) per block, then the kept cells' keys and the kept blocks (where they fit)
__host__ __device__ inline size_t bs_smem(int64_t n_kv) {
    return sizeof(float)*bs_blocks(n_kv) + sizeof(uint32_t)*BS_CAP + sizeof(int32_t)*(BS_CAP / A_CELLS);
}

__global__ void __launch_bounds__(BS_THREADS) sparq_bound_select(const sparq_args a, const sparq_scratch s, int64_t r0) {
    extern __shared__ __align__(16) unsigned char smb[];
    __shared__ uint32_t hist[BS_HIST_WORDS];
    __shared__ select_state sst;
    __shared__ float rst[2*MAX_G];
    __shared__ int64_t redl[96];
    __shared__ int red[32];
    __shared__ uint32_t redu[32];
    __shared__ int bin_found;
    __shared__ bool pos_chunk[BS_MAX_KV / A_CHUNK];  // kernel A's chunks whose cells may be window or sink cells
    __shared__ bucket_state bst;
    __shared__ uint64_t bnd[BND_CAP];  // the boundary bucket's candidate keys
    __shared__ uint32_t n_bnd;
    __shared__ uint64_t thr_k;
    SPARQ_TIMING_MARKS(8);
    SPARQ_TL_SCOPE(TL_BS);
    pdl_wait();
    SPARQ_TL_WAITED();
    SPARQ_TIMING_MARK(0);
    const int64_t w = blockIdx.x;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t G = a.group, n_kv = a.n_kv, k2 = a.p.k2;
    const int tid = threadIdx.x;
    const int64_t n_bb = bs_blocks(n_kv), n_bb_a = bs_blocks_a(a.n_chunks_a);
    float    * ub     = (float *) smb;                   // [n_bb] U(b), +inf for blocks that may hold forced cells
    uint32_t * keys_s = (uint32_t *) (ub + n_bb);        // [BS_CAP] a kept cell's key: 0 not a candidate, BS_FORCED
    int32_t  * kb_s   = (int32_t *) (keys_s + BS_CAP);   // [BS_CAP / A_CELLS] the kept blocks, ascending
    const float * lrow = s.logits + w*G*n_kv;
    const uint16_t * m = mask_row(a, c);
    const int32_t * pr = pos_row(a, c);
    int64_t * ri = s.rinfo + w*N_RI;
    int32_t * i2 = s.i2 + w*k2;

    const row_merge rm = merge_chunk_stats(a, s, w, rst, true, redl);
    const int64_t kind = rm.n_vis == 0 ? ROW_EMPTY : rm.n_vis <= k2 ? ROW_DENSE : ROW_SPARSE;
    const int64_t w_lo = rm.p_max - a.window, s_hi = rm.p_min + a.sinks;  // window: pos > w_lo; sinks: pos < s_hi
    if (tid == 0) {
        ri[RI_KIND] = kind;
        ri[RI_N_VIS] = rm.n_vis;
        ri[RI_W_LO] = w_lo;
        ri[RI_S_HI] = s_hi;
    }
    if (kind == ROW_EMPTY) {
        if (tid == 0) {
            ri[RI_N_SEL] = 0;
        }
        return;
    }
    uint32_t * bm = s.bitmap + w*a.n_words;
    if (kind == ROW_DENSE) {  // every visible cell
        for (int64_t i = tid; i < a.n_words; i += BS_THREADS) {
            bm[i] = 0;
        }
        __syncthreads();
        for (int64_t j = tid; j < n_kv; j += BS_THREADS) {
            if (visible(m, j)) {
                mark_cell(bm, j);
            }
        }
        __syncthreads();
        const int n = i2_from_bitmap(a, bm, i2, red);
        if (tid == 0) {
            ri[RI_N_SEL] = n;
        }
        return;
    }

    // 1. U(b) of every block, the histogram of L(b) over the blocks that cannot hold forced cells
    const uint32_t need = (uint32_t) a.n_top;
    for (int i = tid; i < BS_BINS; i += BS_THREADS) {
        hist[i] = 0;
    }
    for (int64_t ch = tid; ch < a.n_chunks_a; ch += BS_THREADS) {  // kernel A's chunks whose cells may be forced
        const int32_t * cv = s.cvis + (w*a.n_chunks_a + ch)*3;
        pos_chunk[ch] = cv[0] > 0 && ((int64_t) cv[2] > w_lo || (int64_t) cv[1] < s_hi);
    }
    if (tid == 0) {
        bin_found = -1;
    }
    __syncthreads();
    SPARQ_TIMING_MARK(1);
    const float * bmax = s.bmax + w*G*n_bb_a;
    for (int64_t b0 = tid; b0 < n_bb; b0 += BS_BATCH*BS_THREADS) {  // BS_BATCH blocks' maxima in flight per head
        float up[BS_BATCH], lo[BS_BATCH];
        bs_bounds(bmax, n_bb_a, n_bb, G, rst, b0, up, lo);
#pragma unroll
        for (int u = 0; u < BS_BATCH; ++u) {
            const int64_t b = b0 + u*BS_THREADS;
            if (b >= n_bb) {
                break;
            }
            bool fb = false;  // some cell's position is in the window or the sinks (its visibility aside)
            if (pos_chunk[b*A_CELLS / A_CHUNK]) {
                for (int e = 0; e < A_CELLS; ++e) {
                    const int64_t j = b*A_CELLS + e;
                    if (j < n_kv) {
                        const int64_t pj = position(pr, j);
                        fb |= pj > w_lo || pj < s_hi;
                    }
                }
            }
            ub[b] = fb ? INFINITY : up[u];
            if (!fb && need > 0) {
                atomicAdd(&hist[min(__float_as_uint(lo[u]) >> BS_BIN_SHIFT, (uint32_t) BS_BINS - 1)], 1u);
            }
        }
    }
    __syncthreads();
    SPARQ_TIMING_MARK(2);
    // the bin of the need-th largest L(b) (bins scanned from the top; thread t owns bins 2t' + 1 and 2t' of t' =
    // BS_THREADS - 1 - t)
    float thr_u = INFINITY;  // no top to find: only the blocks that may hold forced cells
    if (need > 0) {
        const int hi_bin = BS_BINS - 1 - 2*tid;
        const uint32_t c_hi = hist[hi_bin], c_lo = hist[hi_bin - 1];
        int total = 0;
        const uint32_t above = (uint32_t) block_exclusive_scan((int) (c_hi + c_lo), &total, red);
        if (above < need && above + c_hi + c_lo >= need) {
            bin_found = above + c_hi >= need ? hi_bin : hi_bin - 1;
        }
        __syncthreads();
        thr_u = bin_found < 0 ? 0.0f : __uint_as_float((uint32_t) bin_found << BS_BIN_SHIFT) * BS_T_MARGIN;
    }

    // 2. the kept blocks in order: warp v takes a segment of whole 32-block strips, counts its kept blocks by ballots,
    // then lists them after the warps before it
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    constexpr int n_warps = BS_THREADS / WARP_SIZE;
    const int64_t per_warp = (n_bb + n_warps*WARP_SIZE - 1) / (n_warps*WARP_SIZE) * WARP_SIZE;
    const int64_t wb0 = warp*per_warp, wb1 = min(n_bb, wb0 + per_warp);
    int n_kept_w = 0;
    for (int64_t b = wb0 + lane; b < wb0 + per_warp; b += WARP_SIZE) {
        n_kept_w += __popc(__ballot_sync(0xFFFFFFFF, b < wb1 && ub[b] >= thr_u));
    }
    if (lane == 0) {
        red[warp] = n_kept_w;
    }
    __syncthreads();
    int at_w = 0, n_kept = 0;
#pragma unroll
    for (int v = 0; v < n_warps; ++v) {
        at_w += v < warp ? red[v] : 0;
        n_kept += red[v];
    }
    const bool in_smem = n_kept*A_CELLS <= BS_CAP;
    uint32_t * keys = in_smem ? keys_s : s.bkeys + w*n_bb_a*A_CELLS;
    int32_t  * kb   = in_smem ? kb_s : s.bkept + w*n_bb_a;
    for (int64_t b = wb0 + lane; b < wb0 + per_warp; b += WARP_SIZE) {
        const bool keep = b < wb1 && ub[b] >= thr_u;
        const uint32_t ballot = __ballot_sync(0xFFFFFFFF, keep);
        if (keep) {
            kb[at_w + __popc(ballot & ((1u << lane) - 1))] = (int32_t) b;
        }
        at_w += __popc(ballot);
    }
    __syncthreads();  // also makes the scratch lists written by this block visible to it
    SPARQ_TIMING_MARK(3);

    // 3. the kept cells: visibility, forced cells, keys; the counts that decide whether the bound path is exact, and
    // the largest candidate key. At least need candidates score T or more, so only keys from k_lo count.
    const int n_items = n_kept*A_CELLS;
    const uint32_t k_lo = score_key(thr_u);
    int64_t counts = 0;  // forced window cells + (sink cells << 21) + (candidates from k_lo << 42)
    uint32_t k_max = 0;
    for (int i0 = tid; i0 < n_items; i0 += BS_BATCH*BS_THREADS) {  // BS_BATCH cells' logits in flight per head
        int64_t cells[BS_BATCH];
        bool in_row[BS_BATCH];
#pragma unroll
        for (int u = 0; u < BS_BATCH; ++u) {
            const int i = i0 + u*BS_THREADS;
            cells[u] = i < n_items ? (int64_t) kb[i / A_CELLS]*A_CELLS + i % A_CELLS : n_kv;
            in_row[u] = cells[u] < n_kv;
        }
        float score[BS_BATCH];  // every head's logits loaded whatever the cell's status; kept for candidates only
        group_scores(lrow, n_kv, G, rst, cells, in_row, score);
#pragma unroll
        for (int u = 0; u < BS_BATCH; ++u) {
            const int i = i0 + u*BS_THREADS;
            if (i >= n_items) {
                break;
            }
            const int64_t j = cells[u];
            const bool need_pos = ub[j / A_CELLS] == INFINITY;
            const bool vis = in_row[u] && (lrow[j] != -INFINITY || visible(m, j));  // kernel B's rule
            const int64_t pj = need_pos && vis ? position(pr, j) : 0;
            const bool in_w = need_pos && vis && pj > w_lo, in_s = need_pos && vis && pj < s_hi;
            const bool cand = need > 0 && vis && !in_w && !in_s;
            const uint32_t key = cand ? score_key(score[u]) : 0u;
            keys[i] = in_w || in_s ? BS_FORCED : key;
            k_max = max(k_max, key);
            counts += (int64_t) in_w + ((int64_t) in_s << 21) + ((int64_t) (cand && key >= k_lo) << 42);
        }
    }
    counts = block_reduce(counts, op_add(), (int64_t) 0, redl);
    k_max = block_reduce(k_max, op_max(), 0u, redu);
    const int64_t n_w = counts & 0x1FFFFF, n_s = (counts >> 21) & 0x1FFFFF, n_cand = counts >> 42;
    // kernel S's condition for its fast path (exactly the window and the sinks forced, and disjoint), and the top's
    // cells among the kept ones
    const bool exact_all = !(n_w == a.window && n_s == a.sinks && w_lo >= s_hi - 1) || n_cand < (int64_t) need;
    SPARQ_TIMING_MARK(4);
    if (exact_all) {
        select_sparse_row_exact(a, s, w, c, hist, &sst, i2, red, rst);
        return;
    }

    // 4. the exact top need of the candidates from k_lo by K = key << cell_bits | ~cell (equal scores to the lower
    // cell): one bucket pass, the boundary bucket's keys ranked pairwise (kernel S's list path), or the radix select
    // where that bucket is large
    const uint64_t cmask = (uint64_t(1) << a.cell_bits) - 1;
    auto cell_of = [&](int i) -> int64_t { return (int64_t) kb[i / A_CELLS]*A_CELLS + i % A_CELLS; };
    auto key32_of = [&](int64_t i) -> uint32_t {
        const uint32_t k = keys[i];
        return k >= k_lo && k != BS_FORCED ? k : 0u;
    };
    auto key_of = [&](int64_t i) -> uint64_t {
        const uint64_t k = key32_of(i);
        return k == 0 ? 0 : (k << a.cell_bits) | (cmask - (uint64_t) cell_of((int) i));
    };
    uint64_t thr = ~uint64_t(0);  // no top: forced cells only
    if (need > 0) {
        const int shift = bucket_shift(k_lo, k_max);
        const bucket_state bk = bucket_find(n_items, need, k_lo, shift, key32_of, hist, red, &bst);
        if (bk.count <= BND_CAP) {
            if (tid == 0) {
                n_bnd = 0;
            }
            __syncthreads();
            for (int i = tid; i < n_items; i += BS_THREADS) {
                const uint32_t k = key32_of(i);
                if (k != 0 && (k - k_lo) >> shift == bk.bin) {
                    bnd[atomicAdd(&n_bnd, 1u)] = key_of(i);
                }
            }
            __syncthreads();
            const uint32_t rank_thr = need - bk.above - 1;  // the boundary's keys are distinct
            for (uint32_t t = tid; t < bk.count; t += BS_THREADS) {
                uint32_t rk = 0;
                for (uint32_t u = 0; u < bk.count; ++u) {
                    rk += bnd[u] > bnd[t];
                }
                if (rk == rank_thr) {
                    thr_k = bnd[t];
                }
            }
            __syncthreads();
            thr = thr_k;
        } else {
            thr = block_select(n_items, need, top_shift_for(31 + a.cell_bits), key_of, hist, &sst);
        }
    }
    SPARQ_TIMING_MARK(5);

    // 5. I2 in cell order (the items are in cell order): thread t takes items [t*ipt, (t + 1)*ipt)
    const int ipt = (n_items + BS_THREADS - 1) / BS_THREADS, i0 = tid*ipt, i1 = min(n_items, i0 + ipt);
    int n_sel_t = 0;
    for (int i = i0; i < i1; ++i) {
        n_sel_t += keys[i] == BS_FORCED || key_of(i) >= thr;
    }
    int n_sel = 0;
    int at = block_exclusive_scan(n_sel_t, &n_sel, red);
    for (int i = i0; i < i1; ++i) {
        if (keys[i] == BS_FORCED || key_of(i) >= thr) {
            if (at < k2) {
                i2[at] = (int32_t) cell_of(i);
            }
            ++at;
        }
    }
    n_sel = (int) min((int64_t) n_sel, k2);
    finish_sparse_row(a, s, w, i2, n_sel, rst);
    SPARQ_TIMING_MARK(6);
#ifdef SPARQ_CUDA_INSTRUMENT
    if (a.timing && tid == 0 && w == 0) {
        printf("BS blocks %lld kept %d candidates %lld\n", (long long) n_bb, n_kept, (long long) n_cand);
    }
#endif
    SPARQ_TIMING_PRINT("BS: merge, bounds, T+kept blocks, keys, select, I2+alpha", w, 7);
}

}  // namespace
