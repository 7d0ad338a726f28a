// The coarse threshold calibration of a two-level prepared prefix (docs/design.md, "Prepared prefixes"): one
// threshold T over all layers, KV heads and calibration rows such that the mean share of the clustered prefix under
// the kept coarse clusters reaches `keep_coarse` (the largest such T, as
// sparq_llama.reference_squeeze.calibrate_threshold; the fine level is kept by the op's per-row budget): a histogram of the scores by their float
// bits, then an exact pass over the one bin where the target is crossed (O(n), no sort of every score; that pass
// scores only the clusters near the bin, from the normalisers the first pass kept). Also recalibration of a
// prepared prefix at a new keep, and its evaluation over host arrays for tests (sparq-llama-testing.h).
#include "sparq-squeeze.h"
#include "sparq-llama-testing.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <thread>

namespace sparq_squeeze_detail {

// ---- calibration -------------------------------------------------------------------------------------------

// Per layer: the calibration queries and the tables the scores are taken against.
struct calib_layer {
    const squeeze_kv_layer * L;
    const float * q = nullptr;  // [n_rows][n_head][d], owned by the caller (the prepared state, or the eval's input)
    int64_t n_head = 0;
    float   scale  = 0.0f;
    float   var_weight = 0.0f;  // the kept rule's variance term (tables of width 2d + 1)
};

// ---- the scores of one (layer, KV head) ----------------------------------------------------------------------

// out[r] = q_r . c for NR query rows q [NR][d], with 8 independent partial sums per row: one running sum is a
// chain of dependent adds (one add per add latency); these vectorise and pipeline.
template <int NR>
#if defined(__GNUC__)
__attribute__((always_inline)) inline // into each build of table_logits
#endif
static void dot_rows(const float * q, int64_t d, const float * c, float * out) {
    int64_t e = 0;
#if defined(__GNUC__)
    // GCC and Clang vector extensions of 4 floats, the width every target has (SSE, NEON): the compiler keeps the
    // sums in registers, which it does not do for a plain float array of them (nor for wider vectors on SSE)
    typedef float f32x4 __attribute__((vector_size(16), aligned(4), may_alias));
    f32x4 acc0[NR] = {}, acc1[NR] = {};
    for (; e + 8 <= d; e += 8) {
        const f32x4 c0 = *(const f32x4 *) (c + e), c1 = *(const f32x4 *) (c + e + 4);
        for (int r = 0; r < NR; ++r) {
            acc0[r] += *(const f32x4 *) (q + r*d + e)*c0;
            acc1[r] += *(const f32x4 *) (q + r*d + e + 4)*c1;
        }
    }
    for (int r = 0; r < NR; ++r) {
        const f32x4 a = acc0[r] + acc1[r];
        out[r] = (a[0] + a[1]) + (a[2] + a[3]);
    }
#else
    for (int r = 0; r < NR; ++r) {
        out[r] = 0.0f;
    }
#endif
    for (int r = 0; r < NR; ++r) {
        float sum[8] = {};
        for (int64_t f = e; f < d; ++f) {
            sum[f % 8] += q[r*d + f]*c[f];
        }
        out[r] += ((sum[0] + sum[4]) + (sum[1] + sum[5])) + ((sum[2] + sum[6]) + (sum[3] + sum[7]));
    }
}

// out[r*n + i] = scale * q_r . C_i for the query rows q [n_q][d] and the n rows C_i = table + i*stride (d floats
// each). Blocks of 4 query rows: a centroid is read once per block, not once per row.
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
// most of the calibration's time: an FMA build besides the baseline one, chosen when the library loads
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
static void table_logits(const float * q, int64_t n_q, const float * table, int64_t n, int64_t stride, int64_t d,
                         float scale, float * out) {
    constexpr int NR = 4;
    float dots[NR];
    int64_t r = 0;
    for (; r + NR <= n_q; r += NR) {
        for (int64_t i = 0; i < n; ++i) {
            dot_rows<NR>(q + r*d, d, table + i*stride, dots);
            for (int k = 0; k < NR; ++k) {
                out[(r + k)*n + i] = scale*dots[k];
            }
        }
    }
    for (; r < n_q; ++r) {
        for (int64_t i = 0; i < n; ++i) {
            dot_rows<1>(q + r*d, d, table + i*stride, dots);
            out[r*n + i] = scale*dots[0];
        }
    }
}

// One (layer, KV head)'s calibration work: the coarse logits of every row r = t*G + j (query row t, head j of the
// group) and the coarse cluster sizes, read contiguously.
struct head_logits {
    std::vector<float> q;     // [n_rows*G][d] the group's query rows
    std::vector<float> qsq;   // [n_rows*G][d] their squares (the variance term)
    std::vector<float> top;   // [n_rows*G][n_c] against the coarse level: the normaliser's logits scale q.C
    std::vector<float> top_rule;  // the same plus the variance term (var_weight > 0; else empty: top is the rule)
    std::vector<float> tmp;   // scratch of the variance term
    std::vector<float> size;  // [n_c] coarse cluster sizes
    double n_total = 0.0;     // the head's clustered keys (the coarse sizes' sum)

