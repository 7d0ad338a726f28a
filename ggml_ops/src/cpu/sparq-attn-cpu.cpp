// CPU kernel of ggml_sparq_attn. Semantics: ggml_ops/include/ggml-sparq.h and docs/design.md, "SparQ: op semantics".
//
// Work is organised in "rows": one row = (KV head h, query row t, stream s); all query heads of h's
// group are handled together because they share the selection. Rows are processed in waves of W rows
// so scratch stays bounded for long multi-row (prefill) batches. Each wave runs four phases separated
// by barriers; within a phase, threads take tasks dynamically:
//   0. per row:            I1 (top-k1 components of sum_g |q_g|) and the scaled query components (not with the
//                          q4 index, which scores every component)
//   A. per (row, chunk):   approximate (or exact) scores of a chunk of cells, exponentiated against the
//                          chunk's max, with the chunk's sum: the softmax normaliser comes out of this pass
//   B. per row:            merge chunk normalisers, combined group score, O(n) top-k selection, alpha, mean V
//   C. per (row, q head):  exact attention over the selected cells, Sparse-V threshold, mean reallocation
// Splitting phase A along the sequence keeps every thread busy with one KV head and one query.
#include "sparq-attn-cpu.h"

#include "attn-cpu-common.h"
#include "ggml-sparq.h"

#include "ggml-cpu.h"
#include "ggml-cpu/ggml-cpu-impl.h"
#include "ggml-cpu/vec.h"
#include "ggml-impl.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>

namespace {

// Cells per phase-A task: long enough that each K^T row read is a long contiguous burst (DRAM streams,
// few TLB misses), short enough that a wave still gives every thread several tasks.
constexpr int64_t k_chunk_max = 32768;
constexpr int64_t k_chunk_min = 256;
constexpr int64_t k_wave_bytes = 8 << 20;  // scratch budget for the scores of one wave of rows
constexpr int64_t k_kt_sub   = 32;   // phase A converts K^T rows to f32 in sub-blocks of this many cells
                                     // (32 and 64 measured fastest of 32..2048 on a 2-core AVX-512 machine)
static_assert(k_kt_sub % 32 == 0 && k_chunk_min % k_kt_sub == 0, "sub-blocks hold whole q8_0 index blocks");
constexpr int64_t k_kt_block = 8;    // K^T components accumulated per pass over the scores (loop below is for 8)
constexpr int32_t k_prefetch_rows = 8;  // phase C: K rows of I2 requested this far ahead
constexpr uint16_t k_f16_neg_inf = 0xFC00;
constexpr int64_t k_max_head_dim = 1024;  // phase 0 keeps |q| sums on the stack
constexpr int64_t k_select_sample = 1024;  // selection threshold from about this many sampled scores

enum row_kind : int32_t { ROW_EMPTY = 0, ROW_DENSE = 1, ROW_SPARSE = 2 };

using attn_cpu::load_f32;
using attn_cpu::pad16;
using attn_cpu::prefetch_bytes;

struct sparq_shape {
    int64_t d, d_v, n_q, n_head, n_head_kv, ns, n_kv, group, chunk, chunk_shift, n_chunks, n_rows, wave;
};

// Offsets (in 4-byte units) of one wave row's scratch, and of one thread's scratch.
struct sparq_layout {
    size_t qs, i1, e, cstat, i2, alpha, vmean, kind, row_size;
    size_t tmp, pairs, factor, logits, acc, thread_size;
    size_t total_bytes;
};

sparq_shape make_shape(const ggml_tensor * dst, int n_tasks) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[3];
    sparq_shape s;
    s.d         = q->ne[0];
    s.n_q       = q->ne[1];
    s.n_head    = q->ne[2];
    s.ns        = q->ne[3];
    s.n_kv      = k->ne[1];
    s.n_head_kv = k->ne[2];
    s.d_v       = v->ne[0];
    s.group     = s.n_head / s.n_head_kv;
    s.n_rows    = s.n_head_kv * s.n_q * s.ns;
    // as many rows per wave as the scratch budget allows (fewer barriers, better balance: a decode step is
    // usually one wave), but at least enough to feed every thread in phases B and C
    const int64_t row_bytes_est = 4 * (s.group * s.n_kv + 1024);
    s.wave      = std::min<int64_t>(s.n_rows, std::max<int64_t>(2 * n_tasks, k_wave_bytes / row_bytes_est));
    s.chunk     = k_chunk_max;
    while (s.chunk > k_chunk_min && s.wave * ((s.n_kv + s.chunk - 1) / s.chunk) < 4 * n_tasks) {
        s.chunk /= 2;
    }
    s.n_chunks  = (s.n_kv + s.chunk - 1) / s.chunk;
    s.chunk_shift = 0;
    while ((int64_t(1) << s.chunk_shift) < s.chunk) {
        ++s.chunk_shift;
    }
    return s;
}

bool is_q4_index(const ggml_tensor * kt) { return kt && kt->type == GGML_TYPE_I8; }

