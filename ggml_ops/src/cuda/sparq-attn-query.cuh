// Kernel Q of the CUDA SparQ op (included by sparq-attn.cu only; the op's files: sparq-attn-common.cuh), one block per
// row: I1 (the k1 largest components of sum_g |q_g|, or of sigma_i * sum_g |q_g,i| for select qsigma) and every
// head's query components at I1, scaled by scale / sqrt(rho_g), into scratch for kernel A (sparq-attn-score.cuh).
// docs/design.md, "CUDA kernels".
#pragma once

#include "sparq-attn-common.cuh"

namespace {

// factor_g = scale / sqrt(rho_g) (double, as the CPU), into fac: rho_g = |q_g[I1]|_1 / |q_g|_1, or with sigma (select
// qsigma) the share of the score's variance, sum_{I1} (q_g,i sigma_i)^2 / sum_i (q_g,i sigma_i)^2; a warp per head,
// lanes strided, one butterfly; q_of(g) gives head g's d components (global memory or a shared copy: the same values,
// so the same bits). Ends with a barrier (fac is read by the whole block).
template <typename QFn>
__device__ void query_factors(const sparq_args & a, int64_t G, int64_t d, const int * i1, const float * sigma, float * fac,
                              QFn q_of) {
    const int k1 = a.p.k1;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    // each component's weight in the CPU's operation order
    auto weight = [&](const float * qg, int64_t i) {
        return sigma ? (double) qg[i] * qg[i] * sigma[i] * sigma[i] : fabs((double) qg[i]);
    };
    for (int64_t g = warp; g < G; g += blockDim.x / WARP_SIZE) {
        const float * qg = q_of(g);
        double all = 0.0, sel = 0.0;
        for (int64_t i = lane; i < d; i += WARP_SIZE) {
            all += weight(qg, i);
        }
        for (int i = lane; i < k1; i += WARP_SIZE) {
            sel += weight(qg, i1[i]);
        }
        all = warp_reduce(all, op_add());
        sel = warp_reduce(sel, op_add());
        if (lane == 0) {
            const double rho = all > 0.0 ? sel / all : 1.0;
            fac[g] = (float) (a.p.scale / sqrt(rho > 0.0 ? rho : 1.0));
        }
    }
    __syncthreads();
}

// I1 of row c (ascending; the k1 largest components of sum_g |q_g|, times sigma_i where sigma is given (select
// qsigma), ties to the lower component) into i1, and factor_g = scale / sqrt(rho_g) into fac. Shared scratch: absum
// [d] floats, rank [d] ints.
static __device__ void row_query(const sparq_args & a, const row_coords & c, const float * sigma, float * absum, int * rank,
                                 int * i1, float * fac) {
    const int64_t d = a.d, G = a.group;
    const int k1 = a.p.k1;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
        float sum = 0.0f;  // in head order, as the CPU
        for (int64_t g = 0; g < G; ++g) {
            sum += fabsf(q_row(a, c.h*G + g, c)[i]);
        }
        absum[i] = sigma ? sum * sigma[i] : sum;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
        const float ai = absum[i];
        int rk = 0;
        for (int64_t j = 0; j < d; ++j) {
            const float b = absum[j];
            rk += (b > ai) | ((b == ai) & (j < i));
        }
        rank[i] = rk;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
        if (rank[i] < k1) {
            int at = 0;
            for (int64_t j = 0; j < i; ++j) {
                at += rank[j] < k1;
            }
            i1[at] = (int) i;
        }
    }
    __syncthreads();
    query_factors(a, G, d, i1, sigma, fac, [&](int64_t g) { return q_row(a, c.h*G + g, c); });
}

// The row's queries into qrow [G][d] (shared), every head's loads in flight together; read by row_query_fast after a
// barrier (kernel Q issues them before the key statistics, so that both take one round trip).
static __device__ void load_query_rows(const sparq_args & a, const row_coords & c, float * qrow) {
    const int d = (int) a.d, G = (int) a.group;
    for (int idx = threadIdx.x; idx < G*d; idx += blockDim.x) {
        qrow[idx] = q_row(a, c.h*G + idx / d, c)[idx % d];
    }
}

