// Kernels P, B and S of the CUDA SparQ op: the selection of I2 over many blocks, for any number of rows (included by
// sparq-attn.cu only; the op's files: sparq-attn-common.cuh).
//   P. prepare (one block per row): merges kernel A's chunk statistics (softmax normaliser, visible count, position
//      range), classifies the row (empty, dense, sparse) and sets a candidate threshold from a strided sample of the
//      group score, so that 4 to 8 times the cells to pick pass it;
//   B. sweep (grid: chunks of B_CHUNK cells x rows): marks the forced cells (window and sinks, or every visible cell
//      of a dense row) in a bitmap, lists the forced cells of sparse rows, and appends the cells whose group score
//      passes the threshold to the row's candidate list;
//   S. select (one block per row): the exact top n_top of the candidates by (score, cell), equal scores going to the
//      lower cell, I2 in cell order, alpha_g. Where the sample misleads (too few or too many candidates) or positions
//      are not distinct, an exact selection over all cells: slower, the same result.
// Also the selection helpers that kernel PBS (sparq-attn-select-cluster.cuh) shares. docs/design.md, "CUDA kernels".
#pragma once

#include "sparq-attn-common.cuh"

namespace {

// Kernel P's sample for the candidate threshold: at least SAMPLE cells (rows permitting), and at most SAMPLE_MAX,
// strided so that the threshold's rank in the sample is at least SAMPLE_RANK (sample_plan). The count of a row's
// cells above the sample's r-th key is ~ stride * Gamma(r): at rank 6 (a 64k row with a fixed 1024-cell sample)
// ~5e-4 of the rows fall below n_top and take kernel S's exact fallback over all cells (~2.3 ms each, ~1.2 ms per
// decode token of the Llama-2 shape at 64k on an H100); at rank 16 that is ~3e-9.
constexpr int      SAMPLE      = 1024;
constexpr int      SAMPLE_MAX  = 4096;
constexpr int      SAMPLE_RANK = 16;

struct select_state {
    uint64_t prefix;
    uint32_t need;
    int      done;
};

constexpr int HIST_WORDS = 256 * (B_THREADS / WARP_SIZE + 1);  // per-warp histograms + their sum

// Radix select over keys key_of(0..n) (0 = not an item; items have distinct keys): returns T such that
// exactly `need` items have key >= T (need <= number of items). Digits of 8 bits from bit top_shift down;
// stops early once a digit's bin holds exactly the remaining need. Keys share their leading digits (scores
// of one row lie within a few binades), so counting goes through per-warp histograms with the lanes of a
// warp that hit the same bin merged first (__match_any_sync): no pile-up of atomics on one address.
// hist: HIST_WORDS shared words; blockDim.x <= B_THREADS.
template <typename KeyFn>
__device__ uint64_t block_select(int64_t n, uint32_t need, int top_shift, KeyFn key_of, uint32_t * hist,
                                 select_state * sst) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    uint32_t * total = hist + 256*n_warps;
    if (threadIdx.x == 0) {
        sst->prefix = 0;
        sst->need   = need;
        sst->done   = 0;
    }
    uint64_t pmask = 0;
    for (int shift = top_shift; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256*n_warps; b += blockDim.x) {
            hist[b] = 0;
        }
        __syncthreads();
        const uint64_t prefix = sst->prefix;
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
            const uint64_t key = key_of(i);
            const uint32_t bin = key != 0 && (key & pmask) == prefix ? (uint32_t) (key >> shift) & 0xFF : 256u;
            const uint32_t peers = __match_any_sync(__activemask(), bin);
            if (bin < 256 && lane == __ffs(peers) - 1) {
                atomicAdd(&hist[warp*256 + bin], (uint32_t) __popc(peers));
            }
        }
        __syncthreads();
        for (int b = threadIdx.x; b < 256; b += blockDim.x) {
            uint32_t sum = 0;
            for (int w = 0; w < n_warps; ++w) {
                sum += hist[w*256 + b];
            }
            total[b] = sum;
        }
        __syncthreads();
        if (threadIdx.x < WARP_SIZE) {
            // lane l owns bins 255 - 8l ... 248 - 8l (descending); prefix sums over lanes find the bin where the
            // count from the top reaches `need`
            uint32_t c[8], tot = 0;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                c[e] = total[255 - 8*lane - e];
                tot += c[e];
            }
            uint32_t incl = tot;
#pragma unroll
            for (int off = 1; off < WARP_SIZE; off <<= 1) {
                const uint32_t y = __shfl_up_sync(0xFFFFFFFF, incl, off);
                incl += lane >= off ? y : 0;
            }
            const uint32_t need_now = sst->need;
            __syncwarp();
            if (incl - tot < need_now && incl >= need_now) {
                uint32_t cum = incl - tot;
                for (int e = 0; e < 8; ++e) {
                    if (cum + c[e] >= need_now) {
                        sst->prefix = prefix | ((uint64_t) (255 - 8*lane - e) << shift);
                        sst->need   = need_now - cum;
                        sst->done   = c[e] == need_now - cum;
                        break;
                    }
                    cum += c[e];
                }
            }
        }
        __syncthreads();
        pmask |= (uint64_t) 0xFF << shift;
        if (sst->done) {
            break;
        }
    }
    const uint64_t result = sst->prefix;
    __syncthreads();
    return result;
}

__device__ __forceinline__ int top_shift_for(int bits) { return ((bits - 1) / 8) * 8; }

