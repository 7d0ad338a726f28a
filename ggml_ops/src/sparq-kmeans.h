// Spherical k-means as ggml graphs on a backend (sparq-kmeans.cpp): used by the eval API (tests, research)
// and by the preparation of a fixed prefix for centroid-sparse attention.
#pragma once

#include "ggml-backend.h"
#include "ggml.h"

#include <cstdint>
#include <string>
#include <vector>

struct sparq_kmeans_result {
    std::vector<float>   table;       // [H][n][2d + 1]: member means of the unnormalised rows, the size, the variances
    std::vector<int32_t> assignment;  // [H][P]
    int                  n_iter = 0;  // iterations run (stops early when no assignment changes)
    // in: where to read the table back to (H * n * (2d + 1) floats, e.g. the caller's own copy); null: into table.
    // A prepared 7B layer's table is 53 MB: a fresh vector's page faults and a second copy cost ~10 ms each.
    float *              table_dst = nullptr;
    double               phase_s[3] = {};  // wall seconds: setup (state, normalising, seeding), iterations, the table
};

// The initial centroids (sparq_llama.reference_squeeze.kmeans_cosine's init).
enum sparq_kmeans_init {
    SPARQ_KMEANS_EVEN = 0,  // the rows at evenly spaced positions
    SPARQ_KMEANS_KPP  = 1,  // k-means++ seeding in rounds (64 seeds, more for many clusters), by a counter-based generator
};

// x: [d, P, H] f32, contiguous, allocated on `backend`. Problem h draws its k-means++ seeds as problem head0 + h
// (a layer clustered in chunks of heads seeds each head as in one piece). center: the iterations compare each
// problem's rows minus their mean row (the table is still of the rows themselves). weights [H][d] (host memory) or
// null: the (centred) rows compared are times problem h's d weights. Returns "" on success, else what went wrong.
std::string sparq_kmeans_run(ggml_backend_t backend, ggml_tensor * x, int64_t n_clusters, int n_iter,
                             sparq_kmeans_result & res, sparq_kmeans_init init = SPARQ_KMEANS_EVEN, int64_t head0 = 0,
                             bool center = false, const float * weights = nullptr);
