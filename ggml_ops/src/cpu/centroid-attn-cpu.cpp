// CPU kernel of ggml_centroid_attn. Semantics: ggml_ops/include/ggml-centroid.h and docs/design.md,
// "Centroid-sparse: op semantics"; the float64 reference is sparq_llama.reference_squeeze.centroid_attn.
//
// Work is organised in "rows": one row = (KV head h, query row t, stream s), all query heads of h's group
// together since they share the selection. Rows go in waves of W rows (bounded scratch for long prefill
// batches); each wave runs three phases separated by barriers, threads taking tasks dynamically:
//   A. per row:          the kept clusters (centroid scores, the budget rule; the coarse level first when there is one)
//   B. per (row, part):  exact attention of every head of the group over the selected cells of one part of
//                        the sequence, as a partial softmax (max, sum, weighted sum of V): with one KV head
//                        and one query, the parts keep every thread busy
//   C. per (row, head):  the parts' partials merged into the output
#include "centroid-attn-cpu.h"

#include "attn-cpu-common.h"
#include "ggml-centroid.h"

#include "ggml-cpu/vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

using attn_cpu::load_f32;
using attn_cpu::pad16;
using attn_cpu::prefetch_bytes;

constexpr int64_t k_wave_rows_max = 1024;  // rows per wave (prefill batches): bounds the partials' scratch
constexpr int64_t k_block = 256;           // cells per block of phase B's online softmax
constexpr int32_t k_prefetch_rows = 8;     // phase B: K rows of selected cells requested this far ahead
constexpr uint16_t k_f16_neg_inf = 0xFC00;

struct centroid_shape {
    int64_t d, d_v, n_q, n_head, n_head_kv, ns, n_kv, group, n_cent, n_coarse, n_rows, wave, n_parts, part_len;
};

// Offsets (in 4-byte units) of one wave row's scratch and of one thread's scratch.
struct centroid_layout {
    size_t kept, kept_coarse, partials, row_size;
    size_t z, score, log_z, qsq, order, sel, logits, tmp_k, tmp_v, thread_size;
    size_t total_bytes;
};

centroid_shape make_shape(const ggml_tensor * dst, int n_tasks) {
    const ggml_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2];
    const ggml_tensor * cent = dst->src[4], * coarse = dst->src[6];
    centroid_shape s;
    s.d         = q->ne[0];
    s.n_q       = q->ne[1];
    s.n_head    = q->ne[2];
    s.ns        = q->ne[3];
    s.n_kv      = k->ne[1];
    s.n_head_kv = k->ne[2];
    s.d_v       = v->ne[0];
    s.group     = s.n_head / s.n_head_kv;
    s.n_cent    = cent->ne[1];
    s.n_coarse  = coarse ? coarse->ne[1] : 0;
    s.n_rows    = s.n_head_kv * s.n_q * s.ns;
    s.wave      = std::min(s.n_rows, k_wave_rows_max);
    // enough parts per row that every thread gets about two tasks in phase B
    s.n_parts   = std::max<int64_t>(1, std::min<int64_t>((2 * n_tasks + s.wave - 1) / s.wave,
                                                         (s.n_kv + k_block - 1) / k_block));
    s.part_len  = (s.n_kv + s.n_parts - 1) / s.n_parts;
    return s;
}

