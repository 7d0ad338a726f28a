// CPU kernel of ggml_sparq_index_write. Semantics: ggml_ops/include/ggml-sparq.h. Tasks take one index block's
// (block b of stream j) components in segments of SEG, so no two write one element and a decode step's one block a
// layer still spreads over the threads. K is dequantized with its type's to_float (what get_rows runs)
// and K^T written with the index type's from_float (what set_rows runs), so the index equals what those ops gave.
// The q4 index (ggml-sparq.h, "The q4 index") is written by its own quantizer, a task per block, KV head and segment.
#include "sparq-index-cpu.h"

#include "ggml-sparq.h"

#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t SEG = 32;    // key components dequantized at a time: one block of any quantized KV type
constexpr int64_t MAX_B = 32;  // the largest index block (q8_0)

// ggml's f32 has no to_float (get_rows copies f32 rows): the same here
void copy_f32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    std::copy_n((const float *) x, n, y);
}

// One component's 32 cells x as a q4 block's column: ggml's q4_0 of them (the value of largest magnitude, the first
// such, over -8 as the scale; nibbles min(15, trunc(x/scale + 8.5))). Returns the scale; n gets the nibbles.
float q4_quantize(const float * x, uint8_t * n) {
    float amax = 0.0f, extreme = 0.0f;
    for (int64_t u = 0; u < GGML_SPARQ_Q4_CELLS; ++u) {
        if (amax < fabsf(x[u])) {
            amax    = fabsf(x[u]);
            extreme = x[u];
        }
    }
    const float scale = extreme / -8.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    for (int64_t u = 0; u < GGML_SPARQ_Q4_CELLS; ++u) {
        n[u] = (uint8_t) std::min(15, (int) (x[u] * inv + 8.5f));
    }
    return scale;
}

// The q4 index: task = (written block t, KV head h, segment of SEG components, or of 8 where the head dim is not a
// multiple of SEG: K is a float type then). Each task writes its components' nibble words and scales.
void q4_index_write_tasks(const ggml_compute_params * params, const ggml_tensor * kt, const ggml_tensor * k,
                          const int32_t * cell, const int64_t * blks, const float * mk, int64_t n_blk, int64_t ns,
                          int32_t s0) {
    constexpr int64_t B = GGML_SPARQ_Q4_CELLS;
    const int64_t head_dim = kt->ne[0] / GGML_SPARQ_Q4_DIM_BYTES, n_head_kv = kt->ne[1], n_blk_row = kt->ne[2];
    const int64_t kv_size = k->ne[1], n_stream = kt->ne[3];
    const int64_t seg = head_dim % SEG == 0 ? SEG : 8;
    GGML_ASSERT(head_dim % 8 == 0 && seg % ggml_blck_size(k->type) == 0 && s0 >= 0 && s0 + ns <= n_stream);
    ggml_to_float_t const to_float = k->type == GGML_TYPE_F32 ? copy_f32 : ggml_get_type_traits(k->type)->to_float;
    GGML_ASSERT(to_float);

    float vals[B][SEG];  // the block's cells' components [e0, e0 + seg) of head h
    float x[B];
    uint8_t nib[SEG][B];
    const int64_t n_seg = head_dim / seg;
    for (int64_t task = params->ith; task < n_blk*ns*n_head_kv*n_seg; task += params->nth) {
        const int64_t t = task / (n_head_kv*n_seg), h = (task / n_seg) % n_head_kv, e0 = (task % n_seg)*seg;
        const int64_t j = t / n_blk, first = t*B, bn = blks[t];
        GGML_ASSERT(bn >= 0 && bn < n_blk_row);  // as ggml_set_rows: a block outside the row is a caller's bug
        for (int64_t u = 0; u < B; ++u) {
            const int64_t c = cell[first + u];
            GGML_ASSERT(c >= 0 && c < kv_size*n_stream);
            const char * row = (const char *) k->data + (c / kv_size)*k->nb[2] + (c % kv_size)*k->nb[1];
            to_float(row + ggml_row_size(k->type, h*head_dim + e0), vals[u], seg);
        }
        uint8_t * blk = (uint8_t *) kt->data + (s0 + j)*kt->nb[3] + bn*kt->nb[2] + h*kt->nb[1];
        for (int64_t e = 0; e < seg; ++e) {
            for (int64_t u = 0; u < B; ++u) {
                x[u] = mk ? vals[u][e] * mk[first + u] : vals[u][e];
            }
            const ggml_fp16_t scale = GGML_CPU_FP32_TO_FP16(q4_quantize(x, nib[e]));
            memcpy(blk + 16*head_dim + 2*(e0 + e), &scale, sizeof(scale));
        }
        // word w of cell u: byte j holds component 8w + j (low nibble) and 8w + 4 + j (high)
        for (int64_t w = 0; w < seg / 8; ++w) {
            for (int64_t u = 0; u < B; ++u) {
                uint32_t word = 0;
                for (int jb = 0; jb < 4; ++jb) {
                    word |= (uint32_t) (nib[8*w + jb][u] | (nib[8*w + 4 + jb][u] << 4)) << (8*jb);
                }
                memcpy(blk + 4*(B*(e0/8 + w) + u), &word, sizeof(word));
            }
        }
    }
}

}  // namespace