sparq_layout make_layout(const sparq_shape & s, const ggml_sparq_op_params & p, bool q4_index, int n_tasks) {
    sparq_layout l;
    size_t o = 0;
    l.qs    = o; o += pad16(s.group * p.k1);
    l.i1    = o; o += pad16(p.k1);
    l.e     = o; o += pad16(s.group * s.n_kv);
    l.cstat = o; o += pad16(s.group * s.n_chunks * 2);
    l.i2    = o; o += pad16(p.k2 + 1);           // [0] = count, then the cells
    l.alpha = o; o += pad16(s.group);
    l.vmean = o; o += pad16(s.d_v);
    l.kind  = o; o += pad16(1);
    l.row_size = o;

    o = 0;
    // q4 index: a block's scales [d] f32, one head's products [d] f32 and coefficients [d] i8
    const int64_t q4_tmp = q4_index ? 3 * s.d : 0;
    const size_t conv = pad16(std::max<int64_t>({k_kt_block * k_kt_sub, s.d, s.d_v, q4_tmp}));
    l.tmp    = o; o += conv;
    l.pairs  = o; o += pad16(2 * s.n_kv);        // uint64 (score, cell) pairs for the selection
    l.factor = o; o += pad16(s.group * s.n_chunks) + pad16(s.n_kv);  // chunk factors, then candidate scores
    l.logits = o; o += pad16(std::max<int64_t>(p.k2, 1));
    l.acc    = o; o += pad16(s.d_v);
    l.thread_size = o;

    l.total_bytes = 4 * (l.row_size * s.wave + l.thread_size * n_tasks) + 64;
    return l;
}

// Max of x[0..n): independent lanes so the compiler vectorises it without reassociating (ggml's
// ggml_vec_max_f32 is a scalar loop).
float max_f32(const float * x, int64_t n) {
    constexpr int lanes = 16;
    float acc[lanes];
    std::fill(acc, acc + lanes, -INFINITY);
    int64_t j = 0;
    for (; j + lanes <= n; j += lanes) {
        for (int u = 0; u < lanes; ++u) {
            acc[u] = acc[u] > x[j + u] ? acc[u] : x[j + u];
        }
    }
    float mx = -INFINITY;
    for (; j < n; ++j) {
        mx = std::max(mx, x[j]);
    }
    for (int u = 0; u < lanes; ++u) {
        mx = std::max(mx, acc[u]);
    }
    return mx;
}

struct sparq_ctx {
    const ggml_tensor *q, *k, *kt, *v, *mask, *vsum, *pos, *kstat;
    ggml_tensor * dst;
    ggml_sparq_op_params p;
    sparq_shape s;
    sparq_layout l;
    float * rows_base;     // wave scratch
    float * threads_base;  // per-thread scratch

    // row r -> (h, t, s): heads fastest so a wave of decode rows spans heads
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
    const void * kt_row(int64_t i, int64_t h, int64_t st) const {
        return (const char *) kt->data + i * kt->nb[1] + h * kt->nb[2] + st * kt->nb[3];
    }
    const void * v_row(int64_t j, int64_t h, int64_t st) const {
        return (const char *) v->data + j * v->nb[1] + h * v->nb[2] + st * v->nb[3];
    }
    const int32_t * pos_row(int64_t st) const {
        return pos ? (const int32_t *) ((const char *) pos->data + (st % pos->ne[3]) * pos->nb[3]) : nullptr;
    }
    const uint16_t * mask_row(int64_t t, int64_t st) const {
        if (!mask) {
            return nullptr;
        }
        return (const uint16_t *) ((const char *) mask->data + t * mask->nb[1] + (st % mask->ne[3]) * mask->nb[3]);
    }
    bool needs_scores() const { return p.policy != GGML_SPARQ_POLICY_WINDOW || p.mean_on; }

    float exact_logit(const float * qg, const float * krow) const {
        float dot = 0.0f;
        ggml_vec_dot_f32((int) s.d, &dot, 0, qg, 0, krow, 0, 1);
        float logit = p.scale * dot;
        if (p.softcap > 0.0f) {
            logit = p.softcap * tanhf(logit / p.softcap);
        }
        return logit;
    }
};

// sigma_i of the row's visible keys: from the running sums (kstat: S1, S2, n) or, without them, from K itself
void key_sigma(const sparq_ctx & c, int64_t h, int64_t t, int64_t st, int ith, float * sigma) {
    const int64_t d = c.s.d;
    double s1[k_max_head_dim], s2[k_max_head_dim], n = 0.0;
    if (c.kstat) {
        const float * ks = (const float *) ((const char *) c.kstat->data + h * c.kstat->nb[1] + t * c.kstat->nb[2] +
                                            st * c.kstat->nb[3]);
        for (int64_t i = 0; i < d; ++i) {
            s1[i] = ks[i];
            s2[i] = ks[d + i];
        }
        n = ks[2 * d];
    } else {
        std::fill(s1, s1 + d, 0.0);
        std::fill(s2, s2 + d, 0.0);
        const uint16_t * m = c.mask_row(t, st);
        float * tmp = c.thread(ith) + c.l.tmp;
        for (int64_t j = 0; j < c.s.n_kv; ++j) {
            if (m && m[j] == k_f16_neg_inf) {
                continue;
            }
            const float * krow = load_f32(c.k_row(j, h, st), c.k->type, d, tmp);
            for (int64_t i = 0; i < d; ++i) {
                s1[i] += krow[i];
                s2[i] += (double) krow[i] * krow[i];
            }
            n += 1.0;
        }
    }
    for (int64_t i = 0; i < d; ++i) {
        const double mean = n > 0.0 ? s1[i] / n : 0.0;
        const double var  = n > 0.0 ? s2[i] / n - mean * mean : 0.0;
        sigma[i] = (float) sqrt(var > 0.0 ? var : 0.0);
    }
}