// One-pass bucket select (the short lists of kernels P and S; the radix select above needs a pass per 8 bits):
// 32-bit keys key_of(0..n) (0 = not an item) in [lo, lo + (BUCKETS_PER_THREAD*blockDim.x << shift)) counted in
// buckets of width 2^shift from lo; finds the bucket that holds the need-th largest key (1 <= need <= number of
// items): its index, the items in higher buckets and the items in it. Lanes of a warp that hit one bucket are
// merged first (equal keys of a degenerate list do not pile up on one shared address). hist: n_bins shared words.
constexpr int BUCKETS_PER_THREAD = 8;
struct bucket_state {
    uint32_t bin, above, count;
};
__device__ __forceinline__ int bucket_shift(uint32_t lo, uint32_t hi) {
    const uint32_t n_bins = BUCKETS_PER_THREAD*blockDim.x;
    int shift = 0;
    while (((hi - lo) >> shift) >= n_bins) {
        ++shift;
    }
    return shift;
}
template <typename KeyFn>
__device__ bucket_state bucket_find(int64_t n, uint32_t need, uint32_t lo, int shift, KeyFn key_of, uint32_t * hist,
                                    int * red, bucket_state * bs) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int n_bins = BUCKETS_PER_THREAD*blockDim.x;
    for (int b = threadIdx.x; b < n_bins; b += blockDim.x) {
        hist[b] = 0;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const uint32_t key = key_of(i);
        const uint32_t bin = key != 0 ? (key - lo) >> shift : UINT32_MAX;
        const uint32_t peers = __match_any_sync(__activemask(), bin);
        if (bin != UINT32_MAX && lane == __ffs(peers) - 1) {
            atomicAdd(&hist[bin], (uint32_t) __popc(peers));
        }
    }
    __syncthreads();
    // thread t owns buckets n_bins-1-8t down to n_bins-8-8t; a scan in thread order counts the items above them
    uint32_t c[BUCKETS_PER_THREAD];
    int tot = 0;
#pragma unroll
    for (int e = 0; e < BUCKETS_PER_THREAD; ++e) {
        c[e] = hist[n_bins - 1 - BUCKETS_PER_THREAD*threadIdx.x - e];
        tot += c[e];
    }
    int total;
    const uint32_t above = (uint32_t) block_exclusive_scan(tot, &total, red);
    if (above < need && above + tot >= need) {
        uint32_t cum = above;
#pragma unroll
        for (int e = 0; e < BUCKETS_PER_THREAD; ++e) {
            if (cum < need && cum + c[e] >= need) {
                bs->bin   = n_bins - 1 - BUCKETS_PER_THREAD*threadIdx.x - e;
                bs->above = cum;
                bs->count = c[e];
            }
            cum += c[e];
        }
    }
    __syncthreads();
    const bucket_state r = *bs;
    __syncthreads();
    return r;
}

// Group scores of N cells j[u]: the sum over the group's heads of the approximate probability
// exp(l - M_g) / Z_g (rstat = [M_g..., 1/Z_g...]); 0 where cand[u] is false. The logit loads of the N cells
// are issued together. The one formula for the sample, the sweep and the fallback, so their keys agree.
template <int N>
__device__ __forceinline__ void group_scores(const float * lrow, int64_t n_kv, int64_t G, const float * rstat,
                                             const int64_t (&j)[N], const bool (&cand)[N], float (&c)[N],
                                             int64_t g_first = 0) {  // g_first > 0: c holds the heads before it
    if (g_first == 0) {
#pragma unroll
        for (int u = 0; u < N; ++u) {
            c[u] = 0.0f;
        }
    }
    for (int64_t g = g_first; g < G; ++g) {
        float lv[N];
#pragma unroll
        for (int u = 0; u < N; ++u) {
            lv[u] = cand[u] ? lrow[g*n_kv + j[u]] : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < N; ++u) {
            c[u] += __expf(lv[u] - rstat[g]) * rstat[G + g];
        }
    }
}
__device__ __forceinline__ uint32_t score_key(float c) { return __float_as_uint(c) + 1u; }  // c >= 0: order kept

// Kernel P's threshold sample of a sparse row: every stride-th cell, n_samp cells; the threshold is the sample's key at
// rank + 1, so ~target = rank * stride cells pass it. The target is 8 n_top + 64, at most half the candidate list's
// capacity, at least 4 n_top + 16.
struct sample_plan {
    int64_t stride, n_samp, rank;
};
__device__ inline sample_plan plan_sample(int64_t n_kv, int64_t n_top, int64_t cap) {
    const int64_t target = max(4*n_top + 16, min(8*n_top + 64, cap / 2));
    int64_t stride = min(n_kv / SAMPLE, target / SAMPLE_RANK);
    stride = max(stride, (n_kv + SAMPLE_MAX - 1) / SAMPLE_MAX);
    stride = max(stride, (int64_t) 1);
    return { stride, (n_kv + stride - 1) / stride, target / stride };
}

