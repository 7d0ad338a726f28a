// CUDA kernel of ggml_sparq_attn: dispatch (host code, launches, the choice of the selection kernel). Semantics:
// ggml_ops/include/ggml-sparq.h and docs/design.md, "SparQ: op semantics"; the kernels' structure: docs/design.md,
// "CUDA kernels". The CPU kernel (ggml_ops/src/cpu/sparq-attn-cpu.cpp) is the reference for every detail (tie rules
// included).
//
// A row is (KV head h, query row t, stream s), as on the CPU; the query heads of h's group share the row's
// selection. Rows are processed in waves (scratch stays bounded for long prefill batches); per wave, a chain of
// short kernels. Each kernel's grid is either one block per row (the serial steps) or is split along the
// sequence or over output slices, so that every SM works even with 8 KV heads:
//   Q      (sparq-attn-query.cuh): I1 and the scaled query components;
//   A      (sparq-attn-score.cuh): the approximate logits per chunk of cells with the chunk's softmax and visible-cell
//          statistics;
//   then the selection of I2, by one of three kernel families (sparq_cuda_get_best_select_kernel chooses):
//   P, B, S (sparq-attn-select.cuh): merge and sampled threshold, sweep, exact selection; many blocks per row,
//          for any number of rows;
//   PBS    (sparq-attn-select-cluster.cuh): the same selection in one launch, a thread-block cluster per row
//          exchanging counts through distributed shared memory (Hopper), for a few rows all in flight at once;
//   BS     (sparq-attn-select-bound.cuh): one block per row that bounds each 8-cell block's scores from kernel A's
//          per-block maxima and scores only the blocks that can hold a selected cell;
//   LV     (sparq-attn-values.cuh): exact logits over I2, softmax, Sparse-V cut, weighted sum of V, mean mix.
// The selection families give the same I2 and alpha_g. Launch sizes depend on shapes only (CUDA graphs stay on);
// no host round trip. Shared device code: sparq-attn-common.cuh.
//
// Types: kernel A is instantiated for the type it reads (the index's: f32, f16, bf16 or q8_0, whatever K's type; or
// K's for the gather and exact scores); kernel LV for K and V of one float type, or kv_any where K or V is quantized
// or their types differ (run-time types, each value dequantized as ggml defines it); kernel Q reads K (select qsigma
// without kstat) through the run-time type too.
//
// Testing switch: SPARQ_CUDA_SELECT=auto|cluster|sweep|bound (read once per process; unset or empty: auto) forces the
// selection kernel, so that the op tests cover every family on every shape:
//   auto     the choice of sparq_cuda_get_best_select_kernel (the default);
//   sweep    kernels P, B and S for every launch;
//   bound    kernel BS wherever it can run (rows with logits of at most BS_MAX_KV cells), however many rows;
//   cluster  kernel PBS wherever it can hold the rows (at most PBS_MAX_CPT cells per thread at clusters of 16), however
//            many rows there are (clusters past the resident ones wait for a slot); longer rows fall back to P, B and
//            S. A device or build where kernel PBS cannot run at all (before Hopper, no sm_90 code) aborts.
// Any other value aborts. Results are the same whichever runs; only the speed differs.
//
// Debugging build: -DSPARQ_CUDA_INSTRUMENT (e.g. cmake -DSPARQ_CUDA_INSTRUMENT=ON) compiles in the instrumentation of
// sparq-attn-common.cuh, switched on at run time by SPARQ_CUDA_TIMELINE=1 (each kernel's start, end of its dependent-
// launch wait and end, printed after each wave) and SPARQ_CUDA_TIMING=1 (phase timings of kernels Q, P, S, PBS, BS
// and LV, and kernel S's exact fallbacks). Without the define there is no instrumentation code and no environment read.
#include "sparq-attn.cuh"
#include "sparq-attn-query.cuh"
#include "sparq-attn-score.cuh"
#include "sparq-attn-select.cuh"
#include "sparq-attn-select-cluster.cuh"
#include "sparq-attn-select-bound.cuh"
#include "sparq-attn-values.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

// ---- host ------------------------------------------------------------------------------------------

// Opt a kernel into more than the default 48 KiB of shared memory (static + dynamic) when a launch needs it;
// once per kernel, device and size (the attribute is per device: with -sm layer each GPU needs its own).
template <auto kernel>
void ensure_smem(size_t bytes) {
    static size_t configured[GGML_CUDA_MAX_DEVICES] = {};  // one array per kernel instance
    const int device = ggml_cuda_get_device();
    if (bytes <= configured[device]) {
        return;
    }
    cudaFuncAttributes attr;
    CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    if (attr.sharedSizeBytes + bytes > 48*1024) {
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) bytes));
    }
    configured[device] = bytes;
}

template <typename T, int POL, int NG>
void launch_scores(dim3 grid, size_t smem, cudaStream_t stream, const sparq_args & a, const sparq_scratch & s, int64_t r0) {
    ensure_smem<sparq_scores<T, POL, NG>>(smem);
    ggml_cuda_kernel_launch(sparq_scores<T, POL, NG>, ggml_cuda_kernel_launch_params(grid, A_THREADS, smem, stream), a, s, r0);
}

