// Kernel PBS of the CUDA SparQ op: the work of kernels P, B and S as one kernel per row over a thread-block cluster
// (Hopper; included by sparq-attn.cu only; the op's files: sparq-attn-common.cuh). docs/design.md, "CUDA kernels".
#pragma once

#include "sparq-attn-select.cuh"

namespace {

// Kernels P, B and S run each row's selection as a chain of dependent memory round trips and block barriers in
// one block per row (P, S) or through a global candidate list (B): ~35 us of the chain's ~86 at 32k (H100, the
// op's timeline). Kernel PBS spreads a row over a cluster of 8 or 16 blocks that exchange their counts through
// distributed shared memory: no sample, no threshold guess, no candidate list, no fallback for a misleading sample.
//   1. block b takes cells [b*span, (b+1)*span), thread t of it the cpt cells from b*span + t*cpt (so the order of
//      threads is the order of cells); their first-head logits are loaded (16-byte loads, all in flight) before the
//      block merges kernel A's chunk statistics (as kernel P, the same bits): the row's kind, window and sinks
//      bounds and softmax statistics are known in every block without an exchange;
//   2. visibility (from the logits, the mask only for -inf), forced cells (window, sinks; every visible cell of a
//      dense row), group scores as kernel B, 32-bit keys in place of the logits, and the histogram of the keys'
//      exponents (the first radix digit);
//   3. the exact top n_top of the candidates by (score, cell), equal scores to the lower cell: a radix select over the
//      composite key K = key << cell_bits | ~cell, 8-bit digits from the top, one block histogram per pass summed over
//      the cluster by every block: one cluster barrier per pass (most rows take two); the first carries the counts of
//      forced window and sink cells; later passes look only at the cells whose exponent is the boundary's;
//   4. I2 in cell order: each thread's selected cells, a block scan, the blocks before this one from the cluster;
//      alpha_g from the selected cells' scores (G = 1) or logits, summed over the blocks in rank order.
// Rows whose window or sinks do not come out exact (positions not distinct) take kernel S's exact selection over
// all cells in the cluster's first block. Sizes: span = cpt * PBS_THREADS cells, cpt a multiple of 4 up to 36.
// Where it runs (sparq_cuda_get_best_select_kernel, sparq-attn.cu): kernel PBS is built for latency, one wave of
// clusters doing few cells each; kernels P, B and S for throughput (kernel B's sweep spreads any number of cells over
// many blocks, and its per-cell work is a threshold test where PBS's is a key, a histogram count and a select test).
// Measured on an H100 (op bench, Llama-2 heads, PBS with up to 64 cells per thread vs P, B, S): one sequence (B = 1)
// 60 vs 72 us at 4k, 92 vs 100 at 32k, 134 vs 136 at 64k, but 212 vs 195 at 128k; B = 8 slower at every length (32k:
// 372 vs 321). So PBS runs for rows of at most PBS_MAX_CPT cells per thread when every row's cluster is resident at once;
// devices before Hopper run P, B and S. The bound covers decodes at depth 32k and 64k, whose rows are 33024 and 65792
// cells (the cache view is padded); end to end PBS is worth more there than the op bench shows (llama-bench tg at
// 32k: 7.36 vs 8.03 ms; op 96 vs 104 us). Few long rows (GQA: 8 rows at B = 1) take clusters of 16 blocks (op with
// Llama-3 heads at 65792 cells: 83 us vs 97 with clusters of 8 and 91 with P, B, S). Kernel BS, faster still, takes
// every row it can run except a few short ones (sparq-attn.cu): PBS runs for at most 32 rows of fewer than 32768 cells.
constexpr int PBS_THREADS = 256;
constexpr int PBS_MAX_CPT = 36;    // rows up to 73728 cells: decodes at depth 64k (n_kv 65792, padded) take PBS
constexpr int PBS_REG_CPT = 20;    // a thread's first logits held in registers during the merge (more would spill)
constexpr int PBS_BINS    = 256;  // 8-bit digits
static_assert(PBS_BINS == PBS_THREADS, "a thread per histogram bin");
static_assert(A_CHUNK % 8 == 0, "a thread's group of 4 cells lies in one chunk of kernel A");

// What a block publishes to its cluster (read by the others through distributed shared memory).
struct pbs_exchange {
    uint32_t hist[2][PBS_BINS];  // radix histogram of the pass; by parity, so one cluster barrier per pass suffices:
                                 // a block clears hist[p] in pass p + 2, after every block has passed pass p + 1's
                                 // barrier, i.e. finished reading pass p's
    int      n_w, n_s, n_sel;    // forced window and sink cells, selected cells
    float    alpha[MAX_G];       // the block's part of alpha_g
};

// cells per thread, a multiple of 4 (16-byte accesses), with clusters of cl blocks per row
__host__ __device__ inline int pbs_cpt(int64_t n_kv, int cl) {
    const int64_t per_thread = (n_kv + cl*PBS_THREADS - 1) / (cl*PBS_THREADS);
    return (int) ((per_thread + 3) / 4 * 4);
}
// A thread's keys in shared memory: cpt words and 4 or 8 of padding, a stride of 4 mod 8 words, so that the 16-byte
// accesses of 8 consecutive threads (one phase of a warp's vector access) fall on distinct banks.
__host__ __device__ inline int pbs_stride(int cpt) { return cpt % 8 == 0 ? cpt + 4 : cpt + 8; }
constexpr int PBS_VEC = PBS_REG_CPT / 4;  // 16-byte loads of a thread's logits in flight during the merge

// Four first-head logits from cell j (-inf past the row's end or without logits): one 16-byte load where aligned.
__device__ __forceinline__ uint4 pbs_logits4(const sparq_args & a, const float * lrow, int64_t n_kv, int64_t j) {
    if (a.has_logits && a.vec_logits && j + 4 <= n_kv) {
        return *(const uint4 *) (lrow + j);
    }
    uint32_t e4[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        e4[e] = a.has_logits && j + e < n_kv ? __float_as_uint(lrow[j + e]) : __float_as_uint(-INFINITY);
    }
    return make_uint4(e4[0], e4[1], e4[2], e4[3]);
}

// The bin of this thread's cluster-wide histogram (bin 255 - tid: the scans run from the top bin down), the sum of the
// cluster's blocks' hist[bin], read through distributed shared memory. Device code for sm_90 or later only: the
// cooperative-groups cluster types do not exist for older targets.
#if SPARQ_PBS_BUILT && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900)
template <int CL>
__device__ __forceinline__ uint32_t pbs_cluster_bin(const cooperative_groups::cluster_group & cluster, uint32_t * hist) {
    uint32_t cnt = 0;
#pragma unroll
    for (int b0 = 0; b0 < CL; b0 += 8) {
        uint32_t part[8];
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            part[b] = cluster.map_shared_rank(hist, b0 + b)[PBS_BINS - 1 - threadIdx.x];
        }
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            cnt += part[b];
        }
    }
    return cnt;
}
#endif  // SPARQ_PBS_BUILT && sm_90 or later

