// Preparing a fixed prefix for centroid-sparse attention (DESIGN.md "Centroid-sparse"), the sidecar file and
// the C API (sparq-llama.h):
//   1. capture: the prefix's last n_calib tokens are removed and decoded again while the graph copies each
//      layer's query rows out (the cache ends as it was; those tokens stay unclustered, read exactly);
//   2. cluster: per layer, the clustered prefix keys of every KV head, gathered from the cache on the backend
//      that holds it, run through the graph k-means (sparq-kmeans.cpp); two levels cluster the centroids again;
//   3. calibrate: one threshold T over all layers, KV heads and calibration rows such that the mean kept
//      fraction of the clustered prefix reaches `keep` (the largest such T, as
//      sparq_llama.reference_squeeze.calibrate_threshold): a histogram of the scores by their float bits, then
//      an exact pass over the one bin where the target is crossed (O(n), no sort of every score; that pass scores
//      only the clusters near the bin, from the normalisers the first pass kept);
//   4. install the tables on the device (sparq-squeeze-state.cpp).
#include "sparq-squeeze.h"
#include "sparq-llama-testing.h"

#include "../sparq-kmeans.h"

#include "ggml-alloc.h"
#include "ggml-centroid.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-memory-hybrid.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
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

// One (layer, KV head)'s calibration work: the logits of every row r = t*G + j (query row t, head j of the group)
// and the cluster sizes, read contiguously.
struct head_logits {
    std::vector<float> q;     // [n_rows*G][d] the group's query rows
    std::vector<float> qsq;   // [n_rows*G][d] their squares (the variance term)
    std::vector<float> top;   // [n_rows*G][n_top] against the top level (the coarse one with two levels): the
                              // normaliser's logits scale q.C
    std::vector<float> top_rule;  // the same plus the variance term (var_weight > 0; else empty: top is the rule)
    std::vector<float> fine;  // [n_rows*G][n_f] rule logits against the fine level (two levels, fine pass only)
    std::vector<float> tmp;   // scratch of the variance term
    std::vector<float> size;  // [n_c + n_f] cluster sizes, the coarse ones first (n_c = 0 with one level)
    double n_total = 0.0;     // the head's clustered keys (the fine sizes' sum)

    // the top level's rule logits (the scores' exponents), per row [n_top]
    const float * top_scores() const { return top_rule.empty() ? top.data() : top_rule.data(); }
};

static void compute_head_logits(const calib_layer & cl, int64_t h, int n_rows, bool coarse_pass, head_logits & hl) {
    const squeeze_kv_layer & L = *cl.L;
    const int64_t d = L.d, G = cl.n_head / L.n_head_kv, n_q = n_rows*G, W = L.width;
    const bool two = L.n_coarse > 0;
    const int64_t n_c = two ? L.n_coarse : 0, n_f = L.n_cent;
    const float * coarse = two ? L.coarse_table.data() + h*n_c*W : nullptr;
    const float * fine = L.table.data() + h*n_f*W;
    const bool var = cl.var_weight > 0.0f;
    GGML_ASSERT(!var || W == 2*d + 1);
    hl.q.resize((size_t) n_q*d);
    for (int64_t t = 0; t < n_rows; ++t) {
        std::memcpy(hl.q.data() + t*G*d, cl.q + (t*cl.n_head + h*G)*d, (size_t) G*d*sizeof(float));
    }
    hl.size.resize((size_t) (n_c + n_f));
    hl.n_total = 0.0;
    for (int64_t i = 0; i < n_c + n_f; ++i) {
        hl.size[i] = i < n_c ? coarse[i*W + d] : fine[(i - n_c)*W + d];
        hl.n_total += i < n_c ? 0.0 : hl.size[i];
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
    const int64_t n_top = two ? n_c : n_f;
    hl.top.resize((size_t) n_q*n_top);
    table_logits(hl.q.data(), n_q, two ? coarse : fine, n_top, W, d, cl.scale, hl.top.data());
    hl.top_rule.clear();
    if (var) {
        hl.top_rule = hl.top;
        add_variance(two ? coarse : fine, n_top, hl.top_rule);
    }
    if (two && !coarse_pass) {
        hl.fine.resize((size_t) n_q*n_f);
        table_logits(hl.q.data(), n_q, fine, n_f, W, d, cl.scale, hl.fine.data());
        if (var) {
            add_variance(fine, n_f, hl.fine);
        }
    }
}

// A calibration row's scores are exp(l - m)/z per head of the group: m the largest logit of the top level, z the
// top level's size-weighted sum of exp(l - m). The histogram pass keeps (m, z) and the best candidate of each
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

// The group scores of calibration row t into comb [n_c + n_f] (coarse clusters first) and its normalisers into
// norm [G]. coarse_pass: the coarse level only (two levels). top_exp: scratch [n_top].
static void group_scores(const calib_layer & cl, int64_t t, int group, bool coarse_pass, const head_logits & hl,
                         double * comb, double * top_exp, row_norm * norm) {
    const squeeze_kv_layer & L = *cl.L;
    const int64_t G = cl.n_head / L.n_head_kv;
    const bool two = L.n_coarse > 0;
    const int64_t n_c = two ? L.n_coarse : 0, n_f = L.n_cent, n_top = two ? n_c : n_f;
    const float * size = hl.size.data();
    for (int64_t j = 0; j < G; ++j) {
        const float * lg = hl.top.data() + (t*G + j)*n_top;
        double m = -INFINITY;
        for (int64_t i = 0; i < n_top; ++i) {
            m = size[i] > 0.0f ? std::max(m, (double) lg[i]) : m;
        }
        // one exp per top-level cluster: the normaliser and the top level's scores share it
        double z = 0.0;
        for (int64_t i = 0; i < n_top; ++i) {
            top_exp[i] = size[i] > 0.0f ? std::exp((double) lg[i] - m) : 0.0;
            z += size[i]*top_exp[i];
        }
        norm[j] = { m, z };
        const float * lr = hl.top_scores() + (t*G + j)*n_top;  // the rule's logits (lg itself without variances)
        for (int64_t i = 0; i < n_top; ++i) {
            if (size[i] > 0.0f) {
                combine(group, G, comb[i], (lr == lg ? top_exp[i] : std::exp((double) lr[i] - m))/z);
            }
        }
        if (two && !coarse_pass) {
            const float * lf = hl.fine.data() + (t*G + j)*n_f;
            for (int64_t i = 0; i < n_f; ++i) {
                if (size[n_c + i] > 0.0f) {
                    combine(group, G, comb[n_c + i], std::exp((double) lf[i] - m)/z);
                }
            }
        }
    }
}

// The candidates of a row's scored level (comb indices [lo, hi)) into cand [hi - lo]: live clusters, and with two
// levels and !coarse_pass only fine clusters under a coarse cluster kept at t_coarse (or the best coarse one).
static void candidates(const calib_layer & cl, int64_t h, bool coarse_pass, float t_coarse, const head_logits & hl,
                       const double * comb, std::vector<char> & cand) {
    const squeeze_kv_layer & L = *cl.L;
    const int64_t n_c = L.n_coarse, n_f = L.n_cent;
    const float * size = hl.size.data();
    if (n_c == 0 || coarse_pass) {
        const int64_t n = n_c == 0 ? n_f : n_c;
        cand.resize(n);
        for (int64_t i = 0; i < n; ++i) {
            cand[i] = size[i] > 0.0f;
        }
        return;
    }
    int64_t best_c = -1;
    for (int64_t c = 0; c < n_c; ++c) {
        if (size[c] > 0.0f && (best_c < 0 || comb[c] > comb[best_c])) {
            best_c = c;
        }
    }
    cand.resize(n_f);
    for (int64_t i = 0; i < n_f; ++i) {
        const int32_t p = L.parent[h*n_f + i];
        // the float score against the float threshold, as the op compares them (the cluster at T itself is kept)
        cand[i] = size[n_c + i] > 0.0f && (p == best_c || (float) comb[p] >= t_coarse);
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

// Histogram pass, one row: the best candidate's weight is always kept (base), the others' weights go to the bins
// of their scores. Weights are fractions of the head's clustered keys.
static void hist_row(const calib_layer & cl, int64_t t, int group, bool coarse_pass, float t_coarse, int64_t h,
                     const head_logits & hl, std::vector<double> & buf, std::vector<char> & cand, head_rows & rows,
                     hist_acc & acc) {
    const int64_t G = cl.n_head / cl.L->n_head_kv, n = (int64_t) hl.size.size();
    const int64_t lo = coarse_pass || cl.L->n_coarse == 0 ? 0 : cl.L->n_coarse;
    buf.assign((size_t) 2*n, 0.0); // [n] combined scores, then [n_top] exps
    double * comb = buf.data();
    group_scores(cl, t, group, coarse_pass, hl, comb, buf.data() + n, rows.norm.data() + t*G);
    candidates(cl, h, coarse_pass, t_coarse, hl, comb, cand);
    int64_t best = -1;
    for (int64_t i = 0; i < (int64_t) cand.size(); ++i) {
        if (cand[i] && (best < 0 || comb[lo + i] > comb[lo + best])) {
            best = i; // ties: the lower index
        }
    }
    rows.best[t] = (int32_t) best;
    if (best < 0) {
        return;
    }
    acc.base += hl.size[lo + best]/hl.n_total;
    acc.n_rows += 1.0;
    for (int64_t i = 0; i < (int64_t) cand.size(); ++i) {
        if (cand[i] && i != best) {
            const float s = (float) comb[lo + i];
            acc.hist[score_bin(s)] += hl.size[lo + i]/hl.n_total;
            acc.max_score = std::max(acc.max_score, s);
        }
    }
}

struct bin_acc {
    uint32_t bin = 0;
    std::vector<std::pair<float, double>> pairs; // (score, weight) of the candidates in the bin
};

// Bin pass, one row: the candidates whose score falls into acc.bin. Only clusters whose logits come within a
// margin of the bin's edges (in log space, from the row's normalisers) are scored; the margin (1e-4) is far above
// the rounding of that test, so no candidate of the bin is skipped, and the scores are the histogram pass's.
static void bin_row(const calib_layer & cl, int64_t t, int group, bool coarse_pass, float t_coarse, int64_t h,
                    const head_logits & hl, std::vector<double> & buf, std::vector<char> & cand, const head_rows & rows,
                    bin_acc & acc) {
    const squeeze_kv_layer & L = *cl.L;
    const int64_t G = cl.n_head / L.n_head_kv, n_c = L.n_coarse, n_f = L.n_cent;
    const bool fine_under_coarse = n_c > 0 && !coarse_pass;
    const int64_t lo = fine_under_coarse ? n_c : 0, n_top = n_c > 0 ? n_c : n_f;
    const row_norm * norm = rows.norm.data() + t*G;
    const int32_t best = rows.best[t];
    if (best < 0) {
        return;
    }
    std::vector<const float *> top(G), scored(G);
    for (int64_t j = 0; j < G; ++j) {
        top[j] = hl.top_scores() + (t*G + j)*n_top;
        scored[j] = fine_under_coarse ? hl.fine.data() + (t*G + j)*n_f : top[j];
    }
    buf.assign((size_t) n_c, 0.0); // the coarse scores that choose the fine candidates
    for (int64_t i = 0; fine_under_coarse && i < n_c; ++i) {
        buf[i] = hl.size[i] > 0.0f ? group_score(top.data(), i, norm, G, group) : 0.0;
    }
    candidates(cl, h, coarse_pass, t_coarse, hl, buf.data(), cand);
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
    for (int64_t i = 0; i < (int64_t) cand.size(); ++i) {
        if (!cand[i] || i == best) {
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
            acc.pairs.emplace_back(s, hl.size[lo + i]/hl.n_total);
        }
    }
}

// Runs row(cl, t, h, hl, buf, cand, rows, acc) over every (layer, KV head, row) on n_threads threads, one
// accumulator per thread; rows: one head_rows per (layer, KV head), in order.
template <typename Acc, typename Row>
std::vector<Acc> score_all(const std::vector<calib_layer> & cls, int n_rows, bool coarse_pass, int n_threads,
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
            std::vector<char> cand;
            head_logits hl;
            for (size_t i = w; i < items.size(); i += n_threads) {
                const calib_layer & cl = cls[items[i].l];
                const int64_t G = cl.n_head / cl.L->n_head_kv;
                compute_head_logits(cl, items[i].h, n_rows, coarse_pass, hl);
                rows[i].norm.resize((size_t) n_rows*G);
                rows[i].best.resize(n_rows);
                for (int t = 0; t < n_rows; ++t) {
                    row(cl, t, items[i].h, hl, buf, cand, rows[i], accs[w]);
                }
            }
        });
    }
    for (auto & th : workers) {
        th.join();
    }
    return accs;
}