    // the top level's rule logits (the scores' exponents), per row [n_top]
    const float * top_scores() const { return top_rule.empty() ? top.data() : top_rule.data(); }
};

static void compute_head_logits(const calib_layer & cl, int64_t h, int n_rows, head_logits & hl) {
    const squeeze_kv_layer & L = *cl.L;
    const int64_t d = L.d, G = cl.n_head / L.n_head_kv, n_q = n_rows*G, W = L.width;
    const int64_t n_c = L.n_coarse;
    GGML_ASSERT(n_c > 0);
    const float * coarse = L.coarse_table.data() + h*n_c*W;
    const bool var = cl.var_weight > 0.0f;
    GGML_ASSERT(!var || W == 2*d + 1);
    hl.q.resize((size_t) n_q*d);
    for (int64_t t = 0; t < n_rows; ++t) {
        std::memcpy(hl.q.data() + t*G*d, cl.q + (t*cl.n_head + h*G)*d, (size_t) G*d*sizeof(float));
    }
    hl.size.resize((size_t) n_c);
    hl.n_total = 0.0;
    for (int64_t i = 0; i < n_c; ++i) {
        hl.size[i] = coarse[i*W + d];
        hl.n_total += hl.size[i];
    }
    // the variance term var_weight scale^2 / 2 (q*q) . D_i added to logits [n_q][n] of the table's rows
    const float coef = 0.5f*cl.var_weight*cl.scale*cl.scale;
    auto add_variance = [&](const float * table, int64_t n, std::vector<float> & logits) {
        hl.tmp.resize((size_t) n_q*n);
        table_logits(hl.qsq.data(), n_q, table + d + 1, n, W, d, coef, hl.tmp.data());
        for (size_t e = 0; e < hl.tmp.size(); ++e) {
            logits[e] += hl.tmp[e];
        }
    };
    if (var) {
        hl.qsq.resize(hl.q.size());
        for (size_t e = 0; e < hl.q.size(); ++e) {
            hl.qsq[e] = hl.q[e]*hl.q[e];
        }
    }
    hl.top.resize((size_t) n_q*n_c);
    table_logits(hl.q.data(), n_q, coarse, n_c, W, d, cl.scale, hl.top.data());
    hl.top_rule.clear();
    if (var) {
        hl.top_rule = hl.top;
        add_variance(coarse, n_c, hl.top_rule);
    }
}

// A calibration row's scores are exp(l - m)/z per head of the group: m the largest coarse logit, z the coarse
// level's size-weighted sum of exp(l - m). The histogram pass keeps (m, z) and the best candidate of each
// row so that the bin pass scores, bit for bit alike, only the clusters that may fall into its bin.
struct row_norm { double m, z; };
struct head_rows {
    std::vector<row_norm> norm;  // [n_rows][G]
    std::vector<int32_t>  best;  // [n_rows] the best candidate (comb index), -1: none
};

static void combine(int group, int64_t G, double & c, double s) {
    c = group == GGML_CENTROID_GROUP_MEAN ? c + s/G : std::max(c, s);
}

// The group score of cluster i from its logits lg[j][i] and the row's normalisers.
static double group_score(const float * const * lg, int64_t i, const row_norm * norm, int64_t G, int group) {
    double c = 0.0;
    for (int64_t j = 0; j < G; ++j) {
        combine(group, G, c, std::exp((double) lg[j][i] - norm[j].m)/norm[j].z);
    }
    return c;
}

// The coarse group scores of calibration row t into comb [n_c] and its normalisers into norm [G]. top_exp: scratch
// [n_c].
static void group_scores(const calib_layer & cl, int64_t t, int group, const head_logits & hl, double * comb,
                         double * top_exp, row_norm * norm) {
    const squeeze_kv_layer & L = *cl.L;
    const int64_t G = cl.n_head / L.n_head_kv, n_c = L.n_coarse;
    const float * size = hl.size.data();
    for (int64_t j = 0; j < G; ++j) {
        const float * lg = hl.top.data() + (t*G + j)*n_c;
        double m = -INFINITY;
        for (int64_t i = 0; i < n_c; ++i) {
            m = size[i] > 0.0f ? std::max(m, (double) lg[i]) : m;
        }
        // one exp per coarse cluster: the normaliser and the scores share it
        double z = 0.0;
        for (int64_t i = 0; i < n_c; ++i) {
            top_exp[i] = size[i] > 0.0f ? std::exp((double) lg[i] - m) : 0.0;
            z += size[i]*top_exp[i];
        }
        norm[j] = { m, z };
        const float * lr = hl.top_scores() + (t*G + j)*n_c;  // the rule's logits (lg itself without variances)
        for (int64_t i = 0; i < n_c; ++i) {
            if (size[i] > 0.0f) {
                combine(group, G, comb[i], (lr == lg ? top_exp[i] : std::exp((double) lr[i] - m))/z);
            }
        }
    }
}

struct hist_acc {
    std::vector<double> hist = std::vector<double>(1u << 16, 0.0);
    double base = 0.0, n_rows = 0.0;
    float  max_score = 0.0f;
};

static uint32_t score_bin(float s) {
    uint32_t bits;
    std::memcpy(&bits, &s, sizeof(bits));
    return bits >> 16; // scores are >= 0: the float bits order them
}

// Histogram pass, one row: the best live coarse cluster's weight is always kept (base), the others' weights go to
// the bins of their scores. Weights are fractions of the head's clustered keys.
static void hist_row(const calib_layer & cl, int64_t t, int group, const head_logits & hl, std::vector<double> & buf,
                     head_rows & rows, hist_acc & acc) {
    const int64_t G = cl.n_head / cl.L->n_head_kv, n = (int64_t) hl.size.size();
    buf.assign((size_t) 2*n, 0.0); // [n] combined scores, then [n] exps
    double * comb = buf.data();
    group_scores(cl, t, group, hl, comb, buf.data() + n, rows.norm.data() + t*G);
    int64_t best = -1;
    for (int64_t i = 0; i < n; ++i) {
        if (hl.size[i] > 0.0f && (best < 0 || comb[i] > comb[best])) {
            best = i; // ties: the lower index
        }
    }
    rows.best[t] = (int32_t) best;
    if (best < 0) {
        return;
    }
    acc.base += hl.size[best]/hl.n_total;
    acc.n_rows += 1.0;
    for (int64_t i = 0; i < n; ++i) {
        if (hl.size[i] > 0.0f && i != best) {
            const float s = (float) comb[i];
            acc.hist[score_bin(s)] += hl.size[i]/hl.n_total;
            acc.max_score = std::max(acc.max_score, s);
        }
    }
}

struct bin_acc {
    uint32_t bin = 0;
    std::vector<std::pair<float, double>> pairs; // (score, weight) of the clusters in the bin
};

// Bin pass, one row: the live coarse clusters whose score falls into acc.bin. Only clusters whose logits come within
// a margin of the bin's edges (in log space, from the row's normalisers) are scored; the margin (1e-4) is far above
// the rounding of that test, so no cluster of the bin is skipped, and the scores are the histogram pass's.
static void bin_row(const calib_layer & cl, int64_t t, int group, const head_logits & hl, const head_rows & rows,
                    bin_acc & acc) {
    const squeeze_kv_layer & L = *cl.L;
    const int64_t G = cl.n_head / L.n_head_kv, n_c = L.n_coarse;
    const row_norm * norm = rows.norm.data() + t*G;
    const int32_t best = rows.best[t];
    if (best < 0) {
        return;
    }
    std::vector<const float *> scored(G);
    for (int64_t j = 0; j < G; ++j) {
        scored[j] = hl.top_scores() + (t*G + j)*n_c;
    }
    // the bin's scores [s_lo, s_hi) as logits per head: l in [lo_j, hi_j); a mean over G heads is below s_hi only
    // if every head's score is below G*s_hi
    const uint32_t bits_lo = acc.bin << 16, bits_hi = (acc.bin + 1) << 16;
    float s_lo, s_hi;
    std::memcpy(&s_lo, &bits_lo, sizeof(s_lo));
    std::memcpy(&s_hi, &bits_hi, sizeof(s_hi));
    const double hi_factor = group == GGML_CENTROID_GROUP_MEAN ? (double) G : 1.0, margin = 1e-4;
    std::vector<double> l_lo(G), l_hi(G);
    for (int64_t j = 0; j < G; ++j) {
        l_lo[j] = norm[j].m + std::log((double) s_lo*norm[j].z) - margin;
        l_hi[j] = norm[j].m + std::log(hi_factor*s_hi*norm[j].z) + margin;
    }
    for (int64_t i = 0; i < n_c; ++i) {
        if (!(hl.size[i] > 0.0f) || i == best) {
            continue;
        }
        bool reaches_lo = false, below_hi = true;
        for (int64_t j = 0; j < G; ++j) {
            reaches_lo = reaches_lo || scored[j][i] >= l_lo[j];
            below_hi = below_hi && scored[j][i] < l_hi[j];
        }
        if (!reaches_lo || !below_hi) {
            continue;
        }
        const float s = (float) group_score(scored.data(), i, norm, G, group);
        if (score_bin(s) == acc.bin) {
            acc.pairs.emplace_back(s, hl.size[i]/hl.n_total);
        }
    }
}

// Runs row(cl, t, hl, buf, rows, acc) over every (layer, KV head, row) on n_threads threads, one accumulator per
// thread; rows: one head_rows per (layer, KV head), in order.
template <typename Acc, typename Row>
std::vector<Acc> score_all(const std::vector<calib_layer> & cls, int n_rows, int n_threads,
                           const Acc & proto, std::vector<head_rows> & rows, const Row & row) {
    struct item { size_t l; int64_t h; };
    std::vector<item> items;
    for (size_t l = 0; l < cls.size(); ++l) {
        for (int64_t h = 0; h < cls[l].L->n_head_kv; ++h) {
            items.push_back({ l, h });
        }
    }
    rows.resize(items.size());
    n_threads = std::max(1, std::min<int>(n_threads, (int) items.size()));
    std::vector<Acc> accs(n_threads, proto);
    std::vector<std::thread> workers;
    for (int w = 0; w < n_threads; ++w) {
        workers.emplace_back([&, w] {
            std::vector<double> buf;
            head_logits hl;
            for (size_t i = w; i < items.size(); i += n_threads) {
                const calib_layer & cl = cls[items[i].l];
                const int64_t G = cl.n_head / cl.L->n_head_kv;
                compute_head_logits(cl, items[i].h, n_rows, hl);
                rows[i].norm.resize((size_t) n_rows*G);
                rows[i].best.resize(n_rows);
                for (int t = 0; t < n_rows; ++t) {
                    row(cl, t, hl, buf, rows[i], accs[w]);
                }
            }
        });
    }
    for (auto & th : workers) {
        th.join();
    }
    return accs;
}

// The largest coarse threshold whose mean kept fraction (of the clustered cells under the kept coarse clusters) is
// >= keep; *kept: that mean kept fraction.
static float calibrate(const std::vector<calib_layer> & cls, int n_rows, int group, float keep, int n_threads,
                       float * kept) {
    std::vector<head_rows> rows;
    hist_acc h;
    auto hist = [&](const calib_layer & cl, int t, const head_logits & hl, std::vector<double> & buf, head_rows & r,
                    hist_acc & acc) {
        hist_row(cl, t, group, hl, buf, r, acc);
    };
    for (auto & s : score_all(cls, n_rows, n_threads, hist_acc(), rows, hist)) {
        for (size_t b = 0; b < h.hist.size(); ++b) {
            h.hist[b] += s.hist[b];
        }
        h.base += s.base;
        h.n_rows += s.n_rows;
        h.max_score = std::max(h.max_score, s.max_score);
    }
    if (h.n_rows == 0.0) {
        *kept = 1.0f;
        return 0.0f;
    }
    const double target = (double) keep*h.n_rows - h.base;
    if (keep >= 1.0f) {
        *kept = 1.0f;
        return 0.0f;
    }
    if (target <= 1e-12*h.n_rows) {
        *kept = (float) (h.base/h.n_rows);
        return std::nextafter(h.max_score, INFINITY); // only the best cluster of each row
    }
    double cum = 0.0;
    int64_t bin = (int64_t) h.hist.size() - 1;
    for (; bin >= 0; --bin) {
        if (cum + h.hist[bin] >= target - 1e-12*h.n_rows) {
            break;
        }
        cum += h.hist[bin];
    }
    if (bin < 0) {
        *kept = (float) ((h.base + cum)/h.n_rows);
        return 0.0f; // every cluster is needed
    }
    bin_acc proto;
    proto.bin = (uint32_t) bin;
    auto in_bin = [&](const calib_layer & cl, int t, const head_logits & hl, std::vector<double> &, head_rows & r,
                      bin_acc & acc) {
        bin_row(cl, t, group, hl, r, acc);
    };
    std::vector<std::pair<float, double>> pairs;
    for (auto & s : score_all(cls, n_rows, n_threads, proto, rows, in_bin)) {
        pairs.insert(pairs.end(), s.pairs.begin(), s.pairs.end());
    }
    std::sort(pairs.begin(), pairs.end(), [](const auto & a, const auto & b) { return a.first > b.first; });
    float t = pairs.empty() ? 0.0f : pairs.back().first;
    for (size_t i = 0; i < pairs.size(); ++i) {
        cum += pairs[i].second;
        if (cum >= target - 1e-12*h.n_rows) {
            t = pairs[i].first;
            for (size_t j = i + 1; j < pairs.size() && pairs[j].first == t; ++j) {
                cum += pairs[j].second; // ties with T are kept too
            }
            break;
        }
    }
    *kept = (float) std::min(1.0, (h.base + cum)/h.n_rows);
    return t;
}

// The coarse threshold (two levels; 0 with one level: the fine level is kept by the op's per-row budget, which
// needs no calibration); returns the mean share of the clustered cells under the kept coarse clusters (1 with one
// level).
static float calibrate_levels(const std::vector<calib_layer> & cls, int n_rows, int group, int levels, float keep,
                       float keep_coarse, int n_threads, float * threshold_coarse) {
    float kept = 1.0f;
    *threshold_coarse = 0.0f;
    if (levels == 2) {
        const float keep_c = keep_coarse > 0.0f ? keep_coarse : std::min(1.0f, 2.0f*keep);
        *threshold_coarse = calibrate(cls, n_rows, group, keep_c, n_threads, &kept);
    }
    return kept;
}

}  // namespace sparq_squeeze_detail

