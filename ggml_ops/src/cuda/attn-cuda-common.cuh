// Device helpers shared by our CUDA kernels (sparq-attn.cu, centroid-attn.cu, cluster-update.cu): conversions,
// 16-byte row loads, warp reductions and the programmatic-dependent-launch calls. Header-only (inline).
#pragma once

#include "common.cuh"

#include <cstdint>

namespace attn_cuda {

// Programmatic dependent launch (Hopper): a kernel launched with ggml_cuda_kernel_launch waits here for its
// predecessor before it reads or writes anything; pdl_release lets its successor's blocks launch at once (without
// it they launch as its blocks exit).
__device__ __forceinline__ void pdl_wait()    { ggml_cuda_pdl_sync(); }
__device__ __forceinline__ void pdl_release() { ggml_cuda_pdl_lc(); }

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(nv_bfloat16 x) { return __bfloat162float(x); }

// 8 consecutive values from a 16-byte aligned address.
__device__ __forceinline__ void load8(const half * p, float (&x)[8]) {
    const uint4 u = *(const uint4 *) p;
    const half2 * h = (const half2 *) &u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        x[2*i] = f.x; x[2*i + 1] = f.y;
    }
}
__device__ __forceinline__ void load8(const nv_bfloat16 * p, float (&x)[8]) {
    const uint4 u = *(const uint4 *) p;
    const uint32_t w[4] = { u.x, u.y, u.z, u.w };
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        x[2*i]     = __uint_as_float(w[i] << 16);
        x[2*i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
}
__device__ __forceinline__ void load8(const float * p, float (&x)[8]) {
    const float4 a = ((const float4 *) p)[0], b = ((const float4 *) p)[1];
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

// Elements [e0, e0 + 8) of a row of n values, one vector load when allowed, zero past the end.
template <typename T>
__device__ __forceinline__ void load8_row(const T * row, int64_t e0, int64_t n, bool vec, float (&x)[8]) {
    if (vec && e0 + 8 <= n) {
        load8(row + e0, x);
        return;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        x[e] = e0 + e < n ? to_f32(row[e0 + e]) : 0.0f;
    }
}

// Sum and maximum over a warp (butterfly: every lane gets the result, in the same order on every lane).
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int off = WARP_SIZE/2; off > 0; off >>= 1) {
        v += __shfl_xor_sync(0xFFFFFFFF, v, off);
    }
    return v;
}
template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
    for (int off = WARP_SIZE/2; off > 0; off >>= 1) {
        const T o = __shfl_xor_sync(0xFFFFFFFF, v, off);
        v = o > v ? o : v;
    }
    return v;
}

}  // namespace attn_cuda