template <int CL>  // blocks per row (cluster size): 8 or 16
__global__ void __launch_bounds__(PBS_THREADS, 3) sparq_pbs(const sparq_args a, const sparq_scratch s, int64_t r0) {
    static_assert(CL == 8 || CL == 16, "a warp's lanes read the cluster's blocks");
#if SPARQ_PBS_BUILT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    extern __shared__ __align__(16) uint32_t keys[];  // [PBS_THREADS][stride]: logits, then 0 hidden / score keys
    __shared__ pbs_exchange ex;
    __shared__ float rst[2*MAX_G];
    __shared__ int64_t redl[96];
    __shared__ int red[32];
    __shared__ bool pos_chunk[PBS_MAX_CPT*PBS_THREADS/A_CHUNK + 2];  // the A chunks this block's cells meet (a span
                                                                     // not on chunk edges meets up to 2 more than
                                                                     // span / A_CHUNK): can any of their cells be forced
    __shared__ float fred[32];  // block_reduce of alpha_g's parts
    __shared__ uint32_t bin_found[3];  // the pass's boundary bin, the items above it, the items in it
    __shared__ int64_t row_sum[3];     // from the cluster: forced window cells, sink cells; selected cells before this block
    __shared__ uint32_t hist[HIST_WORDS];  // kernel S's exact selection (first block, rows that need it)
    __shared__ select_state sst;
    SPARQ_TIMING_MARKS(10);
    SPARQ_TL_SCOPE(TL_PBS);
    pdl_wait();
    SPARQ_TL_WAITED();
    SPARQ_TIMING_MARK(0);
    const int rank = (int) cluster.block_rank();
    const int64_t w = blockIdx.x / CL;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t G = a.group, n_kv = a.n_kv, k2 = a.p.k2;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int cpt = pbs_cpt(n_kv, CL);
    const int64_t base = rank*(int64_t) cpt*PBS_THREADS, j0 = base + (int64_t) tid*cpt;  // this thread: [j0, j0 + cpt)
    uint32_t * mine = keys + tid*pbs_stride(cpt);
    const uint64_t cmask = (uint64_t(1) << a.cell_bits) - 1;
    const float * lrow = s.logits + w*G*n_kv;

    // 1. the first head's logits of this thread's cells (the first PBS_REG_CPT), in flight during the merge
    uint4 raw_l[PBS_VEC];
#pragma unroll
    for (int v = 0; v < PBS_VEC; ++v) {
        raw_l[v] = 4*v < cpt ? pbs_logits4(a, lrow, n_kv, j0 + 4*v) : make_uint4(0, 0, 0, 0);
    }
    const row_merge rm = merge_chunk_stats<false>(a, s, w, rst, rank == 0, redl);
    SPARQ_TIMING_MARK(1);
    const int64_t kind = rm.n_vis == 0 ? ROW_EMPTY : rm.n_vis <= k2 ? ROW_DENSE : ROW_SPARSE;
    const int64_t w_lo = rm.p_max - a.window, s_hi = rm.p_min + a.sinks;  // window: pos > w_lo; sinks: pos < s_hi
    int64_t * ri = s.rinfo + w*N_RI;
    if (rank == 0 && tid == 0) {
        ri[RI_KIND] = kind;
        ri[RI_N_VIS] = rm.n_vis;
        ri[RI_W_LO] = w_lo;
        ri[RI_S_HI] = s_hi;
    }
    if (kind == ROW_EMPTY) {  // the same in every block: no exchange
        if (rank == 0 && tid == 0) {
            ri[RI_N_SEL] = 0;
        }
        return;
    }
    const bool sparse = kind == ROW_SPARSE, find_cand = sparse && a.n_top > 0;
    const uint16_t * m = mask_row(a, c);
    const int32_t * pr = pos_row(a, c);
    const int64_t ch0 = base / A_CHUNK;  // a block's span need not start or end at a chunk's edge (cpt % 8 == 4)
    const int n_chunks_block = (int) ((base + (int64_t) cpt*PBS_THREADS - 1) / A_CHUNK - ch0 + 1);
    for (int i = tid; i < n_chunks_block; i += PBS_THREADS) {
        const int64_t ch = ch0 + i;
        const int32_t * cv = s.cvis + (w*a.n_chunks_a + ch)*3;
        pos_chunk[i] = ch < a.n_chunks_a && sparse && cv[0] > 0 && ((int64_t) cv[2] > w_lo || (int64_t) cv[1] < s_hi);
    }
    ex.hist[0][tid] = 0;
#pragma unroll
    for (int v = 0; v < PBS_VEC; ++v) {
        if (4*v < cpt) {
            *(uint4 *) (mine + 4*v) = raw_l[v];
        }
    }
    for (int u0 = 4*PBS_VEC; u0 < cpt; u0 += 4) {  // rows of more than PBS_REG_CPT cells per thread: the rest now
        *(uint4 *) (mine + u0) = pbs_logits4(a, lrow, n_kv, j0 + u0);
    }
    __syncthreads();

    // 2. keys in place of the logits, forced bits, the exponents' histogram (the first digit of K)
    uint64_t forced = 0;
    int64_t n_ws = 0;  // forced window cells + (sink cells << 32)
    for (int u0 = 0; u0 < cpt; u0 += 4) {
        const bool need_pos = pos_chunk[(j0 + u0) / A_CHUNK - ch0];  // 4 cells never straddle a chunk's edge
        const uint4 raw = *(const uint4 *) (mine + u0);
        int64_t cells[4];
        float score[4] = { __uint_as_float(raw.x), __uint_as_float(raw.y), __uint_as_float(raw.z), __uint_as_float(raw.w) };
        bool vis[4], scored[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int64_t j = cells[u] = j0 + u0 + u;
            vis[u] = score[u] != -INFINITY || (j < n_kv && visible(m, j));
            const int64_t pj = need_pos && vis[u] ? position(pr, j) : 0;
            const bool in_w = sparse && vis[u] && need_pos && pj > w_lo;
            const bool in_s = sparse && vis[u] && need_pos && pj < s_hi;
            n_ws += (int64_t) in_w + ((int64_t) in_s << 32);
            const bool mark = kind == ROW_DENSE ? vis[u] : (in_w || in_s);
            forced |= (uint64_t) mark << (u0 + u);
            scored[u] = sparse && a.has_logits && vis[u];  // forced cells too: their scores go into alpha_g
        }
        // group scores as kernel B: the first head from the logit (0 + x, as group_scores), then the other heads
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            score[u] = scored[u] ? 0.0f + __expf(score[u] - rst[0]) * rst[G] : 0.0f;
        }
        if (G > 1) {
            group_scores(lrow, n_kv, G, rst, cells, scored, score, 1);
        }
        uint32_t key[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            key[u] = scored[u] ? score_key(score[u]) : (vis[u] ? 1u : 0u);
            if (find_cand && vis[u] && !((forced >> (u0 + u)) & 1)) {
                atomicAdd(&ex.hist[0][key[u] >> 23], 1u);  // K's top 8 of 31 + cell_bits bits: the key's bits 30..23
            }
        }
        *(uint4 *) (mine + u0) = make_uint4(key[0], key[1], key[2], key[3]);
    }
    n_ws = block_reduce(n_ws, op_add(), (int64_t) 0, redl);
    if (tid == 0) {
        ex.n_w = (int) (n_ws & 0xFFFFFFFF);
        ex.n_s = (int) (n_ws >> 32);
    }
    SPARQ_TIMING_MARK(2);

    // 3. the cluster's sums: the forced counts, the first digit's histogram; the boundary bin; further passes
    cluster.sync();  // also: every block of the cluster runs, so its shared memory can be read
    if (warp == 0) {
        const pbs_exchange * o = cluster.map_shared_rank(&ex, lane % CL);
        int64_t nw_b = lane < CL ? o->n_w : 0, ns_b = lane < CL ? o->n_s : 0;
        nw_b = warp_reduce(nw_b, op_add());
        ns_b = warp_reduce(ns_b, op_add());
        if (lane == 0) {
            row_sum[0] = nw_b;
            row_sum[1] = ns_b;
        }
    }
    uint32_t cnt = find_cand ? pbs_cluster_bin<CL>(cluster, ex.hist[0]) : 0;
    __syncthreads();
    SPARQ_TIMING_MARK(3);
    // kernel S's condition for the fast path: exactly the window and the sinks forced, and disjoint
    const bool exact_all = sparse && !(row_sum[0] == a.window && row_sum[1] == a.sinks && w_lo >= s_hi - 1);
    const int total_bits = 31 + a.cell_bits;  // group scores are at most G <= 64: score_key < 2^31
    int sh = total_bits - 8, width = 8, par = 0, n_pass = 0;
    uint64_t prefix = 0;
    uint32_t top_digit = 0;  // the boundary's exponent (the first pass's bin)
    if (find_cand && !exact_all) {
        uint32_t need = (uint32_t) a.n_top;
        for (;;) {
            ++n_pass;
            int n_items = 0;
            const uint32_t above = (uint32_t) block_exclusive_scan((int) cnt, &n_items, red);
            if (above < need && above + cnt >= need) {
                bin_found[0] = PBS_BINS - 1 - tid; bin_found[1] = above; bin_found[2] = cnt;
            }
            __syncthreads();
            prefix = (prefix << width) | bin_found[0];
            top_digit = n_pass == 1 ? bin_found[0] : top_digit;
            need -= bin_found[1];
            if (bin_found[2] == need || sh == 0) {
                break;
            }
            const int sh_next = max(0, sh - 8);
            width = sh - sh_next;
            sh = sh_next;
            par ^= 1;
            uint32_t * h = ex.hist[par];
            h[tid] = 0;
            __syncthreads();
            for (int u0 = 0; u0 < cpt; u0 += 4) {
                const uint4 raw = *(const uint4 *) (mine + u0);
                const uint32_t k4[4] = { raw.x, raw.y, raw.z, raw.w };
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    if (k4[u] >> 23 == top_digit && k4[u] != 0 && !((forced >> (u0 + u)) & 1)) {
                        const uint64_t K = ((uint64_t) k4[u] << a.cell_bits) | (cmask - (uint64_t) (j0 + u0 + u));
                        if ((K >> (sh + width)) == prefix) {
                            atomicAdd(&h[(uint32_t) (K >> sh) & ((1u << width) - 1)], 1u);
                        }
                    }
                }
            }
            cluster.sync();
            cnt = pbs_cluster_bin<CL>(cluster, h);
        }
    }
    SPARQ_TIMING_MARK(4);

    // 4. the selected cells: forced, or candidates with K >= prefix << sh; this thread's cells are consecutive
    const uint64_t thr = prefix << sh;
    uint64_t sel = 0;
    float part_alpha = 0.0f;  // alpha_0's part (G = 1: the scores themselves)
    if (!exact_all) {
        for (int u0 = 0; u0 < cpt; u0 += 4) {
            const uint4 raw = *(const uint4 *) (mine + u0);
            const uint32_t k4[4] = { raw.x, raw.y, raw.z, raw.w };
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const bool f = (forced >> (u0 + u)) & 1;
                bool top = false;
                if (find_cand && k4[u] != 0 && !f && k4[u] >> 23 >= top_digit) {
                    const uint64_t K = ((uint64_t) k4[u] << a.cell_bits) | (cmask - (uint64_t) (j0 + u0 + u));
                    top = K >= thr;
                }
                sel |= (uint64_t) (f || top) << (u0 + u);
                if ((f || top) && G == 1 && a.has_logits) {
                    part_alpha += __uint_as_float(k4[u] - 1u);
                }
            }
        }
    }
    int n_sel_block = 0;
    const int at_thread = block_exclusive_scan(__popcll(sel), &n_sel_block, red);
    SPARQ_TIMING_MARK(5);
    // alpha_g's part of this block (sparse rows with the mean on), in a fixed order
    const bool want_alpha = sparse && a.p.mean_on && !exact_all;
    if (want_alpha) {
        for (int64_t g = 0; g < G; ++g) {
            float p = part_alpha;
            if (G > 1) {
                p = 0.0f;
                for (uint64_t bits = sel; bits; bits &= bits - 1) {
                    const int64_t j = j0 + __ffsll((long long) bits) - 1;
                    p += __expf(lrow[g*n_kv + j] - rst[g]) * rst[G + g];
                }
            }
            p = block_reduce(p, op_add(), 0.0f, fred);
            if (tid == 0) {
                ex.alpha[g] = p;
            }
        }
    }
    SPARQ_TIMING_MARK(6);
    if (tid == 0) {
        ex.n_sel = n_sel_block;
    }
    cluster.sync();
    if (warp == 0) {  // lane b: block b's count; this block's offset and the row's total
        const int n_b = lane < CL ? cluster.map_shared_rank(&ex, lane % CL)->n_sel : 0;
        const int64_t before = warp_reduce(lane < rank ? (int64_t) n_b : (int64_t) 0, op_add());
        const int64_t total = warp_reduce((int64_t) n_b, op_add());
        if (lane == 0) {
            row_sum[2] = before;
            if (rank == 0 && !exact_all) {
                ri[RI_N_SEL] = min(total, k2);
            }
        }
    }
    if (want_alpha && rank == 0) {
        for (int64_t g = tid; g < G; g += PBS_THREADS) {
            float sum = 0.0f;  // in rank order
#pragma unroll
            for (int b0 = 0; b0 < CL; b0 += 8) {
                float part[8];
#pragma unroll
                for (int b = 0; b < 8; ++b) {
                    part[b] = cluster.map_shared_rank(&ex, b0 + b)->alpha[g];
                }
#pragma unroll
                for (int b = 0; b < 8; ++b) {
                    sum += part[b];
                }
            }
            s.alpha[w*G + g] = sum;
        }
    }
    cluster.barrier_arrive();  // this block's reads of other blocks' shared memory are done; wait before exiting
    __syncthreads();  // row_sum[2]
    SPARQ_TIMING_MARK(7);
    int32_t * i2 = s.i2 + w*k2;
    if (!exact_all) {
        int64_t at = row_sum[2] + at_thread;
        for (uint64_t bits = sel; bits; bits &= bits - 1, ++at) {
            if (at < k2) {
                i2[at] = (int32_t) (j0 + __ffsll((long long) bits) - 1);
            }
        }
    } else if (rank == 0) {
        // positions not distinct: kernel S's exact selection over every cell, in this block
        select_sparse_row_exact(a, s, w, c, hist, &sst, i2, red, rst);
    }
    SPARQ_TIMING_MARK(8);
    cluster.barrier_wait();
    SPARQ_TIMING_MARK(9);
#ifdef SPARQ_CUDA_INSTRUMENT
    if (a.timing && tid == 0 && w == 0 && rank == 0) {
        printf("PBS passes %d exact_all %d cpt %d\n", n_pass, (int) exact_all, cpt);
    }
#endif
    SPARQ_TIMING_PRINT("PBS: merge, keys+count, exchange, radix, select, alpha, exchange, i2, wait", w*CL + rank, 10);
#else
    NO_DEVICE_CODE;
#endif
}

}  // namespace
