// CUDA kernel of ggml_sparq_index_write (ggml_ops/src/cuda/sparq-upkeep.cu), called from the patched ggml-cuda.cu.
#pragma once

#include "common.cuh"

// Writes the op's index blocks on the context's stream (no scratch).
void ggml_cuda_sparq_index_write(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// Whether the kernel takes these tensors (types, grid limits).
bool ggml_cuda_sparq_index_write_supported(int device, const ggml_tensor * op);
