// CPU kernel of ggml_sparq_index_write (compiled into ggml-cpu; called from ggml-cpu.c through vendor/patches).
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

// No work buffer: each task writes whole index blocks, its K values in a stack buffer.
void ggml_compute_forward_sparq_index_write(const struct ggml_compute_params * params, struct ggml_tensor * dst);

#ifdef __cplusplus
}
#endif