// Phase 0: I1 and the query components scaled by scale / sqrt(rho_g).
void phase_query(const sparq_ctx & c, int64_t w, int64_t r, int ith) {
    int64_t h, t, st;
    c.row_coords(r, h, t, st);
    float * rs = c.row(w);
    int32_t * i1 = (int32_t *) (rs + c.l.i1);
    float * qs = rs + c.l.qs;
    const int64_t d = c.s.d, k1 = c.p.k1;
    const bool qsigma = c.p.select == GGML_SPARQ_SELECT_QSIGMA;

    float sigma[k_max_head_dim];
    if (qsigma) {
        key_sigma(c, h, t, st, ith, sigma);
    }
    float absum[k_max_head_dim];
    int32_t order[k_max_head_dim];
    std::fill(absum, absum + d, 0.0f);
    for (int64_t g = 0; g < c.s.group; ++g) {
        const float * qg = c.q_row(h * c.s.group + g, t, st);
        for (int64_t i = 0; i < d; ++i) {
            absum[i] += fabsf(qg[i]);
        }
    }
    if (qsigma) {
        for (int64_t i = 0; i < d; ++i) {
            absum[i] *= sigma[i];
        }
    }
    for (int64_t i = 0; i < d; ++i) {
        order[i] = (int32_t) i;
    }
    std::partial_sort(order, order + k1, order + d, [&](int32_t x, int32_t y) {
        return absum[x] > absum[y] || (absum[x] == absum[y] && x < y);
    });
    std::sort(order, order + k1);
    std::copy(order, order + k1, i1);

    // rho_g: the share of |q_g| on I1 (q), or of the score's variance sum_i (q_i sigma_i)^2 (qsigma)
    for (int64_t g = 0; g < c.s.group; ++g) {
        const float * qg = c.q_row(h * c.s.group + g, t, st);
        auto weight = [&](int64_t i) {
            return qsigma ? (double) qg[i] * qg[i] * sigma[i] * sigma[i] : (double) fabsf(qg[i]);
        };
        double all = 0.0, sel = 0.0;
        for (int64_t i = 0; i < d; ++i) {
            all += weight(i);
        }
        for (int64_t i = 0; i < k1; ++i) {
            sel += weight(i1[i]);
        }
        const double rho = all > 0.0 ? sel / all : 1.0;
        const float factor = (float) (c.p.scale / sqrt(rho > 0.0 ? rho : 1.0));
        for (int64_t i = 0; i < k1; ++i) {
            qs[g * k1 + i] = qg[i1[i]] * factor;
        }
    }
}

// The integer dot products of a q4 block's 32 cells with one head's int8 coefficients (component i at coef8[i]) into
// dot: per word row w (components 8w..8w+7: byte j's low nibble 8w + j, high 8w + 4 + j) each cell's word against the
// row's 8 coefficients. With AVX2, dp4a's arithmetic: u8 nibbles times s8 coefficients in pairs (maddubs), the two
// nibble halves added in 16 bits for up to 4 rows (|sum| <= 4 * 2 * 2 * 127 * 15 = 30480), then widened in pairs
// (madd) into the 32-bit sums: 8 cells in 9 operations a row, where the plain loop below takes 32.
void q4_block_dot(const uint32_t * words, const int8_t * coef8, int64_t n_words, int32_t * dot) {
    constexpr int64_t n_cells = attn_cpu::k_q4_cells;
#if defined(__AVX2__)
    static_assert(n_cells == 32, "4 registers of 8 cells");
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i acc[4] = { _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256() };
    for (int64_t w0 = 0; w0 < n_words; w0 += 4) {
        __m256i part[4] = { _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                            _mm256_setzero_si256() };
        for (int64_t w = w0; w < std::min(w0 + 4, n_words); ++w) {
            int32_t c_lo, c_hi;
            memcpy(&c_lo, coef8 + 8 * w, sizeof(c_lo));
            memcpy(&c_hi, coef8 + 8 * w + 4, sizeof(c_hi));
            const __m256i cl = _mm256_set1_epi32(c_lo), ch = _mm256_set1_epi32(c_hi);
            for (int r = 0; r < 4; ++r) {
                const __m256i x  = _mm256_loadu_si256((const __m256i *) (words + n_cells * w + 8 * r));
                const __m256i lo = _mm256_and_si256(x, m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(x, 4), m4);
                part[r] = _mm256_add_epi16(part[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, cl),
                                                                     _mm256_maddubs_epi16(hi, ch)));
            }
        }
        for (int r = 0; r < 4; ++r) {
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(part[r], ones));
        }
    }
    for (int r = 0; r < 4; ++r) {
        _mm256_storeu_si256((__m256i *) (dot + 8 * r), acc[r]);
    }
#else
    std::fill(dot, dot + n_cells, 0);
    for (int64_t w = 0; w < n_words; ++w) {
        const int8_t * a = coef8 + 8 * w;
        const uint32_t * x = words + n_cells * w;
        for (int64_t u = 0; u < n_cells; ++u) {
            const uint32_t xu = x[u];
            dot[u] += a[0] * (int32_t) (xu & 15)         + a[4] * (int32_t) ((xu >> 4) & 15) +
                      a[1] * (int32_t) ((xu >> 8) & 15)  + a[5] * (int32_t) ((xu >> 12) & 15) +
                      a[2] * (int32_t) ((xu >> 16) & 15) + a[6] * (int32_t) ((xu >> 20) & 15) +
                      a[3] * (int32_t) ((xu >> 24) & 15) + a[7] * (int32_t) (xu >> 28);
        }
    }
#endif
}

