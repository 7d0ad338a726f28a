// CPU kernel of ggml_cluster_update. Semantics: ggml_ops/include/ggml-centroid.h; float64 reference:
// sparq_llama.reference_squeeze.kmeans_cosine (its update step and its final table).
//
// Tasks are (problem h, slice of components): each task sums its components of every row of problem h into its
// cluster's output row, rows in order, so threads never write the same element and the sums are deterministic.
// The sizes and, in the spherical mode, the norms need every component of a row: a second pass after a barrier.
// GGML_CLUSTER_TABLE_VAR adds a third, after the means are final: per (problem, slice) the squared deviations of the
// members from their mean, rows in order, then divided by the size.
#include "cluster-update-cpu.h"

#include "attn-cpu-common.h"
#include "ggml-centroid.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

constexpr int64_t k_slice = 16;  // components per task

struct cluster_view {
    const ggml_tensor * x, * assign, * prev;
    ggml_tensor * dst;
    int64_t d, P, H, n, width;
    bool table;  // the table modes (means and sizes)
    bool var;    // GGML_CLUSTER_TABLE_VAR: then the variances

    const float * x_row(int64_t p, int64_t h) const {
        return (const float *) ((const char *) x->data + p * x->nb[1] + h * x->nb[2]);
    }
    const int32_t * assign_row(int64_t h) const { return (const int32_t *) ((const char *) assign->data + h * assign->nb[1]); }
    float * out_row(int64_t i, int64_t h) const { return (float *) ((char *) dst->data + i * dst->nb[1] + h * dst->nb[2]); }
    const float * prev_row(int64_t i, int64_t h) const {
        return (const float *) ((const char *) prev->data + i * prev->nb[1] + h * prev->nb[2]);
    }
};

// Calls add(x_row, out_row) for problem h's rows that have a cluster, in row order (the summation order every
// backend keeps).
template <typename F> void for_members(const cluster_view & v, int64_t h, F && add) {
    const int32_t * a = v.assign_row(h);
    for (int64_t p = 0; p < v.P; ++p) {
        if (a[p] >= 0 && a[p] < v.n) {
            add(v.x_row(p, h), v.out_row(a[p], h));
        }
    }
}

// Sums of components [c0, c1) of problem h's rows per cluster (the sizes are counted in pass 2).
void sum_slice(const cluster_view & v, int64_t h, int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < v.n; ++i) {
        std::fill(v.out_row(i, h) + c0, v.out_row(i, h) + c1, 0.0f);
    }
    for_members(v, h, [&](const float * xr, float * o) {
        for (int64_t c = c0; c < c1; ++c) {
            o[c] += xr[c];
        }
    });
}

// Pass 2 for problem h: sizes, then means (table) or normalised sums / prev rows (spherical).
void finish_problem(const cluster_view & v, int64_t h, int64_t * count) {
    std::fill(count, count + v.n, 0);
    const int32_t * a = v.assign_row(h);
    for (int64_t p = 0; p < v.P; ++p) {
        if (a[p] >= 0 && a[p] < v.n) {
            ++count[a[p]];
        }
    }
    for (int64_t i = 0; i < v.n; ++i) {
        float * o = v.out_row(i, h);
        if (v.table) {
            const float inv = count[i] > 0 ? 1.0f / (float) count[i] : 0.0f;
            for (int64_t c = 0; c < v.d; ++c) {
                o[c] *= inv;
            }
            o[v.d] = (float) count[i];
        } else if (count[i] == 0) {
            memcpy(o, v.prev_row(i, h), v.d * sizeof(float));
        } else {
            double ss = 0.0;
            for (int64_t c = 0; c < v.d; ++c) {
                ss += (double) o[c] * o[c];
            }
            const float inv = ss > 0.0 ? (float) (1.0 / std::sqrt(ss)) : 0.0f;
            for (int64_t c = 0; c < v.d; ++c) {
                o[c] *= inv;
            }
        }
    }
}