// The largest threshold whose mean kept fraction is >= keep; *kept: that mean kept fraction.
static float calibrate(const std::vector<calib_layer> & cls, int n_rows, int group, bool coarse_pass, float t_coarse,
                float keep, int n_threads, float * kept) {
    std::vector<head_rows> rows;
    hist_acc h;
    auto hist = [&](const calib_layer & cl, int t, int64_t head, const head_logits & hl, std::vector<double> & buf,
                    std::vector<char> & cand, head_rows & r, hist_acc & acc) {
        hist_row(cl, t, group, coarse_pass, t_coarse, head, hl, buf, cand, r, acc);
    };
    for (auto & s : score_all(cls, n_rows, coarse_pass, n_threads, hist_acc(), rows, hist)) {
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
        return 0.0f; // every candidate is needed
    }
    bin_acc proto;
    proto.bin = (uint32_t) bin;
    auto in_bin = [&](const calib_layer & cl, int t, int64_t head, const head_logits & hl, std::vector<double> & buf,
                      std::vector<char> & cand, head_rows & r, bin_acc & acc) {
        bin_row(cl, t, group, coarse_pass, t_coarse, head, hl, buf, cand, r, acc);
    };
    std::vector<std::pair<float, double>> pairs;
    for (auto & s : score_all(cls, n_rows, coarse_pass, n_threads, proto, rows, in_bin)) {
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

// Both thresholds (the coarse one first, two levels); returns the mean kept fraction at them.
static float calibrate_levels(const std::vector<calib_layer> & cls, int n_rows, int group, int levels, float keep,
                       float keep_coarse, int n_threads, float * threshold, float * threshold_coarse) {
    float kept = 1.0f;
    *threshold_coarse = 0.0f;
    if (levels == 2) {
        const float keep_c = keep_coarse > 0.0f ? keep_coarse : std::min(1.0f, 2.0f*keep);
        *threshold_coarse = calibrate(cls, n_rows, group, true, 0.0f, keep_c, n_threads, &kept);
    }
    *threshold = calibrate(cls, n_rows, group, false, *threshold_coarse, keep, n_threads, &kept);
    return kept;
}

// ---- clustering ---------------------------------------------------------------------------------------------

struct ctx_free { void operator()(ggml_context * c) const { ggml_free(c); } };
struct buf_free { void operator()(ggml_backend_buffer * b) const { ggml_backend_buffer_free(b); } };
struct galloc_free { void operator()(ggml_gallocr * g) const { ggml_gallocr_free(g); } };

// k-means of one layer's clustered prefix keys, heads [h0, h0 + n_h) of the stream, into res (table and
// assignment for those heads). The keys are gathered from the cache on `backend` (cells given by position).
// Bytes the k-means similarity matrix of one chunk of heads may take: 1 GiB on the CPU; on a GPU a quarter of
// its free memory, within [1, 8] GiB (a 7B-shaped 32k prefix then clusters a layer's 32 KV heads at once
// instead of 7 chunks of 5, each chunk being a gather, a graph and an allocation).
static int64_t similarity_budget(ggml_backend_t backend) {
    const int64_t gib = int64_t(1) << 30;
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    if (dev == nullptr || ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_GPU) {
        return gib;
    }
    size_t free_bytes = 0, total_bytes = 0;
    ggml_backend_dev_memory(dev, &free_bytes, &total_bytes);
    return std::clamp<int64_t>((int64_t) (free_bytes/4), gib, 8*gib);
}

static std::string cluster_heads(ggml_backend_t backend, ggml_tensor * k_cache, uint32_t kv_size, uint32_t stream,
                          int64_t d, int64_t h0, int64_t n_h, const std::vector<uint32_t> & cells, int64_t n_cent,
                          int n_iter, sparq_kmeans_init init, sparq_kmeans_result & res) {
    const int64_t P = (int64_t) cells.size();
    const int64_t n_embd = k_cache->ne[0];
    ggml_init_params ip = { 8*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, /*no_alloc =*/ true };
    std::unique_ptr<ggml_context, ctx_free> ctx(ggml_init(ip));
    ggml_tensor * idx = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, P);
    ggml_tensor * x   = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, d, P, n_h);
    std::unique_ptr<ggml_backend_buffer, buf_free> buf(ggml_backend_alloc_ctx_tensors(ctx.get(), backend));
    if (!buf) {
        return "could not allocate the keys to cluster on " + std::string(ggml_backend_name(backend));
    }
    std::vector<int32_t> rows(cells.begin(), cells.end());
    ggml_backend_tensor_set(idx, rows.data(), 0, ggml_nbytes(idx));

    ggml_cgraph * gf = ggml_new_graph(ctx.get());
    GGML_ASSERT((h0 + n_h)*d <= n_embd);
    // only the chunk's heads of each cell ([d*n_h] of the row's n_embd components) where the type's blocks
    // allow a view from head h0, else whole rows
    const int64_t blck = ggml_blck_size(k_cache->type);
    const bool narrow = (d*h0) % blck == 0 && (d*n_h) % blck == 0;
    const int64_t c0 = narrow ? d*h0 : 0;
    ggml_tensor * ks = ggml_view_2d(ctx.get(), k_cache, narrow ? d*n_h : n_embd, kv_size, k_cache->nb[1],
                                    k_cache->nb[1]*kv_size*stream + ggml_row_size(k_cache->type, c0));
    ggml_tensor * kr = ggml_get_rows(ctx.get(), ks, idx);                                   // [d*n_h or n_embd, P] f32
    ggml_tensor * kh = ggml_view_3d(ctx.get(), kr, d, n_h, P, ggml_row_size(kr->type, d), kr->nb[1],
                                    ggml_row_size(kr->type, d*h0 - c0));                     // [d, n_h, P]
    ggml_build_forward_expand(gf, ggml_cpy(ctx.get(), ggml_permute(ctx.get(), kh, 0, 2, 1, 3), x));
    std::unique_ptr<ggml_gallocr, galloc_free> galloc(ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend)));
    if (!ggml_gallocr_alloc_graph(galloc.get(), gf) || ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
        return "gathering the prefix keys failed on " + std::string(ggml_backend_name(backend));
    }
    return sparq_kmeans_run(backend, x, n_cent, n_iter, res, init, h0);  // problem h is the layer's head h0 + h
}