// Kernel A's chunk statistics of row w merged (kernels P and BS; every block of kernel PBS: the same loop, so the same
// bits): per head the softmax max M_g and 1/Z_g into rst [2G] (and into scratch where write_global; a warp per head,
// lanes across chunks), and the visible cells and their position range, in every thread. Ends with a barrier (rst
// complete). WIDE: a lane's first 4 chunks (one round of loads to 128 chunks, 131072 cells) and the thread's first
// chunk's visibility loaded together; kernel PBS, bound by its registers, takes the narrow form (one chunk, no early
// load).
struct row_merge {
    int64_t n_vis, p_min, p_max;
};
template <bool WIDE = true>
static __device__ row_merge merge_chunk_stats(const sparq_args & a, const sparq_scratch & s, int64_t w, float * rst,
                                       bool write_global, int64_t * redl) {
    const int64_t G = a.group, nA = a.n_chunks_a;
    constexpr int NL = WIDE ? 4 : 1;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    float * rstat = s.rstat + w*2*G;
    // this thread's first chunk's visible cells and position range, loaded with the heads' statistics below
    int32_t cv0[3] = { 0, 0, 0 };
    if (WIDE && threadIdx.x < nA) {
        const int32_t * cv = s.cvis + (w*nA + threadIdx.x)*3;
        cv0[0] = cv[0];
        cv0[1] = cv[1];
        cv0[2] = cv[2];
    }
    for (int64_t g = warp; g < G; g += blockDim.x / WARP_SIZE) {
        const float * cm = s.cmax + (w*G + g)*nA;
        const float * cs = s.csum + (w*G + g)*nA;
        float cmv[NL], csv[NL];
#pragma unroll
        for (int e = 0; e < NL; ++e) {
            const int64_t ch = lane + e*WARP_SIZE;
            cmv[e] = ch < nA ? cm[ch] : -INFINITY;
            csv[e] = ch < nA ? cs[ch] : 0.0f;
        }
        float mx = -INFINITY;
#pragma unroll
        for (int e = 0; e < NL; ++e) {
            mx = fmaxf(mx, cmv[e]);
        }
        for (int64_t ch = lane + NL*WARP_SIZE; ch < nA; ch += WARP_SIZE) {
            mx = fmaxf(mx, cm[ch]);
        }
        mx = warp_reduce(mx, op_max());
        double total = 0.0;  // a lane's chunks in ascending order
#pragma unroll
        for (int e = 0; e < NL; ++e) {
            total += cmv[e] == -INFINITY ? 0.0 : csv[e] * exp((double) cmv[e] - mx);
        }
        for (int64_t ch = lane + NL*WARP_SIZE; ch < nA; ch += WARP_SIZE) {
            total += cm[ch] == -INFINITY ? 0.0 : cs[ch] * exp((double) cm[ch] - mx);
        }
        total = warp_reduce(total, op_add());
        if (lane == 0) {
            const float inv_z = total > 0.0 ? (float) (1.0 / total) : 0.0f;
            rst[g] = mx;
            rst[G + g] = inv_z;
            if (write_global) {
                rstat[g] = mx;
                rstat[G + g] = inv_z;
            }
        }
    }
    row_merge rm = { 0, INT64_MAX, INT64_MIN };
    for (int64_t ch = threadIdx.x; ch < nA; ch += blockDim.x) {
        int32_t n = cv0[0], p0 = cv0[1], p1 = cv0[2];
        if (!WIDE || ch != threadIdx.x) {
            const int32_t * cv = s.cvis + (w*nA + ch)*3;
            n = cv[0];
            p0 = cv[1];
            p1 = cv[2];
        }
        if (n > 0) {
            rm.n_vis += n;
            rm.p_min = min(rm.p_min, (int64_t) p0);
            rm.p_max = max(rm.p_max, (int64_t) p1);
        }
    }
    block_sum_min_max(rm.n_vis, rm.p_min, rm.p_max, redl);  // its barriers publish rst
    return rm;
}