centroid_layout make_layout(const centroid_shape & s, int n_tasks) {
    centroid_layout l;
    size_t o = 0;
    l.kept        = o; o += pad16((s.n_cent + 3) / 4);    // one byte per fine cluster
    l.kept_coarse = o; o += pad16((s.n_coarse + 3) / 4);  // one byte per coarse cluster
    l.partials    = o; o += pad16(s.n_parts * s.group * (2 + s.d_v));  // per part and head: max, sum, acc[d_v]
    l.row_size = o;

    o = 0;
    const int64_t n_c = std::max(s.n_cent, s.n_coarse);
    l.z      = o; o += pad16(s.group * n_c);      // scaled dot products q_g . C_i
    l.score  = o; o += pad16(n_c);                // group scores
    l.log_z  = o; o += pad16(2 * s.group);        // log normaliser per head (double)
    l.qsq    = o; o += pad16(s.group * s.d);      // the squared query components (the variance term)
    l.order  = o; o += pad16(s.n_cent);           // scored fine clusters in budget order (int32)
    l.sel    = o; o += pad16(k_block);            // selected cells of a block (int32)
    l.logits = o; o += pad16(s.group * k_block);
    l.tmp_k  = o; o += pad16(s.d);
    l.tmp_v  = o; o += pad16(s.d_v);
    l.thread_size = o;

    l.total_bytes = 4 * (l.row_size * s.wave + l.thread_size * n_tasks) + 64;
    return l;
}

struct centroid_ctx {
    const ggml_tensor *q, *k, *v, *mask, *cent, *cell, *coarse, *parent;
    ggml_tensor * dst;
    ggml_centroid_op_params p;
    centroid_shape s;
    centroid_layout l;
    float * rows_base;     // wave scratch
    float * threads_base;  // per-thread scratch

    // row r -> (h, t, s): heads fastest, as the SparQ kernel
    void row_coords(int64_t r, int64_t & h, int64_t & t, int64_t & st) const {
        h  = r % s.n_head_kv;
        t  = (r / s.n_head_kv) % s.n_q;
        st = r / (s.n_head_kv * s.n_q);
    }
    float * row(int64_t w) const { return rows_base + w * l.row_size; }
    float * thread(int ith) const { return threads_base + ith * l.thread_size; }

    const float * q_row(int64_t hq, int64_t t, int64_t st) const {
        return (const float *) ((const char *) q->data + t * q->nb[1] + hq * q->nb[2] + st * q->nb[3]);
    }
    const void * k_row(int64_t j, int64_t h, int64_t st) const {
        return (const char *) k->data + j * k->nb[1] + h * k->nb[2] + st * k->nb[3];
    }
    const void * v_row(int64_t j, int64_t h, int64_t st) const {
        return (const char *) v->data + j * v->nb[1] + h * v->nb[2] + st * v->nb[3];
    }
    const uint16_t * mask_row(int64_t t, int64_t st) const {
        if (!mask) {
            return nullptr;
        }
        return (const uint16_t *) ((const char *) mask->data + t * mask->nb[1] + (st % mask->ne[3]) * mask->nb[3]);
    }
    // row i of a centroid table ([d + 1 or 2d + 1, n, n_head_kv, ns]: components, size, variances)
    static const float * table_row(const ggml_tensor * t, int64_t i, int64_t h, int64_t st) {
        return (const float *) ((const char *) t->data + i * t->nb[1] + h * t->nb[2] + st * t->nb[3]);
    }
    static const int32_t * map_row(const ggml_tensor * t, int64_t h, int64_t st) {
        return (const int32_t *) ((const char *) t->data + h * t->nb[1] + st * t->nb[2]);
    }
    float logit(const float * qg, const float * krow) const {
        float dot = 0.0f;
        ggml_vec_dot_f32((int) s.d, &dot, 0, qg, 0, krow, 0, 1);
        float x = p.scale * dot;
        if (p.softcap > 0.0f) {
            x = p.softcap * tanhf(x / p.softcap);
        }
        return x;
    }
};

// Adds the variance term var_weight scale^2 / 2 sum_d q_gd^2 D_id to the rule logits z [G][n] of cluster i
// (qsq [G][d]: the squared query components). No-op without var_weight.
void add_variance_term(const centroid_ctx & c, const ggml_tensor * table, int64_t n, int64_t i, int64_t h, int64_t st,
                       const float * qsq, float * z) {
    if (c.p.var_weight <= 0.0f) {
        return;
    }
    const float coef = 0.5f * c.p.var_weight * c.p.scale * c.p.scale;
    const float * var = centroid_ctx::table_row(table, i, h, st) + c.s.d + 1;
    for (int64_t g = 0; g < c.s.group; ++g) {
        float dot = 0.0f;
        ggml_vec_dot_f32((int) c.s.d, &dot, 0, qsq + g * c.s.d, 0, var, 0, 1);
        z[g * n + i] += coef * dot;
    }
}

