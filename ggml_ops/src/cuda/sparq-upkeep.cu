// CUDA kernel of SparQ's derived-state upkeep: ggml_sparq_index_write and ggml_sparq_decode_upkeep (and its one-table
// forms ggml_sparq_vsum_rows, ggml_sparq_kstat_rows). Semantics: ggml_ops/include/ggml-sparq.h; the CPU kernels
// (ggml_ops/src/cpu/sparq-index-cpu.cpp, sparq-vsum-cpu.cpp) are the reference.
//
// One kernel, its grid in two ranges:
//   - index blocks: per written index block (block b of stream j) a chunk of UK_THREADS key components; thread e takes
//     component e: it gathers the B cells' values of component e from K, dequantized as ggml-cuda's get_rows
//     dequantizes them (the same device functions), times the mask, and writes them to row e of K^T converted as
//     ggml-cuda's set_rows converts (q8_0: its block quantizer; the q4 index: the CPU's quantizer, its nibbles gathered
//     into each cell's words through shared memory). K rows are read by consecutive threads (coalesced along the
//     components); a q8_0 block is stored by its warp, a row at a time. A decode step writes one index block a layer,
//     so the components are what spreads it over the GPU;
//   - sums: per (token, KV head) one block; thread i adds component i of the token's rounded value to its sequence's
//     V-sum row and of its key as the cache holds it (and its square) to its key-statistics row, writes both to the
//     result and back to the tables; one thread adds the counts. The rounding is CUDA's round-to-nearest-even
//     conversion, as ggml-cuda's own cast to the cache type; the keys are read back from the cache, dequantized as
//     for the index blocks, so the graph's new keys keep one use (their cache write, which ggml-cuda then fuses with
//     their RoPE).
// A decode step's upkeep is then one launch where it took five (the index write, two sums and their two write backs):
// each small kernel costs a few microseconds on the step's serial chain whatever its work. The five took ~22 us a layer
// (Llama-2-7B shape, H100); the one launch gave back ~7 of them (docs/performance.md, "(b) End to end on CUDA").
#include "sparq-index.cuh"
#include "sparq-vsum.cuh"
#include "attn-cuda-common.cuh"
#include "convert.cuh"
#include "cpy-utils.cuh"
#include "dequantize.cuh"

#include "ggml-sparq.h"

#include <cstdint>