// Kernel P's work for one row: merge the chunk statistics, classify the row, set the candidate threshold.
static __device__ void prepare_row(const sparq_args & a, const sparq_scratch & s, int64_t w, int64_t r) {
    SPARQ_TIMING_MARKS(5);
    SPARQ_TIMING_MARK(0);
    __shared__ uint32_t skey[SAMPLE_MAX];
    __shared__ uint32_t hist[HIST_WORDS];
    __shared__ int64_t info[N_RI];
    __shared__ int red[32];
    __shared__ uint32_t red3[96];
    __shared__ bucket_state bst;
    const int64_t G = a.group, n_kv = a.n_kv;
    __shared__ float rst[2*MAX_G];
    __shared__ int64_t redl[96];
    SPARQ_TIMING_MARK(1);
    const row_merge rm = merge_chunk_stats(a, s, w, rst, true, redl);
    const int64_t n_vis = rm.n_vis, p_min = rm.p_min, p_max = rm.p_max;
    if (threadIdx.x == 0) {
        info[RI_KIND]  = n_vis == 0 ? ROW_EMPTY : n_vis <= a.p.k2 ? ROW_DENSE : ROW_SPARSE;
        info[RI_N_VIS] = n_vis;
        info[RI_W_LO]  = p_max - a.window;   // window: position > w_lo
        info[RI_S_HI]  = p_min + a.sinks;    // sinks:  position < s_hi
        info[RI_THR]   = 1;                  // every candidate
        info[RI_ZERO_FIRST] = 0;
    }
    SPARQ_TIMING_MARK(2);
    SPARQ_TIMING_MARK(3);  // set on every path (again after the sample where there is one)
    __syncthreads();  // rstat (global, this block) and info
    if (info[RI_KIND] == ROW_SPARSE && a.n_top > 0) {
        // threshold: the sample's value at the rank that leaves ~target cells above it
        const sample_plan sp = plan_sample(n_kv, a.n_top, a.cap);
        const int64_t stride = sp.stride, n_samp = sp.n_samp;
        const float * lrow = s.logits + w*G*n_kv;
        const int64_t w_lo = info[RI_W_LO], s_hi = info[RI_S_HI];
        const row_coords c = coords_of(a, r);
        const uint16_t * m = mask_row(a, c);
        const int32_t * pr = pos_row(a, c);
        // 8 samples per thread in flight: the masks and positions, then the logits of the candidates
        uint32_t cnt = 0, kmin = UINT32_MAX, kmax = 0;
        for (int64_t i0 = threadIdx.x; i0 < n_samp; i0 += 8*blockDim.x) {
            bool cand[8];
            int64_t j[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int64_t i = i0 + u*blockDim.x;
                j[u] = i * stride;
                cand[u] = i < n_samp && visible(m, j[u]);
                const int64_t pj = cand[u] ? position(pr, j[u]) : 0;
                cand[u] = cand[u] && !(pj > w_lo || pj < s_hi);
            }
            float c[8];
            group_scores(lrow, n_kv, G, rst, j, cand, c);
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int64_t i = i0 + u*blockDim.x;
                if (i < n_samp) {
                    const uint32_t key = cand[u] ? score_key(c[u]) : 0u;
                    skey[i] = key;
                    cnt += cand[u];
                    kmin = cand[u] ? min(kmin, key) : kmin;
                    kmax = cand[u] ? max(kmax, key) : kmax;
                }
            }
        }
        block_sum_min_max(cnt, kmin, kmax, red3);
        const int64_t n_valid = cnt;
        SPARQ_TIMING_MARK(3);
        const int64_t rank = sp.rank;
        if (rank < n_valid) {
            // the lower bound of the bucket that holds the sample's (rank+1)-th key: at most a bucket's worth of
            // extra candidates pass (any threshold is correct: it only filters)
            const int shift = bucket_shift(kmin, kmax);
            const bucket_state b = bucket_find(n_samp, (uint32_t) rank + 1, kmin, shift,
                                               [&](int64_t i) { return skey[i]; }, hist, red, &bst);
            if (threadIdx.x == 0) {
                info[RI_THR] = (int64_t) (kmin + (b.bin << shift));
            }
        }
        __syncthreads();
    }
    // A threshold at the zero score: the group scores of most cells underflowed to 0 (a peaked row), so every
    // cell would pass it and kernel S would fall back to the exact selection over all cells (~1 ms at 32k).
    // Zero-score cells tie, and ties go to the lower cell: only the first sweep chunk's zero-score cells can be
    // needed, unless it holds fewer than the top needs, which kernel S sees (fewer than n_top candidates).
    if (threadIdx.x == 0 && info[RI_KIND] == ROW_SPARSE && a.n_top > 0 && info[RI_THR] <= (int64_t) score_key(0.0f) &&
        n_kv > B_CHUNK) {
        info[RI_ZERO_FIRST] = 1;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < N_RI; i += blockDim.x) {
        s.rinfo[w*N_RI + i] = info[i];
    }
    SPARQ_TIMING_MARK(4);
    SPARQ_TIMING_PRINT("P: start, merge, sample, select", w, 5);
}

// Kernel P, one block per row: merges kernel A's chunk statistics and sets the row's candidate threshold. A
// kernel of its own (not kernel A's last block) so that kernel A carries none of its shared memory and runs
// more blocks per SM.
__global__ void __launch_bounds__(Q_THREADS) sparq_prepare(const sparq_args a, const sparq_scratch s, int64_t r0) {
    SPARQ_TL_SCOPE(TL_P);
    pdl_wait();
    SPARQ_TL_WAITED();
    // kernel B's counters of this row start at zero (here rather than a memset: a memset would break the
    // chain of dependent launches)
    for (int i = threadIdx.x; i < N_CTR; i += blockDim.x) {
        s.counters[blockIdx.x*N_CTR + i] = 0;
    }
    prepare_row(a, s, blockIdx.x, r0 + blockIdx.x);
}

__device__ __forceinline__ void mark_cell(uint32_t * bm, int64_t j) { atomicOr(&bm[j >> 5], 1u << (j & 31)); }
// Bitmap words are read past L1 (__ldcg): this block's atomics update them in L2.
__device__ __forceinline__ bool marked(const uint32_t * bm, int64_t j) { return (__ldcg(bm + (j >> 5)) >> (j & 31)) & 1u; }

__device__ __forceinline__ uint64_t order_key(int64_t pos, int64_t j) {  // (position, cell) as one unsigned key
    return ((uint64_t) ((uint32_t) pos ^ 0x80000000u) << 32) | (uint64_t) j;
}

// Exact selections over every cell of the row (the fallback): window and sinks by (position, cell), then the
// top of the group score over the rest.
static __device__ void select_all_cells(const sparq_args & a, const sparq_scratch & s, int64_t w, const row_coords & c,
                                 uint32_t * hist, select_state * sst) {
    const int64_t n_kv = a.n_kv, G = a.group;
    const uint16_t * m  = mask_row(a, c);
    const int32_t  * pr = pos_row(a, c);
    uint32_t * bm = s.bitmap + w*a.n_words;
    const float * lrow  = s.logits + w*G*n_kv;
    const float * rstat = s.rstat + w*2*G;
    for (int64_t i = threadIdx.x; i < a.n_words; i += blockDim.x) {
        bm[i] = 0;
    }
    __syncthreads();
    auto key_window = [&](int64_t j) -> uint64_t { return visible(m, j) ? order_key(position(pr, j), j) + 1 : 0; };
    auto key_sinks  = [&](int64_t j) -> uint64_t { return visible(m, j) ? ~order_key(position(pr, j), j) : 0; };
    if (a.window > 0) {
        const uint64_t thr = block_select(n_kv, (uint32_t) a.window, 56, key_window, hist, sst);
        for (int64_t j = threadIdx.x; j < n_kv; j += blockDim.x) {
            const uint64_t key = key_window(j);
            if (key != 0 && key >= thr) {
                mark_cell(bm, j);
            }
        }
    }
    if (a.sinks > 0) {
        const uint64_t thr = block_select(n_kv, (uint32_t) a.sinks, 56, key_sinks, hist, sst);
        for (int64_t j = threadIdx.x; j < n_kv; j += blockDim.x) {
            const uint64_t key = key_sinks(j);
            if (key != 0 && key >= thr) {
                mark_cell(bm, j);
            }
        }
    }
    __syncthreads();
    if (a.n_top > 0) {
        const uint64_t cmask = (uint64_t(1) << a.cell_bits) - 1;
        auto key_cand = [&](int64_t j) -> uint64_t {
            if (!visible(m, j) || marked(bm, j)) {
                return 0;
            }
            const int64_t cell[1] = { j };
            const bool cand[1] = { true };
            float score[1];
            group_scores(lrow, n_kv, G, rstat, cell, cand, score);
            return ((uint64_t) score_key(score[0]) << a.cell_bits) | (cmask - (uint64_t) j);
        };
        const uint64_t thr = block_select(n_kv, (uint32_t) a.n_top, top_shift_for(31 + a.cell_bits), key_cand, hist, sst);
        for (int64_t j = threadIdx.x; j < n_kv; j += blockDim.x) {
            const uint64_t key = key_cand(j);  // only this thread sets bit j: the key cannot change under it
            if (key != 0 && key >= thr) {
                mark_cell(bm, j);
            }
        }
    }
    __syncthreads();
}

