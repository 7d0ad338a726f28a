// Kernels S1 and S2 of the CUDA centroid op (included by centroid-attn.cu only; the op's files:
// centroid-attn-common.cuh): the level-1 scores with their block statistics, then the kept clusters of each row.
#pragma once

#include "centroid-attn-common.cuh"

namespace {

// ---- S1: level-1 scaled dot products and block statistics --------------------------------------------

// TR components per lane (d <= 32 TR); each warp holds S1_ROWS table rows in flight.
constexpr int S1_ROWS = 4;
static_assert(S_CLUSTERS % (S_WARPS * S1_ROWS) == 0, "kernel S1: whole steps of rows");
template <int TR>
__global__ void __launch_bounds__(S_THREADS) centroid_level1(const centroid_args a, const centroid_scratch s,
                                                             const int64_t r0) {
    pdl_wait();
    extern __shared__ float s1_smem[];  // [G][S_CLUSTERS] dot products, then [S_CLUSTERS] sizes
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int64_t w = blockIdx.y, G = a.group, n1 = a.n1, d = a.d, i0 = (int64_t) blockIdx.x * S_CLUSTERS;
    const row_coords c = coords_of(a, r0 + w);
    float * zs = s1_smem, * sz = s1_smem + G*S_CLUSTERS;
    float * z1 = s.z1 + w*G*n1;

    for (int k0 = warp*S1_ROWS; k0 < S_CLUSTERS; k0 += S_WARPS*S1_ROWS) {
        float ce[S1_ROWS][TR], size[S1_ROWS];
#pragma unroll
        for (int u = 0; u < S1_ROWS; ++u) {  // clusters past the table count as empty
            const int64_t i = i0 + k0 + u;
            const float * row = i < n1 ? (a.coarse ? coarse_row(a, i, c) : cent_row(a, i, c)) : nullptr;
#pragma unroll
            for (int e = 0; e < TR; ++e) {
                const int64_t x = lane + WARP_SIZE*e;
                ce[u][e] = row && x < d ? row[x] : 0.0f;
            }
            size[u] = row ? row[d] : 0.0f;
        }
        for (int64_t g = 0; g < G; ++g) {
            const float * qg = q_row(a, c.h*G + g, c);
            float qv[TR];
#pragma unroll
            for (int e = 0; e < TR; ++e) {
                const int64_t x = lane + WARP_SIZE*e;
                qv[e] = x < d ? qg[x] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < S1_ROWS; ++u) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < TR; ++e) {
                    dot += qv[e] * ce[u][e];
                }
                dot = warp_sum(dot);
                const float z = size[u] > 0.0f ? a.p.scale * dot : -INFINITY;
                const int64_t i = i0 + k0 + u;
                if (lane == 0) {
                    zs[g*S_CLUSTERS + k0 + u] = z;
                    if (i < n1) {
                        z1[g*n1 + i] = z;
                    }
                }
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int u = 0; u < S1_ROWS; ++u) {
                sz[k0 + u] = size[u];
            }
        }
    }
    if (a.p.var_weight > 0.0f) {
        // the stored rule logits get the variance term (the block statistics above are the normaliser's: means
        // only); the same warps and lanes as above, so each lane 0 adds to the values it wrote
        for (int k0 = warp*S1_ROWS; k0 < S_CLUSTERS; k0 += S_WARPS*S1_ROWS) {
            float va[S1_ROWS][TR];
            bool live[S1_ROWS];
#pragma unroll
            for (int u = 0; u < S1_ROWS; ++u) {
                const int64_t i = i0 + k0 + u;
                const float * row = i < n1 ? (a.coarse ? coarse_row(a, i, c) : cent_row(a, i, c)) : nullptr;
                live[u] = row && row[d] > 0.0f;
#pragma unroll
                for (int e = 0; e < TR; ++e) {
                    const int64_t x = lane + WARP_SIZE*e;
                    va[u][e] = live[u] && x < d ? row[d + 1 + x] : 0.0f;
                }
            }
            const float coef = variance_coef(a);
            for (int64_t g = 0; g < G; ++g) {
                const float * qg = q_row(a, c.h*G + g, c);
                float qq[TR];
#pragma unroll
                for (int e = 0; e < TR; ++e) {
                    const int64_t x = lane + WARP_SIZE*e;
                    qq[e] = x < d ? qg[x] * qg[x] : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < S1_ROWS; ++u) {
                    float dot = 0.0f;
#pragma unroll
                    for (int e = 0; e < TR; ++e) {
                        dot += qq[e] * va[u][e];
                    }
                    dot = warp_sum(dot);
                    if (lane == 0 && live[u]) {
                        z1[g*n1 + i0 + k0 + u] += coef * dot;
                    }
                }
            }
        }
    }
    __syncthreads();
    double * out = s.part1 + ((w*a.n_chunks1 + blockIdx.x)*G)*2;
    for (int64_t g = warp; g < G; g += S_WARPS) {
        float m = -INFINITY;
        for (int k = lane; k < S_CLUSTERS; k += WARP_SIZE) {
            m = fmaxf(m, zs[g*S_CLUSTERS + k]);
        }
        m = warp_max(m);
        double sum = 0.0;
        for (int k = lane; k < S_CLUSTERS; k += WARP_SIZE) {
            const float z = zs[g*S_CLUSTERS + k];
            if (z != -INFINITY) {
                sum += (double) sz[k] * exp((double) (z - m));
            }
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            out[2*g]     = (double) m;
            out[2*g + 1] = sum;
        }
    }
}