template <typename T, int POL>
void launch_scores_ng(int ng, dim3 grid, size_t smem, cudaStream_t stream, const sparq_args & a,
                      const sparq_scratch & s, int64_t r0) {
    switch (ng) {
        case 1:  launch_scores<T, POL, 1>(grid, smem, stream, a, s, r0); break;
        case 2:  launch_scores<T, POL, 2>(grid, smem, stream, a, s, r0); break;
        case 4:  launch_scores<T, POL, 4>(grid, smem, stream, a, s, r0); break;
        default: launch_scores<T, POL, 8>(grid, smem, stream, a, s, r0); break;
    }
}

// Kernel A for a scoring policy: instantiated for the type it reads, K^T's for SC_KT (f32, f16, bf16 or q8_0), K's for
// the gather and exact scores (a float type, or kv_any for the quantized ones); SC_NONE reads neither.
template <int POL>
void launch_scores_of(ggml_type type, int ng, dim3 grid, size_t smem, cudaStream_t stream, const sparq_args & a,
                      const sparq_scratch & s, int64_t r0) {
    switch (type) {
        case GGML_TYPE_F32:  launch_scores_ng<float,       POL>(ng, grid, smem, stream, a, s, r0); break;
        case GGML_TYPE_F16:  launch_scores_ng<half,        POL>(ng, grid, smem, stream, a, s, r0); break;
        case GGML_TYPE_BF16: launch_scores_ng<nv_bfloat16, POL>(ng, grid, smem, stream, a, s, r0); break;
        default:
            if constexpr (POL == SC_KT) {
                GGML_ASSERT(type == GGML_TYPE_Q8_0);
                if (a.vec_kt_q8) {
                    launch_scores_ng<q8_warp, POL>(ng, grid, smem, stream, a, s, r0);
                } else {
                    launch_scores_ng<block_q8_0, POL>(ng, grid, smem, stream, a, s, r0);
                }
            } else {
                launch_scores_ng<kv_any, POL>(ng, grid, smem, stream, a, s, r0);
            }
            break;
    }
}

// Kernel LV's slice width (see the kernel), a function of the shapes and the device: 32 unless the 32-slices of
// these rows make more than one wave of V_MIN_BLOCKS-per-SM blocks. Measured on an H100 (op bench, Llama-2 heads):
// B = 1 at 32k narrow 94 / wide 97 us; B = 4 at 8k 112 / 104; B = 8 at 8k 158 / 141.5 (LV alone 42.7 / 18.7 us under
// ncu). The op tests' shapes take both: decode-like rows the narrow slices, prefill batches the wide ones.
constexpr int V_MIN_BLOCKS = 2;
static int lv_slice(const sparq_args & a, int64_t nw) {
    const int64_t n_narrow = ((a.d_v + V_SLICE_NARROW - 1) / V_SLICE_NARROW) * a.group * nw;
    const int64_t wave = (int64_t) ggml_cuda_info().devices[ggml_cuda_get_device()].nsm * V_MIN_BLOCKS;
    return n_narrow > wave ? V_SLICE_WIDE : V_SLICE_NARROW;
}

template <typename T, int VPT, int SLICE>
void launch_lv(int64_t nw, cudaStream_t stream, const sparq_args & a, const sparq_scratch & s, int64_t r0) {
    const dim3 grid_v((unsigned) (((a.d_v + SLICE - 1) / SLICE) * a.group), (unsigned) nw);
    const size_t smem_lv = 2*sizeof(float)*a.p.k2;
    ensure_smem<sparq_logits_values<T, VPT, SLICE>>(smem_lv);
    ggml_cuda_kernel_launch(sparq_logits_values<T, VPT, SLICE>, ggml_cuda_kernel_launch_params(grid_v, V_THREADS, smem_lv, stream),
                            a, s, r0);
}

template <typename T>
void launch_logits_values(int vpt, int slice, int64_t nw, cudaStream_t stream, const sparq_args & a, const sparq_scratch & s,
                          int64_t r0) {
    const bool wide = slice == V_SLICE_WIDE;
    switch (vpt) {
        case 1:  wide ? launch_lv<T, 1, V_SLICE_WIDE>(nw, stream, a, s, r0) : launch_lv<T, 1, V_SLICE_NARROW>(nw, stream, a, s, r0); break;
        case 2:  wide ? launch_lv<T, 2, V_SLICE_WIDE>(nw, stream, a, s, r0) : launch_lv<T, 2, V_SLICE_NARROW>(nw, stream, a, s, r0); break;
        default: wide ? launch_lv<T, 4, V_SLICE_WIDE>(nw, stream, a, s, r0) : launch_lv<T, 4, V_SLICE_NARROW>(nw, stream, a, s, r0); break;
    }
}

// Kernel PBS's dynamic shared memory at cpt cells per thread: the keys of a block's cells.
static size_t pbs_smem(int cpt) { return sizeof(uint32_t) * pbs_stride(cpt)*PBS_THREADS; }

