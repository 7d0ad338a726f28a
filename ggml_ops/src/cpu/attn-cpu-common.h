// Helpers shared by our CPU attention kernels (sparq-attn-cpu.cpp, centroid-attn-cpu.cpp).
#pragma once

#include "ggml-cpu.h"
#include "ggml-cpu/ggml-cpu-impl.h"
#include "ggml-cpu/simd-mappings.h"
#include "ggml-impl.h"
#include "ggml-sparq.h"

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace attn_cpu {

inline size_t pad16(size_t n) { return (n + 15) & ~size_t(15); }  // in 4-byte units: 64-byte alignment

// The q4 index's blocks (ggml-sparq.h, "The q4 index")
constexpr int64_t k_q4_cells = GGML_SPARQ_Q4_CELLS;

// ggml's q8_0 block: an f16 scale d and 32 int8 values, each worth d * q
constexpr int64_t k_q8_0_block = 32;
constexpr size_t  k_q8_0_bytes = 2 + k_q8_0_block;

// One q8_0 block: its scale, and a pointer to its 32 values
inline const int8_t * q8_0_block(const uint8_t * b, float & d) {
    ggml_fp16_t d16;
    memcpy(&d16, b, sizeof(d16));
    d = GGML_CPU_FP16_TO_FP32(d16);
    return reinterpret_cast<const int8_t *>(b + sizeof(d16));
}

// n values (a multiple of 32) of q8_0 blocks as f32. Inline here, so that it is compiled for the CPU backend's
// instruction set: the SparQ index streams through it (ggml-base's dequantizer is built for the baseline ISA)
inline void q8_0_to_f32(const void * src, float * y, int64_t n) {
    const uint8_t * b = static_cast<const uint8_t *>(src);
    for (int64_t i = 0; i < n; i += k_q8_0_block, b += k_q8_0_bytes) {
        float d;
        const int8_t * qs = q8_0_block(b, d);
        for (int64_t j = 0; j < k_q8_0_block; ++j) {
            y[i + j] = d * (float) qs[j];
        }
    }
}

// A row of n values of type `type` as f32: the source itself for f32, else converted into `buf`. Quantized
// types (n a multiple of their block) are dequantized as ggml defines them.
inline const float * load_f32(const void * src, ggml_type type, int64_t n, float * buf) {
    switch (type) {
        case GGML_TYPE_F32:  return static_cast<const float *>(src);
        case GGML_TYPE_F16:  ggml_cpu_fp16_to_fp32(static_cast<const ggml_fp16_t *>(src), buf, n); return buf;
        case GGML_TYPE_BF16: ggml_cpu_bf16_to_fp32(static_cast<const ggml_bf16_t *>(src), buf, n); return buf;
        case GGML_TYPE_Q8_0:
            GGML_ASSERT(n % k_q8_0_block == 0);
            q8_0_to_f32(src, buf, n);
            return buf;
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q5_1:
            GGML_ASSERT(n % ggml_blck_size(type) == 0);
            ggml_get_type_traits(type)->to_float(src, buf, n);
            return buf;
        default: GGML_ABORT("unsupported K/V type %s", ggml_type_name(type));
    }
}

inline void prefetch_bytes(const void * p, size_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
    for (size_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch((const char *) p + off);
    }
#else
    (void) p;
    (void) bytes;
#endif
}

// Dynamic task distribution over ggml's threadpool counter. One shared counter serves every phase of an op:
// a phase of n tasks advances it by exactly n, so each thread knows the next phase's base without another
// barrier. Thread 0 sets the counter to nth before the op's first barrier.
struct task_counter {
    ggml_threadpool * tp;
    int ith, nth;
    int64_t base = 0;

    template <typename F> void run(int64_t n, F && f) {
        for (int64_t t = ith; t < n; t = ggml_threadpool_chunk_add(tp, 1) - base) {
            f(t);
        }
        base += n;
    }
};

}  // namespace attn_cpu
