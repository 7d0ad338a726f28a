// ggml_sparq_attn: SparQ attention as one ggml op (semantics: docs/design.md, "SparQ: op semantics").
//
// Per KV head h, stream s, query row t, with G the query heads sharing h and V_t the visible cells:
//   1. |V_t| <= k2: exact attention over V_t.
//   2. I1 = the k1 largest components of sum_g |q_g| (select q) or of sigma_i * sum_g |q_g,i| (select qsigma,
//      sigma_i the std of component i over the row's visible keys); approximate scores s_g = q_g[I1] . K^T[I1, :]
//      (K^T as the index stores it: a float type, or int8 with one scale per component and 32 cells),
//      p_g = softmax(scale * s_g / sqrt(rho_g)), rho_g = |q_g[I1]|_1 / |q_g|_1 (q) or
//      sum_{I1} (q_g,i sigma_i)^2 / sum_i (q_g,i sigma_i)^2 (qsigma: the share of the score's variance).
//      With the q4 index every component is scored (k1 = head_dim, rho_g = 1) as integer dot products (below).
//   3. I2 = window (last visible) + sinks (first visible) + top of sum_g p_g (ties: lower cell index).
//   4. exact attention of each q_g over I2 (softcap, optional Sparse-V threshold).
//   5. mean on: y_g = alpha_g * y_g + (1 - alpha_g) * mean(V over V_t), alpha_g = sum_{I2} p_g.
// Policies: SPARQ (above), EXACT (rank by the true scores: reads all K), WINDOW (sinks + most recent).
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

enum ggml_sparq_policy {
    GGML_SPARQ_POLICY_SPARQ  = 0,
    GGML_SPARQ_POLICY_EXACT  = 1,
    GGML_SPARQ_POLICY_WINDOW = 2,
};

enum ggml_sparq_mean {
    GGML_SPARQ_MEAN_AUTO = 0, // on for MHA (n_head == n_head_kv), off for GQA: the paper's finding
    GGML_SPARQ_MEAN_ON   = 1,
    GGML_SPARQ_MEAN_OFF  = 2,
};

enum ggml_sparq_select {
    GGML_SPARQ_SELECT_Q      = 0, // the k1 components of largest sum_g |q_g| (the paper)
    GGML_SPARQ_SELECT_QSIGMA = 1, // the k1 components of largest sigma_i * sum_g |q_g,i|: the keys' spread
                                  // weighs each component (a component all keys share shifts every score alike)
};

// The q4 index: per KV head and block of 32 cells, every key component in 4 bits with one f16 scale per component
// (ggml's q4_0 of the component's 32 cells: s = the signed value of largest magnitude / -8, n = min(15, (int)
// (x/s + 8.5)), reading back (n - 8)*s), stored cell-major so that a cell's components lie side by side for integer
// dot products. A block is 18*d bytes: d/8 nibble words per cell, word w of cell c the u32 at byte 4*(32*w + c) (byte
// j: low nibble component 8w + j, high nibble component 8w + 4 + j), then the d f16 scales from byte 16*d.
// Scores: for query head g and a block, w_i = q_g,i * s_i and m = max_i |w_i| (f32); if m = 0 the block's cells score
// 0, else a_i = rint(w_i * (127/m)) (int8) and cell c scores (m/127) * (sum_i a_i*n_i,c - 8*sum_i a_i), the sum an
// exact integer (the query's int8 coefficients against the 4-bit keys: dp4a's operands).
#define GGML_SPARQ_Q4_CELLS 32  // cells per block
#define GGML_SPARQ_Q4_DIM_BYTES 18  // a block's bytes per key component: 16 of nibbles, 2 of scale

struct ggml_sparq_params {
    int32_t k1;               // r: query components for the approximate scores, 1..head_dim
    int32_t k2;               // k: cells kept per (KV head, query row), >= 1
    int32_t window;           // most recent visible cells always kept; < 0: k2/4
    int32_t sinks;            // first visible cells always kept
    enum ggml_sparq_mean   mean;
    enum ggml_sparq_policy policy;
    float   scale;            // kq scale; 0: 1/sqrt(head_dim)
    float   softcap;          // logit softcap (gemma2-style); 0: none
    float   sparse_v_thresh;  // drop final weights below this and renormalise; 0: off
    enum ggml_sparq_select select;
};