#if SPARQ_PBS_BUILT
// A launch of kernel PBS for nw rows at cpt cells per thread: clusters of cl blocks, dependent on its predecessor by
// ggml_cuda_kernel_launch's rules (GGML_CUDA_USE_PDL; GGML_CUDA_PDL=0 turns it off) where `dependent`.
struct pbs_launch {
    cudaLaunchAttribute attrs[2];
    cudaLaunchConfig_t  cfg = {};

    pbs_launch(int64_t nw, int cl, int cpt, cudaStream_t stream, bool dependent) {
        cfg.gridDim = dim3((unsigned) (nw*cl));
        cfg.blockDim = dim3(PBS_THREADS);
        cfg.dynamicSmemBytes = pbs_smem(cpt);
        cfg.stream = stream;
        attrs[0].id = cudaLaunchAttributeClusterDimension;
        attrs[0].val.clusterDim.x = cl;
        attrs[0].val.clusterDim.y = 1;
        attrs[0].val.clusterDim.z = 1;
        cfg.attrs = attrs;
        cfg.numAttrs = 1;
#if defined(GGML_CUDA_USE_PDL)
        static const bool pdl = [] {
            const char * e = getenv("GGML_CUDA_PDL");
            return e == nullptr || atoi(e) != 0;
        }();
        if (dependent && pdl) {
            attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attrs[1].val.programmaticStreamSerializationAllowed = 1;
            cfg.numAttrs = 2;
        }
#else
        GGML_UNUSED(dependent);
#endif
    }
    pbs_launch(const pbs_launch &) = delete;  // cfg points at attrs
    pbs_launch & operator=(const pbs_launch &) = delete;
};

// How many clusters of CL blocks at the largest size are resident at once on the current device (0: none)
template <int CL>
int pbs_resident_clusters() {
    if (CL > 8) {  // 16 is Hopper's non-portable size: the kernel opts in
        if (cudaFuncSetAttribute(sparq_pbs<CL>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
            (void) cudaGetLastError();
            return 0;
        }
    }
    ensure_smem<sparq_pbs<CL>>(pbs_smem(PBS_MAX_CPT));
    const pbs_launch l(1, CL, PBS_MAX_CPT, nullptr, false);
    int n_clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&n_clusters, sparq_pbs<CL>, &l.cfg) != cudaSuccess) {
        n_clusters = 0;
    }
    (void) cudaGetLastError();  // a refused query leaves no error behind
    return n_clusters;
}
#endif  // SPARQ_PBS_BUILT

// ---- the choice of the selection kernel ---------------------------------------------------------------

// The kernels that select I2: P, B and S (sparq-attn-select.cuh), or PBS (sparq-attn-select-cluster.cuh) with
// clusters of 8 or 16 blocks per row.
enum sparq_select_kernel {
    SPARQ_SELECT_SWEEP      = 0,   // kernels P, B, S
    SPARQ_SELECT_BOUND      = 1,   // kernel BS
    SPARQ_SELECT_CLUSTER_8  = 8,   // kernel PBS, clusters of 8
    SPARQ_SELECT_CLUSTER_16 = 16,  // kernel PBS, clusters of 16 (Hopper's non-portable size)
};

// What the choice needs to know of a device: how many clusters of kernel PBS at its largest size (PBS_MAX_CPT cells per
// thread) are resident at once, with clusters of 8 and of 16 blocks; 0 where kernel PBS cannot run (before Hopper, or
// no sm_90 code for it in this build). Queried once per device (select_device_caps).
struct sparq_select_caps {
    int resident_cl8;
    int resident_cl16;
};

// Rows longer than this many cells per thread at clusters of 8 take clusters of 16 where those fit.
constexpr int PBS_CL16_FROM_CPT = 20;

// Kernel BS for every row with logits of at most BS_MAX_KV cells, except a few short rows. On an H100 (op bench,
// bench/results/cuda_op_select_ab.json) it is faster than the other kernels from BS_FROM_KV cells (B = 1: 32 rows of
// Llama-2 heads by 5-16%, 8 of Llama-3 by 0-5%) and for many rows at any length (B = 16, 128 or 512 rows: by 11-19%
// from 4k); below 32k it is as fast with 32 rows and 5-7% slower with 8 (one block per row leaves most SMs idle, where
// kernel PBS runs a cluster of 16 blocks per row).
constexpr int64_t BS_FROM_KV       = 32768;
constexpr int64_t BS_FEW_ROWS_UPTO = 32;

// Where kernel BS can run at all: rows with logits (its bounds come from kernel A's per-block maxima of them) of at
// most BS_MAX_KV cells (every block's bound in shared memory).
static bool bs_can_run(int64_t n_kv, bool has_logits) {
    return has_logits && n_kv <= BS_MAX_KV;
}

