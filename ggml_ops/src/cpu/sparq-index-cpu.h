// CPU kernel of ggml_sparq_index_write (compiled into ggml-cpu; called from ggml-cpu.c through vendor/patches).
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

// No work buffer: each task writes whole index blocks, its K values in a stack buffer.
void ggml_compute_forward_sparq_index_write(const struct ggml_compute_params * params, struct ggml_tensor * dst);

// The op's work on explicit tensors (ggml_sparq_index_write's arguments), this thread's share of the tasks: also the
// index part of ggml_sparq_decode_upkeep.
void sparq_index_write_tasks(const struct ggml_compute_params * params, const struct ggml_tensor * kt,
                             const struct ggml_tensor * k, const struct ggml_tensor * cells,
                             const struct ggml_tensor * blk, const struct ggml_tensor * mask, int32_t s0);

#ifdef __cplusplus
}
#endif
