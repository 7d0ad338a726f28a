// CPU kernel of ggml_sparq_decode_upkeep (GGML_OP_SPARQ_VSUM_ROWS; compiled into ggml-cpu; called from ggml-cpu.c
// through vendor/patches).
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

// No work buffer: each task writes whole result columns and their table rows, or whole index blocks.
void ggml_compute_forward_sparq_vsum_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst);

#ifdef __cplusplus
}
#endif