// The selection kernel without kernel BS: kernel PBS where it holds the rows (at most PBS_MAX_CPT cells per thread) and
// every row's cluster is resident at once (one wave of clusters: PBS is built for latency, P, B and S for throughput;
// see sparq-attn-select-cluster.cuh for the measurements); clusters of 16 where clusters of 8 would not fit or would
// leave more than PBS_CL16_FROM_CPT cells per thread (few long rows, as GQA models' 8 rows in one decode step, whose
// 8-block clusters would leave half the SMs idle); elsewhere P, B and S.
static sparq_select_kernel pbs_or_sweep(int64_t n_kv, int64_t n_rows, const sparq_select_caps & dev) {
    const bool fits8  = pbs_cpt(n_kv, 8)  <= PBS_MAX_CPT && n_rows <= dev.resident_cl8;
    const bool fits16 = pbs_cpt(n_kv, 16) <= PBS_MAX_CPT && n_rows <= dev.resident_cl16;
    if (fits16 && (!fits8 || pbs_cpt(n_kv, 8) > PBS_CL16_FROM_CPT)) {
        return SPARQ_SELECT_CLUSTER_16;
    }
    return fits8 ? SPARQ_SELECT_CLUSTER_8 : SPARQ_SELECT_SWEEP;
}

// The selection kernel for n_rows rows of n_kv cells on a device with the given caps: a pure function of the shapes and
// the device (no state, no environment), as ggml-cuda chooses a flash-attention kernel. Kernel BS where it can run,
// except for a few short rows (above); elsewhere pbs_or_sweep's choice.
static sparq_select_kernel sparq_cuda_get_best_select_kernel(int64_t n_kv, int64_t n_rows, bool has_logits,
                                                             const sparq_select_caps & dev) {
    if (bs_can_run(n_kv, has_logits) && (n_kv >= BS_FROM_KV || n_rows > BS_FEW_ROWS_UPTO)) {
        return SPARQ_SELECT_BOUND;
    }
    return pbs_or_sweep(n_kv, n_rows, dev);
}

// The current device's caps (once per device): cluster occupancy of kernel PBS where the device is Hopper or later and
// the kernel has code for it.
static const sparq_select_caps & select_device_caps() {
    static sparq_select_caps caps[GGML_CUDA_MAX_DEVICES] = {};  // zero: no cluster kernel
    const int device = ggml_cuda_get_device();
#if SPARQ_PBS_BUILT
    static bool known[GGML_CUDA_MAX_DEVICES] = {};
    if (!known[device]) {
        known[device] = true;
        cudaFuncAttributes attr;
        CUDA_CHECK(cudaFuncGetAttributes(&attr, sparq_pbs<8>));
        if (ggml_cuda_info().devices[device].cc >= GGML_CUDA_CC_HOPPER && attr.binaryVersion >= 90) {
            caps[device].resident_cl8  = pbs_resident_clusters<8>();
            caps[device].resident_cl16 = pbs_resident_clusters<16>();
        }
    }
#endif  // SPARQ_PBS_BUILT
    return caps[device];
}

// The testing switch SPARQ_CUDA_SELECT (see the file header), read once per process.
enum select_mode { SELECT_AUTO, SELECT_CLUSTER, SELECT_SWEEP, SELECT_BOUND };
static select_mode select_mode_from_env() {
    static const select_mode mode = [] {
        const char * e = getenv("SPARQ_CUDA_SELECT");
        if (e == nullptr || e[0] == '\0' || strcmp(e, "auto") == 0) {
            return SELECT_AUTO;
        }
        if (strcmp(e, "cluster") == 0) {
            return SELECT_CLUSTER;
        }
        if (strcmp(e, "sweep") == 0) {
            return SELECT_SWEEP;
        }
        if (strcmp(e, "bound") == 0) {
            return SELECT_BOUND;
        }
        GGML_ABORT("SPARQ_CUDA_SELECT=%s: expected auto, cluster, sweep or bound", e);
    }();
    return mode;
}

// The selection kernel of an op's n_rows rows: the pure choice, unless SPARQ_CUDA_SELECT forces one.
static sparq_select_kernel select_kernel_for(const sparq_args & a, int64_t n_rows) {
    const int64_t n_kv = a.n_kv;
    const sparq_select_caps & dev = select_device_caps();
    switch (select_mode_from_env()) {
        case SELECT_SWEEP:
            return SPARQ_SELECT_SWEEP;
        case SELECT_BOUND:
            // kernel BS wherever it can run, however many rows; elsewhere the choice without it
            return bs_can_run(n_kv, a.has_logits) ? SPARQ_SELECT_BOUND : pbs_or_sweep(n_kv, n_rows, dev);
        case SELECT_CLUSTER:
            if (dev.resident_cl8 == 0 && dev.resident_cl16 == 0) {
                GGML_ABORT("SPARQ_CUDA_SELECT=cluster: kernel PBS cannot run on this device "
                           "(it needs compute capability 9.0 or later and a build with sm_90 code)");
            }
            // PBS wherever it holds the rows, whatever their count (the choice for one row); longer rows take P, B, S
            return pbs_or_sweep(n_kv, 1, dev);
        default:
            return sparq_cuda_get_best_select_kernel(n_kv, n_rows, a.has_logits, dev);
    }
}