// Candidate-list capacity per row: the sample threshold passes 4 to 8 n_top cells (at most half the capacity); at
// least B_CHUNK so that a sweep block's own list fits.
__host__ __device__ inline int64_t candidate_cap(int64_t k2) { return 4*k2 + 4096; }

// Kernel S builds I2 from lists (forced cells + the selected top, ranked by cell) up to this k2; above it from
// the bitmap (the rank by cell costs k2 steps per cell).
constexpr int LIST_MAX_K2 = 512;

// Kernel S's shared memory (dynamic part), in bytes from the start: the candidate keys, I2, the list of I2 cells.
struct smem_s_layout {
    size_t keys, i2, uni, total;
};
__host__ __device__ inline smem_s_layout smem_s_plan(int64_t cap, int64_t k2) {
    smem_s_layout l;
    l.keys  = 0;
    l.i2    = cap*sizeof(uint64_t);
    l.uni   = l.i2 + k2*sizeof(int32_t);
    l.total = l.uni + (k2 <= LIST_MAX_K2 ? k2*sizeof(int32_t) : 0);
    return l;
}
constexpr int BND_CAP     = 128;  // keys of the boundary bucket ranked pairwise; more: radix select

// Kernel B: the sweep (grid: chunks of B_CHUNK cells x rows). Each warp takes a strip of 32 * B_CELLS cells,
// lane + 32u, and owns word u of the strip in the bitmap (no atomics, no clearing).
// Sparse rows with a top to find: one round of loads per thread. A cell with a finite logit from kernel A
// is visible (hidden cells get -inf there), so the first head's logits replace the mask except for cells at -inf;
// the positions are loaded with them only where kernel A's position range of the chunk (A_CHUNK == B_CHUNK) reaches
// the window or the sinks.
// Other rows (dense, empty, no top): masks and positions first, then the logits of the candidates (two or three
// rounds).
static_assert(A_CHUNK == B_CHUNK, "kernel B reads kernel A's chunk statistics of its own chunk");
// At least 6 blocks per SM (40 registers, no spill; 8 blocks spill 88 bytes with the mask fallback for -inf logits):
// at 48 registers 5 fit and a 64k step's 1024 blocks run in 1.55 waves, but 8 blocks per SM measured the same as 5
// (19.6 vs 19.3 us under ncu).
__global__ void __launch_bounds__(B_THREADS, 6) sparq_sweep(const sparq_args a, const sparq_scratch s, int64_t r0) {
    extern __shared__ __align__(16) uint64_t local[];  // this block's candidates (B_CHUNK <= cap)
    __shared__ float rst[2*MAX_G];
    __shared__ int red[32];
    __shared__ uint32_t n_local, at_global, n_local_f, at_forced;
    SPARQ_TL_SCOPE(TL_B);
    pdl_wait();
    SPARQ_TL_WAITED();
    const int64_t w = blockIdx.y, chunk = blockIdx.x;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t G = a.group, n_kv = a.n_kv;
    const int64_t * ri = s.rinfo + w*N_RI;
    const int64_t kind = ri[RI_KIND], w_lo = ri[RI_W_LO], s_hi = ri[RI_S_HI];
    const uint32_t thr = (uint32_t) ri[RI_THR];
    // zero-score candidates only from the first chunk (see kernel P)
    const uint32_t thr_zero = ri[RI_ZERO_FIRST] && chunk > 0 ? score_key(0.0f) + 1u : thr;
    const float * lrow  = s.logits + w*G*n_kv;
    const uint16_t * m  = mask_row(a, c);
    const int32_t  * pr = pos_row(a, c);
    uint32_t * bm  = s.bitmap + w*a.n_words;
    uint32_t * ctr = s.counters + w*N_CTR;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const bool find_cand = kind == ROW_SPARSE && a.n_top > 0;
    const uint64_t cmask = (uint64_t(1) << a.cell_bits) - 1;
    const bool from_logits = find_cand;
    const int32_t * cv = s.cvis + (w*a.n_chunks_a + chunk)*3;
    // positions are needed where a cell of the chunk can be in the window or the sinks
    const bool need_pos = !from_logits || (cv[0] > 0 && ((int64_t) cv[2] > w_lo || (int64_t) cv[1] < s_hi));
    for (int64_t i = threadIdx.x; i < 2*G; i += blockDim.x) {
        rst[i] = s.rstat[w*2*G + i];
    }
    if (threadIdx.x == 0) {
        n_local = 0;
        n_local_f = 0;
    }
    __syncthreads();
    const bool list_forced = kind == ROW_SPARSE;

    const int64_t strip = chunk*B_CHUNK + (int64_t) warp*WARP_SIZE*B_CELLS;
    bool vis[B_CELLS], mark[B_CELLS], cand[B_CELLS];
    int64_t cells[B_CELLS], pos_c[B_CELLS];
    float score[B_CELLS] = {};
    if (from_logits) {  // the first head's logits and the needed positions in one round
#pragma unroll
        for (int u = 0; u < B_CELLS; ++u) {
            const int64_t j = cells[u] = strip + u*WARP_SIZE + lane;
            score[u] = j < n_kv ? lrow[j] : -INFINITY;  // the logit until the score below
            pos_c[u] = need_pos && j < n_kv ? position(pr, j) : 0;
        }
    }
    int n_w = 0, n_s = 0;
#pragma unroll
    for (int u = 0; u < B_CELLS; ++u) {
        const int64_t j = cells[u] = strip + u*WARP_SIZE + lane;
        if (from_logits) {
            // a finite logit means visible; -inf is a hidden cell, or a visible one whose approximate logit
            // overflowed (the mask says which: read only for these cells)
            vis[u] = score[u] != -INFINITY || (j < n_kv && visible(m, j));
        } else {
            vis[u] = j < n_kv && visible(m, j);
            pos_c[u] = vis[u] ? position(pr, j) : 0;
        }
        const bool in_w = kind == ROW_SPARSE && vis[u] && need_pos && pos_c[u] > w_lo;
        const bool in_s = kind == ROW_SPARSE && vis[u] && need_pos && pos_c[u] < s_hi;
        n_w += in_w;
        n_s += in_s;
        mark[u] = kind == ROW_DENSE ? vis[u] : (in_w || in_s);
        cand[u] = find_cand && vis[u] && !mark[u];
    }
    if (from_logits) {
        // group_scores' first head from the loaded logits (0 + x, as there), then the other heads
#pragma unroll
        for (int u = 0; u < B_CELLS; ++u) {
            score[u] = cand[u] ? 0.0f + __expf(score[u] - rst[0]) * rst[G] : 0.0f;
        }
        if (G > 1) {
            group_scores(lrow, n_kv, G, rst, cells, cand, score, 1);
        }
    } else if (find_cand) {
        group_scores(lrow, n_kv, G, rst, cells, cand, score);
    }
#pragma unroll
    for (int u = 0; u < B_CELLS; ++u) {
        const int64_t j = strip + u*WARP_SIZE + lane;
        const uint32_t word = __ballot_sync(0xFFFFFFFF, mark[u]);
        if (lane == 0 && strip + u*WARP_SIZE < n_kv) {
            bm[(strip + u*WARP_SIZE) / WARP_SIZE] = word;
        }
        if (cand[u]) {
            const uint32_t key32 = score_key(score[u]);
            if (key32 >= thr && key32 >= thr_zero) {
                local[atomicAdd(&n_local, 1u)] = ((uint64_t) key32 << a.cell_bits) | (cmask - (uint64_t) j);
            }
        }
        if (list_forced && mark[u]) {  // from the other end: candidates and forced cells of the chunk are disjoint
            local[B_CHUNK - 1 - atomicAdd(&n_local_f, 1u)] = (uint64_t) j;
        }
    }
    n_w = block_reduce(n_w, op_add(), 0, red);
    n_s = block_reduce(n_s, op_add(), 0, red);
    if (threadIdx.x == 0) {
        at_global = n_local > 0 ? atomicAdd(&ctr[CTR_N_CAND], n_local) : 0;
        at_forced = n_local_f > 0 ? atomicAdd(&ctr[CTR_N_F], n_local_f) : 0;
        if (kind == ROW_SPARSE) {
            atomicAdd(&ctr[CTR_N_W], (uint32_t) n_w);
            atomicAdd(&ctr[CTR_N_S], (uint32_t) n_s);
        }
    }
    __syncthreads();
    uint64_t * cl = s.cand + w*a.cap;
    for (uint32_t i = threadIdx.x; i < n_local; i += blockDim.x) {
        if (at_global + i < a.cap) {
            cl[at_global + i] = local[i];
        }
    }
    int32_t * fl = s.forced + w*a.p.k2;
    for (uint32_t i = threadIdx.x; i < n_local_f; i += blockDim.x) {
        if (at_forced + i < a.p.k2) {
            fl[at_forced + i] = (int32_t) local[B_CHUNK - 1 - i];
        }
    }
}