namespace sqp = sparq_squeeze_detail;

// Step 3: two levels, the coarse threshold (st.threshold_coarse, st.kept_calib) from the calibration queries in
// st.calib_q at st.params.keep_coarse.
std::string sparq_squeeze_access::calibrate_layers(llama_context & ctx, const llama_kv_cache & kv, squeeze_kv_state & st) {
    if (st.params.levels != 2) {  // one level: nothing to calibrate (the op's per-row budget)
        st.threshold_coarse = 0.0f;
        st.kept_calib = 1.0f;
        return "";
    }
    const auto & hp = ctx.model.hparams;
    const int32_t n_calib = st.n_prefix - st.n_clustered;
    std::vector<sqp::calib_layer> cls;
    for (size_t ikv = 0; ikv < kv.layers.size(); ++ikv) {
        const auto & L = st.layers[ikv];
        const uint32_t il = kv.layers[ikv].il;
        if (!L.active) {
            continue;
        }
        auto it = st.calib_q.find((int32_t) il);
        if (it == st.calib_q.end() || st.calib_scale.count((int32_t) il) == 0) {
            return "layer " + std::to_string(il) + "'s queries were not captured (its graph does not reach "
                   "llama.cpp's KV attention)";
        }
        sqp::calib_layer cl;
        cl.L      = &L;
        cl.n_head = hp.n_head(il);
        cl.scale  = st.calib_scale.at((int32_t) il);
        cl.var_weight = st.params.var_weight;
        cl.q      = it->second.data();
        if ((int64_t) it->second.size() != (int64_t) n_calib*cl.n_head*L.d) {
            return "layer " + std::to_string(il) + ": captured query rows have an unexpected size";
        }
        cls.push_back(std::move(cl));
    }
    st.kept_calib = sqp::calibrate_levels(cls, n_calib, st.params.group, st.params.levels, st.params.keep, st.params.keep_coarse,
                                           std::max(1, (int) ctx.cparams.n_threads_batch), &st.threshold_coarse);
    return "";
}