// Coarse level: k-means of the fine centroids (their components) per head on `backend`; the coarse table is the
// size-weighted mean of the member centroids (= the mean of the member keys), the summed size and (tables with
// variances) the member keys' variances about the coarse centroid, sum_f N_f (D_f + (C_f - C)^2) / N: the law of
// total variance, exact from the fine table.
static std::string cluster_coarse(ggml_backend_t backend, squeeze_kv_layer & L, int64_t n_coarse, int n_iter,
                                  sparq_kmeans_init init) {
    const int64_t d = L.d, H = L.n_head_kv, n = L.n_cent, W = L.width;
    GGML_ASSERT(W == d + 1 || W == 2*d + 1);
    ggml_init_params ip = { 2*ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
    std::unique_ptr<ggml_context, ctx_free> ctx(ggml_init(ip));
    ggml_tensor * x = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, d, n, H);
    std::unique_ptr<ggml_backend_buffer, buf_free> buf(ggml_backend_alloc_ctx_tensors(ctx.get(), backend));
    if (!buf) {
        return "could not allocate the centroids to cluster";
    }
    std::vector<float> comp((size_t) d*n*H);
    for (int64_t r = 0; r < n*H; ++r) {
        std::memcpy(comp.data() + r*d, L.table.data() + r*W, d*sizeof(float));
    }
    ggml_backend_tensor_set(x, comp.data(), 0, ggml_nbytes(x));
    sparq_kmeans_result res;
    std::string err = sparq_kmeans_run(backend, x, n_coarse, n_iter, res, init);
    if (!err.empty()) {
        return err;
    }
    L.n_coarse = n_coarse;
    L.parent = res.assignment;
    L.coarse_table.assign((size_t) H*n_coarse*W, 0.0f);
    std::vector<double> acc((size_t) H*n_coarse*W, 0.0);  // sums of N C (then N (D + (C_f - C)^2)) and N
    for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < n; ++i) {
            const float * c = L.table.data() + (h*n + i)*W;
            double * a = acc.data() + (h*n_coarse + L.parent[h*n + i])*W;
            for (int64_t e = 0; e < d; ++e) {
                a[e] += (double) c[d]*c[e];
            }
            a[d] += c[d];
        }
    }
    for (int64_t r = 0; r < H*n_coarse; ++r) {  // the means
        const double size = acc[r*W + d];
        for (int64_t e = 0; e < d; ++e) {
            acc[r*W + e] = size > 0.0 ? acc[r*W + e]/size : 0.0;
        }
    }
    if (W == 2*d + 1) {
        for (int64_t h = 0; h < H; ++h) {
            for (int64_t i = 0; i < n; ++i) {
                const float * c = L.table.data() + (h*n + i)*W;
                double * a = acc.data() + (h*n_coarse + L.parent[h*n + i])*W;
                for (int64_t e = 0; e < d; ++e) {
                    const double dev = (double) c[e] - a[e];
                    a[d + 1 + e] += (double) c[d]*((double) c[d + 1 + e] + dev*dev);
                }
            }
        }
    }
    for (int64_t r = 0; r < H*n_coarse; ++r) {
        const double size = acc[r*W + d];
        for (int64_t e = 0; e < W; ++e) {
            L.coarse_table[r*W + e] = (float) (e <= d ? acc[r*W + e] : size > 0.0 ? acc[r*W + e]/size : 0.0);
        }
    }
    return "";
}

static bool host_buffer(const ggml_tensor * t) {
    return t->buffer == nullptr || ggml_backend_buffer_is_host(t->buffer);
}

