# Our native sources, compiled into the llama.cpp targets they extend. Included from the top-level
# CMakeLists.txt after add_subdirectory(llama.cpp), so every target below exists.
# (Only the plain ggml-cpu target is supported: not GGML_CPU_ALL_VARIANTS / GGML_BACKEND_DL builds.)
set(SPARQ_OPS_DIR "${CMAKE_CURRENT_LIST_DIR}")

# ---- ggml: our ops (headers public to everything that links ggml) ------------------------------
target_include_directories(ggml-base PUBLIC "${SPARQ_OPS_DIR}/include")
target_sources(ggml-base PRIVATE "${SPARQ_OPS_DIR}/src/ggml-sparq.c" "${SPARQ_OPS_DIR}/src/ggml-centroid.c")
target_sources(ggml-cpu PRIVATE "${SPARQ_OPS_DIR}/src/cpu/sparq-attn-cpu.cpp" "${SPARQ_OPS_DIR}/src/cpu/centroid-attn-cpu.cpp"
                               "${SPARQ_OPS_DIR}/src/cpu/cluster-update-cpu.cpp" "${SPARQ_OPS_DIR}/src/cpu/sparq-vsum-cpu.cpp"
                               "${SPARQ_OPS_DIR}/src/cpu/sparq-index-cpu.cpp")
target_include_directories(ggml-cpu PRIVATE "${SPARQ_OPS_DIR}/src/cpu")  # for the patched ggml-cpu.c
# The q4 index's quantizer rounds x/s, then adds 8.5, as two f32 operations (as gguf's quantizer and the reference
# do); a contracted FMA rounds once and moves values that sit on a nibble boundary to the other side.
set_source_files_properties("${SPARQ_OPS_DIR}/src/cpu/sparq-index-cpu.cpp" TARGET_DIRECTORY ggml-cpu
    PROPERTIES COMPILE_OPTIONS "$<$<NOT:$<CXX_COMPILER_ID:MSVC>>:-ffp-contract=off>")
if (GGML_CUDA)
    # the kernels include ggml-cuda's common.cuh; the patched ggml-cuda.cu includes our headers. sparq-attn.cu is the
    # SparQ op's one translation unit (its kernels in the sparq-attn-*.cuh headers), centroid-attn.cu the centroid
    # op's (centroid-attn-*.cuh).
    target_sources(ggml-cuda PRIVATE "${SPARQ_OPS_DIR}/src/cuda/sparq-attn.cu" "${SPARQ_OPS_DIR}/src/cuda/centroid-attn.cu"
                                     "${SPARQ_OPS_DIR}/src/cuda/cluster-update.cu"
                                     "${SPARQ_OPS_DIR}/src/cuda/sparq-upkeep.cu"
                                     "${SPARQ_OPS_DIR}/src/cuda/sparq-attn-common.cuh" "${SPARQ_OPS_DIR}/src/cuda/sparq-attn-query.cuh"
                                     "${SPARQ_OPS_DIR}/src/cuda/sparq-attn-score.cuh"
                                     "${SPARQ_OPS_DIR}/src/cuda/sparq-attn-select.cuh"
                                     "${SPARQ_OPS_DIR}/src/cuda/sparq-attn-select-cluster.cuh"
                                     "${SPARQ_OPS_DIR}/src/cuda/sparq-attn-select-bound.cuh"
                                     "${SPARQ_OPS_DIR}/src/cuda/sparq-attn-values.cuh"
                                     "${SPARQ_OPS_DIR}/src/cuda/centroid-attn-common.cuh"
                                     "${SPARQ_OPS_DIR}/src/cuda/centroid-attn-select.cuh"
                                     "${SPARQ_OPS_DIR}/src/cuda/centroid-attn-attend.cuh")
    target_include_directories(ggml-cuda PRIVATE "${SPARQ_OPS_DIR}/src/cuda" "${SPARQ_LLAMA_TREE}/ggml/src/ggml-cuda")
    # The debugging build of the SparQ kernel: its timeline and timing instrumentation (sparq-attn.cu's header).
    option(SPARQ_CUDA_INSTRUMENT "compile the CUDA SparQ kernel's timeline and timing instrumentation" OFF)
    if (SPARQ_CUDA_INSTRUMENT)
        set_source_files_properties("${SPARQ_OPS_DIR}/src/cuda/sparq-attn.cu" TARGET_DIRECTORY ggml-cuda
            PROPERTIES COMPILE_DEFINITIONS SPARQ_CUDA_INSTRUMENT)
    endif()
endif()

# ---- llama: C API (libllama exports it; everything that links llama can include it) -------------
target_include_directories(llama PUBLIC "${SPARQ_OPS_DIR}/include")
target_sources(llama PRIVATE
    "${SPARQ_OPS_DIR}/src/sparq-llama-info.cpp"
    "${SPARQ_OPS_DIR}/src/sparq-ops-eval.cpp"
    "${SPARQ_OPS_DIR}/src/sparq-kmeans.cpp"
    "${SPARQ_OPS_DIR}/src/llama/sparq-llama-context.cpp"
    "${SPARQ_OPS_DIR}/src/llama/sparq-llama-kv.cpp"
    "${SPARQ_OPS_DIR}/src/llama/sparq-llama-graph.cpp"
    "${SPARQ_OPS_DIR}/src/llama/sparq-squeeze-state.cpp"
    "${SPARQ_OPS_DIR}/src/llama/sparq-squeeze-prepare.cpp"
    "${SPARQ_OPS_DIR}/src/llama/sparq-squeeze-cluster.cpp"
    "${SPARQ_OPS_DIR}/src/llama/sparq-squeeze-calibrate.cpp"
    "${SPARQ_OPS_DIR}/src/llama/sparq-squeeze-sidecar.cpp"
    "${SPARQ_OPS_DIR}/src/llama/sparq-squeeze-api.cpp"
    "${SPARQ_OPS_DIR}/src/llama/sparq-state-file.cpp")

# ---- llama-common: the tools' --squeeze setup (llama-completion, llama-server and llama-cli share it) ------------
target_sources(llama-common PRIVATE "${SPARQ_OPS_DIR}/src/common/sparq-squeeze-common.cpp"
                                    "${SPARQ_OPS_DIR}/src/common/sparq-common.cpp")
target_include_directories(llama-common PUBLIC "${SPARQ_OPS_DIR}/src/common")

# The patched common/build-info.cpp (--version of every common-based tool) prints our build info.
target_link_libraries(llama-common-base PUBLIC llama)

set(_info_defs
    SPARQ_LLAMA_VERSION="${SPARQ_LLAMA_VERSION}"
    SPARQ_LLAMA_CPP_COMMIT="${SPARQ_LLAMA_CPP_COMMIT}"
    SPARQ_LLAMA_CPP_PYTHON="${SPARQ_LLAMA_CPP_PYTHON}"
    SPARQ_HAVE_OP_SPARQ_ATTN
    SPARQ_HAVE_OP_CENTROID_ATTN)
if (GGML_CUDA)
    list(APPEND _info_defs SPARQ_WITH_CUDA)
endif()
if (GGML_RPC)
    list(APPEND _info_defs SPARQ_WITH_RPC)
endif()
set_source_files_properties("${SPARQ_OPS_DIR}/src/sparq-llama-info.cpp" TARGET_DIRECTORY llama
    PROPERTIES COMPILE_DEFINITIONS "${_info_defs}")
