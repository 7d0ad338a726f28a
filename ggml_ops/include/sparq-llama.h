// sparq-llama: the public C API of our additions to llama.cpp, exported from libllama.
// Functions only: llama.cpp's public structs are never changed (llama-cpp-python binds them by value).
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#    define SPARQ_API __declspec(dllexport)
#else
#    define SPARQ_API __attribute__((visibility("default")))
#endif

// Version of the sparq-llama package this library was built from, e.g. "0.1.0".
SPARQ_API const char * sparq_llama_version(void);

// What this build holds, as one JSON object (static storage, never freed):
//   {"name": "sparq-llama", "version": ..., "llama_cpp_commit": ..., "llama_cpp_python": ...,
//    "ops": [names of our ggml ops compiled in], "backends": [ggml backends compiled in, e.g. "CPU", "CUDA"]}
SPARQ_API const char * sparq_llama_build_info(void);

#ifdef __cplusplus
}
#endif