// Whether the device holding this layer's cache can run ggml_centroid_attn on it.
static bool device_runs_op(const ggml_tensor * k_cache, const ggml_tensor * v_cache, int64_t d, int64_t d_v, int64_t n_head,
                    int64_t n_head_kv, bool two_levels) {
    if (host_buffer(k_cache)) {
        return true; // the CPU kernel takes every case the op's check accepts
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(k_cache->buffer));
    if (dev == nullptr) {
        return false;
    }
    ggml_init_params ip = { 12*ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
    std::unique_ptr<ggml_context, ctx_free> ctx(ggml_init(ip));
    const int64_t n = 256;
    ggml_tensor * q    = ggml_new_tensor_4d(ctx.get(), GGML_TYPE_F32, d, 1, n_head, 1);
    ggml_tensor * k    = ggml_new_tensor_4d(ctx.get(), k_cache->type, d, n, n_head_kv, 1);
    ggml_tensor * v    = ggml_new_tensor_4d(ctx.get(), v_cache->type, d_v, n, n_head_kv, 1);
    ggml_tensor * mask = ggml_new_tensor_4d(ctx.get(), GGML_TYPE_F16, n, 1, 1, 1);
    ggml_tensor * cent = ggml_new_tensor_4d(ctx.get(), GGML_TYPE_F32, 2*d + 1, 8, n_head_kv, 1);
    ggml_tensor * cell = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_I32, n, n_head_kv, 1);
    ggml_tensor * coarse = two_levels ? ggml_new_tensor_4d(ctx.get(), GGML_TYPE_F32, 2*d + 1, 2, n_head_kv, 1) : nullptr;
    ggml_tensor * parent = two_levels ? ggml_new_tensor_3d(ctx.get(), GGML_TYPE_I32, 8, n_head_kv, 1) : nullptr;
    ggml_centroid_params p = ggml_centroid_default_params();
    p.threshold = 0.5f;
    p.var_weight = 0.5f;
    if (ggml_centroid_attn_check(q, k, v, mask, cent, cell, coarse, parent, &p) != nullptr) {
        return false;
    }
    ggml_tensor * op = ggml_centroid_attn(ctx.get(), q, k, v, mask, cent, cell, coarse, parent, p);
    return ggml_backend_dev_supports_op(dev, op);
}

// ---- sidecar ------------------------------------------------------------------------------------------------

constexpr char     SIDECAR_MAGIC[4] = { 'S', 'Q', 'Z', 'P' };
constexpr uint32_t SIDECAR_VERSION  = 3;  // 2: + the calibration queries; 3: + var_weight and the tables' variances
                                          // (versions 1 and 2 are still read: the mean rule, tables of width d + 1)

// What a saved prefix must match: the model's shape and description, and a hash of its first token embeddings.
static std::string model_fingerprint(const llama_model & model) {
    const auto & hp = model.hparams;
    std::string fp = model.arch_name() + "|" + model.desc() + "|" + std::to_string(model.n_elements()) + "|" +
                     std::to_string(hp.n_embd) + "|" + std::to_string(hp.n_layer()) + "|";
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        fp += std::to_string(hp.n_head_kv(il)) + "x" + std::to_string(hp.n_embd_head_k(il)) + ",";
    }
    uint64_t hash = 1469598103934665603ull; // FNV-1a
    if (model.tok_embd != nullptr && model.tok_embd->buffer != nullptr) {
        std::vector<uint8_t> bytes(std::min<size_t>(ggml_nbytes(model.tok_embd), 1u << 16));
        ggml_backend_tensor_get(model.tok_embd, bytes.data(), 0, bytes.size());
        for (uint8_t b : bytes) {
            hash = (hash ^ b)*1099511628211ull;
        }
    }
    char hex[24];
    snprintf(hex, sizeof(hex), "%016llx", (unsigned long long) hash);
    return fp + "|" + hex;
}

struct writer {
    FILE * f;
    bool ok = true;
    void raw(const void * p, size_t n) { ok = ok && fwrite(p, 1, n, f) == n; }
    template <typename T> void val(T v) { raw(&v, sizeof(v)); }
    template <typename T> void vec(const std::vector<T> & v) { val<uint64_t>(v.size()); raw(v.data(), v.size()*sizeof(T)); }
    void str(const std::string & s) { val<uint64_t>(s.size()); raw(s.data(), s.size()); }
};

struct reader {
    FILE * f;
    bool ok = true;
    void raw(void * p, size_t n) { ok = ok && fread(p, 1, n, f) == n; }
    template <typename T> T val() { T v{}; raw(&v, sizeof(v)); return v; }
    template <typename T> void vec(std::vector<T> & v, uint64_t max_n) {
        const uint64_t n = val<uint64_t>();
        if (!ok || n > max_n) { ok = false; return; }
        v.resize(n);
        raw(v.data(), n*sizeof(T));
    }
    std::string str(uint64_t max_n) {
        std::string s;
        const uint64_t n = val<uint64_t>();
        if (!ok || n > max_n) { ok = false; return s; }
        s.resize(n);
        raw(s.data(), n);
        return s;
    }
};

struct file_closer { void operator()(FILE * f) const { fclose(f); } };

}  // namespace sparq_squeeze_detail

namespace sqp = sparq_squeeze_detail;

llama_kv_cache * sparq_squeeze_access::cache(llama_context & ctx, std::string & err) {
    llama_memory_i * mem = ctx.memory.get();
    llama_kv_cache * kv = nullptr;
    if (mem == nullptr) {
        err = "the context has no KV cache (an embedding-only or encoder context)";
    } else if (auto * plain = dynamic_cast<llama_kv_cache *>(mem)) {
        kv = plain;
    } else if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        kv = iswa->get_base(); // sliding-window layers read a bounded window: they stay dense
    } else if (auto * hyb = dynamic_cast<llama_memory_hybrid *>(mem)) {
        kv = hyb->get_mem_attn();
    } else {
        err = "this model's memory is not an attention KV cache (recurrent or a special cache)";
    }
    if (kv && kv->other) {
        err = "this KV cache shares its cells with another cache (not supported)";
        kv = nullptr;
    }
    if (kv && kv->v_trans) {
        err = "centroid-sparse attention needs flash attention's row-major V cache; create the context with flash "
              "attention on (-fa on, flash_attn=True, LLAMA_FLASH_ATTN_TYPE_ENABLED)";
        kv = nullptr;
    }
    return kv;
}

void sparq_squeeze_access::reset_graphs(llama_context & ctx) {
    ctx.sched_need_reserve = true;
    for (auto & res : ctx.gf_res_prev) {
        if (res) {
            res->reset();
        }
    }
    ctx.gf_res_prev_active = nullptr;
}

void sparq_squeeze_access::clear(llama_context & ctx) {
    std::string err;
    if (llama_kv_cache * kv = cache(ctx, err)) {
        kv->squeeze.reset();
    }
    reset_graphs(ctx);
}

// Which layers take part; the others stay dense (logged once per reason). Returns how many take part.
int sparq_squeeze_access::select_layers(llama_context & ctx, const llama_kv_cache & kv, squeeze_kv_state & st) {
    const auto & hp = ctx.model.hparams;
    st.layers.resize(kv.layers.size());
    int n_active = 0;
    std::map<std::string, std::string> dense; // reason -> layers
    for (size_t ikv = 0; ikv < kv.layers.size(); ++ikv) {
        const auto & layer = kv.layers[ikv];
        auto & L = st.layers[ikv];
        const uint32_t il = layer.il;
        L.d = hp.n_embd_head_k(il);
        L.n_head_kv = hp.n_head_kv(il);
        const ggml_type kt = layer.k->type;
        if (hp.is_swa(il)) {
            L.reason = "sliding-window layer (its read is bounded)";
        } else if (layer.v == nullptr || (kt != GGML_TYPE_F32 && kt != GGML_TYPE_F16 && kt != GGML_TYPE_BF16) || layer.v->type != kt) {
            L.reason = std::string("KV cache type ") + ggml_type_name(kt) + " (the op reads f32, f16 or bf16 caches)";
        } else if (!sqp::device_runs_op(layer.k, layer.v, L.d, hp.n_embd_head_v(il), hp.n_head(il), L.n_head_kv, st.params.levels == 2)) {
            L.reason = std::string("no ggml_centroid_attn kernel for this case on ") +
                       ggml_backend_buft_name(ggml_backend_buffer_get_type(layer.k->buffer));
        }
        if (!L.reason.empty()) {
            auto & list = dense[L.reason];
            list += (list.empty() ? "" : ",") + std::to_string(il);
            continue;
        }
        L.active = true;
        n_active++;
    }
    for (const auto & [reason, list] : dense) {
        LLAMA_LOG_INFO("%s: centroid-sparse: dense attention for layers %s: %s\n", __func__, list.c_str(), reason.c_str());
    }
    return n_active;
}