// One head's int8 coefficients of a q4 block (scales [d] f32; d a multiple of 8) into coef8: w_i = q_i * s_i,
// m = max |w_i|, a_i = rint(w_i * (127/m)). Returns m (0: every coefficient 0) and their sum in a_sum. With AVX2 8
// components at a time (the conversion rounds to nearest even, as lrintf in the default rounding mode), 32 of them
// narrowed to bytes by two saturating packs and one dword permute: byte by byte in a scalar loop, the narrowing was
// about as much work as the block's dot products.
float q4_coefficients(const float * q, const float * scales, int64_t d, float * w, int8_t * coef8, int32_t & a_sum) {
    float m = 0.0f;
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8) {
        const __m256 wi = _mm256_mul_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(scales + i));
        _mm256_storeu_ps(w + i, wi);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, wi));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (const float x : lanes) {
        m = std::max(m, x);
    }
#endif
    for (; i < d; ++i) {
        w[i] = q[i] * scales[i];
        m = std::max(m, fabsf(w[i]));
    }
    a_sum = 0;
    if (!(m > 0.0f)) {
        return 0.0f;
    }
    const float inv = 127.0f / m;  // |w_i * inv| <= 127
    i = 0;
#if defined(__AVX2__)
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the packs interleave 4-byte groups by lane
    __m256i sums = _mm256_setzero_si256();
    for (; i + 32 <= d; i += 32) {
        __m256i a4[4];
        for (int r = 0; r < 4; ++r) {
            a4[r] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(w + i + 8 * r), vinv));
            sums = _mm256_add_epi32(sums, a4[r]);
        }
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a4[0], a4[1]), _mm256_packs_epi32(a4[2], a4[3]));
        _mm256_storeu_si256((__m256i *) (coef8 + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
    alignas(32) int32_t a[8];
    _mm256_store_si256((__m256i *) a, sums);
    for (const int32_t x : a) {
        a_sum += x;
    }
    for (; i + 8 <= d; i += 8) {
        _mm256_store_si256((__m256i *) a, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_set1_ps(inv))));
        for (int j = 0; j < 8; ++j) {
            coef8[i + j] = (int8_t) a[j];
            a_sum += a[j];
        }
    }
#endif
    for (; i < d; ++i) {
        coef8[i] = (int8_t) lrintf(w[i] * inv);
        a_sum += coef8[i];
    }
    return m;
}

// Phase A with the q4 index: the approximate logits scale * s_hat of cells [j0, j1) (j0 a whole block) for every head
// of the group into e (ggml-sparq.h, "The q4 index"): per block and head the int8 coefficients, then q4_block_dot.
void q4_logits(const sparq_ctx & c, int64_t h, int64_t t, int64_t st, int64_t j0, int64_t j1, float * e,
               float * scales, float * w, int8_t * coef8) {
    constexpr int64_t n_cells = attn_cpu::k_q4_cells;
    const int64_t d = c.s.d, n_kv = c.s.n_kv, G = c.s.group, n_words = d / 8;
    GGML_ASSERT(j0 % n_cells == 0 && d % 8 == 0);
    for (int64_t b = j0 / n_cells; b * n_cells < j1; ++b) {
        const uint8_t * blk = (const uint8_t *) c.kt_row(b, h, st);
        const uint32_t * words = (const uint32_t *) blk;  // word row w of cell u at 32*w + u
        const ggml_fp16_t * s16 = (const ggml_fp16_t *) (blk + 16 * d);
        ggml_cpu_fp16_to_fp32(s16, scales, d);
        const int64_t c0 = b * n_cells, n_c = std::min(n_cells, j1 - c0);
        for (int64_t g = 0; g < G; ++g) {
            const float * qg = c.q_row(h * G + g, t, st);
            float * eg = e + g * n_kv + c0;
            int32_t a_sum;
            const float m = q4_coefficients(qg, scales, d, w, coef8, a_sum);
            if (!(m > 0.0f)) {
                std::fill(eg, eg + n_c, 0.0f);
                continue;
            }
            const float unit = m / 127.0f;
            int32_t dot[n_cells];
            q4_block_dot(words, coef8, n_words, dot);
            for (int64_t u = 0; u < n_c; ++u) {
                const float s_hat = unit * (float) (dot[u] - 8 * a_sum);
                eg[u] = c.p.scale * s_hat;
            }
        }
    }
}

