// CUDA kernel of ggml_sparq_decode_upkeep (GGML_OP_SPARQ_VSUM_ROWS; ggml_ops/src/cuda/sparq-upkeep.cu), called from
// the patched ggml-cuda.cu.
#pragma once

#include "common.cuh"

// Runs the op on the context's stream (no scratch).
void ggml_cuda_sparq_vsum_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// Whether the kernel takes these tensors (types, strides, grid limits).
bool ggml_cuda_sparq_vsum_rows_supported(int device, const ggml_tensor * op);