namespace {

using namespace attn_cuda;  // pdl_wait

constexpr int UK_THREADS = 128;
constexpr int IW_MAX_B   = QK8_0;  // the largest index block

struct index_args {  // the index part; n_blocks 0 without one
    char * kt; const char * k; const int32_t * cells; const int64_t * blk; const float * mask;
    int64_t n_embd, n_blk, n_chunks, n_blocks;
    size_t kt_nb1, kt_nb2, kt_nb3, k_nb1;  // the q4 index: head, block and stream strides; else row and stream
    int64_t head_dim;                      // the q4 index's
    int32_t s0;
};

struct sums_args {  // one table of sums; tab NULL without it
    float * tab;
    const char * x;             // the V sums' values [d, n_head_kv, n_tokens]; the key statistics' cache keys
    const int32_t * cells;      // the key statistics: each token's row of x (stream * kv_size + cell)
    int64_t d, n_seq, out_off;  // out_off: the part's first element in a result column
    int64_t n_rows;             // the key statistics: x's rows over all streams
    size_t t_nb1, x_nb1, x_nb2;
    ggml_type type;             // the V sums: the cache type the values are rounded to
};

struct upkeep_args {
    index_args ix;
    sums_args vs, ks;           // V sums [r, 1], key statistics [r, r*r, 1] per head
    const char * idx; size_t i_nb0;
    char * dst; size_t o_nb1;
    int64_t n_head_kv;
};

// Component e of a K row of type K_TYPE, as ggml-cuda's get_rows gives it (its dequantize functions: pairs of values,
// qr = 1 at adjacent positions, qr = 2 at j and j + qk/2).
template <ggml_type K_TYPE>
__device__ __forceinline__ float key_value(const char * row, int64_t e) {
    if constexpr (K_TYPE == GGML_TYPE_F32) {
        return ((const float *) row)[e];
    } else if constexpr (K_TYPE == GGML_TYPE_F16) {
        return ggml_cuda_cast<float>(((const half *) row)[e]);
    } else if constexpr (K_TYPE == GGML_TYPE_BF16) {
        return ggml_cuda_cast<float>(((const nv_bfloat16 *) row)[e]);
    } else {
        constexpr int qk = ggml_cuda_type_traits<K_TYPE>::qk, qr = ggml_cuda_type_traits<K_TYPE>::qr;
        const int64_t ib = e / qk;
        const int j = (int) (e % qk);
        const int iqs = qr == 1 ? (j & ~1) : (j < qk/2 ? j : j - qk/2);
        const bool second = qr == 1 ? (j & 1) : j >= qk/2;
        float2 v;
        if constexpr (K_TYPE == GGML_TYPE_Q8_0) {
            dequantize_q8_0(row, ib, iqs, v);
        } else if constexpr (K_TYPE == GGML_TYPE_Q4_0) {
            dequantize_q4_0(row, ib, iqs, v);
        } else if constexpr (K_TYPE == GGML_TYPE_Q4_1) {
            dequantize_q4_1(row, ib, iqs, v);
        } else if constexpr (K_TYPE == GGML_TYPE_Q5_0) {
            dequantize_q5_0(row, ib, iqs, v);
        } else {
            static_assert(K_TYPE == GGML_TYPE_Q5_1, "a KV cache type");
            dequantize_q5_1(row, ib, iqs, v);
        }
        return second ? v.y : v.x;
    }
}

// The q8_0 blocks of a warp's 32 components (one block of row e each), stored a row at a time: each thread quantizes
// its block into shared memory, then 17 lanes store one row's 34-byte block as 2-byte pieces. Stored by its own thread,
// each of a block's 33 stores hit a different row in every lane: 32 sectors for 32 bytes (ncu on the prefill launch:
// 1.0 of 32 bytes used per sector, 60% of the warps' stalls waiting on the LG queue).
__device__ __forceinline__ void store_q8_0_by_warp(const float * x, bool in_row, char * kt_s, size_t kt_nb1,
                                                   int64_t e, int64_t n_embd, int64_t blk) {
    constexpr int PIECES = sizeof(block_q8_0)/sizeof(uint16_t);
    static_assert(sizeof(block_q8_0) == PIECES*sizeof(uint16_t) && alignof(block_q8_0) <= alignof(uint16_t),
                  "a q8_0 block is whole 2-byte pieces");
    __shared__ uint16_t stage[UK_THREADS/WARP_SIZE][WARP_SIZE][PIECES + 1];  // an odd word stride: no bank conflicts
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (in_row) {
        quantize_f32_q8_0_block(x, (block_q8_0 *) stage[warp][lane]);
    }
    __syncwarp();
    const int64_t e0 = e - lane;  // the warp's first component
    const int n_rows = (int) min((int64_t) WARP_SIZE, n_embd - e0);
    for (int r = 0; r < n_rows; ++r) {
        if (lane < PIECES) {
            ((uint16_t *) (kt_s + (e0 + r)*kt_nb1 + blk*sizeof(block_q8_0)))[lane] = stage[warp][r][lane];
        }
    }
}

// The q4 index (ggml-sparq.h, "The q4 index"): thread e quantizes its component's 32 cells x as the CPU does (the
// first value of largest magnitude over -8 as the scale, nibbles min(15, trunc(x/scale + 8.5)) in two roundings) and
// stores the scale; the nibbles go through shared memory, from where each cell's words (8 components each) are stored,
// consecutive threads taking consecutive cells of a word row.
__device__ __forceinline__ void store_q4_block(const float (&x)[GGML_SPARQ_Q4_CELLS], bool in_row, const index_args & a,
                                               char * kt_b, int64_t e) {
    constexpr int B = GGML_SPARQ_Q4_CELLS;
    __shared__ uint8_t nib[B][UK_THREADS + 8];  // [cell][component of the chunk]; + 8: a word row's 8 bytes stay apart
    const int64_t d = a.head_dim, e_chunk = e - threadIdx.x;
    if (in_row) {
        float amax = 0.0f, extreme = 0.0f;
#pragma unroll
        for (int u = 0; u < B; ++u) {
            if (amax < fabsf(x[u])) {
                amax = fabsf(x[u]);
                extreme = x[u];
            }
        }
        const float scale = __fdiv_rn(extreme, -8.0f), inv = scale != 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
#pragma unroll
        for (int u = 0; u < B; ++u) {
            nib[u][threadIdx.x] = (uint8_t) min(15, (int) __fadd_rn(__fmul_rn(x[u], inv), 8.5f));
        }
        ((half *) (kt_b + (e / d)*a.kt_nb1 + 16*d))[e % d] = __float2half_rn(scale);
    }
    __syncthreads();
    const int n_comp = (int) min((int64_t) UK_THREADS, a.n_embd - e_chunk);  // a multiple of 8 (d is)
    for (int idx = threadIdx.x; idx < B*n_comp/8; idx += UK_THREADS) {
        const int c = idx % B, w = idx / B;       // cell c's word of the chunk's components 8w .. 8w + 7
        const uint2 b = *(const uint2 *) &nib[c][8*w];
        const int64_t e0 = e_chunk + 8*w;         // within one head: d is a multiple of 8
        char * blk = kt_b + (e0 / d)*a.kt_nb1;
        ((uint32_t *) blk)[((e0 % d)/8)*B + c] = b.x | (b.y << 4);
    }
}

template <ggml_type K_TYPE, ggml_type KT_TYPE>
__device__ __forceinline__ void write_index_block(const index_args & a, int64_t bid) {
    constexpr int B = KT_TYPE == GGML_TYPE_Q8_0 ? QK8_0 : KT_TYPE == GGML_TYPE_I8 ? GGML_SPARQ_Q4_CELLS : 1;
    static_assert(B <= IW_MAX_B, "an index block fits the thread's values");
    const int64_t t = bid / a.n_chunks;  // block b of stream j: t = j*n_blk + b
    const int64_t j = t / a.n_blk;
    const int64_t first = t*B;           // this index block's cells in cells and mask
    const int64_t blk = a.blk[t];
    char * kt_s = a.kt + (a.s0 + j)*a.kt_nb2;
    const int64_t e = (bid % a.n_chunks)*UK_THREADS + threadIdx.x;
    const bool in_row = e < a.n_embd;
    float x[B];
    if (in_row) {
#pragma unroll
        for (int u = 0; u < B; ++u) {
            const float val = key_value<K_TYPE>(a.k + (int64_t) a.cells[first + u]*a.k_nb1, e);
            x[u] = a.mask ? val * a.mask[first + u] : val;
        }
    }
    if constexpr (KT_TYPE == GGML_TYPE_I8) {
        store_q4_block(x, in_row, a, a.kt + (a.s0 + j)*a.kt_nb3 + blk*a.kt_nb2, e);
    } else if constexpr (KT_TYPE == GGML_TYPE_Q8_0) {
        if (e - threadIdx.x % WARP_SIZE < a.n_embd) {  // the warp has rows (all its lanes take this branch)
            store_q8_0_by_warp(x, in_row, kt_s, a.kt_nb1, e, a.n_embd, blk);
        }
    } else if (in_row) {
        char * row = kt_s + e*a.kt_nb1;
        if constexpr (KT_TYPE == GGML_TYPE_F16) {
            ((half *) row)[blk] = ggml_cuda_cast<half>(x[0]);
        } else if constexpr (KT_TYPE == GGML_TYPE_BF16) {
            ((nv_bfloat16 *) row)[blk] = ggml_cuda_cast<nv_bfloat16>(x[0]);
        } else {
            ((float *) row)[blk] = x[0];
        }
    }
}

__device__ __forceinline__ float round_to_cache(float x, ggml_type type) {
    switch (type) {
        case GGML_TYPE_F16:  return __half2float(__float2half_rn(x));
        case GGML_TYPE_BF16: return __bfloat162float(__float2bfloat16_rn(x));
        default:             return x;
    }
}

// One table's part of token t's KV head h: its table row, the token's values (the V sums: a float row; the key
// statistics: the cache's K row and the head's first component) and its part of the result column; tab NULL without
// the table or where a row is outside it (a caller's bug: the CPU asserts; left unwritten). Per head the key
// statistics' part is [r, r*r, 1], the V sums' [r, 1].
struct token_part {
    float * tab; const char * x; float * out;
    int64_t d, e0; ggml_type type;
};
__device__ __forceinline__ token_part values_part(const sums_args & s, float * out_col, int32_t row, int64_t t,
                                                  int64_t h) {
    if (s.tab == nullptr || row < 0 || row >= s.n_seq) {
        return { nullptr, nullptr, nullptr, 0, 0, s.type };
    }
    return { (float *) ((char *) s.tab + row*s.t_nb1) + h*(s.d + 1), s.x + h*s.x_nb1 + t*s.x_nb2,
             out_col + s.out_off + h*(s.d + 1), s.d, 0, s.type };
}
__device__ __forceinline__ token_part keys_part(const sums_args & s, float * out_col, int32_t row, int64_t t,
                                                int64_t h) {
    if (s.tab == nullptr || row < 0 || row >= s.n_seq || s.cells[t] < 0 || s.cells[t] >= s.n_rows) {
        return { nullptr, nullptr, nullptr, 0, 0, s.type };
    }
    return { (float *) ((char *) s.tab + row*s.t_nb1) + h*(2*s.d + 1), s.x + (int64_t) s.cells[t]*s.x_nb1,
             out_col + s.out_off + h*(2*s.d + 1), s.d, h*s.d, s.type };
}

// Token t's KV head h in both tables (V sums v, key statistics k), every load before any store: the compiler cannot
// tell the tables and the result apart, so a store between two loads would make the second wait for it (a round trip
// each, where the whole part is two: the table row's index, then the sums).
template <ggml_type K_TYPE>
__device__ __forceinline__ void add_token(const token_part & v, const token_part & k) {
    const int64_t n = v.d > k.d ? v.d : k.d;  // d is 0 without the table
    for (int64_t i = threadIdx.x; i < n; i += UK_THREADS) {
        const bool in_v = i < v.d, in_k = i < k.d;
        const float v_sum = in_v ? v.tab[i] : 0.0f, v_new = in_v ? ((const float *) v.x)[i] : 0.0f;
        const float k_sum = in_k ? k.tab[i] : 0.0f, k_sq = in_k ? k.tab[k.d + i] : 0.0f;
        const float r = in_k ? key_value<K_TYPE>(k.x, k.e0 + i) : 0.0f;
        if (in_v) {
            const float sum = v_sum + round_to_cache(v_new, v.type);
            v.out[i] = v.tab[i] = sum;
        }
        if (in_k) {
            const float sum = k_sum + r;
            const float sq  = __fadd_rn(k_sq, __fmul_rn(r, r));  // no contraction: the CPU's two roundings
            k.out[i] = k.tab[i] = sum;
            k.out[k.d + i] = k.tab[k.d + i] = sq;
        }
    }
    if (threadIdx.x == 0) {
        const float v_n = v.tab ? v.tab[v.d] : 0.0f, k_n = k.tab ? k.tab[2*k.d] : 0.0f;
        if (v.tab) {
            v.out[v.d] = v.tab[v.d] = v_n + 1.0f;
        }
        if (k.tab) {
            k.out[2*k.d] = k.tab[2*k.d] = k_n + 1.0f;
        }
    }
}

template <ggml_type K_TYPE, ggml_type KT_TYPE>
__global__ void __launch_bounds__(UK_THREADS) upkeep_kernel(const upkeep_args a) {
    pdl_wait();
    pdl_release();  // the SparQ op's first kernel launches now and waits on the device for this one to finish
    const int64_t bid = blockIdx.x;
    if (bid < a.ix.n_blocks) {
        write_index_block<K_TYPE, KT_TYPE>(a.ix, bid);
        return;
    }
    const int64_t t = (bid - a.ix.n_blocks) / a.n_head_kv, h = (bid - a.ix.n_blocks) % a.n_head_kv;
    const int32_t row = *(const int32_t *) (a.idx + t*a.i_nb0);
    float * out_col = (float *) (a.dst + t*a.o_nb1);
    add_token<K_TYPE>(values_part(a.vs, out_col, row, t, h), keys_part(a.ks, out_col, row, t, h));
}

template <ggml_type K_TYPE>
void launch_for_index(ggml_type kt_type, unsigned n_blocks, cudaStream_t stream, const upkeep_args & a) {
    const ggml_cuda_kernel_launch_params lp(dim3(n_blocks), UK_THREADS, 0, stream);
    switch (kt_type) {
        case GGML_TYPE_Q8_0: ggml_cuda_kernel_launch(upkeep_kernel<K_TYPE, GGML_TYPE_Q8_0>, lp, a); break;
        case GGML_TYPE_I8:   ggml_cuda_kernel_launch(upkeep_kernel<K_TYPE, GGML_TYPE_I8>,   lp, a); break;
        case GGML_TYPE_F16:  ggml_cuda_kernel_launch(upkeep_kernel<K_TYPE, GGML_TYPE_F16>,  lp, a); break;
        case GGML_TYPE_BF16: ggml_cuda_kernel_launch(upkeep_kernel<K_TYPE, GGML_TYPE_BF16>, lp, a); break;
        default:             ggml_cuda_kernel_launch(upkeep_kernel<K_TYPE, GGML_TYPE_F32>,  lp, a); break;
    }
}

// The kernel for K's and K^T's types (the sums alone: any instantiation, here f32), over the args' blocks.
void launch_upkeep(ggml_type k_type, ggml_type kt_type, cudaStream_t stream, const upkeep_args & a, int64_t n_tokens) {
    const int64_t n_blocks = a.ix.n_blocks + n_tokens*a.n_head_kv;
    if (n_blocks == 0) {
        return;
    }
    GGML_ASSERT(n_blocks <= INT32_MAX);
    switch (k_type) {
        case GGML_TYPE_F16:  launch_for_index<GGML_TYPE_F16> (kt_type, (unsigned) n_blocks, stream, a); break;
        case GGML_TYPE_BF16: launch_for_index<GGML_TYPE_BF16>(kt_type, (unsigned) n_blocks, stream, a); break;
        case GGML_TYPE_Q8_0: launch_for_index<GGML_TYPE_Q8_0>(kt_type, (unsigned) n_blocks, stream, a); break;
        case GGML_TYPE_Q4_0: launch_for_index<GGML_TYPE_Q4_0>(kt_type, (unsigned) n_blocks, stream, a); break;
        case GGML_TYPE_Q4_1: launch_for_index<GGML_TYPE_Q4_1>(kt_type, (unsigned) n_blocks, stream, a); break;
        case GGML_TYPE_Q5_0: launch_for_index<GGML_TYPE_Q5_0>(kt_type, (unsigned) n_blocks, stream, a); break;
        case GGML_TYPE_Q5_1: launch_for_index<GGML_TYPE_Q5_1>(kt_type, (unsigned) n_blocks, stream, a); break;
        default:             launch_for_index<GGML_TYPE_F32> (kt_type, (unsigned) n_blocks, stream, a); break;
    }
}

// The index part from ggml_sparq_index_write's arguments.
index_args index_part(const ggml_tensor * kt, const ggml_tensor * k, const ggml_tensor * cells,
                      const ggml_tensor * blk, const ggml_tensor * mask, int32_t s0) {
    index_args a = {};
    a.kt = (char *) kt->data; a.k = (const char *) k->data; a.cells = (const int32_t *) cells->data;
    a.blk = (const int64_t *) blk->data; a.mask = mask ? (const float *) mask->data : nullptr;
    const bool q4 = kt->type == GGML_TYPE_I8;
    a.head_dim = q4 ? kt->ne[0] / GGML_SPARQ_Q4_DIM_BYTES : 0;
    a.n_embd = q4 ? a.head_dim*kt->ne[1] : kt->ne[1];
    a.n_blk = blk->ne[0]; a.n_chunks = (a.n_embd + UK_THREADS - 1) / UK_THREADS;
    a.n_blocks = a.n_blk*blk->ne[2]*a.n_chunks;
    a.kt_nb1 = kt->nb[1]; a.kt_nb2 = kt->nb[2]; a.kt_nb3 = q4 ? kt->nb[3] : kt->nb[2]; a.k_nb1 = k->nb[1];
    a.s0 = s0;
    return a;
}

sums_args values_args(const ggml_tensor * tab, const ggml_tensor * v, ggml_type type) {
    sums_args s = {};
    if (tab) {
        s.tab = (float *) tab->data; s.x = (const char *) v->data;
        s.d = v->ne[0]; s.n_seq = tab->ne[1];
        s.t_nb1 = tab->nb[1]; s.x_nb1 = v->nb[1]; s.x_nb2 = v->nb[2];
        s.type = type;
    }
    return s;
}

// The key statistics' part: the cache's keys k at each token's row in cells (k's rows over its streams are evenly
// strided: k is contiguous, as ggml_sparq_kstat_rows_check requires).
sums_args keys_args(const ggml_tensor * tab, const ggml_tensor * k, const ggml_tensor * cells, int64_t out_off) {
    sums_args s = {};
    if (tab) {
        const int64_t n_head_kv = tab->ne[0] - 2*k->ne[0];
        s.tab = (float *) tab->data; s.x = (const char *) k->data; s.cells = (const int32_t *) cells->data;
        s.d = k->ne[0] / n_head_kv; s.n_seq = tab->ne[1]; s.out_off = out_off; s.n_rows = k->ne[1]*k->ne[2];
        s.t_nb1 = tab->nb[1]; s.x_nb1 = k->nb[1];
        s.type = k->type;
    }
    return s;
}

bool kt_type_ok(ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 || t == GGML_TYPE_Q8_0;
}
bool k_type_ok(ggml_type t) {
    return kt_type_ok(t) || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1 || t == GGML_TYPE_Q5_0 || t == GGML_TYPE_Q5_1;
}

bool index_supported(const ggml_tensor * kt, const ggml_tensor * k, const ggml_tensor * blk) {
    const int64_t n_embd = kt->type == GGML_TYPE_I8 ? kt->ne[0] / GGML_SPARQ_Q4_DIM_BYTES * kt->ne[1] : kt->ne[1];
    return (kt_type_ok(kt->type) || kt->type == GGML_TYPE_I8) && k_type_ok(k->type) &&
           blk->ne[0]*blk->ne[2]*((n_embd + UK_THREADS - 1) / UK_THREADS) <= INT32_MAX / 2;  // a 1-D grid
}

bool values_supported(const ggml_tensor * tab, const ggml_tensor * v, ggml_type type) {
    return tab == nullptr || (tab->type == GGML_TYPE_F32 && v->type == GGML_TYPE_F32 && tab->nb[0] == sizeof(float) &&
                              v->nb[0] == sizeof(float) &&
                              (type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16));
}

bool keys_supported(const ggml_tensor * tab, const ggml_tensor * k) {
    return tab == nullptr || (tab->type == GGML_TYPE_F32 && tab->nb[0] == sizeof(float) && k_type_ok(k->type) &&
                              ggml_is_contiguous(k) && k->ne[1]*k->ne[2] <= INT32_MAX);
}

}  // namespace