// I2 in cell order from the row's bitmap bm into i2 (shared or global memory): each thread counts a run of words (loaded
// at once), a block scan places them; at most k2 cells. Returns their count. red: 32 shared ints.
static __device__ int i2_from_bitmap(const sparq_args & a, const uint32_t * bm, int32_t * i2, int * red) {
    constexpr int WORDS_IN_REGS = 16;
    const int64_t k2 = a.p.k2;
    const int64_t wpt = (a.n_words + blockDim.x - 1) / blockDim.x;
    const int64_t wd0 = threadIdx.x*wpt, wd1 = min(a.n_words, wd0 + wpt);
    uint32_t wv[WORDS_IN_REGS];
    int cnt = 0, n_sel = 0;
    if (wpt <= WORDS_IN_REGS) {
#pragma unroll
        for (int u = 0; u < WORDS_IN_REGS; ++u) {
            wv[u] = wd0 + u < wd1 ? __ldcg(bm + wd0 + u) : 0u;
        }
#pragma unroll
        for (int u = 0; u < WORDS_IN_REGS; ++u) {
            cnt += __popc(wv[u]);
        }
    } else {
        for (int64_t wd = wd0; wd < wd1; ++wd) {
            cnt += __popc(__ldcg(bm + wd));
        }
    }
    int at = block_exclusive_scan(cnt, &n_sel, red);
    for (int64_t wd = wd0; wd < wd1; ++wd) {
        const uint32_t word = wpt <= WORDS_IN_REGS ? wv[(int) min(wd - wd0, (int64_t) WORDS_IN_REGS - 1)] : __ldcg(bm + wd);
        for (uint32_t bits = word; bits; bits &= bits - 1) {
            if (at < k2) {
                i2[at] = (int32_t) (wd*32 + __ffs(bits) - 1);
            }
            ++at;
        }
    }
    return (int) min((int64_t) n_sel, k2);
}