// Kernel PBS: a cluster of cl blocks per row, launched dependent on kernel A as the other kernels are
// (ggml_cuda_kernel_launch's rules: GGML_CUDA_PDL=0 turns dependent launches off).
template <int CL>
void launch_pbs(int64_t nw, cudaStream_t stream, const sparq_args & a, const sparq_scratch & s, int64_t r0) {
#if SPARQ_PBS_BUILT
    const pbs_launch l(nw, CL, pbs_cpt(a.n_kv, CL), stream, true);
    ensure_smem<sparq_pbs<CL>>(l.cfg.dynamicSmemBytes);
    CUDA_CHECK(cudaLaunchKernelEx(&l.cfg, sparq_pbs<CL>, a, s, r0));
#else
    GGML_UNUSED(nw); GGML_UNUSED(stream); GGML_UNUSED(a); GGML_UNUSED(s); GGML_UNUSED(r0);
    (void) sparq_pbs<CL>;
    GGML_ABORT("kernel PBS is not built (select_device_caps gives it no clusters)");
#endif  // SPARQ_PBS_BUILT
}

// Kernel LV for K and V of one float type (instantiated for it), or kv_any for quantized or mixed types.
static void launch_lv_of(int vpt, int slice, int64_t nw, cudaStream_t stream, const sparq_args & a, const sparq_scratch & s,
                         int64_t r0) {
    const ggml_type type = a.k_type == a.v_type ? a.k_type : GGML_TYPE_COUNT;
    switch (type) {
        case GGML_TYPE_F32:  launch_logits_values<float>      (vpt, slice, nw, stream, a, s, r0); break;
        case GGML_TYPE_F16:  launch_logits_values<half>       (vpt, slice, nw, stream, a, s, r0); break;
        case GGML_TYPE_BF16: launch_logits_values<nv_bfloat16>(vpt, slice, nw, stream, a, s, r0); break;
        default:             launch_logits_values<kv_any>     (vpt, slice, nw, stream, a, s, r0); break;
    }
}

static void launch_all(int pol, int ng, int vpt, dim3 grid_a, size_t smem_a, int64_t nw, size_t smem_s,
                       sparq_select_kernel sel, cudaStream_t stream, const sparq_args & a, const sparq_scratch & s,
                       int64_t r0) {
    switch (pol) {
        case SC_NONE:   launch_scores<float, SC_NONE, 1>(grid_a, smem_a, stream, a, s, r0); break;  // reads no K
        case SC_KT:     launch_scores_of<SC_KT>    (a.kt_type, ng, grid_a, smem_a, stream, a, s, r0); break;
        case SC_Q4:     launch_scores_ng<uint8_t, SC_Q4>(ng, grid_a, smem_a, stream, a, s, r0); break;
        case SC_GATHER: launch_scores_of<SC_GATHER>(a.k_type,  ng, grid_a, smem_a, stream, a, s, r0); break;
        default:        launch_scores_of<SC_EXACT> (a.k_type,  ng, grid_a, smem_a, stream, a, s, r0); break;
    }
    if (sel == SPARQ_SELECT_BOUND) {
        ensure_smem<sparq_bound_select>(bs_smem(a.n_kv));
        ggml_cuda_kernel_launch(sparq_bound_select,
                                ggml_cuda_kernel_launch_params(dim3((unsigned) nw), BS_THREADS, bs_smem(a.n_kv), stream),
                                a, s, r0);
    } else if (sel == SPARQ_SELECT_CLUSTER_16) {
        launch_pbs<16>(nw, stream, a, s, r0);
    } else if (sel == SPARQ_SELECT_CLUSTER_8) {
        launch_pbs<8>(nw, stream, a, s, r0);
    } else {
        const dim3 rows((unsigned) nw), grid_b((unsigned) a.n_chunks_b, (unsigned) nw);
        ggml_cuda_kernel_launch(sparq_prepare, ggml_cuda_kernel_launch_params(rows, Q_THREADS, 0, stream), a, s, r0);
        ggml_cuda_kernel_launch(sparq_sweep, ggml_cuda_kernel_launch_params(grid_b, B_THREADS, sizeof(uint64_t)*B_CHUNK, stream),
                                a, s, r0);
        ensure_smem<sparq_select>(smem_s);
        ggml_cuda_kernel_launch(sparq_select, ggml_cuda_kernel_launch_params(rows, B_THREADS, smem_s, stream), a, s, r0);
    }
    launch_lv_of(vpt, lv_slice(a, nw), nw, stream, a, s, r0);
}

static bool aligned16(const void * p) { return ((uintptr_t) p & 15) == 0; }
// Kernel A's heads per pass (its instances: 1, 2, 4, 8) for a group of G query heads
static int heads_per_pass(int64_t G) { return G >= 8 ? 8 : G >= 4 ? (G == 4 ? 4 : 8) : G >= 2 ? (G == 2 ? 2 : 4) : 1; }
// Kernel A's head groups (blocks per chunk) for n_blocks = chunks x rows: the largest divisor of G whose grid stays
// within one wave of A_WAVE_PER_SM blocks (A_SM_WARPS warps) per SM. With few rows (GQA heads, short rows) one block
// per chunk and row leaves kernel A latency bound: H200, Llama-3 heads at 32k (128 blocks of 8 warps, q4 index): 7.8
// warps per SM issuing 0.26 a cycle. The sibling blocks of a chunk are adjacent in the grid, so they read its K^T or
// index rows at about the same time and L2 serves all but the first read.
constexpr int A_WAVE_PER_SM = A_SM_WARPS / A_WARPS;
static int a_head_groups(int64_t n_blocks, int64_t G, int n_sm) {
    int groups = 1;
    for (int64_t hg = 2; hg <= G; ++hg) {
        if (G % hg == 0 && n_blocks*hg <= (int64_t) A_WAVE_PER_SM*n_sm) {
            groups = (int) hg;
        }
    }
    return groups;
}
static bool strides16(const ggml_tensor * t) { return t->nb[1] % 16 == 0 && t->nb[2] % 16 == 0 && t->nb[3] % 16 == 0; }