// Phase A: scores of cells [j0, j1) for every head of the group, exponentiated against the chunk max.
void phase_scores(const sparq_ctx & c, int64_t w, int64_t r, int64_t chunk, int ith) {
    int64_t h, t, st;
    c.row_coords(r, h, t, st);
    float * rs = c.row(w);
    const int64_t j0 = chunk * c.s.chunk, j1 = std::min(c.s.n_kv, j0 + c.s.chunk), n = j1 - j0;
    const int64_t n_kv = c.s.n_kv, G = c.s.group, k1 = c.p.k1;
    float * e = rs + c.l.e;
    float * tmp = c.thread(ith) + c.l.tmp;
    const int32_t * i1 = (const int32_t *) (rs + c.l.i1);
    const float * qs = rs + c.l.qs;

    if (c.p.policy == GGML_SPARQ_POLICY_SPARQ && is_q4_index(c.kt)) {
        q4_logits(c, h, t, st, j0, j1, e, tmp, tmp + c.s.d, (int8_t *) (tmp + 2 * c.s.d));
    } else if (c.p.policy == GGML_SPARQ_POLICY_SPARQ && c.kt) {
        // r rows of K^T: score[j] += q_i * KT[i, j]. Components outer, cells inner: each K^T row is read
        // as one long sequential run (the hardware prefetcher streams it), k_kt_block rows side by side,
        // converted to f32 in small sub-blocks that stay in L1; the chunk's scores stay in L2.
        // A q8_0 index: a sub-block is one q8_0 block; its int8 values are converted as they are and the block's
        // scale goes into the query coefficient (one multiply per block and component, not per cell).
        const ggml_type kt_type = c.kt->type;
        const bool kt_q8 = kt_type == GGML_TYPE_Q8_0;
        static_assert(k_kt_sub == attn_cpu::k_q8_0_block, "a sub-block is one q8_0 block");
        for (int64_t g = 0; g < G; ++g) {
            std::fill(e + g * n_kv + j0, e + g * n_kv + j1, 0.0f);
        }
        for (int64_t i = 0; i < k1; i += k_kt_block) {
            const int64_t m = std::min(k_kt_block, k1 - i);
            const char * rows[k_kt_block];
            for (int64_t u = 0; u < k_kt_block; ++u) {
                rows[u] = (const char *) c.kt_row(i1[i + std::min(u, m - 1)], h, st);
            }
            for (int64_t b0 = j0; b0 < j1; b0 += k_kt_sub) {
                const int64_t nb = std::min(k_kt_sub, j1 - b0);
                const float * x[k_kt_block];
                float xs[k_kt_block];  // the sub-block's scale per row
                for (int64_t u = 0; u < k_kt_block; ++u) {
                    if (u >= m) {
                        x[u] = x[0];
                        xs[u] = 0.0f;
                    } else if (kt_q8) {
                        const uint8_t * blk = (const uint8_t *) rows[u] + (b0 / k_kt_sub) * attn_cpu::k_q8_0_bytes;
                        const int8_t * qv = attn_cpu::q8_0_block(blk, xs[u]);
                        float * xu = tmp + u * k_kt_sub;
                        for (int64_t j = 0; j < k_kt_sub; ++j) {
                            xu[j] = (float) qv[j];
                        }
                        x[u] = xu;
                    } else {
                        x[u] = load_f32(rows[u] + ggml_row_size(kt_type, b0), kt_type, nb, tmp + u * k_kt_sub);
                        xs[u] = 1.0f;
                    }
                }
                for (int64_t g = 0; g < G; ++g) {
                    float qv[k_kt_block];
                    for (int64_t u = 0; u < k_kt_block; ++u) {
                        qv[u] = qs[g * k1 + i + std::min(u, m - 1)] * xs[u];
                    }
                    float * eg = e + g * n_kv + b0;
                    const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
                    const float *x4 = x[4], *x5 = x[5], *x6 = x[6], *x7 = x[7];
                    for (int64_t j = 0; j < nb; ++j) {
                        eg[j] += (qv[0] * x0[j] + qv[1] * x1[j] + qv[2] * x2[j] + qv[3] * x3[j]) +
                                 (qv[4] * x4[j] + qv[5] * x5[j] + qv[6] * x6[j] + qv[7] * x7[j]);
                    }
                }
            }
        }
    } else if (c.p.policy == GGML_SPARQ_POLICY_SPARQ) {
        // default layout: gather the k1 components from each row-major K row
        for (int64_t j = j0; j < j1; ++j) {
            const float * krow = load_f32(c.k_row(j, h, st), c.k->type, c.s.d, tmp);
            for (int64_t g = 0; g < G; ++g) {
                float acc = 0.0f;
                for (int64_t i = 0; i < k1; ++i) {
                    acc += qs[g * k1 + i] * krow[i1[i]];
                }
                e[g * n_kv + j] = acc;
            }
        }
    } else {
        // exact scores (policy exact; policy window when alpha needs the true probabilities)
        for (int64_t j = j0; j < j1; ++j) {
            const float * krow = load_f32(c.k_row(j, h, st), c.k->type, c.s.d, tmp);
            for (int64_t g = 0; g < G; ++g) {
                e[g * n_kv + j] = c.exact_logit(c.q_row(h * G + g, t, st), krow);
            }
        }
    }

    if (const uint16_t * m = c.mask_row(t, st)) {
        for (int64_t g = 0; g < G; ++g) {  // branch-free so it vectorises
            float * eg = e + g * n_kv;
            for (int64_t j = j0; j < j1; ++j) {
                eg[j] = m[j] == k_f16_neg_inf ? -INFINITY : eg[j];
            }
        }
    }

    float * cstat = rs + c.l.cstat;
    for (int64_t g = 0; g < G; ++g) {
        float * eg = e + g * n_kv + j0;
        const float mx = max_f32(eg, n);
        double sum = 0.0;
        if (mx == -INFINITY) {
            std::fill(eg, eg + n, 0.0f);
        } else {
            sum = ggml_vec_soft_max_f32((int) n, eg, eg, mx);
        }
        cstat[(g * c.s.n_chunks + chunk) * 2 + 0] = mx;
        cstat[(g * c.s.n_chunks + chunk) * 2 + 1] = (float) sum;
    }
}