// alpha_g = the approximate probability mass of I2 (one warp per head), for sparse rows with the mean on; i2 in shared
// or global memory (written by this block before a barrier).
static __device__ void row_alpha(const sparq_args & a, const sparq_scratch & s, int64_t w, const int32_t * i2, int n_sel,
                          const float * rst) {
    const int64_t G = a.group, n_kv = a.n_kv;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const float * lrow = s.logits + w*G*n_kv;
    for (int64_t g = warp; g < G; g += blockDim.x / WARP_SIZE) {
        float sum = 0.0f;
#pragma unroll 4
        for (int i = lane; i < n_sel; i += WARP_SIZE) {
            sum += __expf(lrow[g*n_kv + i2[i]] - rst[g]) * rst[G + g];
        }
        sum = warp_reduce(sum, op_add());
        if (lane == 0) {
            s.alpha[w*G + g] = sum;
        }
    }
}

// The end of a sparse row's selection in a block that wrote i2 (global memory) itself: the barrier that makes i2
// visible to the block, alpha_g where the mean is on, and I2's size.
static __device__ void finish_sparse_row(const sparq_args & a, const sparq_scratch & s, int64_t w, const int32_t * i2,
                                         int n_sel, const float * rst) {
    __syncthreads();
    if (a.p.mean_on) {
        row_alpha(a, s, w, i2, n_sel, rst);
    }
    if (threadIdx.x == 0) {
        s.rinfo[w*N_RI + RI_N_SEL] = n_sel;
    }
}

// Kernel S's exact selection over every cell of a sparse row, done by one block of kernel PBS or BS where their fast
// path cannot decide the row (positions not distinct, or too few candidates): I2 into i2 (global), then the row's end.
static __device__ void select_sparse_row_exact(const sparq_args & a, const sparq_scratch & s, int64_t w,
                                               const row_coords & c, uint32_t * hist, select_state * sst,
                                               int32_t * i2, int * red, const float * rst) {
    select_all_cells(a, s, w, c, hist, sst);
    const int n_sel = i2_from_bitmap(a, s.bitmap + w*a.n_words, i2, red);
    finish_sparse_row(a, s, w, i2, n_sel, rst);
}

