// CUDA kernel of ggml_cluster_update (ggml_ops/src/cuda/cluster-update.cu), called from the patched ggml-cuda.cu.
#pragma once

#include "common.cuh"

// Runs the op on the context's stream (no scratch).
void ggml_cuda_cluster_update(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// Whether the kernel takes these tensors (types, strides, row width).
bool ggml_cuda_cluster_update_supported(int device, const ggml_tensor * op);