// row_query's results (the same I1, the same factors bit for bit) in fewer dependent steps, for kernel Q: the row's
// queries are read from global memory once, into qrow [G][d] by load_query_rows before a barrier (row_query reads
// them three times); each component's
// rank is counted by R consecutive lanes (as many as fit, up to a warp) over a 1/R share of the others (row_query:
// one thread over all d); I1 is compacted in order by one warp's ballots (row_query: each selected component
// counts the selected ones below it, O(d) serial loads). The factors: query_factors over the same values, as
// row_query. Shared: absum [d], rank [d], qrow [G*d] floats.
// At 32k (H100): kernel Q's body takes 4.7 us with this, 6.2 us with row_query, of a ~86 us chain.
static __device__ void row_query_fast(const sparq_args & a, const row_coords & c, const float * sigma, float * absum, int * rank,
                                      float * qrow, int * i1, float * fac) {
    const int d = (int) a.d, G = (int) a.group, k1 = a.p.k1, nt = (int) blockDim.x;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    for (int i = threadIdx.x; i < d; i += nt) {
        float sum = 0.0f;  // in head order, as the CPU
        for (int g = 0; g < G; ++g) {
            sum += fabsf(qrow[g*d + i]);
        }
        absum[i] = sigma ? sum * sigma[i] : sum;
    }
    __syncthreads();
    int R = 1;  // lanes per component; R divides the warp, so a component's lanes are in one warp
    while (2*R <= WARP_SIZE && 2*R*d <= nt) {
        R *= 2;
    }
    const int n_t = (d*R + WARP_SIZE - 1) / WARP_SIZE * WARP_SIZE;  // whole warps: the shuffles below
    for (int t = threadIdx.x; t < n_t; t += nt) {
        const int i = t / R, p = t % R;
        int rk = 0;
        if (i < d) {
            const float ai = absum[i];
#pragma unroll 8
            for (int j = p; j < d; j += R) {
                const float b = absum[j];
                rk += (b > ai) | ((b == ai) & (j < i));
            }
        }
        for (int off = R/2; off > 0; off >>= 1) {
            rk += __shfl_xor_sync(0xFFFFFFFF, rk, off);
        }
        if (i < d && p == 0) {
            rank[i] = rk;
        }
    }
    __syncthreads();
    if (warp == 0) {
        int run = 0;
        for (int i0 = 0; i0 < d; i0 += WARP_SIZE) {
            const int i = i0 + lane;
            const bool take = i < d && rank[i] < k1;
            const uint32_t b = __ballot_sync(0xFFFFFFFF, take);
            if (take) {
                i1[run + __popc(b & ((1u << lane) - 1))] = i;
            }
            run += __popc(b);
        }
    }
    __syncthreads();
    query_factors(a, G, d, i1, sigma, fac, [&](int64_t g) { return (const float *) qrow + g*d; });
}

// sigma_i of the row's visible keys (select qsigma), sigma_i^2 = max(0, S2_i/n - (S1_i/n)^2), into sigma [d], in double
// as the CPU: from the running sums of kstat, or without them from K over the row's visible cells. The pass over K:
// with d <= the block's threads, n_cg = threads/d groups of d threads, group cg summing cells cg, cg + n_cg, ... (a
// thread per component, the row's components read together), the groups' sums then added in group order (red:
// 3 * blockDim.x doubles); with d > the threads, each thread sums its components over all cells. The sums of
// squares are of products exact in double, so the order changes the sums only in their last bits. Ends with a
// barrier.
__device__ __forceinline__ float sigma_of(double s1, double s2, double n) {
    const double mean = n > 0.0 ? s1 / n : 0.0;
    const double var  = n > 0.0 ? s2 / n - mean*mean : 0.0;
    return (float) sqrt(var > 0.0 ? var : 0.0);
}
static __device__ void key_sigma(const sparq_args & a, const row_coords & c, float * sigma, double * red) {
    const int d = (int) a.d, nt = (int) blockDim.x, tid = threadIdx.x;
    if (a.kstat) {
        const float * ks = (const float *) (a.kstat + c.h*a.ks_nb1 + c.t*a.ks_nb2 + c.st*a.ks_nb3);
        const double n = ks[2*d];
        for (int i = tid; i < d; i += nt) {
            sigma[i] = sigma_of(ks[i], ks[d + i], n);
        }
        __syncthreads();
        return;
    }
    const uint16_t * m = mask_row(a, c);
    const char * kb = a.k + c.h*a.k_nb2 + c.st*a.k_nb3;
    const int n_cg = d <= nt ? nt / d : 1;
    if (n_cg == 1) {
        for (int i = tid; i < d; i += nt) {
            double s1 = 0.0, s2 = 0.0, n = 0.0;
            for (int64_t j = 0; j < a.n_kv; ++j) {
                if (visible(m, j)) {
                    const float x = dequant1(kb + j*a.k_nb1, a.k_type, i);
                    s1 += x;
                    s2 += (double) x * x;
                    n  += 1.0;
                }
            }
            sigma[i] = sigma_of(s1, s2, n);
        }
        __syncthreads();
        return;
    }
    const int cg = tid / d, i = tid % d;
    if (cg < n_cg) {
        double s1 = 0.0, s2 = 0.0, n = 0.0;
        for (int64_t j = cg; j < a.n_kv; j += n_cg) {
            if (visible(m, j)) {
                const float x = dequant1(kb + j*a.k_nb1, a.k_type, i);
                s1 += x;
                s2 += (double) x * x;
                n  += 1.0;
            }
        }
        red[tid] = s1; red[nt + tid] = s2; red[2*nt + tid] = n;
    }
    __syncthreads();
    if (tid < d) {
        double s1 = 0.0, s2 = 0.0, n = 0.0;
        for (int g = 0; g < n_cg; ++g) {
            s1 += red[g*d + tid]; s2 += red[nt + g*d + tid]; n += red[2*nt + g*d + tid];
        }
        sigma[tid] = sigma_of(s1, s2, n);
    }
    __syncthreads();
}