// Scratch of one wave: each array 256-byte aligned.
struct scratch_plan {
    size_t qs, i1, logits, bmax, bkeys, bkept, cmax, csum, cvis, rstat, rinfo, counters, bitmap, cand, forced, i2, alpha, total;
};
static scratch_plan plan_scratch(const sparq_args & a, bool scores, bool bound, int64_t W) {
    const int64_t G = a.group;
    scratch_plan p;
    size_t o = 0;
    auto take = [&](size_t bytes) { const size_t at = o; o += (bytes + 255) & ~size_t(255); return at; };
    p.qs       = take(sizeof(float) * W*G*a.p.k1);
    p.i1       = take(sizeof(int32_t) * W*a.p.k1);
    p.logits   = take(scores ? sizeof(float) * W*G*a.n_kv : 0);
    p.bmax     = take(bound ? sizeof(float) * W*G*bs_blocks_a(a.n_chunks_a) : 0);
    p.bkeys    = take(bound ? sizeof(uint32_t) * W*bs_blocks_a(a.n_chunks_a)*A_CELLS : 0);
    p.bkept    = take(bound ? sizeof(int32_t) * W*bs_blocks_a(a.n_chunks_a) : 0);
    p.cmax     = take(sizeof(float) * W*G*a.n_chunks_a);
    p.csum     = take(sizeof(float) * W*G*a.n_chunks_a);
    p.cvis     = take(sizeof(int32_t) * W*a.n_chunks_a*3);
    p.rstat    = take(sizeof(float) * W*2*G);
    p.rinfo    = take(sizeof(int64_t) * W*N_RI);
    p.counters = take(sizeof(uint32_t) * W*N_CTR);
    p.bitmap   = take(sizeof(uint32_t) * W*a.n_words);
    p.cand     = take(a.n_top > 0 ? sizeof(uint64_t) * W*a.cap : 0);
    p.forced   = take(sizeof(int32_t) * W*a.p.k2);
    p.i2       = take(sizeof(int32_t) * W*a.p.k2);
    p.alpha    = take(sizeof(float) * W*G);
    p.total    = o;
    return p;
}

}  // namespace

// The types the kernels read: K and V each f32, f16, bf16 or one of ggml's quantized types of blocks of 32 (K and V of
// one float type run the kernels instantiated for it, every other pair kv_any); the index (K^T) f32, f16, bf16 or
// q8_0, whatever K's type.
static bool kv_type_ok(ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 || t == GGML_TYPE_Q8_0 ||
           t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1 || t == GGML_TYPE_Q5_0 || t == GGML_TYPE_Q5_1;
}
static bool kt_type_ok(ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 || t == GGML_TYPE_Q8_0 || t == GGML_TYPE_I8;
}

bool ggml_cuda_sparq_attn_supported(int device, const ggml_tensor * op) {
    const ggml_tensor * q = op->src[0], * k = op->src[1], * kt = op->src[2], * v = op->src[3];
    const ggml_tensor * mask = op->src[4], * vsum = op->src[5], * pos = op->src[6], * kstat = op->src[7];
    if (q->type != GGML_TYPE_F32 || op->type != GGML_TYPE_F32 || !kv_type_ok(k->type) || !kv_type_ok(v->type) ||
        (kt && !kt_type_ok(kt->type)) || (mask && mask->type != GGML_TYPE_F16) ||
        (vsum && vsum->type != GGML_TYPE_F32) || (pos && pos->type != GGML_TYPE_I32) ||
        (kstat && kstat->type != GGML_TYPE_F32)) {
        return false;
    }
    for (const ggml_tensor * t : { q, k, kt, v, mask, vsum, pos, kstat }) {
        if (t && t->nb[0] != ggml_type_size(t->type)) {
            return false;
        }
    }
    const int64_t d = q->ne[0], G = q->ne[2] / k->ne[2];
    if (!ggml_is_contiguous(op) || d > MAX_HEAD_DIM || v->ne[0] > MAX_HEAD_DIM || G > MAX_G) {
        return false;
    }
    // quantized rows are whole blocks (the kernels read 8 values of one block at a time); a q8_0 index row holds
    // n_kv cells rounded up to its blocks
    const bool q4 = kt && kt->type == GGML_TYPE_I8;
    if (d % ggml_blck_size(k->type) != 0 || v->ne[0] % ggml_blck_size(v->type) != 0 ||
        (kt && !q4 && kt->ne[0] != GGML_PAD(k->ne[1], ggml_blck_size(kt->type)))) {
        return false;
    }
    // the q4 index: a quarter of the components per thread in whole words, the scales in registers; 16-byte loads
    if (q4 && (d % (8*Q4_THREADS) != 0 || d > Q4_MAX_HEAD_DIM || !aligned16(kt->data) || !strides16(kt) ||
               a_qs_bytes(heads_per_pass(G), d, d) + q4_coef_bytes(heads_per_pass(G), d) >
                   ggml_cuda_info().devices[device].smpbo)) {
        return false;
    }
    // kernel A takes a K^T row's address as a 32 x 32-bit product (kt_row)
    if (kt && kt->nb[1] > UINT32_MAX) {
        return false;
    }
    const ggml_sparq_op_params p = ggml_sparq_get_op_params(op);
    if (p.select != GGML_SPARQ_SELECT_Q && p.select != GGML_SPARQ_SELECT_QSIGMA) {
        return false;
    }
    // kernel S keeps the candidate keys and I2 in shared memory
    const size_t smem_s = smem_s_plan(candidate_cap(p.k2), p.k2).total + 12*1024;  // + static
    return smem_s <= ggml_cuda_info().devices[device].smpbo;
}