// Phase B: visible set, selection I2 (sorted), alpha and the mean value of the row.
void phase_select(const sparq_ctx & c, int64_t w, int64_t r, int ith) {
    int64_t h, t, st;
    c.row_coords(r, h, t, st);
    float * rs = c.row(w);
    int32_t * i2 = (int32_t *) (rs + c.l.i2);  // i2[0] = count, cells follow
    int32_t & kind = *(int32_t *) (rs + c.l.kind);
    const int64_t n_kv = c.s.n_kv, G = c.s.group, k2 = c.p.k2, n_chunks = c.s.n_chunks;
    const uint16_t * m = c.mask_row(t, st);
    auto visible = [m](int64_t j) { return !m || m[j] != k_f16_neg_inf; };

    int64_t n_vis = n_kv;
    if (m) {
        n_vis = 0;
        for (int64_t j = 0; j < n_kv; ++j) {
            n_vis += m[j] != k_f16_neg_inf;
        }
    }
    int32_t n_sel = 0;
    if (n_vis <= k2) {
        kind = n_vis == 0 ? ROW_EMPTY : ROW_DENSE;
        for (int64_t j = 0; j < n_kv; ++j) {
            if (visible(j)) {
                i2[1 + n_sel++] = (int32_t) j;
            }
        }
        i2[0] = n_sel;
        return;
    }
    kind = ROW_SPARSE;

    // f[g][chunk] = exp(m_chunk - M_g) / S_g turns phase A's exponentials into probabilities
    float * factor = c.thread(ith) + c.l.factor;
    if (c.needs_scores()) {
        const float * cstat = rs + c.l.cstat;
        for (int64_t g = 0; g < G; ++g) {
            const float * cs = cstat + g * n_chunks * 2;
            float mx = -INFINITY;
            for (int64_t ch = 0; ch < n_chunks; ++ch) {
                mx = std::max(mx, cs[2 * ch]);
            }
            double total = 0.0;
            for (int64_t ch = 0; ch < n_chunks; ++ch) {
                total += cs[2 * ch] == -INFINITY ? 0.0 : cs[2 * ch + 1] * exp((double) cs[2 * ch] - mx);
            }
            for (int64_t ch = 0; ch < n_chunks; ++ch) {
                factor[g * n_chunks + ch] = cs[2 * ch] == -INFINITY ? 0.0f : (float) (exp((double) cs[2 * ch] - mx) / total);
            }
        }
    }
    const float * e = rs + c.l.e;
    auto prob = [&](int64_t g, int64_t j) { return e[g * n_kv + j] * factor[g * n_chunks + (j >> c.s.chunk_shift)]; };

    // forced cells: the first `sinks` and the last `window` visible ones (disjoint: sinks + window <= k2 < n_vis)
    const int64_t sinks  = c.p.sinks;
    const int64_t window = c.p.policy == GGML_SPARQ_POLICY_WINDOW ? k2 - sinks : c.p.window;
    int64_t lo = 0, hi = n_kv;  // candidates are the visible cells in [lo, hi)
    const int32_t * pr = c.pos_row(st);
    if (!pr) {
        for (int64_t seen = 0; seen < sinks; ++lo) {
            if (visible(lo)) {
                i2[1 + n_sel++] = (int32_t) lo;
                ++seen;
            }
        }
        for (int64_t seen = 0; seen < window; ) {
            --hi;
            if (visible(hi)) {
                i2[1 + n_sel++] = (int32_t) hi;
                ++seen;
            }
        }
    } else {
        // by position: the `sinks` smallest and `window` largest (position, cell) keys of the visible cells.
        // Fast path: a sequence's positions are distinct, so the cells within `window` of the largest
        // position (and `sinks` of the smallest) are exactly them; otherwise order the keys.
        int32_t p_min = INT32_MAX, p_max = INT32_MIN;
        for (int64_t j = 0; j < n_kv; ++j) {
            if (visible(j)) {
                p_min = std::min(p_min, pr[j]);
                p_max = std::max(p_max, pr[j]);
            }
        }
        const int64_t w_lo = (int64_t) p_max - window, s_hi = (int64_t) p_min + sinks;  // window: pos > w_lo
        int64_t n_w = 0, n_s = 0;
        for (int64_t j = 0; j < n_kv && n_w <= window && n_s <= sinks; ++j) {
            if (visible(j)) {
                n_w += pr[j] > w_lo;
                n_s += pr[j] < s_hi;
            }
        }
        if (n_w == window && n_s == sinks && w_lo >= s_hi - 1) {
            for (int64_t j = 0; j < n_kv; ++j) {
                if (visible(j) && (pr[j] > w_lo || pr[j] < s_hi)) {
                    i2[1 + n_sel++] = (int32_t) j;
                }
            }
        } else {
            uint64_t * keys = (uint64_t *) (c.thread(ith) + c.l.pairs);
            int64_t n = 0;
            for (int64_t j = 0; j < n_kv; ++j) {
                if (visible(j)) {
                    keys[n++] = ((uint64_t) ((uint32_t) pr[j] ^ 0x80000000u) << 32) | (uint64_t) j;
                }
            }
            if (sinks > 0) {
                std::nth_element(keys, keys + sinks, keys + n);
            }
            if (window > 0) {
                std::nth_element(keys + sinks, keys + (n - window), keys + n);
            }
            for (int64_t i = 0; i < sinks; ++i) {
                i2[1 + n_sel++] = (int32_t) (keys[i] & 0xFFFFFFFFu);
            }
            for (int64_t i = n - window; i < n; ++i) {
                i2[1 + n_sel++] = (int32_t) (keys[i] & 0xFFFFFFFFu);
            }
        }
    }

    // top (k2 - forced) of the group's summed probability, in O(n). Scores of the candidate range [lo, hi)
    // first (-1 for hidden cells; probabilities are >= 0), then a threshold from a strided sample keeps
    // ~2x the needed cells, and only those are ordered. Order key = (score bits, ~cell): larger keys win,
    // equal scores go to the lower cell (non-negative floats order like their bit patterns). The result
    // does not depend on the threshold: every cell of the top set is at or above it.
    const int64_t n_top = k2 - n_sel;
    if (n_top > 0) {
        float * sc = factor + pad16(G * n_chunks);  // scratch after the factors: hi - lo floats
        uint64_t * pairs = (uint64_t *) (c.thread(ith) + c.l.pairs);
        const int64_t n_range = hi - lo;
        std::fill(sc, sc + n_range, 0.0f);
        for (int64_t g = 0; g < G; ++g) {
            for (int64_t j = lo; j < hi; ) {
                const int64_t ch = j >> c.s.chunk_shift, j_end = std::min(hi, (ch + 1) << c.s.chunk_shift);
                ggml_vec_mad_f32((int) (j_end - j), sc + (j - lo), e + g * n_kv + j, factor[g * n_chunks + ch]);
                j = j_end;
            }
        }
        if (m) {
            for (int64_t j = lo; j < hi; ++j) {
                sc[j - lo] = m[j] == k_f16_neg_inf ? -1.0f : sc[j - lo];
            }
        }
        if (pr) {
            for (int32_t i = 0; i < n_sel; ++i) {  // forced cells are not candidates
                sc[i2[1 + i] - lo] = -1.0f;
            }
        }
        // threshold: the sample's value at the rank that leaves ~2 * n_top cells above it
        const int64_t stride = std::max<int64_t>(1, n_range / k_select_sample);
        float * sample = (float *) pairs;  // pairs is unused until the threshold is known
        int64_t n_sample = 0;
        for (int64_t j = 0; j < n_range; j += stride) {
            if (sc[j] >= 0.0f) {
                sample[n_sample++] = sc[j];
            }
        }
        float thr = -0.5f;  // default: every candidate
        const int64_t rank = (2 * n_top + 16) / stride;
        if (rank < n_sample) {
            std::nth_element(sample, sample + rank, sample + n_sample, std::greater<float>());
            thr = sample[rank];
        }
        int64_t n_keep = 0;
        for (int pass = 0; pass < 2; ++pass) {
            n_keep = 0;
            const float keep = std::max(thr, 0.0f);  // hidden cells are -1
            for (int64_t j = 0; j < n_range; ++j) {
                if (sc[j] >= keep) {
                    uint32_t bits;
                    memcpy(&bits, &sc[j], sizeof(bits));
                    pairs[n_keep++] = ((uint64_t) bits << 32) | (uint64_t) (0xFFFFFFFFu - (uint32_t) (lo + j));
                }
            }
            if (n_keep >= n_top) {
                break;
            }
            thr = -0.5f;  // the sample misled us: take every candidate
        }
        GGML_ASSERT(n_keep >= n_top);
        std::nth_element(pairs, pairs + (n_top - 1), pairs + n_keep, std::greater<uint64_t>());
        for (int64_t i = 0; i < n_top; ++i) {
            i2[1 + n_sel++] = (int32_t) (0xFFFFFFFFu - (uint32_t) (pairs[i] & 0xFFFFFFFFu));
        }
    }
    std::sort(i2 + 1, i2 + 1 + n_sel);
    i2[0] = n_sel;

    if (!c.p.mean_on) {
        return;
    }
    float * alpha = rs + c.l.alpha;
    for (int64_t g = 0; g < G; ++g) {
        double a = 0.0;
        for (int32_t i = 0; i < n_sel; ++i) {
            a += prob(g, i2[1 + i]);
        }
        alpha[g] = (float) a;
    }
    float * vmean = rs + c.l.vmean;
    if (c.vsum) {
        const float * vs = (const float *) ((const char *) c.vsum->data + h * c.vsum->nb[1] + t * c.vsum->nb[2] +
                                            st * c.vsum->nb[3]);
        const float inv = vs[c.s.d_v] > 0.0f ? 1.0f / vs[c.s.d_v] : 0.0f;
        for (int64_t i = 0; i < c.s.d_v; ++i) {
            vmean[i] = vs[i] * inv;
        }
    } else {
        float * tmp = c.thread(ith) + c.l.tmp;
        std::fill(vmean, vmean + c.s.d_v, 0.0f);
        for (int64_t j = 0; j < n_kv; ++j) {
            if (visible(j)) {
                ggml_vec_acc_f32((int) c.s.d_v, vmean, load_f32(c.v_row(j, h, st), c.v->type, c.s.d_v, tmp));
            }
        }
        ggml_vec_scale_f32((int) c.s.d_v, vmean, 1.0f / (float) n_vis);
    }
}