// The squared query components of the row's heads into qsq [G][d] (the variance term's query side).
void square_queries(const centroid_ctx & c, int64_t h, int64_t t, int64_t st, float * qsq) {
    for (int64_t g = 0; g < c.s.group; ++g) {
        const float * qg = c.q_row(h * c.s.group + g, t, st);
        for (int64_t e = 0; e < c.s.d; ++e) {
            qsq[g * c.s.d + e] = qg[e] * qg[e];
        }
    }
}

// Group score of cluster i from the rule logits z [G][n] (the scaled dot products, plus the variance term): max or
// mean over the heads of exp(z_g[i] - log_z[g]).
float group_score(const centroid_ctx & c, const float * z, int64_t n, int64_t i, const double * log_z) {
    double agg = 0.0;
    for (int64_t g = 0; g < c.s.group; ++g) {
        const double sg = std::exp((double) z[g * n + i] - log_z[g]);
        agg = c.p.group == GGML_CENTROID_GROUP_MAX ? std::max(agg, sg) : agg + sg / (double) c.s.group;
    }
    return (float) agg;
}

// Group scores of the clusters i with live[i] (others get -1): max or mean over the group's heads of
// exp(z_g[i] - log_z[g]). z: [G][n] rule logits (filled here for live clusters).
void group_scores(const centroid_ctx & c, const ggml_tensor * table, int64_t n, const uint8_t * live_of,
                  const double * log_z, int64_t h, int64_t t, int64_t st, const float * qsq, float * z, float * score) {
    const int64_t G = c.s.group, d = c.s.d;
    for (int64_t i = 0; i < n; ++i) {
        score[i] = -1.0f;
        if (!live_of[i]) {
            continue;
        }
        const float * ci = centroid_ctx::table_row(table, i, h, st);
        for (int64_t g = 0; g < G; ++g) {
            float dot = 0.0f;
            ggml_vec_dot_f32((int) d, &dot, 0, c.q_row(h * G + g, t, st), 0, ci, 0, 1);
            z[g * n + i] = c.p.scale * dot;
        }
        add_variance_term(c, table, n, i, h, st, qsq, z);
        score[i] = group_score(c, z, n, i, log_z);
    }
}

// log Z_g = log sum_i N_i exp(scale q_g . C_i) over the live clusters of a table, for every head of the row.
void log_normaliser(const centroid_ctx & c, const ggml_tensor * table, int64_t n, int64_t h, int64_t t, int64_t st,
                    float * z, double * log_z) {
    const int64_t G = c.s.group, d = c.s.d;
    for (int64_t g = 0; g < G; ++g) {
        const float * qg = c.q_row(h * G + g, t, st);
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; ++i) {
            const float * ci = centroid_ctx::table_row(table, i, h, st);
            z[g * n + i] = -INFINITY;
            if (ci[d] > 0.0f) {
                float dot = 0.0f;
                ggml_vec_dot_f32((int) d, &dot, 0, qg, 0, ci, 0, 1);
                z[g * n + i] = c.p.scale * dot;
                mx = std::max(mx, z[g * n + i]);
            }
        }
        double sum = 0.0;
        for (int64_t i = 0; i < n; ++i) {
            if (z[g * n + i] != -INFINITY) {
                sum += (double) centroid_ctx::table_row(table, i, h, st)[d] * std::exp((double) (z[g * n + i] - mx));
            }
        }
        log_z[g] = sum > 0.0 ? (double) mx + std::log(sum) : 0.0;
    }
}

