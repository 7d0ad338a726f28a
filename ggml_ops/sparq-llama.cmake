# Our native sources, compiled into the llama.cpp targets they extend. Included from the top-level
# CMakeLists.txt after add_subdirectory(llama.cpp), so every target below exists.
set(SPARQ_OPS_DIR "${CMAKE_CURRENT_LIST_DIR}")

# Public header: libllama exports the functions, everything that links llama can include it.
target_include_directories(llama PUBLIC "${SPARQ_OPS_DIR}/include")
target_sources(llama PRIVATE "${SPARQ_OPS_DIR}/src/sparq-llama-info.cpp")

# The patched common/build-info.cpp (--version of every common-based tool) prints our build info.
target_link_libraries(llama-common-base PUBLIC llama)

set(_info_defs
    SPARQ_LLAMA_VERSION="${SPARQ_LLAMA_VERSION}"
    SPARQ_LLAMA_CPP_COMMIT="${SPARQ_LLAMA_CPP_COMMIT}"
    SPARQ_LLAMA_CPP_PYTHON="${SPARQ_LLAMA_CPP_PYTHON}")
if (GGML_CUDA)
    list(APPEND _info_defs SPARQ_WITH_CUDA)
endif()
set_source_files_properties("${SPARQ_OPS_DIR}/src/sparq-llama-info.cpp" TARGET_DIRECTORY llama
    PROPERTIES COMPILE_DEFINITIONS "${_info_defs}")