void ggml_compute_forward_sparq_index_write(const ggml_compute_params * params, ggml_tensor * dst) {
    GGML_ASSERT(dst->data == dst->src[0]->data);  // the result is kt, written in place
    sparq_index_write_tasks(params, dst->src[0], dst->src[1], dst->src[2], dst->src[3], dst->src[4],
                            ggml_get_op_params_i32(dst, 0));
}

void sparq_index_write_tasks(const ggml_compute_params * params, const ggml_tensor * kt, const ggml_tensor * k,
                             const ggml_tensor * cells, const ggml_tensor * blk, const ggml_tensor * mask, int32_t s0) {
    if (kt->type == GGML_TYPE_I8) {
        q4_index_write_tasks(params, kt, k, (const int32_t *) cells->data, (const int64_t *) blk->data,
                             mask ? (const float *) mask->data : nullptr, blk->ne[0], blk->ne[2], s0);
        return;
    }
    const int64_t B = ggml_blck_size(kt->type), n_embd = kt->ne[1], row_len = kt->ne[0], n_stream = kt->ne[2];
    const int64_t kv_size = k->ne[1], n_blk = blk->ne[0], ns = blk->ne[2];
    GGML_ASSERT(B <= MAX_B && k->ne[0] == n_embd && s0 >= 0 && s0 + ns <= n_stream);
    GGML_ASSERT(n_embd % ggml_blck_size(k->type) == 0 && SEG % ggml_blck_size(k->type) == 0);
    ggml_to_float_t const to_float = k->type == GGML_TYPE_F32 ? copy_f32 : ggml_get_type_traits(k->type)->to_float;
    ggml_from_float_t const from_float = ggml_get_type_traits_cpu(kt->type)->from_float;
    GGML_ASSERT(to_float && from_float);
    const int32_t * cell = (const int32_t *) cells->data;
    const int64_t * blks = (const int64_t *) blk->data;
    const float   * mk   = mask ? (const float *) mask->data : nullptr;

    float vals[MAX_B][SEG];  // the block's cells' components [e0, e0 + SEG)
    float x[MAX_B];
    const int64_t n_seg = (n_embd + SEG - 1) / SEG;
    for (int64_t task = params->ith; task < n_blk*ns*n_seg; task += params->nth) {
        const int64_t t = task / n_seg, e0 = (task % n_seg)*SEG;
        const int64_t j = t / n_blk, first = t*B;
        const int64_t bn = blks[t];
        GGML_ASSERT(bn >= 0 && (bn + 1)*B <= row_len);  // as ggml_set_rows: a block outside the row is a caller's bug
        char * kt_s = (char *) kt->data + (s0 + j)*kt->nb[2];
        const int64_t n = std::min(SEG, n_embd - e0);
        for (int64_t u = 0; u < B; ++u) {
            const int64_t c = cell[first + u];
            GGML_ASSERT(c >= 0 && c < kv_size*n_stream);
            const char * row = (const char *) k->data + (c / kv_size)*k->nb[2] + (c % kv_size)*k->nb[1];
            to_float(row + ggml_row_size(k->type, e0), vals[u], n);
        }
        for (int64_t e = 0; e < n; ++e) {
            for (int64_t u = 0; u < B; ++u) {
                x[u] = mk ? vals[u][e] * mk[first + u] : vals[u][e];
            }
            char * row = kt_s + (e0 + e)*kt->nb[1];
            from_float(x, row + ggml_row_size(kt->type, bn*B), B);
        }
    }
}