// kept[i] = score[i] >= threshold for the scored clusters (score >= 0), and the best scored one (ties: lower
// index). The coarse level's rule.
void keep_clusters(const float * score, int64_t n, float threshold, uint8_t * kept) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; ++i) {
        kept[i] = score[i] >= 0.0f && score[i] >= threshold;
        if (score[i] >= 0.0f && (best < 0 || score[i] > score[best])) {
            best = i;
        }
    }
    if (best >= 0) {
        kept[best] = 1;
    }
}

// The fine level's budget B = max(1, ceil(keep * N)) for N clustered cells; keep * N in float32, as every backend
// computes it (N is a sum of integer sizes, exact in float below 2^24 cells).
double keep_budget(float keep, double n_clustered) {
    const float prod = keep * (float) n_clustered;
    return std::max(1.0, (double) std::ceil(prod));
}

// The budget rule (ggml-centroid.h, step 3): the scored clusters (score >= 0) in order of score, larger first and
// equal scores by lower index, each kept while the sizes of those before it sum to less than `budget`.
// order: scratch of n int32.
void keep_budget_clusters(const centroid_ctx & c, const float * score, int64_t n, double budget, int64_t h, int64_t st,
                          int32_t * order, uint8_t * kept) {
    int64_t n_scored = 0;
    for (int64_t i = 0; i < n; ++i) {
        kept[i] = 0;
        if (score[i] >= 0.0f) {
            order[n_scored++] = (int32_t) i;
        }
    }
    std::sort(order, order + n_scored, [score](int32_t a, int32_t b) {
        return score[a] > score[b] || (score[a] == score[b] && a < b);
    });
    double before = 0.0;  // sizes of the clusters ahead in the order: integers, exact
    for (int64_t r = 0; r < n_scored && before < budget; ++r) {
        kept[order[r]] = 1;
        before += (double) centroid_ctx::table_row(c.cent, order[r], h, st)[c.s.d];
    }
}

// N: the clustered cells of the row's fine table (the sum of its sizes).
double clustered_cells(const centroid_ctx & c, int64_t h, int64_t st) {
    double n = 0.0;
    for (int64_t i = 0; i < c.s.n_cent; ++i) {
        n += (double) centroid_ctx::table_row(c.cent, i, h, st)[c.s.d];
    }
    return n;
}

// Phase A: the row's kept fine clusters.
void phase_clusters(const centroid_ctx & c, int64_t w, int64_t r, int ith) {
    int64_t h, t, st;
    c.row_coords(r, h, t, st);
    float * th = c.thread(ith);
    float * z = th + c.l.z;
    float * score = th + c.l.score;
    uint8_t * kept = (uint8_t *) (c.row(w) + c.l.kept);
    double * log_z = (double *) (th + c.l.log_z);
    float * qsq = th + c.l.qsq;
    int32_t * order = (int32_t *) (th + c.l.order);
    const int64_t n_cent = c.s.n_cent, d = c.s.d;
    const double budget = keep_budget(c.p.keep, clustered_cells(c, h, st));

    const ggml_tensor * level1 = c.coarse ? c.coarse : c.cent;
    const int64_t n1 = c.coarse ? c.s.n_coarse : n_cent;
    if (c.p.var_weight > 0.0f) {
        square_queries(c, h, t, st, qsq);
    }
    log_normaliser(c, level1, n1, h, t, st, z, log_z);
    // level-1 scores from the normaliser pass's dot products and the variance term (head 0's -inf marks an empty
    // cluster)
    for (int64_t i = 0; i < n1; ++i) {
        if (z[i] == -INFINITY) {
            score[i] = -1.0f;
            continue;
        }
        add_variance_term(c, level1, n1, i, h, st, qsq, z);
        score[i] = group_score(c, z, n1, i, log_z);
    }
    if (!c.coarse) {
        keep_budget_clusters(c, score, n_cent, budget, h, st, order, kept);
        return;
    }
    // two levels: the fine clusters under kept coarse ones, against the coarse normaliser
    uint8_t * kept_c = (uint8_t *) (c.row(w) + c.l.kept_coarse);
    keep_clusters(score, n1, c.p.threshold_coarse, kept_c);
    const int32_t * parent = centroid_ctx::map_row(c.parent, h, st);
    for (int64_t i = 0; i < n_cent; ++i) {
        const int32_t pi = parent[i];
        kept[i] = centroid_ctx::table_row(c.cent, i, h, st)[d] > 0.0f && pi >= 0 && pi < n1 && kept_c[pi];
    }
    group_scores(c, c.cent, n_cent, kept, log_z, h, t, st, qsq, z, score);
    keep_budget_clusters(c, score, n_cent, budget, h, st, order, kept);
}