bool ggml_cuda_sparq_index_write_supported(int device, const ggml_tensor * op) {
    GGML_UNUSED(device);
    return index_supported(op->src[0], op->src[1], op->src[3]);
}

void ggml_cuda_sparq_index_write(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * kt = dst->src[0], * k = dst->src[1];
    GGML_ASSERT(ggml_cuda_sparq_index_write_supported(ctx.device, dst));
    GGML_ASSERT(dst->data == kt->data);  // the result is kt, written in place
    upkeep_args a = {};
    a.ix = index_part(kt, k, dst->src[2], dst->src[3], dst->src[4], ggml_get_op_params_i32(dst, 0));
    a.n_head_kv = 1;
    launch_upkeep(k->type, kt->type, ctx.stream(), a, 0);
}

bool ggml_cuda_sparq_vsum_rows_supported(int device, const ggml_tensor * op) {
    GGML_UNUSED(device);
    const ggml_tensor * idx = op->src[0], * vsum = op->src[1], * v = op->src[2], * kstat = op->src[3];
    const ggml_tensor * kt = op->src[5], * k = op->src[6];
    const auto v_type = (ggml_type) ggml_get_op_params_i32(op, 0);
    return idx->type == GGML_TYPE_I32 && op->type == GGML_TYPE_F32 && op->nb[0] == sizeof(float) &&
           values_supported(vsum, v, v_type) && keys_supported(kstat, k) &&
           (kt == nullptr || index_supported(kt, k, op->src[8])) &&
           (vsum ? v->ne[1] : kstat->ne[0] - 2*k->ne[0])*idx->ne[0] <= INT32_MAX;
}