// ---- S2: normaliser, group scores, kept clusters -------------------------------------------------------

constexpr int RADIX_BINS = 256;  // the budget select: 8 bits of the 64-bit keys a pass
static_assert(S_THREADS == RADIX_BINS, "kernel S2: a thread per radix bin");
static_assert(RADIX_BINS == 8*WARP_SIZE, "kernel S2: eight radix bins per lane of the scanning warp");

struct budget_smem {
    uint32_t weight[RADIX_BINS];  // the sizes of the pass's candidates per bin
    uint32_t count[RADIX_BINS];   // the candidates per bin
    double   red[S_WARPS];
    uint64_t remaining;           // the budget left for the candidates of the chosen bin
    uint32_t bin, bin_count;      // the chosen bin and its candidates
    bool     all;                 // the scored clusters' sizes do not reach the budget: all are kept
};

// The budget rule (ggml-centroid.h, step 3) for one row over its fine scores fscore [n_cent] (< 0: unscored): with
// clusters ordered by key (best_key), the boundary cluster b is the first whose size, with those of the clusters
// before it, reaches B = max(1, ceil(keep * N)); kept: b and the clusters before it (every scored one when their
// sizes sum to less than B). Found as the largest key K with sum{size_i : key_i >= K} >= B by a radix select from
// the top byte of the keys down: a pass histograms the sizes of the candidates (keys with the chosen prefix) over
// the next 8 bits, the scanning warp finds the bin where the sum from the top crosses the budget left, and the
// pass ends the search once that bin holds one cluster (keys are distinct: at most 8 passes). Integer sizes and
// shared-memory atomics: the same bits on every run. Then kept[i] = key_i >= K.
static __device__ void keep_by_budget(const centroid_args & a, const row_coords & c, const float * fscore,
                                      uint8_t * kept, budget_smem & sm) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int64_t n = a.n_cent;

    // N: the clustered cells (the fine table's sizes); B computed as the CPU kernel does (a float32 product)
    double n_sum = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += S_THREADS) {
        n_sum += (double) cent_row(a, i, c)[a.d];
    }
    n_sum = block_sum_f64(n_sum, sm.red);
    const double budget = fmax(1.0, (double) ceilf(__fmul_rn(a.p.keep, (float) n_sum)));

    uint64_t prefix = 0, mask = 0;   // the boundary key's bits chosen so far
    uint64_t remaining = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        sm.weight[threadIdx.x] = 0;
        sm.count[threadIdx.x]  = 0;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < n; i += S_THREADS) {
            const uint64_t key = best_key(fscore[i], i);
            if (key != 0 && (key & mask) == prefix) {
                const uint32_t bin = (uint32_t) (key >> shift) & (RADIX_BINS - 1);
                atomicAdd(&sm.weight[bin], (uint32_t) cent_row(a, i, c)[a.d]);
                atomicAdd(&sm.count[bin], 1u);
            }
        }
        __syncthreads();
        if (warp == 0) {
            // lane l scans bins 255 - 8l down to 248 - 8l: the lanes in order cover the bins from the top
            uint32_t w[8];
            uint64_t local = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                w[j] = sm.weight[RADIX_BINS - 1 - 8*lane - j];
                local += w[j];
            }
            uint64_t incl = local;