// Phase B: partial softmax of every head of the row over the selected cells of part `part`.
void phase_part(const centroid_ctx & c, int64_t w, int64_t r, int64_t part, int ith) {
    int64_t h, t, st;
    c.row_coords(r, h, t, st);
    const int64_t G = c.s.group, d_v = c.s.d_v, n_cent = c.s.n_cent;
    float * th = c.thread(ith);
    int32_t * sel = (int32_t *) (th + c.l.sel);
    float * logits = th + c.l.logits;
    float * tmp_k = th + c.l.tmp_k;
    float * tmp_v = th + c.l.tmp_v;
    const uint8_t * kept = (const uint8_t *) (c.row(w) + c.l.kept);
    float * partial = c.row(w) + c.l.partials + part * G * (2 + d_v);  // per head: max, sum, acc[d_v]
    for (int64_t g = 0; g < G; ++g) {
        float * pg = partial + g * (2 + d_v);
        pg[0] = -INFINITY;
        pg[1] = 0.0f;
        std::fill(pg + 2, pg + 2 + d_v, 0.0f);
    }
    const uint16_t * m = c.mask_row(t, st);
    const int32_t * cell = centroid_ctx::map_row(c.cell, h, st);
    const int64_t lo = part * c.s.part_len, hi = std::min(c.s.n_kv, lo + c.s.part_len);
    const size_t k_bytes = c.s.d * ggml_type_size(c.k->type), v_bytes = d_v * ggml_type_size(c.v->type);
    for (int64_t b0 = lo; b0 < hi; b0 += k_block) {
        int32_t n_sel = 0;
        for (int64_t j = b0; j < std::min(hi, b0 + k_block); ++j) {
            const int32_t cl = cell[j];
            if ((!m || m[j] != k_f16_neg_inf) && (cl < 0 || (cl < n_cent && kept[cl]))) {
                sel[n_sel++] = (int32_t) j;
            }
        }
        if (n_sel == 0) {
            continue;
        }
        for (int32_t i = 0; i < std::min(n_sel, k_prefetch_rows); ++i) {
            prefetch_bytes(c.k_row(sel[i], h, st), k_bytes);
        }
        for (int32_t i = 0; i < n_sel; ++i) {
            if (i + k_prefetch_rows < n_sel) {
                prefetch_bytes(c.k_row(sel[i + k_prefetch_rows], h, st), k_bytes);
            }
            prefetch_bytes(c.v_row(sel[i], h, st), v_bytes);
            const float * krow = load_f32(c.k_row(sel[i], h, st), c.k->type, c.s.d, tmp_k);
            for (int64_t g = 0; g < G; ++g) {
                logits[g * k_block + i] = c.logit(c.q_row(h * G + g, t, st), krow);
            }
        }
        // online softmax: rescale each head's running sums to the block's new max, then add the block
        for (int64_t g = 0; g < G; ++g) {
            float * pg = partial + g * (2 + d_v);
            float * lg = logits + g * k_block;
            float mx = pg[0];
            for (int32_t i = 0; i < n_sel; ++i) {
                mx = std::max(mx, lg[i]);
            }
            if (mx > pg[0]) {
                const float f = pg[0] == -INFINITY ? 0.0f : expf(pg[0] - mx);
                pg[1] *= f;
                ggml_vec_scale_f32((int) d_v, pg + 2, f);
                pg[0] = mx;
            }
            float sum = 0.0f;
            for (int32_t i = 0; i < n_sel; ++i) {
                lg[i] = expf(lg[i] - mx);
                sum += lg[i];
            }
            pg[1] += sum;
        }
        for (int32_t i = 0; i < n_sel; ++i) {
            const float * vrow = load_f32(c.v_row(sel[i], h, st), c.v->type, d_v, tmp_v);
            for (int64_t g = 0; g < G; ++g) {
                ggml_vec_mad_f32((int) d_v, partial + g * (2 + d_v) + 2, vrow, logits[g * k_block + i]);
            }
        }
    }
}