// Whether the prefix's tail [n_clustered, ...) can be removed and decoded again as it was decoded: a sliding-window
// layers' cache that keeps only its window (swa_full off) drops positions as decoding goes on, and the tail's first
// token attends to positions from before n_clustered that may be gone (decoding it again would then silently see a
// shorter window and change the prefix's K and V).
std::string sparq_squeeze_access::redecode_check(llama_context & ctx, int32_t seq_id, int32_t n_clustered) {
    auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(llama_get_memory(&ctx));
    if (iswa == nullptr) {
        return "";
    }
    const llama_hparams & hp = ctx.model.hparams;
    llama_pos p_need = n_clustered;  // the lowest position the token at n_clustered attends to in a windowed layer
    while (p_need > 0 && !llama_hparams::is_masked_swa(hp.n_swa, hp.swa_type, p_need - 1, n_clustered)) {
        --p_need;
    }
    const llama_pos p_min = iswa->get_swa()->seq_pos_min(seq_id);
    if (p_need < n_clustered && (p_min < 0 || p_min > p_need)) {
        return "the sliding-window layers' cache keeps only its window and no longer holds position " +
               std::to_string(p_need) + " (it starts at " + std::to_string(p_min) + "), which the calibration "
               "tokens from " + std::to_string(n_clustered) + " attend to: evaluate only the prefix's first " +
               std::to_string(n_clustered) + " tokens before preparing (the rest is decoded then), or make the "
               "context with a full-size sliding-window cache (swa_full, --swa-full)";
    }
    return "";
}

// Step 1: the calibration queries. The prefix's last n_prefix - n_clustered tokens are decoded (again, after their
// removal, unless only [0, n_clustered) is in the cache: tail_in_cache false) while the graph hook copies each
// layer's query rows out: q_rows[il] = [n_calib][n_head][d].
std::string sparq_squeeze_access::capture_queries(llama_context & ctx, squeeze_kv_state & st, const int32_t * tokens,
                                                  bool tail_in_cache, std::map<int32_t, std::vector<float>> & q_rows) {
    const int32_t seq_id = st.seq_id, n_prefix = st.n_prefix, n_clustered = st.n_clustered;
    st.capturing = true;
    reset_graphs(ctx);
    if (tail_in_cache && !llama_memory_seq_rm(llama_get_memory(&ctx), seq_id, n_clustered, -1)) {
        return "this model's memory cannot remove the prefix's last tokens to decode them again (recurrent "
               "layers); centroid-sparse preparation needs that";
    }
    const int32_t n_ub = (int32_t) ctx.cparams.n_ubatch;
    for (int32_t p0 = n_clustered; p0 < n_prefix; p0 += n_ub) {
        const int32_t n = std::min(n_ub, n_prefix - p0);
        llama_batch batch = llama_batch_init(n, 0, 1);
        for (int32_t i = 0; i < n; ++i) {
            batch.token[i] = tokens[p0 + i];
            batch.pos[i] = p0 + i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = seq_id;
            batch.logits[i] = p0 + i == n_prefix - 1;
        }
        batch.n_tokens = n;
        st.captured_q.clear();
        reset_graphs(ctx);  // the graph hook captures while the graph is built: a reused graph would capture nothing
        const int32_t rc = llama_decode(&ctx, batch);
        llama_batch_free(batch);
        if (rc != 0) {
            return "decoding the calibration tokens failed (llama_decode returned " + std::to_string(rc) +
                   "); the cache lost positions from " + std::to_string(p0);
        }
        for (auto & [il, t] : st.captured_q) {
            auto & rows = q_rows[il];
            const size_t off = rows.size();
            rows.resize(off + ggml_nelements(t));
            ggml_backend_tensor_get(t, rows.data() + off, 0, ggml_nbytes(t));
        }
    }
    st.capturing = false;
    st.captured_q.clear();
    reset_graphs(ctx);
    return "";
}

// Step 2: k-means of each active layer's clustered keys (positions [0, n_clustered)) on the backend that holds
// its cache, then the coarse level; progress(f) reports f in [0.05, 0.9] and cancels by returning false.
std::string sparq_squeeze_access::cluster_layers(llama_context & ctx, llama_kv_cache & kv, squeeze_kv_state & st,
                                                 int64_t n_cent, int64_t n_coarse, int n_active,
                                                 const std::function<bool(float)> & progress) {
    std::string err = prefix_cells(kv, st.seq_id, st.n_prefix, st.n_clustered, true, st.stream, st.cells);
    if (!err.empty()) {
        return err;
    }
    const int64_t n_clustered = st.n_clustered;
    const uint32_t kv_size = kv.get_size();
    for (size_t ikv = 0, done = 0; ikv < kv.layers.size(); ++ikv) {
        auto & L = st.layers[ikv];
        if (!L.active) {
            continue;
        }
        const auto & layer = kv.layers[ikv];
        ggml_backend_t backend = backend_for(ctx, layer.k);
        if (backend == nullptr) {
            return "no backend of this context holds layer " + std::to_string(layer.il) + "'s cache";
        }
        L.n_cent = n_cent;
        L.width = 2*L.d + 1;  // the k-means table holds the variances
        L.table.assign((size_t) L.n_head_kv*n_cent*L.width, 0.0f);
        L.assign.assign((size_t) L.n_head_kv*n_clustered, 0);
        // a chunk of heads at a time keeps the similarity matrix [n_cent, P, heads] f32 within the budget
        const int64_t per_head = n_cent*n_clustered*(int64_t) sizeof(float);
        const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(L.n_head_kv, sqp::similarity_budget(backend)/std::max<int64_t>(1, per_head)));
        for (int64_t h0 = 0; h0 < L.n_head_kv; h0 += chunk) {
            const int64_t n_h = std::min(chunk, L.n_head_kv - h0);
            sparq_kmeans_result res;
            res.table_dst = L.table.data() + h0*n_cent*L.width;  // read back in place: [n_h][n_cent][width]
            err = sqp::cluster_heads(backend, layer.k, kv_size, st.stream, L.d, h0, n_h, st.cells, n_cent,
                                     st.params.n_iter, (sparq_kmeans_init) st.params.init, res);
            if (!err.empty()) {
                return "layer " + std::to_string(layer.il) + ": " + err;
            }
            std::copy(res.assignment.begin(), res.assignment.end(), L.assign.begin() + h0*n_clustered);
        }
        if (n_coarse > 0) {
            err = sqp::cluster_coarse(backend, L, n_coarse, st.params.n_iter, (sparq_kmeans_init) st.params.init);
            if (!err.empty()) {
                return "layer " + std::to_string(layer.il) + " (coarse level): " + err;
            }
        }
        if (!progress(0.05f + 0.85f*(float) ++done/(float) n_active)) {
            return "cancelled";
        }
    }
    return "";
}

// Step 3: the thresholds (st.threshold, st.threshold_coarse, st.kept_calib) from the calibration queries in
// st.calib_q at st.params.keep (and keep_coarse).
std::string sparq_squeeze_access::calibrate_layers(llama_context & ctx, const llama_kv_cache & kv, squeeze_kv_state & st) {
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
                                           std::max(1, (int) ctx.cparams.n_threads_batch), &st.threshold,
                                           &st.threshold_coarse);
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
    if (st->calib_q.empty()) {
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
    // graphs carry the threshold: a new generation keeps them from being reused
    st->generation = next_generation();
    reset_graphs(ctx);
    LLAMA_LOG_INFO("%s: centroid-sparse prefix recalibrated to keep %.3g: T = %.4g%s, kept on the calibration queries %.1f%%\n",
                   __func__, (double) keep, (double) st->threshold,
                   st->params.levels == 2 ? (", coarse T = " + std::to_string(st->threshold_coarse)).c_str() : "",
                   100.0*st->kept_calib);
    return "";
}