#pragma unroll
            for (int off = 1; off < WARP_SIZE; off <<= 1) {
                const uint64_t o = __shfl_up_sync(0xFFFFFFFF, incl, off);
                incl += lane >= off ? o : 0;
            }
            const uint64_t excl = incl - local;
            if (shift == 56) {
                const uint64_t total = __shfl_sync(0xFFFFFFFF, incl, WARP_SIZE - 1);
                remaining = (double) total < budget ? 0 : (uint64_t) budget;
                if (lane == 0) {
                    sm.all = remaining == 0;
                }
            }
            if (remaining != 0 && excl < remaining && incl >= remaining) {  // one lane: the crossing
                uint64_t cum = excl;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (cum + w[j] >= remaining) {
                        const uint32_t bin = RADIX_BINS - 1 - 8*lane - j;
                        sm.bin = bin;
                        sm.bin_count = sm.count[bin];
                        sm.remaining = remaining - cum;
                        break;
                    }
                    cum += w[j];
                }
            }
        }
        __syncthreads();
        if (sm.all) {
            break;
        }
        prefix |= (uint64_t) sm.bin << shift;
        mask   |= (uint64_t) (RADIX_BINS - 1) << shift;
        remaining = sm.remaining;
        if (sm.bin_count == 1) {
            break;  // the bin's one cluster is the boundary: prefix (lower bits 0) separates it from those after it
        }
    }
    const uint64_t boundary = sm.all ? 1 : prefix;
    for (int64_t i = threadIdx.x; i < n; i += S_THREADS) {
        kept[i] = best_key(fscore[i], i) >= boundary;
    }
}

__global__ void __launch_bounds__(S_THREADS) centroid_select(const centroid_args a, const centroid_scratch s,
                                                             const int64_t r0) {
    pdl_wait();
    extern __shared__ double log_z[];  // [G]
    __shared__ uint64_t red[S_WARPS];
    __shared__ budget_smem sm;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int64_t w = blockIdx.x, G = a.group, n1 = a.n1;
    const row_coords c = coords_of(a, r0 + w);

    // log Z_g = M + log sum_b S_b exp(M_b - M) over S1's blocks (the CPU's normaliser, summed in double)
    const double * part1 = s.part1 + w*a.n_chunks1*G*2;
    for (int64_t g = warp; g < G; g += S_WARPS) {
        double m = -INFINITY;
        for (int64_t b = lane; b < a.n_chunks1; b += WARP_SIZE) {
            m = fmax(m, part1[(b*G + g)*2]);
        }
        m = warp_max(m);
        double sum = 0.0;
        for (int64_t b = lane; b < a.n_chunks1; b += WARP_SIZE) {
            const double mb = part1[(b*G + g)*2];
            if (mb != -INFINITY) {
                sum += part1[(b*G + g)*2 + 1] * exp(mb - m);
            }
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            log_z[g] = sum > 0.0 ? m + log(sum) : 0.0;
        }
    }
    __syncthreads();

    // level 1: scores of the live clusters; with two levels the coarse ones >= threshold_coarse, and the best one
    const bool two = a.coarse != nullptr;
    uint8_t * kept = s.kept + w*a.n_cent;
    float * fscore = s.fscore + w*a.n_cent;
    const float * z1 = s.z1 + w*G*n1;
    if (!two) {
        for (int64_t i = threadIdx.x; i < n1; i += S_THREADS) {
            float score = -1.0f;
            if (z1[i] != -INFINITY) {  // head 0's -inf marks an empty cluster
                score = group_score(a, log_z, [&](int64_t g) { return z1[g*n1 + i]; });
            }
            fscore[i] = score;
        }
        __syncthreads();
        keep_by_budget(a, c, fscore, kept, sm);
        return;
    }
    uint8_t * kept1 = s.kept_c + w*a.n_coarse;
    uint64_t best = 0;
    for (int64_t i = threadIdx.x; i < n1; i += S_THREADS) {
        float score = -1.0f;
        if (z1[i] != -INFINITY) {
            score = group_score(a, log_z, [&](int64_t g) { return z1[g*n1 + i]; });
        }
        kept1[i] = score >= 0.0f && score >= a.p.threshold_coarse;
        const uint64_t key = best_key(score, i);
        best = key > best ? key : best;
    }
    best = block_max_u64(best, red);
    if (threadIdx.x == 0 && best) {
        kept1[best_index(best)] = 1;
    }
    __syncthreads();

    // level 2: the fine clusters under kept parents, against the coarse normaliser (a warp per cluster)
    const int32_t * parent = parent_row(a, c);
    for (int64_t i = warp; i < a.n_cent; i += S_WARPS) {
        const float * row = cent_row(a, i, c);
        const int32_t pi = parent[i];
        float score = -1.0f;
        if (row[a.d] > 0.0f && pi >= 0 && pi < n1 && kept1[pi]) {  // warp-uniform
            float ce[TABLE_REGS], va[TABLE_REGS];
            load_table_row(row, a.d, ce);
            if (a.p.var_weight > 0.0f) {
                load_table_row(row + a.d + 1, a.d, va);
            }
            score = group_score(a, log_z, [&](int64_t g) {
                const float * qg = q_row(a, c.h*G + g, c);
                const float z = a.p.scale * warp_dot(qg, a.d, ce);
                return a.p.var_weight > 0.0f ? z + warp_variance_term(a, qg, va) : z;
            });
        }
        if (lane == 0) {
            fscore[i] = score;
        }
    }
    __syncthreads();
    keep_by_budget(a, c, fscore, kept, sm);
}

}  // namespace
