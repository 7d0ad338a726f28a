// CPU kernel of ggml_cluster_update (compiled into ggml-cpu; called from ggml-cpu.c through vendor/patches).
#pragma once

#include "ggml.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

void ggml_compute_forward_cluster_update(const struct ggml_compute_params * params, struct ggml_tensor * dst);

// Bytes of the graph plan's work buffer the op needs with n_tasks threads.
size_t ggml_cluster_update_cpu_work_size(const struct ggml_tensor * dst, int n_tasks);

#ifdef __cplusplus
}
#endif
