// ggml_centroid_attn: centroid-sparse ("Squeezed") attention over a clustered fixed prefix as one ggml op
// (semantics: docs/design.md, "Centroid-sparse: op semantics"; float64 reference: sparq_llama.reference_squeeze).
//
// Per KV head h, stream s, query row t, with G the query heads sharing h and sigma the kq scale:
//   1. S_g[i] = exp(sigma q_g . C_i + var_weight sigma^2 / 2 sum_d q_gd^2 D_id) / sum_j N_j exp(sigma q_g . C_j)
//      over the clusters with N_j > 0. D_i are the members' per-component variances about C_i (tables of width
//      2d + 1); the term is the second-order estimate of E_k exp(sigma q.k) over the members, so a cluster with
//      a spread-out member set is not judged by its mean alone. var_weight 0 (the paper's rule): exp of the mean.
//   2. Group score s[i] = max_g S_g[i] (GGML_CENTROID_GROUP_MAX) or the mean over g; the group shares one
//      selection, so each selected K and V row is read once for all its heads.
//   3. Kept clusters, a budget per row: the scored clusters in order of s (larger first; equal scores: lower index
//      first, so every backend keeps the same set), each kept while the sizes of those before it sum to less
//      than B = max(1, ceil(keep * N)), N the clustered cells (sum of the fine table's sizes) and keep * N a
//      float32 product. The best cluster is always kept; keep >= 1 keeps all. A threshold calibrated once per
//      prefix kept 4.7-6.2% of Gemma-3's clustered cells on a question's rows where 10% was asked for; the budget
//      gives every row its share (docs/quality.md, "Cluster recall").
//   4. Exact attention (softcap) over the visible cells that are not clustered (cell cluster -1) or whose
//      cluster is kept.
// Two levels: coarse clusters over the fine ones (parent links) are scored first against the coarse
// normaliser Z = sum_c N_c exp(sigma q . C_c) and kept when s >= threshold_coarse (<= 0: all; the best always,
// ties: lower index); only fine clusters under kept parents are scored (against Z), and kept by the budget of 3.
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

enum ggml_centroid_group {
    GGML_CENTROID_GROUP_MAX  = 0,  // a cluster is read when any head of the group wants it
    GGML_CENTROID_GROUP_MEAN = 1,  // ... when the heads want it on average
};

struct ggml_centroid_params {
    float keep;              // the fine level's budget: keep * the clustered cells per row (>= 1: every cluster)
    float threshold_coarse;  // two levels: keep coarse clusters whose group score >= this; <= 0: every one
    enum ggml_centroid_group group;
    float scale;             // kq scale; 0: 1/sqrt(head_dim)
    float softcap;           // logit softcap (gemma2-style); 0: none
    float var_weight;        // weight of the variance term in S (> 0 needs tables of width 2d + 1); 0: mean only
};

// keep 1 (dense), group max, scale 1/sqrt(d), no softcap, var_weight 0.
GGML_API struct ggml_centroid_params ggml_centroid_default_params(void);

// Tensors (shapes as ggml_flash_attn_ext; ns = streams):
//   q      [d,      n_q,    n_head,    ns] f32
//   k      [d,      n_kv,   n_head_kv, ns] f32 | f16 | bf16
//   v      [d_v,    n_kv,   n_head_kv, ns] same type as k
//   mask   [n_kv,   n_q,    1,         ns or 1] f16 (0 visible, -inf hidden), or NULL (all visible)
//   cent   [d + 1 or 2d + 1, n_cent, n_head_kv, ns] f32: each fine centroid's d components, then its size N
//          (0: empty), then (width 2d + 1) the members' d per-component variances about the centroid
//   cell   [n_kv,   n_head_kv, ns,     1] i32: the fine cluster of each cell, -1 for cells not clustered
//   coarse [cent's width, n_coarse, n_head_kv, ns] f32 or NULL: coarse centroids, sizes (and variances)
//   parent [n_cent, n_head_kv, ns,     1] i32 or NULL (with coarse): the coarse cluster of each fine one
//   result [d_v, n_head, n_q, ns] f32
// Returns NULL when the arguments are valid, otherwise a message saying what is wrong (thread-local
// storage, valid until the next call on the same thread).
GGML_API const char * ggml_centroid_attn_check(
        const struct ggml_tensor * q, const struct ggml_tensor * k, const struct ggml_tensor * v,
        const struct ggml_tensor * mask, const struct ggml_tensor * cent, const struct ggml_tensor * cell,
        const struct ggml_tensor * coarse, const struct ggml_tensor * parent,
        const struct ggml_centroid_params * params);

