// Build information reported by `llama-cli --version`, sparq_llama.build_info() and `sparq-llama info`.
#include "sparq-llama.h"

#include <string>

// Set by our CMakeLists.txt on this file only, so a version bump recompiles one file.
#ifndef SPARQ_LLAMA_VERSION
#    error "SPARQ_LLAMA_VERSION must be defined by the build"
#endif
#ifndef SPARQ_LLAMA_CPP_COMMIT
#    error "SPARQ_LLAMA_CPP_COMMIT must be defined by the build"
#endif
#ifndef SPARQ_LLAMA_CPP_PYTHON
#    error "SPARQ_LLAMA_CPP_PYTHON must be defined by the build"
#endif

// Our ggml ops compiled into this build. Each op's CMake fragment adds SPARQ_HAVE_OP_<NAME>.
static const char * const k_ops[] = {
#ifdef SPARQ_HAVE_OP_SPARQ_ATTN
    "sparq_attn",
#endif
#ifdef SPARQ_HAVE_OP_CENTROID_ATTN
    "centroid_attn",
#endif
    nullptr,
};

// Backends are a property of the ggml build; our CMake mirrors GGML_<BACKEND> into these.
static const char * const k_backends[] = {
    "CPU",
#ifdef SPARQ_WITH_CUDA
    "CUDA",
#endif
#ifdef SPARQ_WITH_RPC
    "RPC",
#endif
    nullptr,
};

static void append_json_list(std::string & out, const char * const * items) {
    out += '[';
    for (int i = 0; items[i] != nullptr; ++i) {
        out += i ? ", \"" : "\"";
        out += items[i];
        out += '"';
    }
    out += ']';
}

const char * sparq_llama_version(void) {
    return SPARQ_LLAMA_VERSION;
}

const char * sparq_llama_build_info(void) {
    static const std::string info = [] {
        std::string s = "{\"name\": \"sparq-llama\", \"version\": \"" SPARQ_LLAMA_VERSION "\", "
                        "\"llama_cpp_commit\": \"" SPARQ_LLAMA_CPP_COMMIT "\", "
                        "\"llama_cpp_python\": \"" SPARQ_LLAMA_CPP_PYTHON "\", \"ops\": ";
        append_json_list(s, k_ops);
        s += ", \"backends\": ";
        append_json_list(s, k_backends);
        s += '}';
        return s;
    }();
    return info.c_str();
}