void ggml_cuda_sparq_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0], * k = dst->src[1], * kt = dst->src[2], * v = dst->src[3];
    const ggml_tensor * mask = dst->src[4], * vsum = dst->src[5], * pos = dst->src[6], * kstat = dst->src[7];
    GGML_ASSERT(ggml_cuda_sparq_attn_supported(ctx.device, dst));

    sparq_args a = {};
    a.q = (const char *) q->data; a.k = (const char *) k->data; a.kt = kt ? (const char *) kt->data : nullptr;
    a.v = (const char *) v->data; a.mask = mask ? (const char *) mask->data : nullptr;
    a.vsum = vsum ? (const char *) vsum->data : nullptr; a.pos = pos ? (const char *) pos->data : nullptr;
    a.kstat = kstat ? (const char *) kstat->data : nullptr;
    a.dst = (char *) dst->data;
    a.k_type = k->type; a.kt_type = kt ? kt->type : k->type; a.v_type = v->type;
    a.d = q->ne[0]; a.n_q = q->ne[1]; a.n_head = q->ne[2]; a.ns = q->ne[3];
    a.n_kv = k->ne[1]; a.n_head_kv = k->ne[2]; a.d_v = v->ne[0]; a.group = a.n_head / a.n_head_kv;
    a.q_nb1 = q->nb[1]; a.q_nb2 = q->nb[2]; a.q_nb3 = q->nb[3];
    a.k_nb1 = k->nb[1]; a.k_nb2 = k->nb[2]; a.k_nb3 = k->nb[3];
    if (kt) {
        a.kt_nb1 = kt->nb[1]; a.kt_nb2 = kt->nb[2]; a.kt_nb3 = kt->nb[3];
    }
    a.v_nb1 = v->nb[1]; a.v_nb2 = v->nb[2]; a.v_nb3 = v->nb[3];
    if (mask) {
        a.m_nb1 = mask->nb[1]; a.m_nb3 = mask->nb[3]; a.m_ns = mask->ne[3];
    }
    if (vsum) {
        a.vs_nb1 = vsum->nb[1]; a.vs_nb2 = vsum->nb[2]; a.vs_nb3 = vsum->nb[3];
    }
    if (pos) {
        a.p_nb3 = pos->nb[3]; a.p_ns = pos->ne[3];
    }
    if (kstat) {
        a.ks_nb1 = kstat->nb[1]; a.ks_nb2 = kstat->nb[2]; a.ks_nb3 = kstat->nb[3];
    }
    a.o_nb1 = dst->nb[1]; a.o_nb2 = dst->nb[2]; a.o_nb3 = dst->nb[3];
    a.p = ggml_sparq_get_op_params(dst);
    a.sinks  = a.p.sinks;
    a.window = a.p.policy == GGML_SPARQ_POLICY_WINDOW ? a.p.k2 - a.p.sinks : a.p.window;
    a.n_top  = std::max(0, a.p.k2 - a.window - a.sinks);
    a.cell_bits = 1;
    while ((int64_t(1) << a.cell_bits) < a.n_kv) {
        ++a.cell_bits;
    }
    a.n_chunks_a = (int32_t) ((a.n_kv + A_CHUNK - 1) / A_CHUNK);
    a.n_chunks_b = (int32_t) ((a.n_kv + B_CHUNK - 1) / B_CHUNK);
    a.n_words    = (a.n_kv + 31) / 32;
    a.cap        = candidate_cap(a.p.k2);
    a.vec_kt     = kt && kt->type != GGML_TYPE_Q8_0 && kt->type != GGML_TYPE_I8 && aligned16(kt->data) &&
                   strides16(kt);  // q8_0: 2-byte loads; the q4 index: its own loads
    a.vec_kt_q8  = kt && kt->type == GGML_TYPE_Q8_0 && aligned16(kt->data) && strides16(kt) &&
                   GGML_CUDA_CC_IS_NVIDIA(ggml_cuda_info().devices[ctx.device].cc) &&  // device code with cp.async
                   ggml_cuda_highest_compiled_arch(ggml_cuda_info().devices[ctx.device].cc) >= GGML_CUDA_CC_AMPERE;
    a.vec_kv     = aligned16(k->data) && strides16(k) && aligned16(v->data) && strides16(v);
    a.vec_logits = a.n_kv % 4 == 0;
    a.vec_mask   = mask && aligned16(mask->data) && mask->nb[1] % 16 == 0 && mask->nb[3] % 16 == 0;
    a.vec_pos    = pos && aligned16(pos->data) && pos->nb[3] % 16 == 0;
