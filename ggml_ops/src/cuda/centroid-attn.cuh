// CUDA kernel of ggml_centroid_attn (ggml_ops/src/cuda/centroid-attn.cu), called from the patched ggml-cuda.cu.
#pragma once

#include "common.cuh"

// Runs the op on the context's stream; scratch comes from the context's pool.
void ggml_cuda_centroid_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// Whether the kernel takes these tensors (types, strides, head sizes).
bool ggml_cuda_centroid_attn_supported(int device, const ggml_tensor * op);