// Phase C: head g of the row from the parts' partials.
void phase_merge(const centroid_ctx & c, int64_t w, int64_t r, int64_t g) {
    int64_t h, t, st;
    c.row_coords(r, h, t, st);
    const int64_t G = c.s.group, d_v = c.s.d_v;
    float * out = (float *) ((char *) c.dst->data + (h * G + g) * c.dst->nb[1] + t * c.dst->nb[2] + st * c.dst->nb[3]);
    const float * partials = c.row(w) + c.l.partials;
    float mx = -INFINITY;
    for (int64_t part = 0; part < c.s.n_parts; ++part) {
        mx = std::max(mx, partials[(part * G + g) * (2 + d_v)]);
    }
    std::fill(out, out + d_v, 0.0f);
    if (mx == -INFINITY) {
        return;  // no visible cell selected
    }
    double sum = 0.0;
    for (int64_t part = 0; part < c.s.n_parts; ++part) {
        const float * pg = partials + (part * G + g) * (2 + d_v);
        if (pg[0] == -INFINITY) {
            continue;
        }
        const float f = expf(pg[0] - mx);
        sum += (double) pg[1] * f;
        ggml_vec_mad_f32((int) d_v, out, pg + 2, f);
    }
    ggml_vec_scale_f32((int) d_v, out, (float) (1.0 / sum));
}

}  // namespace

size_t ggml_centroid_attn_cpu_work_size(const ggml_tensor * dst, int n_tasks) {
    return make_layout(make_shape(dst, n_tasks), n_tasks).total_bytes;
}

void ggml_compute_forward_centroid_attn(const ggml_compute_params * params, ggml_tensor * dst) {
    const int ith = params->ith, nth = params->nth;
    centroid_ctx c;
    c.q = dst->src[0]; c.k = dst->src[1]; c.v = dst->src[2]; c.mask = dst->src[3];
    c.cent = dst->src[4]; c.cell = dst->src[5]; c.coarse = dst->src[6]; c.parent = dst->src[7];
    c.dst = dst;
    c.p = ggml_centroid_get_op_params(dst);
    c.s = make_shape(dst, nth);
    c.l = make_layout(c.s, nth);
    GGML_ASSERT(params->wsize >= c.l.total_bytes);
    float * base = (float *) GGML_PAD((uintptr_t) params->wdata, 64);
    c.rows_base = base;
    c.threads_base = base + c.l.row_size * c.s.wave;

    attn_cpu::task_counter tasks{params->threadpool, ith, nth};
    if (ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, nth);
    }
    ggml_barrier(params->threadpool);

    for (int64_t r0 = 0; r0 < c.s.n_rows; r0 += c.s.wave) {
        const int64_t n_w = std::min(c.s.wave, c.s.n_rows - r0);
        tasks.run(n_w, [&](int64_t w) { phase_clusters(c, w, r0 + w, ith); });
        ggml_barrier(params->threadpool);
        tasks.run(n_w * c.s.n_parts, [&](int64_t task) {
            phase_part(c, task / c.s.n_parts, r0 + task / c.s.n_parts, task % c.s.n_parts, ith);
        });
        ggml_barrier(params->threadpool);
        tasks.run(n_w * c.s.group, [&](int64_t task) {
            phase_merge(c, task / c.s.group, r0 + task / c.s.group, task % c.s.group);
        });
        ggml_barrier(params->threadpool);
    }
}