std::string sparq_squeeze_access::recalibrate(llama_context & ctx, float keep, float keep_coarse) {
    std::string err;
    llama_kv_cache * kv = cache(ctx, err);
    if (kv == nullptr) {
        return err;
    }
    verify(*kv);
    squeeze_kv_state * st = kv->squeeze.get();
    if (st == nullptr || !st->ready) {
        return "no prepared prefix to recalibrate";
    }
    if (st->calib_q.empty() && st->params.levels == 2) {
        return "this prefix was loaded from a sidecar without its calibration queries (format version 1): prepare it "
               "again, or save it with this build, to recalibrate";
    }
    llama_squeeze_params p = st->params;
    p.keep        = keep;
    p.keep_coarse = keep_coarse;
    if (const char * msg = llama_squeeze_check(&p)) {
        return msg;
    }
    const llama_squeeze_params before = st->params;
    st->params = p;
    err = calibrate_layers(ctx, *kv, *st);
    if (!err.empty()) {
        st->params = before;
        return err;
    }
    // graphs carry keep and the coarse threshold: a new generation keeps them from being reused
    st->generation = next_generation();
    reset_graphs(ctx);
    LLAMA_LOG_INFO("%s: centroid-sparse prefix set to keep %.3g%s\n", __func__, (double) keep,
                   st->params.levels == 2 ? (", coarse T = " + std::to_string(st->threshold_coarse) + ", under kept "
                                            "coarse clusters on the calibration queries " +
                                            std::to_string(100.0*st->kept_calib) + "%").c_str() : "");
    return "";
}