#ifdef SPARQ_CUDA_INSTRUMENT
    a.timing     = getenv("SPARQ_CUDA_TIMING") != nullptr;
    static const bool timeline = getenv("SPARQ_CUDA_TIMELINE") != nullptr;
    a.timeline = timeline;
#endif

    const bool scores = a.p.policy != GGML_SPARQ_POLICY_WINDOW || a.p.mean_on;
    a.has_logits = scores;
    const int pol = !scores ? SC_NONE : a.p.policy != GGML_SPARQ_POLICY_SPARQ ? SC_EXACT :
                    kt && kt->type == GGML_TYPE_I8 ? SC_Q4 : kt ? SC_KT : SC_GATHER;
    const int64_t G = a.group;
    const int n_sm = ggml_cuda_info().devices[ctx.device].nsm;
    const int64_t n_vec = (a.d + 7) / 8;  // kernel LV: K vectors of 8 components per thread
    const int vpt = n_vec <= 32 ? 1 : n_vec <= 64 ? 2 : 4;

    const int64_t n_rows = a.n_head_kv * a.n_q * a.ns;
    // one selection kernel for every wave (each takes any number of rows): the choice for all the rows
    const sparq_select_kernel sel = select_kernel_for(a, n_rows);
    a.write_bmax = sel == SPARQ_SELECT_BOUND;
    const int64_t row_bytes = plan_scratch(a, scores, a.write_bmax, 1).total;
    const int64_t W = std::max<int64_t>(1, std::min<int64_t>({ n_rows, 65535, WAVE_BYTES / row_bytes }));
    const scratch_plan plan = plan_scratch(a, scores, a.write_bmax, W);
    ggml_cuda_pool_alloc<char> buf(ctx.pool(), plan.total);
    char * base = buf.get();
    sparq_scratch s;
    s.qs       = (float *)    (base + plan.qs);
    s.i1       = (int32_t *)  (base + plan.i1);
    s.logits   = (float *)    (base + plan.logits);
    s.bmax     = (float *)    (base + plan.bmax);
    s.bkeys    = (uint32_t *) (base + plan.bkeys);
    s.bkept    = (int32_t *)  (base + plan.bkept);
    s.cmax     = (float *)    (base + plan.cmax);
    s.csum     = (float *)    (base + plan.csum);
    s.cvis     = (int32_t *)  (base + plan.cvis);
    s.rstat    = (float *)    (base + plan.rstat);
    s.rinfo    = (int64_t *)  (base + plan.rinfo);
    s.counters = (uint32_t *) (base + plan.counters);
    s.bitmap   = (uint32_t *) (base + plan.bitmap);
    s.cand     = (uint64_t *) (base + plan.cand);
    s.forced   = (int32_t *)  (base + plan.forced);
    s.i2       = (int32_t *)  (base + plan.i2);
    s.alpha    = (float *)    (base + plan.alpha);

    const size_t smem_q = query_smem(a);
    const size_t smem_s = smem_s_plan(a.cap, a.p.k2).total;
    cudaStream_t stream = ctx.stream();
    for (int64_t r0 = 0; r0 < n_rows; r0 += W) {
        const int64_t nw = std::min(W, n_rows - r0);
        a.a_head_groups = pol == SC_NONE ? 1 : a_head_groups(a.n_chunks_a*nw, G, n_sm);
        const int ng = heads_per_pass(G / a.a_head_groups);
        const size_t smem_a = pol == SC_KT && a.vec_kt_q8 ? a_warp_smem(ng, (int) a.p.k1) :
                              a_qs_bytes(ng, a.p.k1, a.d) + (pol == SC_Q4 ? q4_coef_bytes(ng, a.d) : 0);
        const dim3 grid_a((unsigned) (a.n_chunks_a*a.a_head_groups), (unsigned) nw);
        if ((pol == SC_KT || pol == SC_GATHER) && a.p.select == GGML_SPARQ_SELECT_QSIGMA) {
            ensure_smem<sparq_query<true>>(smem_q);
            ggml_cuda_kernel_launch(sparq_query<true>,
                                    ggml_cuda_kernel_launch_params(dim3((unsigned) nw), Q_THREADS, smem_q, stream), a, s, r0);
        } else if (pol == SC_KT || pol == SC_GATHER) {
            ensure_smem<sparq_query<false>>(smem_q);
            ggml_cuda_kernel_launch(sparq_query<false>,
                                    ggml_cuda_kernel_launch_params(dim3((unsigned) nw), Q_THREADS, smem_q, stream), a, s, r0);
        }
        launch_all(pol, ng, vpt, grid_a, smem_a, nw, smem_s, sel, stream, a, s, r0);
#ifdef SPARQ_CUDA_INSTRUMENT
        if (a.timeline) {
            sparq_timeline_dump<<<1, 1, 0, stream>>>(a.n_kv, nw);
        }
#endif
        CUDA_CHECK(cudaGetLastError());
    }
}