// k1 = 32, k2 = 128, window = k2/4, sinks = 0, mean auto, policy SPARQ, scale 1/sqrt(d), no softcap, select q.
GGML_API struct ggml_sparq_params ggml_sparq_default_params(void);

// Tensors (shapes as ggml_flash_attn_ext):
//   q    [d,      n_q,  n_head,    ns] f32
//   k    [d,      n_kv, n_head_kv, ns] f32 | f16 | bf16 | q8_0 | q4_0 | q4_1 | q5_0 | q5_1 (quantized: d % 32 == 0)
//   kt   [n_kt,   d,    n_head_kv, ns] the index: K^T, or NULL (step 2 then reads k). f32 | f16 | bf16 with
//        n_kt = n_kv, or q8_0 with n_kt = n_kv rounded up to 32: per component row, blocks of 32 cells with one
//        f16 scale each (ggml's q8_0 of the row). The op scores from it as it is; it is K^T of the keys as k
//        holds them (dequantized), quantized per block (the cells of a block past n_kv are ignored).
//        Or the q4 index: i8 [18*d, n_kt/32, n_head_kv, ns] (n_kt = n_kv rounded up to 32, d % 8 == 0, k1 = d),
//        per KV head and stream its blocks of 32 cells, each 18*d bytes (layout and scores: "The q4 index" above).
//   v    [d_v,    n_kv, n_head_kv, ns] as k's types (quantized: d_v % 32 == 0)
//   mask [n_kv,   n_q,  1,         ns or 1] f16 (0 visible, -inf hidden), or NULL (all visible)
//   vsum [d_v+1,  n_head_kv, n_q,  ns] f32 or NULL: per query row, the sum of V over its visible cells
//        followed by their count (the running sums llama keeps); NULL: computed from v (reads all V)
//   result [d_v, n_head, n_q, ns] f32
// Returns NULL when the arguments are valid, otherwise a message saying what is wrong (thread-local
// storage, valid until the next call on the same thread).
GGML_API const char * ggml_sparq_attn_check(
        const struct ggml_tensor * q, const struct ggml_tensor * k, const struct ggml_tensor * kt,
        const struct ggml_tensor * v, const struct ggml_tensor * mask, const struct ggml_tensor * vsum,
        const struct ggml_sparq_params * params);

// Builds the op; aborts with ggml_sparq_attn_check's message on invalid arguments.
GGML_API struct ggml_tensor * ggml_sparq_attn(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * kt,
        struct ggml_tensor  * v,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * vsum,
        struct ggml_sparq_params params);

// Optional key statistics for select qsigma: kstat [2*d+1, n_head_kv, n_q, ns] f32 (contiguous rows): per query
// row, the sum of the keys over its visible cells, the sum of their squares (each component of the key as k
// holds it), then the cell count: the running sums llama keeps. sigma_i^2 = max(0, S2_i/n - (S1_i/n)^2).
// Without it the op computes them from k over the visible cells (reads all of K). Call right after
// ggml_sparq_attn; aborts on a shape or type mismatch.
GGML_API void ggml_sparq_attn_set_kstat(struct ggml_tensor * op, struct ggml_tensor * kstat);

// Optional cell positions for the op: pos [n_kv, 1, 1, ns or 1] i32. The window and the sinks are then the
// visible cells with the largest / smallest positions (ties: the higher / lower cell); without it the cell
// order stands for the position order. A KV cache fills holes left by removed cells, so only positions say
// which cells are recent. Call right after ggml_sparq_attn; aborts on a shape or type mismatch.
GGML_API void ggml_sparq_attn_set_pos(struct ggml_tensor * op, struct ggml_tensor * pos);