int sparq_llama_eval_squeeze_calibrate(const struct squeeze_calib_args * a, char * err, size_t err_size) {
    auto fail = [&](const char * msg) {
        snprintf(err, err_size, "%s", msg);
        return 1;
    };
    if (a == nullptr || a->q == nullptr || a->table == nullptr || !a->threshold_coarse || !a->kept) {
        return fail("args, q, table and the outputs are required");
    }
    const bool two = a->n_coarse > 0;
    if (a->d < 1 || a->n_head_kv < 1 || a->n_head % a->n_head_kv != 0 || a->n_rows < 1 || a->n_layers < 1 ||
        a->n_cent < 1 || a->n_coarse < 0 || (two && (!a->coarse || !a->parent)) || !(a->keep > 0.0f && a->keep <= 1.0f)) {
        return fail("bad sizes, missing two-level tables or keep outside (0, 1]");
    }
    const int64_t d = a->d, H = a->n_head_kv, W = a->table_width > 0 ? a->table_width : d + 1;
    if ((W != d + 1 && W != 2*d + 1) || !(a->var_weight >= 0.0f) || (a->var_weight > 0.0f && W != 2*d + 1)) {
        return fail("table_width must be d + 1 or 2d + 1 (needed for var_weight > 0), var_weight >= 0");
    }
    std::vector<squeeze_kv_layer> layers(a->n_layers);
    std::vector<sqp::calib_layer> cls(a->n_layers);
    for (int64_t l = 0; l < a->n_layers; ++l) {
        auto & L = layers[l];
        L.d = d; L.n_head_kv = H; L.n_cent = a->n_cent; L.n_coarse = a->n_coarse; L.width = W;
        const size_t nt = (size_t) H*a->n_cent*W;
        L.table.assign(a->table + l*nt, a->table + (l + 1)*nt);
        if (two) {
            const size_t nc = (size_t) H*a->n_coarse*W, np = (size_t) H*a->n_cent;
            L.coarse_table.assign(a->coarse + l*nc, a->coarse + (l + 1)*nc);
            L.parent.assign(a->parent + l*np, a->parent + (l + 1)*np);
            for (int32_t p : L.parent) {
                if (p < 0 || p >= a->n_coarse) {
                    return fail("parent index out of range");
                }
            }
        }
        const size_t nq = (size_t) a->n_rows*a->n_head*d;
        cls[l].L = &L;
        cls[l].n_head = a->n_head;
        cls[l].scale = a->scale;
        cls[l].var_weight = a->var_weight;
        cls[l].q = a->q + l*nq;
    }
    *a->kept = sqp::calibrate_levels(cls, (int) a->n_rows, a->group, two ? 2 : 1, a->keep, a->keep_coarse,
                                     std::max(1, a->n_threads), a->threshold_coarse);
    return 0;
}