// Phase C: exact attention of query head g of the row over I2, Sparse-V threshold, mean reallocation.
void phase_attend(const sparq_ctx & c, int64_t w, int64_t r, int64_t g, int ith) {
    int64_t h, t, st;
    c.row_coords(r, h, t, st);
    const float * rs = c.row(w);
    const int32_t * i2 = (const int32_t *) (rs + c.l.i2);
    const int32_t kind = *(const int32_t *) (rs + c.l.kind);
    const int64_t hq = h * c.s.group + g, d_v = c.s.d_v;
    float * out = (float *) ((char *) c.dst->data + hq * c.dst->nb[1] + t * c.dst->nb[2] + st * c.dst->nb[3]);
    float * th = c.thread(ith);
    float * tmp = th + c.l.tmp;
    float * logits = th + c.l.logits;
    float * acc = th + c.l.acc;
    const int32_t n_sel = i2[0];
    if (kind == ROW_EMPTY) {
        std::fill(out, out + d_v, 0.0f);
        return;
    }

    // the selected rows are scattered: prefetch K rows a few ahead and every V row during the K pass,
    // or each gather waits a full memory latency
    const size_t k_bytes = ggml_row_size(c.k->type, c.s.d), v_bytes = ggml_row_size(c.v->type, d_v);
    for (int32_t i = 0; i < std::min<int32_t>(n_sel, k_prefetch_rows); ++i) {
        prefetch_bytes(c.k_row(i2[1 + i], h, st), k_bytes);
    }
    const float * qg = c.q_row(hq, t, st);
    float mx = -INFINITY;
    for (int32_t i = 0; i < n_sel; ++i) {
        if (i + k_prefetch_rows < n_sel) {
            prefetch_bytes(c.k_row(i2[1 + i + k_prefetch_rows], h, st), k_bytes);
        }
        prefetch_bytes(c.v_row(i2[1 + i], h, st), v_bytes);
        logits[i] = c.exact_logit(qg, load_f32(c.k_row(i2[1 + i], h, st), c.k->type, c.s.d, tmp));
        mx = std::max(mx, logits[i]);
    }
    const double sum = ggml_vec_soft_max_f32(n_sel, logits, logits, mx);
    ggml_vec_scale_f32(n_sel, logits, (float) (1.0 / sum));
    if (c.p.sparse_v_thresh > 0.0f) {
        // drop weights below the threshold (the largest always stays) and renormalise
        float wmax = 0.0f;
        for (int32_t i = 0; i < n_sel; ++i) {
            wmax = std::max(wmax, logits[i]);
        }
        const float keep = std::min(c.p.sparse_v_thresh, wmax);
        double kept = 0.0;
        for (int32_t i = 0; i < n_sel; ++i) {
            logits[i] = logits[i] >= keep ? logits[i] : 0.0f;
            kept += logits[i];
        }
        ggml_vec_scale_f32(n_sel, logits, (float) (1.0 / kept));
    }

    std::fill(acc, acc + d_v, 0.0f);
    for (int32_t i = 0; i < n_sel; ++i) {
        if (logits[i] != 0.0f) {
            ggml_vec_mad_f32((int) d_v, acc, load_f32(c.v_row(i2[1 + i], h, st), c.v->type, d_v, tmp), logits[i]);
        }
    }
    if (kind == ROW_SPARSE && c.p.mean_on) {
        const float a = rs[c.l.alpha + g];
        const float * vmean = rs + c.l.vmean;
        for (int64_t i = 0; i < d_v; ++i) {
            out[i] = a * acc[i] + (1.0f - a) * vmean[i];
        }
    } else {
        memcpy(out, acc, d_v * sizeof(float));
    }
}

}  // namespace