// Kernel Q's shared memory, in this order: for select qsigma without kstat the pass over K's partial sums
// [3][Q_THREADS] doubles; absum and rank [d] each; for select qsigma sigma [d]; with the fast path the row's queries
// [G][d] (the fast path runs where absum, rank and the queries fit in Q_SMEM_MAX bytes; row_query elsewhere).
constexpr size_t Q_SMEM_MAX = 32 << 10;
__host__ __device__ inline bool query_fast(int64_t d, int64_t G) {
    return sizeof(float) * (G + 2)*d <= Q_SMEM_MAX;
}
__host__ __device__ inline size_t query_red_doubles(const sparq_args & a) {
    return a.p.select == GGML_SPARQ_SELECT_QSIGMA && !a.kstat ? 3*Q_THREADS : 0;
}
__host__ inline size_t query_smem(const sparq_args & a) {
    const bool qsigma = a.p.select == GGML_SPARQ_SELECT_QSIGMA;
    const int64_t n_f = (2 + (qsigma ? 1 : 0) + (query_fast(a.d, a.group) ? a.group : 0))*a.d;
    return sizeof(double)*query_red_doubles(a) + sizeof(float)*n_f;
}

// Kernel Q, one block per row: I1 and every head's components at I1 scaled by scale / sqrt(rho_g), into scratch
// for kernel A. QSIGMA: select qsigma (a.p.select), an instance of its own, so that select q's instance holds none of
// its code (ptxas, sm_90a: select q's instance 40 registers and 8 bytes of spill; one instance serving both took 48
// registers and 40 bytes of spill).
template <bool QSIGMA>
__global__ void __launch_bounds__(Q_THREADS) sparq_query(const sparq_args a, const sparq_scratch s, int64_t r0) {
    extern __shared__ double smq_d[];  // layout: query_smem
    __shared__ int i1[MAX_HEAD_DIM];
    __shared__ float fac[MAX_G];
    SPARQ_TIMING_MARKS(4);
    SPARQ_TL_SCOPE(TL_Q);
    pdl_wait();
    SPARQ_TL_WAITED();
    SPARQ_TIMING_MARK(0);
    const int64_t w = blockIdx.x;
    const row_coords c = coords_of(a, r0 + w);
    const int64_t d = a.d, G = a.group;
    const int k1 = a.p.k1;
    float * smq   = (float *) (smq_d + (QSIGMA ? query_red_doubles(a) : 0));
    float * sigma = QSIGMA ? smq + 2*d : nullptr;
    float * qrow = query_fast(d, G) ? smq + (QSIGMA ? 3 : 2)*d : nullptr;
    if (qrow) {
        load_query_rows(a, c, qrow);  // in flight with the key statistics' loads
    }
    if constexpr (QSIGMA) {
        key_sigma(a, c, sigma, smq_d);  // ends with a barrier
    } else if (qrow) {
        __syncthreads();
    }
    SPARQ_TIMING_MARK(1);
    if (qrow) {
        row_query_fast(a, c, sigma, smq, (int *) (smq + d), qrow, i1, fac);
        SPARQ_TIMING_MARK(2);
        for (int64_t idx = threadIdx.x; idx < G*k1; idx += blockDim.x) {
            const int64_t g = idx / k1, i = idx % k1;
            s.qs[(w*G + g)*k1 + i] = qrow[g*d + i1[i]] * fac[g];
        }
    } else {
        row_query(a, c, sigma, smq, (int *) (smq + d), i1, fac);
        SPARQ_TIMING_MARK(2);
        for (int64_t idx = threadIdx.x; idx < G*k1; idx += blockDim.x) {
            const int64_t g = idx / k1, i = idx % k1;
            s.qs[(w*G + g)*k1 + i] = q_row(a, c.h*G + g, c)[i1[i]] * fac[g];
        }
    }
    for (int i = threadIdx.x; i < k1; i += blockDim.x) {
        s.i1[w*k1 + i] = i1[i];
    }
    SPARQ_TIMING_MARK(3);
    SPARQ_TIMING_PRINT("Q: loads, select+factors, writes", w, 4);
}

}  // namespace