// Pass 3 (GGML_CLUSTER_TABLE_VAR): variances of components [c0, c1) of problem h about the final means, into
// columns d + 1 + c.
void variance_slice(const cluster_view & v, int64_t h, int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < v.n; ++i) {
        std::fill(v.out_row(i, h) + v.d + 1 + c0, v.out_row(i, h) + v.d + 1 + c1, 0.0f);
    }
    for_members(v, h, [&](const float * xr, float * o) {
        for (int64_t c = c0; c < c1; ++c) {
            const float e = xr[c] - o[c];
            o[v.d + 1 + c] += e * e;
        }
    });
    for (int64_t i = 0; i < v.n; ++i) {
        float * o = v.out_row(i, h);
        const float inv = o[v.d] > 0.0f ? 1.0f / o[v.d] : 0.0f;
        for (int64_t c = c0; c < c1; ++c) {
            o[v.d + 1 + c] *= inv;
        }
    }
}

// GGML_CLUSTER_ASSIGN: rows [r0, r1) of sim (row r = problem r / P, row r % P), each the index of its largest
// value, ties to the higher index: ggml_argmax's CPU loop (ggml_vec_argmax_f32).
void assign_rows(const ggml_tensor * sim, ggml_tensor * dst, int64_t r0, int64_t r1) {
    const int64_t n = sim->ne[0], P = sim->ne[1];
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t p = r % P, h = r / P;
        const float * s = (const float *) ((const char *) sim->data + p * sim->nb[1] + h * sim->nb[2]);
        float best = -INFINITY;
        int32_t idx = 0;
        for (int64_t i = 0; i < n; ++i) {
            best = best > s[i] ? best : s[i];
            if (best == s[i]) {
                idx = (int32_t) i;
            }
        }
        *(int32_t *) ((char *) dst->data + p * dst->nb[0] + h * dst->nb[1]) = idx;
    }
}

}  // namespace

void ggml_compute_forward_cluster_update(const ggml_compute_params * params, ggml_tensor * dst) {
    if (ggml_get_op_params_i32(dst, 0) == GGML_CLUSTER_ASSIGN) {
        const ggml_tensor * sim = dst->src[0];
        GGML_ASSERT(dst->type == GGML_TYPE_I32 && dst->ne[0] == sim->ne[1] && dst->ne[1] == sim->ne[2]);
        const int64_t n_rows = sim->ne[1] * sim->ne[2];
        const int64_t per = (n_rows + params->nth - 1) / params->nth;
        assign_rows(sim, dst, std::min(n_rows, params->ith * per), std::min(n_rows, (params->ith + 1) * per));
        return;
    }
    cluster_view v;
    v.x = dst->src[0]; v.assign = dst->src[1]; v.prev = dst->src[2]; v.dst = dst;
    v.d = v.x->ne[0]; v.P = v.x->ne[1]; v.H = v.x->ne[2]; v.n = dst->ne[1]; v.width = dst->ne[0];
    const int32_t mode = ggml_get_op_params_i32(dst, 0);
    v.table = mode == GGML_CLUSTER_TABLE || mode == GGML_CLUSTER_TABLE_VAR;
    v.var = mode == GGML_CLUSTER_TABLE_VAR;
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && dst->nb[0] == sizeof(float));
    GGML_ASSERT(v.width == (v.var ? 2 * v.d + 1 : v.table ? v.d + 1 : v.d));

    attn_cpu::task_counter tasks{params->threadpool, params->ith, params->nth};
    if (params->ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, params->nth);
    }
    ggml_barrier(params->threadpool);
    const int64_t n_slices = (v.d + k_slice - 1) / k_slice;
    tasks.run(v.H * n_slices, [&](int64_t t) {
        const int64_t h = t / n_slices, c0 = (t % n_slices) * k_slice;
        sum_slice(v, h, c0, std::min(v.d, c0 + k_slice));
    });
    ggml_barrier(params->threadpool);
    // the counts need no scratch beyond one int64 per cluster: the work buffer, one slot per thread
    int64_t * count = (int64_t *) GGML_PAD((uintptr_t) params->wdata, 64) + params->ith * v.n;
    tasks.run(v.H, [&](int64_t h) { finish_problem(v, h, count); });
    if (v.var) {
        ggml_barrier(params->threadpool);
        tasks.run(v.H * n_slices, [&](int64_t t) {
            const int64_t h = t / n_slices, c0 = (t % n_slices) * k_slice;
            variance_slice(v, h, c0, std::min(v.d, c0 + k_slice));
        });
    }
}

size_t ggml_cluster_update_cpu_work_size(const ggml_tensor * dst, int n_tasks) {
    if (ggml_get_op_params_i32(dst, 0) == GGML_CLUSTER_ASSIGN) {
        return 0;
    }
    return sizeof(int64_t) * dst->ne[1] * n_tasks + 64;
}