std::string sparq_squeeze_access::prepare(llama_context & ctx, int32_t seq_id, const int32_t * tokens, int32_t n_prefix,
                                          const llama_squeeze_params & params) {
    if (const char * msg = llama_squeeze_check(&params)) {
        return msg;
    }
    if (tokens == nullptr || n_prefix < 2) {
        return "the prefix needs its tokens and at least 2 of them";
    }
    if (!ctx.cparams.causal_attn) {
        return "the context does not use causal attention (an embedding context)";
    }
    std::string err;
    llama_kv_cache * kv = cache(ctx, err);
    if (kv == nullptr) {
        return err;
    }
    const int32_t n_calib     = llama_squeeze_n_calib(&params, n_prefix);
    const int32_t n_clustered = n_prefix - n_calib;
    const int64_t n_cent      = std::max<int64_t>(1, std::lround((double) params.centroids*n_clustered));
    const int64_t n_coarse    = params.levels == 2 ? std::max<int64_t>(1, std::min<int64_t>(n_cent,
                                    std::lround((double) params.centroids_coarse*n_clustered))) : 0;

    auto st = std::make_shared<squeeze_kv_state>();
    st->params      = params;
    st->generation  = next_generation();
    st->seq_id      = seq_id;
    st->n_prefix    = n_prefix;
    st->n_clustered = n_clustered;
    st->tokens.assign(tokens, tokens + n_prefix);
    // the cache holds the prefix (its tail is decoded again), or only [0, n_clustered) (the tail is decoded here)
    std::vector<uint32_t> cells;
    const bool tail_in_cache = seq_id < 0 || (uint32_t) seq_id >= kv->n_seq_max ||
                               kv->v_cells[kv->seq_to_stream[seq_id]].seq_pos_max(seq_id) + 1 != n_clustered;
    err = prefix_cells(*kv, seq_id, tail_in_cache ? n_prefix : n_clustered, tail_in_cache ? n_prefix : n_clustered,
                       /*only_prefix =*/ true, st->stream, cells);
    if (err.empty() && tail_in_cache) {
        err = redecode_check(ctx, seq_id, n_clustered);
    }
    if (!err.empty()) {
        return err;
    }

    const int n_active = select_layers(ctx, *kv, *st);
    if (n_active == 0) {
        return "no layer can use centroid-sparse attention (see the log)";
    }

    auto progress = [&](float f) {
        return params.progress_callback == nullptr || params.progress_callback(f, params.progress_callback_user_data);
    };
    auto fail = [&](const std::string & why) {
        kv->squeeze.reset();
        reset_graphs(ctx);
        return why;
    };

    // phase_us: microseconds spent in capture, clustering, calibration and install (logged below)
    int64_t phase_us[4] = { 0, 0, 0, 0 };
    int64_t t_us = ggml_time_us();
    auto phase_done = [&](int phase) {
        const int64_t now = ggml_time_us();
        phase_us[phase] = now - t_us;
        t_us = now;
    };

    kv->squeeze = st; // the graph hook captures the queries through it
    err = capture_queries(ctx, *st, tokens, tail_in_cache, st->calib_q);
    phase_done(0);
    if (!err.empty()) {
        return fail(err);
    }
    st->calib_scale = std::move(st->captured_scale);
    st->captured_scale.clear();
    for (size_t ikv = 0; ikv < kv->layers.size(); ++ikv) {  // keep the active layers' queries only
        if (!st->layers[ikv].active) {
            st->calib_q.erase((int32_t) kv->layers[ikv].il);
            st->calib_scale.erase((int32_t) kv->layers[ikv].il);
        }
    }
    if (!progress(0.05f)) {
        return fail("cancelled");
    }
    err = cluster_layers(ctx, *kv, *st, n_cent, n_coarse, n_active, progress);
    phase_done(1);
    if (err.empty()) {
        err = calibrate_layers(ctx, *kv, *st);
        phase_done(2);
    }
    if (err.empty()) {
        err = install(*kv, *st);
        phase_done(3);
    }
    if (!err.empty()) {
        return fail(err);
    }
    reset_graphs(ctx);
    progress(1.0f);
    LLAMA_LOG_INFO("%s: centroid-sparse prefix of sequence %d: %d tokens (%d clustered into %lld clusters per KV head%s, "
                   "%d calibration tokens), %d layers, T = %.4g%s, kept on the calibration queries %.1f%%\n", __func__,
            seq_id, n_prefix, n_clustered, (long long) n_cent, n_coarse ? (", " + std::to_string(n_coarse) + " coarse").c_str() : "",
            n_calib, n_active, (double) st->threshold,
            n_coarse ? (", coarse T = " + std::to_string(st->threshold_coarse)).c_str() : "", 100.0*st->kept_calib);
    LLAMA_LOG_INFO("%s: centroid-sparse preparation phases: capture %.2f s, clustering %.2f s, calibration %.2f s "
                   "(%d threads), install %.2f s\n", __func__, 1e-6*(double) phase_us[0], 1e-6*(double) phase_us[1],
            1e-6*(double) phase_us[2], (int) ctx.cparams.n_threads_batch, 1e-6*(double) phase_us[3]);
    return "";
}