// Kernel S, one block per row: the final selection (the exact top of the candidates, or the fallback over all
// cells), I2 in cell order into scratch with its size, and alpha_g for sparse rows with the mean on.
__global__ void __launch_bounds__(B_THREADS) sparq_select(const sparq_args a, const sparq_scratch s, int64_t r0) {
    SPARQ_TIMING_MARKS(5);
    SPARQ_TIMING_MARK(0);
    extern __shared__ __align__(16) unsigned char sms[];  // smem_s_layout
    __shared__ uint32_t hist[HIST_WORDS];
    __shared__ select_state sst;
    __shared__ float rst[2*MAX_G];
    __shared__ int red[32];
    __shared__ uint32_t red3[96];
    __shared__ uint64_t bnd[BND_CAP];
    __shared__ bucket_state bst;
    __shared__ uint32_t n_uni, n_bnd;
    SPARQ_TL_SCOPE(TL_S);
    pdl_wait();
    SPARQ_TL_WAITED();
    const int64_t w = blockIdx.x;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t G = a.group, k2 = a.p.k2;
    const smem_s_layout L = smem_s_plan(a.cap, k2);
    uint64_t * keys = (uint64_t *) (sms + L.keys);
    int32_t  * i2   = (int32_t *)  (sms + L.i2);
    int32_t  * uni  = (int32_t *)  (sms + L.uni);  // I2 unordered (list path)
    int64_t  * ri   = s.rinfo + w*N_RI;
    const int64_t kind = ri[RI_KIND];
    const int tid = threadIdx.x;
    if (kind == ROW_EMPTY) {
        if (tid == 0) {
            ri[RI_N_SEL] = 0;
        }
        return;
    }
    for (int64_t i = tid; i < 2*G; i += blockDim.x) {
        rst[i] = s.rstat[w*2*G + i];
    }
    uint32_t * bm = s.bitmap + w*a.n_words;
    bool from_list = false;
    int n_sel = 0;
    if (kind == ROW_SPARSE) {
        const uint32_t * ctr = s.counters + w*N_CTR;
        const int64_t n_w = ctr[CTR_N_W], n_s = ctr[CTR_N_S], n_cand = ctr[CTR_N_CAND], n_f = ctr[CTR_N_F];
        const bool fast = n_w == a.window && n_s == a.sinks && ri[RI_W_LO] >= ri[RI_S_HI] - 1 &&
                          (a.n_top == 0 || (n_cand >= a.n_top && n_cand <= a.cap));
        from_list = fast && k2 <= LIST_MAX_K2 && n_f == n_w + n_s && n_f + a.n_top <= k2;
        if (from_list) {
            // I2 unordered: the forced cells (kernel B's list), then the exact top of the candidates: one bucket
            // pass over their 32-bit scores; the keys of the boundary bucket ranked pairwise by (score, cell)
            const uint64_t cmask = (uint64_t(1) << a.cell_bits) - 1;
            const int32_t * fl = s.forced + w*k2;
            if (tid == 0) {
                n_uni = (uint32_t) n_f;
                n_bnd = 0;
            }
            for (int64_t i = tid; i < n_f; i += blockDim.x) {
                uni[i] = fl[i];
            }
            if (a.n_top > 0) {
                const uint64_t * cl = s.cand + w*a.cap;
                uint32_t dummy = 0, kmin = UINT32_MAX, kmax = 0;
#pragma unroll 4
                for (int64_t i = tid; i < n_cand; i += blockDim.x) {
                    const uint64_t key = cl[i];
                    keys[i] = key;
                    const uint32_t k32 = (uint32_t) (key >> a.cell_bits);
                    kmin = min(kmin, k32);
                    kmax = max(kmax, k32);
                }
                block_sum_min_max(dummy, kmin, kmax, red3);
                const int shift = bucket_shift(kmin, kmax);
                auto key32_of = [&](int64_t i) { return (uint32_t) (keys[i] >> a.cell_bits); };
                const bucket_state b = bucket_find(n_cand, (uint32_t) a.n_top, kmin, shift, key32_of, hist, red, &bst);
                if (b.count <= BND_CAP) {
                    for (int64_t i = tid; i < n_cand; i += blockDim.x) {
                        const uint64_t key = keys[i];
                        const uint32_t bin = (key32_of(i) - kmin) >> shift;
                        if (bin > b.bin) {
                            uni[atomicAdd(&n_uni, 1u)] = (int32_t) (cmask - (key & cmask));
                        } else if (bin == b.bin) {
                            bnd[atomicAdd(&n_bnd, 1u)] = key;
                        }
                    }
                    __syncthreads();
                    const uint32_t need = (uint32_t) a.n_top - b.above;
                    for (uint32_t t = tid; t < b.count; t += blockDim.x) {
                        const uint64_t key = bnd[t];
                        uint32_t rk = 0;
                        for (uint32_t u = 0; u < b.count; ++u) {
                            rk += bnd[u] > key;
                        }
                        if (rk < need) {
                            uni[atomicAdd(&n_uni, 1u)] = (int32_t) (cmask - (key & cmask));
                        }
                    }
                } else {
                    const uint64_t thr = block_select(n_cand, (uint32_t) a.n_top, top_shift_for(31 + a.cell_bits),
                                                      [&](int64_t i) { return keys[i]; }, hist, &sst);
                    for (int64_t i = tid; i < n_cand; i += blockDim.x) {
                        if (keys[i] >= thr) {
                            uni[atomicAdd(&n_uni, 1u)] = (int32_t) (cmask - (keys[i] & cmask));
                        }
                    }
                }
            }
            __syncthreads();
            // I2 in cell order: each cell's rank among the (distinct) cells of the list
            n_sel = (int) n_uni;
            for (int t = tid; t < n_sel; t += blockDim.x) {
                const int32_t cell = uni[t];
                int rk = 0;
                for (int u = 0; u < n_sel; ++u) {
                    rk += uni[u] < cell;
                }
                i2[rk] = cell;
            }
        } else if (fast && a.n_top > 0) {
            const uint64_t * cl = s.cand + w*a.cap;
#pragma unroll 4
            for (int64_t i = tid; i < n_cand; i += blockDim.x) {
                keys[i] = cl[i];
            }
            __syncthreads();
            const uint64_t cmask = (uint64_t(1) << a.cell_bits) - 1;
            const uint64_t thr = block_select(n_cand, (uint32_t) a.n_top, top_shift_for(31 + a.cell_bits),
                                              [&](int64_t i) { return keys[i]; }, hist, &sst);
            for (int64_t i = tid; i < n_cand; i += blockDim.x) {
                if (keys[i] >= thr) {
                    mark_cell(bm, (int64_t) (cmask - (keys[i] & cmask)));
                }
            }
        } else if (!fast) {
#ifdef SPARQ_CUDA_INSTRUMENT
            if (a.timing && tid == 0) {
                printf("S: exact fallback, row %lld: window %lld/%d, sinks %lld/%d, candidates %lld (need %lld..%lld)\n",
                       (long long) (r0 + w), (long long) n_w, a.window, (long long) n_s, a.sinks, (long long) n_cand,
                       (long long) a.n_top, (long long) a.cap);
            }
#endif
            select_all_cells(a, s, w, c, hist, &sst);
        }
        __syncthreads();
    }
    SPARQ_TIMING_MARK(1);

    if (!from_list) {
        n_sel = i2_from_bitmap(a, bm, i2, red);
    }
    __syncthreads();
    for (int i = tid; i < n_sel; i += blockDim.x) {
        s.i2[w*k2 + i] = i2[i];
    }
    if (tid == 0) {
        ri[RI_N_SEL] = n_sel;
    }
    SPARQ_TIMING_MARK(2);

    if (kind == ROW_SPARSE && a.p.mean_on) {
        row_alpha(a, s, w, i2, n_sel, rst);
    }
    SPARQ_TIMING_MARK(3);
    SPARQ_TIMING_PRINT("S: select, I2, alpha", w, 4);
}

}  // namespace