// ggml_sparq_vsum_rows: one decode step's running V sums (the vsum rows ggml_sparq_attn takes), in one node.
//   table  [(d_v+1)*n_head_kv, n_seq] f32 with contiguous rows: per sequence, per KV head the sum of V over the
//          sequence's cells followed by their count
//   v      [d_v, n_head_kv, n_tokens] f32 with contiguous components (any row strides): the tokens' new values
//   idx    [n_tokens] i32: each token's table row, in [0, n_seq), no two alike (a decode step: one token per sequence)
//   v_type f32, f16 or bf16: the type the cache stores V as; each component is rounded to it first, so the sums
//          equal sums over the cache
//   result [(d_v+1)*n_head_kv, n_tokens] f32: column t = table[:, idx[t]] + per head [round(v[:, h, t]), 1], also
//          written back into table[:, idx[t]] (in place: the table is the running state)
// The sum is table + value (one float addition per component, as ggml_add of the same operands). It is
// ggml_sparq_decode_upkeep with only its V sums.
GGML_API const char * ggml_sparq_vsum_rows_check(
        const struct ggml_tensor * table, const struct ggml_tensor * v, const struct ggml_tensor * idx,
        enum ggml_type v_type);

// Builds the op; aborts with ggml_sparq_vsum_rows_check's message on invalid arguments.
GGML_API struct ggml_tensor * ggml_sparq_vsum_rows(
        struct ggml_context * ctx,
        struct ggml_tensor  * table,
        struct ggml_tensor  * v,
        struct ggml_tensor  * idx,
        enum ggml_type        v_type);

// ggml_sparq_kstat_rows: one decode step's running key statistics (the kstat rows ggml_sparq_attn_set_kstat takes),
// the V sums' op with the squares added, over the keys as the cache holds them:
//   table  [(2*d+1)*n_head_kv, n_seq] f32 with contiguous rows: per sequence, per KV head the sum of the keys, the sum
//          of their squares (component by component) and their count
//   k      [n_embd = d*n_head_kv, kv_size, n_stream] in a KV cache type, contiguous: the cache's keys, this step's
//          already written (d a whole number of k's blocks; n_head_kv = table->ne[0] - 2*n_embd)
//   cells  [n_tokens] i32: each token's row of k over all streams (stream * kv_size + cell)
//   idx    [n_tokens] i32: each token's table row, no two alike
//   result [(2*d+1)*n_head_kv, n_tokens] f32: column t = table[:, idx[t]] + per head [r, r*r, 1], r the head's
//          components of k's row cells[t] dequantized (as ggml_get_rows gives them), r*r a float32 product (exact
//          for f16 and bf16 keys) added with one float addition; written back as for the V sums
// Reading the keys from the cache rather than from the graph's new keys leaves those one use (the cache write), so
// ggml-cuda can fuse their RoPE with that write; it also replaces reading them back, squaring and concatenating.
GGML_API const char * ggml_sparq_kstat_rows_check(
        const struct ggml_tensor * table, const struct ggml_tensor * k, const struct ggml_tensor * cells,
        const struct ggml_tensor * idx);

// Builds the op; aborts with ggml_sparq_kstat_rows_check's message on invalid arguments.
GGML_API struct ggml_tensor * ggml_sparq_kstat_rows(
        struct ggml_context * ctx,
        struct ggml_tensor  * table,
        struct ggml_tensor  * k,
        struct ggml_tensor  * cells,
        struct ggml_tensor  * idx);