size_t ggml_sparq_attn_cpu_work_size(const ggml_tensor * dst, int n_tasks) {
    const sparq_shape s = make_shape(dst, n_tasks);
    return make_layout(s, ggml_sparq_get_op_params(dst), is_q4_index(dst->src[2]), n_tasks).total_bytes;
}

void ggml_compute_forward_sparq_attn(const ggml_compute_params * params, ggml_tensor * dst) {
    const int ith = params->ith, nth = params->nth;
    sparq_ctx c;
    c.q = dst->src[0]; c.k = dst->src[1]; c.kt = dst->src[2]; c.v = dst->src[3];
    c.mask = dst->src[4]; c.vsum = dst->src[5]; c.pos = dst->src[6]; c.kstat = dst->src[7];
    c.dst = dst;
    c.p = ggml_sparq_get_op_params(dst);
    c.s = make_shape(dst, nth);
    c.l = make_layout(c.s, c.p, is_q4_index(c.kt), nth);
    GGML_ASSERT(params->wsize >= c.l.total_bytes);
    GGML_ASSERT(c.s.d <= k_max_head_dim);
    float * base = (float *) GGML_PAD((uintptr_t) params->wdata, 64);
    c.rows_base = base;
    c.threads_base = base + c.l.row_size * c.s.wave;

    // Tasks are handed out dynamically (memory stalls make equal-sized tasks unequal in time). One shared
    // counter serves every phase: a phase of n tasks advances it by exactly n, so each thread knows the
    // next phase's base without another barrier.
    attn_cpu::task_counter tasks{params->threadpool, ith, nth};
    if (ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, nth);
    }
    ggml_barrier(params->threadpool);

    const bool needs_i1 = c.p.policy == GGML_SPARQ_POLICY_SPARQ && !is_q4_index(c.kt);
    for (int64_t r0 = 0; r0 < c.s.n_rows; r0 += c.s.wave) {
        const int64_t n_w = std::min(c.s.wave, c.s.n_rows - r0);
        if (needs_i1) {
            tasks.run(n_w, [&](int64_t w) { phase_query(c, w, r0 + w, ith); });
            ggml_barrier(params->threadpool);
        }
        if (c.needs_scores()) {
            tasks.run(n_w * c.s.n_chunks, [&](int64_t t) {
                phase_scores(c, t / c.s.n_chunks, r0 + t / c.s.n_chunks, t % c.s.n_chunks, ith);
            });
            ggml_barrier(params->threadpool);
        }
        tasks.run(n_w, [&](int64_t w) { phase_select(c, w, r0 + w, ith); });
        ggml_barrier(params->threadpool);
        tasks.run(n_w * c.s.group, [&](int64_t t) {
            phase_attend(c, t / c.s.group, r0 + t / c.s.group, t % c.s.group, ith);
        });
        ggml_barrier(params->threadpool);
    }
}