ggml_backend_t sparq_squeeze_access::backend_for(llama_context & ctx, const ggml_tensor * t) {
    if (sqp::host_buffer(t)) {
        return ctx.backend_cpu;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
    for (auto & b : ctx.backends) {
        if (ggml_backend_get_device(b.get()) == dev) {
            return b.get();
        }
    }
    return nullptr;
}

std::string sparq_squeeze_access::save(llama_context & ctx, const char * path) {
    std::string err;
    llama_kv_cache * kv = cache(ctx, err);
    if (kv == nullptr) {
        return err;
    }
    verify(*kv);
    const squeeze_kv_state * st = kv->squeeze.get();
    if (st == nullptr || !st->ready) {
        return "no prepared prefix to save";
    }
    std::unique_ptr<FILE, sqp::file_closer> f(fopen(path, "wb"));
    if (!f) {
        return std::string("cannot write ") + path + ": " + strerror(errno);
    }
    sqp::writer w{ f.get() };
    w.raw(sqp::SIDECAR_MAGIC, 4);
    w.val<uint32_t>(sqp::SIDECAR_VERSION);
    w.str(sqp::model_fingerprint(ctx.model));
    const auto & p = st->params;
    w.val(p.centroids); w.val(p.keep); w.val(p.levels); w.val(p.centroids_coarse); w.val(p.keep_coarse);
    w.val(p.n_calib); w.val(p.n_iter); w.val(p.group); w.val(p.var_weight);
    w.val(st->n_prefix); w.val(st->n_clustered);
    w.val(st->threshold); w.val(st->threshold_coarse); w.val(st->kept_calib);
    w.vec(st->tokens);
    w.val<uint32_t>((uint32_t) st->layers.size());
    for (size_t ikv = 0; ikv < st->layers.size(); ++ikv) {
        const auto & L = st->layers[ikv];
        w.val<uint32_t>(kv->layers[ikv].il);
        w.val<uint8_t>(L.active ? 1 : 0);
        w.str(L.reason);
        w.val(L.d); w.val(L.n_head_kv); w.val(L.n_cent); w.val(L.n_coarse); w.val(L.width);
        w.vec(L.table); w.vec(L.assign); w.vec(L.coarse_table); w.vec(L.parent);
    }
    w.val<uint32_t>((uint32_t) st->calib_q.size());
    for (const auto & [il, q] : st->calib_q) {
        w.val<int32_t>(il);
        w.val<float>(st->calib_scale.at(il));
        w.vec(q);
    }
    if (!w.ok || fflush(f.get()) != 0) {
        return std::string("writing ") + path + " failed";
    }
    return "";
}

std::string sparq_squeeze_access::load(llama_context & ctx, int32_t seq_id, const char * path, const int32_t * tokens,
                                       int32_t n_tokens) {
    std::string err;
    llama_kv_cache * kv = cache(ctx, err);
    if (kv == nullptr) {
        return err;
    }
    std::unique_ptr<FILE, sqp::file_closer> f(fopen(path, "rb"));
    if (!f) {
        return std::string("cannot read ") + path + ": " + strerror(errno);
    }
    sqp::reader r{ f.get() };
    char magic[4] = {};
    r.raw(magic, 4);
    if (!r.ok || std::memcmp(magic, sqp::SIDECAR_MAGIC, 4) != 0) {
        return std::string(path) + " is not a centroid-sparse prefix file";
    }
    const uint32_t version = r.val<uint32_t>();
    const uint32_t swapped = ((version & 0xFFu) << 24) | ((version & 0xFF00u) << 8) | ((version >> 8) & 0xFF00u) |
                             (version >> 24);
    if ((version < 1 || version > sqp::SIDECAR_VERSION) && swapped >= 1 && swapped <= sqp::SIDECAR_VERSION) {
        // the file holds its numbers in the writer's byte order (as llama.cpp's state files do)
        return std::string(path) + " was written on a machine of the other byte order; prepare the prefix again here";
    }
    if (version < 1 || version > sqp::SIDECAR_VERSION) {
        return std::string(path) + ": format version " + std::to_string(version) + ", this build reads versions 1 to " +
               std::to_string(sqp::SIDECAR_VERSION);
    }
    if (r.str(1u << 20) != sqp::model_fingerprint(ctx.model)) {
        return std::string(path) + " was prepared with a different model (the fingerprint differs)";
    }
    auto st = std::make_shared<squeeze_kv_state>();
    auto & p = st->params;
    p = llama_squeeze_default_params();
    p.centroids = r.val<float>(); p.keep = r.val<float>(); p.levels = r.val<int32_t>();
    p.centroids_coarse = r.val<float>(); p.keep_coarse = r.val<float>(); p.n_calib = r.val<int32_t>();
    p.n_iter = r.val<int32_t>(); p.group = r.val<int32_t>();
    p.var_weight = version >= 3 ? r.val<float>() : 0.0f;  // older files: the mean rule, whose thresholds they hold
    st->n_prefix = r.val<int32_t>(); st->n_clustered = r.val<int32_t>();
    st->threshold = r.val<float>(); st->threshold_coarse = r.val<float>(); st->kept_calib = r.val<float>();
    r.vec(st->tokens, 1u << 30);
    if (!r.ok || st->n_clustered < 1 || st->n_clustered > st->n_prefix || (int32_t) st->tokens.size() != st->n_prefix ||
        llama_squeeze_check(&p) != nullptr) {
        return std::string(path) + " is truncated or damaged";
    }
    if (tokens != nullptr) {
        if (n_tokens < st->n_prefix || !std::equal(st->tokens.begin(), st->tokens.end(), tokens)) {
            return std::string(path) + " holds a different prefix than the given tokens (" + std::to_string(st->n_prefix) +
                   " saved tokens)";
        }
    }
    const uint32_t n_layers = r.val<uint32_t>();
    if (!r.ok || n_layers != kv->layers.size()) {
        return std::string(path) + ": the layer count differs from this context's cache";
    }
    const auto & hp = ctx.model.hparams;
    st->layers.resize(n_layers);
    for (uint32_t ikv = 0; ikv < n_layers; ++ikv) {
        auto & L = st->layers[ikv];
        const uint32_t il = r.val<uint32_t>();
        L.active = r.val<uint8_t>() != 0;
        L.reason = r.str(1u << 12);
        L.d = r.val<int64_t>(); L.n_head_kv = r.val<int64_t>(); L.n_cent = r.val<int64_t>(); L.n_coarse = r.val<int64_t>();
        L.width = version >= 3 ? r.val<int64_t>() : L.d + 1;
        const uint64_t max_n = uint64_t(1) << 36;
        r.vec(L.table, max_n); r.vec(L.assign, max_n); r.vec(L.coarse_table, max_n); r.vec(L.parent, max_n);
        if (!r.ok || il != kv->layers[ikv].il || L.d != hp.n_embd_head_k(il) || L.n_head_kv != hp.n_head_kv(il)) {
            return std::string(path) + " is truncated, damaged or from a different cache layout (layer " + std::to_string(il) + ")";
        }
        if (L.active && ((L.width != L.d + 1 && L.width != 2*L.d + 1) || (p.var_weight > 0.0f && L.width != 2*L.d + 1) ||
                         (int64_t) L.table.size() != L.n_head_kv*L.n_cent*L.width ||
                         (int64_t) L.assign.size() != L.n_head_kv*st->n_clustered ||
                         (int64_t) L.coarse_table.size() != L.n_head_kv*L.n_coarse*L.width ||
                         (int64_t) L.parent.size() != (L.n_coarse > 0 ? L.n_head_kv*L.n_cent : 0))) {
            return std::string(path) + ": layer " + std::to_string(il) + "'s tables have inconsistent sizes";
        }
        for (int32_t a : L.assign) {
            if (a < 0 || a >= L.n_cent) {
                return std::string(path) + ": layer " + std::to_string(il) + " has a cluster index out of range";
            }
        }
        if (L.active && !sqp::device_runs_op(kv->layers[ikv].k, kv->layers[ikv].v, L.d, hp.n_embd_head_v(il), hp.n_head(il),
                                             L.n_head_kv, L.n_coarse > 0)) {
            L.active = false;
            L.reason = "no ggml_centroid_attn kernel for this case on this device";
        }
    }
    if (version >= 2) {
        const uint32_t n_q = r.val<uint32_t>();
        for (uint32_t i = 0; r.ok && i < n_q; ++i) {
            const int32_t il = r.val<int32_t>();
            const float scale = r.val<float>();
            std::vector<float> q;
            r.vec(q, uint64_t(1) << 36);
            const squeeze_kv_layer * L = nullptr;
            for (uint32_t ikv = 0; ikv < n_layers; ++ikv) {
                L = (int32_t) kv->layers[ikv].il == il ? &st->layers[ikv] : L;
            }
            if (!r.ok || L == nullptr || il < 0 || (int64_t) q.size() !=
                    (int64_t) (st->n_prefix - st->n_clustered)*hp.n_head(il)*L->d) {
                return std::string(path) + " is truncated or damaged (calibration queries)";
            }
            st->calib_q[il] = std::move(q);
            st->calib_scale[il] = scale;
        }
        if (!r.ok) {
            return std::string(path) + " is truncated or damaged (calibration queries)";
        }
    }
    st->generation = next_generation();
    st->seq_id = seq_id;
    err = prefix_cells(*kv, seq_id, st->n_clustered, st->n_clustered, false, st->stream, st->cells);
    if (!err.empty()) {
        return err + " (load the KV state of the prefix before its sidecar)";
    }
    kv->squeeze.reset();
    err = install(*kv, *st);
    if (!err.empty()) {
        return err;
    }
    kv->squeeze = st;
    reset_graphs(ctx);
    LLAMA_LOG_INFO("%s: centroid-sparse prefix of sequence %d loaded from %s: %d tokens, T = %.4g\n", __func__, seq_id, path,
                   st->n_prefix, (double) st->threshold);
    return "";
}

//
// C API
//

static thread_local std::string g_squeeze_error;

int32_t sparq_squeeze_result(const char * fn, const std::string & err) {
    if (err.empty()) {
        g_squeeze_error.clear();
        return 0;
    }
    LLAMA_LOG_ERROR("%s: %s\n", fn, err.c_str());
    g_squeeze_error = err;
    return -1;
}

struct llama_squeeze_params llama_squeeze_default_params(void) {
    llama_squeeze_params p = {};
    p.centroids        = 0.05f;
    p.keep             = 0.1f;
    p.levels           = 1;
    p.centroids_coarse = 0.01f;
    p.keep_coarse      = 0.0f;
    p.n_calib          = 100;
    p.n_iter           = 8;
    p.group            = GGML_CENTROID_GROUP_MAX;
    p.var_weight       = 1.0f;
    p.init             = LLAMA_SQUEEZE_INIT_EVEN;
    p.progress_callback = nullptr;
    p.progress_callback_user_data = nullptr;
    return p;
}

const char * llama_squeeze_check(const struct llama_squeeze_params * p) {
    static thread_local char msg[256];
    auto fail = [&](const char * fmt, auto... args) {
        snprintf(msg, sizeof(msg), fmt, args...);
        return msg;
    };
    if (p == nullptr) {
        return "params is NULL";
    }
    if (!(p->centroids > 0.0f && p->centroids <= 1.0f)) {
        return fail("centroids must be in (0, 1] (a fraction of the prefix), got %g", (double) p->centroids);
    }
    if (!(p->keep > 0.0f && p->keep <= 1.0f)) {
        return fail("keep must be in (0, 1], got %g", (double) p->keep);
    }
    if (p->levels != 1 && p->levels != 2) {
        return fail("levels must be 1 or 2, got %d", p->levels);
    }
    if (p->levels == 2 && !(p->centroids_coarse > 0.0f && p->centroids_coarse <= p->centroids)) {
        return fail("centroids_coarse must be in (0, centroids=%g], got %g", (double) p->centroids, (double) p->centroids_coarse);
    }
    if (!(p->keep_coarse >= 0.0f && p->keep_coarse <= 1.0f)) {
        return fail("keep_coarse must be in [0, 1] (0: min(1, 2*keep)), got %g", (double) p->keep_coarse);
    }
    if (p->n_calib < 1) {
        return fail("n_calib must be >= 1, got %d", p->n_calib);
    }
    if (p->n_iter < 1) {
        return fail("n_iter must be >= 1, got %d", p->n_iter);
    }
    if (p->group != GGML_CENTROID_GROUP_MAX && p->group != GGML_CENTROID_GROUP_MEAN) {
        return fail("group must be max (0) or mean (1), got %d", p->group);
    }
    if (!(p->var_weight >= 0.0f && p->var_weight <= 100.0f)) {
        return fail("var_weight must be in [0, 100] (0: the mean rule), got %g", (double) p->var_weight);
    }
    if (p->init != LLAMA_SQUEEZE_INIT_EVEN && p->init != LLAMA_SQUEEZE_INIT_KPP) {
        return fail("init must be even (0) or kpp (1), got %d", p->init);
    }
    return nullptr;
}

int32_t llama_squeeze_prepare(struct llama_context * ctx, int32_t seq_id, const int32_t * tokens, int32_t n_prefix,
                              const struct llama_squeeze_params * params) {
    if (ctx == nullptr || params == nullptr) {
        return sparq_squeeze_result(__func__, "ctx and params must not be NULL");
    }
    ctx->synchronize();
    return sparq_squeeze_result(__func__, sparq_squeeze_access::prepare(*ctx, seq_id, tokens, n_prefix, *params));
}

int32_t llama_squeeze_save(struct llama_context * ctx, const char * path) {
    if (ctx == nullptr || path == nullptr) {
        return sparq_squeeze_result(__func__, "ctx and path must not be NULL");
    }
    return sparq_squeeze_result(__func__, sparq_squeeze_access::save(*ctx, path));
}

int32_t llama_squeeze_recalibrate(struct llama_context * ctx, float keep, float keep_coarse) {
    if (ctx == nullptr) {
        return sparq_squeeze_result(__func__, "ctx must not be NULL");
    }
    ctx->synchronize();
    return sparq_squeeze_result(__func__, sparq_squeeze_access::recalibrate(*ctx, keep, keep_coarse));
}

int32_t llama_squeeze_load(struct llama_context * ctx, int32_t seq_id, const char * path, const int32_t * tokens,
                           int32_t n_tokens) {
    if (ctx == nullptr || path == nullptr) {
        return sparq_squeeze_result(__func__, "ctx and path must not be NULL");
    }
    ctx->synchronize();
    return sparq_squeeze_result(__func__, sparq_squeeze_access::load(*ctx, seq_id, path, tokens, n_tokens));
}

int32_t llama_squeeze_set_prefill(struct llama_context * ctx, enum llama_squeeze_prefill mode) {
    if (ctx == nullptr) {
        return sparq_squeeze_result(__func__, "ctx must not be NULL");
    }
    if (mode != LLAMA_SQUEEZE_PREFILL_AUTO && mode != LLAMA_SQUEEZE_PREFILL_SPARSE && mode != LLAMA_SQUEEZE_PREFILL_DENSE) {
        return sparq_squeeze_result(__func__, "mode must be LLAMA_SQUEEZE_PREFILL_AUTO, _SPARSE or _DENSE, got " +
                                    std::to_string((int) mode));
    }
    std::string err;
    llama_kv_cache * kv = sparq_squeeze_access::cache(*ctx, err);
    if (kv == nullptr) {
        return sparq_squeeze_result(__func__, err);
    }
    ctx->synchronize();
    sparq_squeeze_access::verify(*kv);
    squeeze_kv_state * st = kv->squeeze.get();
    if (st == nullptr || !st->ready) {
        return sparq_squeeze_result(__func__, "no prepared prefix (llama_squeeze_prepare or llama_squeeze_load first)");
    }
    if (st->prefill != mode) {
        st->prefill = mode;
        st->generation = sparq_squeeze_access::next_generation();  // graphs built for the other mode are not reused
    }
    return sparq_squeeze_result(__func__, "");
}

void llama_squeeze_clear(struct llama_context * ctx) {
    if (ctx != nullptr) {
        sparq_squeeze_access::clear(*ctx);
    }
}

struct llama_squeeze_info llama_squeeze_get_info(const struct llama_context * ctx) {
    llama_squeeze_info info = {};
    std::string err;
    llama_kv_cache * kv = ctx ? sparq_squeeze_access::cache(const_cast<llama_context &>(*ctx), err) : nullptr;
    if (kv == nullptr) {
        return info;
    }
    sparq_squeeze_access::verify(*kv);
    const squeeze_kv_state * st = kv->squeeze.get();
    if (st == nullptr || !st->ready) {
        return info;
    }
    info.prepared         = true;
    info.seq_id           = st->seq_id;
    info.n_prefix         = st->n_prefix;
    info.n_clustered      = st->n_clustered;
    info.levels           = st->params.levels;
    info.threshold        = st->threshold;
    info.prefill          = st->prefill;
    info.threshold_coarse = st->threshold_coarse;
    info.kept_calib       = st->kept_calib;
    info.var_weight       = st->params.var_weight;
    for (const auto & L : st->layers) {
        info.n_layers += L.active ? 1 : 0;
    }
    return info;
}

bool llama_squeeze_seq_sparse(const struct llama_context * ctx, int32_t seq_id) {
    std::string err;
    llama_kv_cache * kv = ctx ? sparq_squeeze_access::cache(const_cast<llama_context &>(*ctx), err) : nullptr;
    if (kv == nullptr) {
        return false;
    }
    sparq_squeeze_access::verify(*kv);
    return sparq_squeeze_access::seq_sparse(*kv, seq_id);
}

int32_t llama_squeeze_n_calib(const struct llama_squeeze_params * params, int32_t n_prefix) {
    return params == nullptr ? 0 : std::max(0, std::min(params->n_calib, n_prefix/2));
}

const char * llama_squeeze_last_error(void) {
    return g_squeeze_error.c_str();
}

int sparq_llama_eval_squeeze_calibrate(const struct squeeze_calib_args * a, char * err, size_t err_size) {
    auto fail = [&](const char * msg) {
        snprintf(err, err_size, "%s", msg);
        return 1;
    };
    if (a == nullptr || a->q == nullptr || a->table == nullptr || !a->threshold || !a->threshold_coarse || !a->kept) {
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
                                     std::max(1, a->n_threads), a->threshold, a->threshold_coarse);
    return 0;
}