// ggml_sparq_decode_upkeep: a decode step's whole upkeep of SparQ's derived KV state in one node: the V sums (as
// ggml_sparq_vsum_rows), the key statistics (as ggml_sparq_kstat_rows) and the index blocks the new keys fall in (as
// ggml_sparq_index_write), each part present where its table (vsum, kstat, kt) is not NULL, at least one table of
// sums. On a GPU it is one kernel where the parts took five a layer (two of them the sums' write backs), and each
// small kernel on a decode step's chain costs a few microseconds whatever its work.
//   result [n_v + n_k, n_tokens] f32: column t = the V-sum part's column then the key statistics' (n_v, n_k: the
//          tables' widths, 0 without); both written back into their tables, the index blocks into kt
// Everything but the result is written in place, so the node must run on the backend whose memory holds the tables
// and kt (llama's graph assigns it there).
struct ggml_sparq_upkeep {
    struct ggml_tensor * idx;     // [n_tokens] i32: each token's table row, no two alike
    struct ggml_tensor * vsum;    // ggml_sparq_vsum_rows's table, or NULL
    struct ggml_tensor * v;       //   and its v
    enum ggml_type       v_type;  //   and v_type
    struct ggml_tensor * kstat;   // ggml_sparq_kstat_rows's table, or NULL
    struct ggml_tensor * k_cells; //   and its cells
    struct ggml_tensor * k;       // the cache's keys: the k of ggml_sparq_kstat_rows and of ggml_sparq_index_write
    struct ggml_tensor * kt;      // ggml_sparq_index_write's kt, or NULL
    struct ggml_tensor * cells;   //   and its cells, mask, blk and s0
    struct ggml_tensor * mask;
    struct ggml_tensor * blk;
    int32_t              s0;
};
GGML_API const char * ggml_sparq_decode_upkeep_check(const struct ggml_sparq_upkeep * u);

// Builds the op; aborts with ggml_sparq_decode_upkeep_check's message on invalid arguments.
GGML_API struct ggml_tensor * ggml_sparq_decode_upkeep(struct ggml_context * ctx, const struct ggml_sparq_upkeep * u);

// ggml_sparq_index_write: blocks of the index (K^T) recomputed from K, in one node (the derived KV state's upkeep after
// a ubatch's K writes, and its rebuild).
//   kt     [row_len, n_embd, n_stream] f32, f16, bf16 or q8_0, contiguous: per stream and key component a row of
//          cells, in blocks of B cells (B = 32 for q8_0, else 1); row_len a multiple of B; or the q4 index,
//          contiguous i8 [18*d, n_head_kv, row_len/32, n_stream] with d*n_head_kv = n_embd: per stream and block of
//          32 cells, each KV head's q4 block (B = 32; a block's q4 quantization is over its 32 cells)
//   k      [n_embd, kv_size, n_stream] in a KV cache type (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1),
//          contiguous: the cache's keys
//   cells  [B*n_blk*ns] i32: per written block its B cells, as indices of k's rows over all streams
//          (stream * kv_size + cell)
//   mask   [B*n_blk*ns] f32 or NULL: each of those cells' factor (1 occupied, 0 empty: a block depends on its
//          occupied cells only)
//   blk    [n_blk, 1, ns] i64: the block numbers (within a component row) written in streams s0 .. s0 + ns - 1
// For stream j < ns, block b < n_blk and component e < n_embd, the B cells from blk[b, j]*B of row e of kt's stream
// s0 + j get x_u = k[e, cells[(j*n_blk + b)*B + u]] * mask[...], dequantized, converted to kt's type as
// ggml_set_rows converts (q8_0: one block's scale amax/127 and rounded values; q4: the q4 index's blocks). The result
// is kt itself (a view, written in place), as for ggml_set_rows. It replaces get_rows, the mask product, a permuted copy and set_rows.
GGML_API const char * ggml_sparq_index_write_check(
        const struct ggml_tensor * kt, const struct ggml_tensor * k, const struct ggml_tensor * cells,
        const struct ggml_tensor * mask, const struct ggml_tensor * blk, int32_t s0);

// Builds the op; aborts with ggml_sparq_index_write_check's message on invalid arguments.
GGML_API struct ggml_tensor * ggml_sparq_index_write(
        struct ggml_context * ctx,
        struct ggml_tensor  * kt,
        struct ggml_tensor  * k,
        struct ggml_tensor  * cells,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * blk,
        int32_t               s0);

// Resolved parameters stored in the op (window, mean and scale made explicit), for backends.
struct ggml_sparq_op_params {
    int32_t k1, k2, window, sinks;
    int32_t mean_on;   // 0 or 1
    int32_t policy;    // enum ggml_sparq_policy
    float   scale, softcap, sparse_v_thresh;
    int32_t select;    // enum ggml_sparq_select
};
GGML_API struct ggml_sparq_op_params ggml_sparq_get_op_params(const struct ggml_tensor * op);

#ifdef __cplusplus
}
#endif