void ggml_cuda_sparq_vsum_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * idx = dst->src[0], * vsum = dst->src[1], * v = dst->src[2], * kstat = dst->src[3];
    const ggml_tensor * k_cells = dst->src[4], * kt = dst->src[5], * k = dst->src[6];
    GGML_ASSERT(ggml_cuda_sparq_vsum_rows_supported(ctx.device, dst));
    const int64_t n_v = vsum ? vsum->ne[0] : 0, n_k = kstat ? kstat->ne[0] : 0, n_tokens = idx->ne[0];
    GGML_ASSERT(dst->ne[0] == n_v + n_k && dst->ne[1] == n_tokens);
    GGML_ASSERT(!vsum || vsum->ne[0] == (v->ne[0] + 1)*v->ne[1]);
    GGML_ASSERT(!kstat || (k_cells->ne[0] == n_tokens && (n_k - 2*k->ne[0])*(k->ne[0] / (n_k - 2*k->ne[0])) == k->ne[0]));
    upkeep_args a = {};
    if (kt) {
        a.ix = index_part(kt, k, dst->src[7], dst->src[8], dst->src[9], ggml_get_op_params_i32(dst, 1));
    }
    a.vs = values_args(vsum, v, (ggml_type) ggml_get_op_params_i32(dst, 0));
    a.ks = keys_args(kstat, k, k_cells, n_v);
    a.idx = (const char *) idx->data; a.i_nb0 = idx->nb[0];
    a.dst = (char *) dst->data; a.o_nb1 = dst->nb[1];
    a.n_head_kv = vsum ? v->ne[1] : n_k - 2*k->ne[0];
    launch_upkeep(k ? k->type : GGML_TYPE_F32, kt ? kt->type : GGML_TYPE_F32, ctx.stream(), a, n_tokens);
}