// Builds the op; aborts with ggml_centroid_attn_check's message on invalid arguments.
GGML_API struct ggml_tensor * ggml_centroid_attn(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * cent,
        struct ggml_tensor  * cell,
        struct ggml_tensor  * coarse,
        struct ggml_tensor  * parent,
        struct ggml_centroid_params params);

// Resolved parameters stored in the op (scale made explicit), for backends.
struct ggml_centroid_op_params {
    float   keep, threshold_coarse;
    int32_t group;  // enum ggml_centroid_group
    float   scale, softcap;
    float   var_weight;
};
GGML_API struct ggml_centroid_op_params ggml_centroid_get_op_params(const struct ggml_tensor * op);

// ggml_cluster_update: one k-means update over H independent problems of P rows each (the clustering of a fixed
// prefix's keys, per layer and KV head, runs as a ggml graph on the backend that holds the KV: similarities by
// ggml_mul_mat, assignments by ggml_cluster_assign, then this op).
//   x      [d, P, H] f32 (rows to cluster; contiguous rows)
//   assign [P, H]    i32 (the cluster of each row; rows with an index outside [0, n_clusters) are skipped)
//   GGML_CLUSTER_SPHERICAL: prev [d, n_clusters, H] f32 required; result [d, n_clusters, H]: each cluster's
//       normalised sum of its members (spherical k-means), or its prev row when it has no member.
//   GGML_CLUSTER_TABLE: prev NULL; result [d + 1, n_clusters, H]: each cluster's mean of its members followed
//       by its size (the centroid table ggml_centroid_attn reads; zeros for an empty cluster).
//   GGML_CLUSTER_TABLE_VAR: prev NULL; result [2d + 1, n_clusters, H]: the table, then each cluster's per-component
//       variance of its members about that mean, sum_p (x_p - mean)^2 / N in a second pass over the rows (zeros
//       for an empty cluster).
// Sums run over the rows in order (deterministic on every backend that keeps that order).
enum ggml_cluster_mode {
    GGML_CLUSTER_SPHERICAL = 0,
    GGML_CLUSTER_TABLE     = 1,
    GGML_CLUSTER_ASSIGN    = 2,  // ggml_cluster_assign's node (not a mode of ggml_cluster_update's arguments)
    GGML_CLUSTER_TABLE_VAR = 3,
};

GGML_API const char * ggml_cluster_update_check(
        const struct ggml_tensor * x, const struct ggml_tensor * assign, const struct ggml_tensor * prev,
        int64_t n_clusters, enum ggml_cluster_mode mode);

GGML_API struct ggml_tensor * ggml_cluster_update(
        struct ggml_context * ctx,
        struct ggml_tensor  * x,
        struct ggml_tensor  * assign,
        struct ggml_tensor  * prev,
        int64_t               n_clusters,
        enum ggml_cluster_mode mode);

// ggml_cluster_assign: the k-means assignment step over H problems, each row's cluster of largest similarity, ties
// to the higher cluster (as ggml_argmax on the CPU; its CUDA kernel leaves ties to its reduction order and runs one
// block of up to 1024 threads per row, which made it most of a 7B prefix's clustering time on an H100).
//   sim [n_clusters, P, H] f32 (contiguous rows); result [P, H] i32. A node of op GGML_OP_CLUSTER_UPDATE.
GGML_API const char * ggml_cluster_assign_check(const struct ggml_tensor * sim);

GGML_API struct ggml_tensor * ggml_cluster_assign(
        struct ggml_context * ctx,
        struct ggml_tensor  * sim);

#ifdef __cplusplus
}
#endif
