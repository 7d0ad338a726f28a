"""Every C function the package calls, declared once: its prototype, argtypes and restype, and the C structs
they take, field for field.

The prototypes are those of ggml_ops/include/sparq-llama.h (the user API), sparq-llama-testing.h (the eval and
bench entry points behind `sparq_llama.ops`) and ggml's own headers (ggml.h, ggml-backend.h). Each function is
declared as llama-cpp-python's llama_cpp.py declares its own: the C prototype in a comment, then a typed stub
whose decorator gives the library, argtypes and restype. Unlike there, nothing is looked up at import: a
function binds on its first call, on the library `_lib` loads (our libllama only once `sparq_llama` has
pointed llama_cpp at it), so importing this module loads nothing native.

    from . import _bindings as C
    C.llama_sparq_check(ctx, ctypes.byref(params))

Other modules call through these names and set no argtypes of their own.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterable
from typing import Any

from ._lib import libggml, libggml_base, libllama

__all__ = ["CFunction", "c_function", "missing"]


class CFunction:
    """A C function of one of our shared libraries, bound (argtypes, restype) on its first call."""

    def __init__(self, library: Callable[[], ctypes.CDLL], name: str, argtypes: list[Any], restype: Any) -> None:
        self.library = library
        self.name = name
        self.argtypes = argtypes
        self.restype = restype
        self._fn: Any = None

    def bind(self) -> Any:
        """The library's function with this declaration's types (AttributeError if the library lacks it)."""
        if self._fn is None:
            fn = getattr(self.library(), self.name)
            fn.argtypes = self.argtypes
            fn.restype = self.restype
            self._fn = fn
        return self._fn

    def available(self) -> bool:
        """Whether the loaded library exports this function (builds from before an API lack some)."""
        return hasattr(self.library(), self.name)

    def __call__(self, *args: Any) -> Any:
        return self.bind()(*args)

    def __repr__(self) -> str:
        return f"<C function {self.name}>"


def c_function(library: Callable[[], ctypes.CDLL], argtypes: list[Any],
               restype: Any) -> Callable[[Callable], CFunction]:
    """Declares the C function named as the decorated stub, in `library` (a loader of `_lib`); the stub gives
    the Python signature and the docstring."""

    def declare(stub: Callable) -> CFunction:
        fn = CFunction(library, stub.__name__, argtypes, restype)
        functools.update_wrapper(fn, stub)
        return fn

    return declare


def missing(functions: Iterable[CFunction]) -> list[str]:
    """The names of those functions the loaded libraries do not export."""
    return [fn.name for fn in functions if not fn.available()]


c_int32_p = ctypes.POINTER(ctypes.c_int32)
c_size_t_p = ctypes.POINTER(ctypes.c_size_t)


# ===================================================================================================
# sparq-llama.h (libllama): the build


# SPARQ_API const char * sparq_llama_version(void);
@c_function(libllama, [], ctypes.c_char_p)
def sparq_llama_version() -> bytes:
    """Version of the sparq-llama package the library was built from."""


# SPARQ_API const char * sparq_llama_build_info(void);
@c_function(libllama, [], ctypes.c_char_p)
def sparq_llama_build_info() -> bytes:
    """What the build holds, as one JSON object (static storage)."""


# ===================================================================================================
# sparq-llama.h (libllama): SparQ in llama.cpp's decode path


class LlamaSparqParams(ctypes.Structure):
    """struct llama_sparq_params (sparq-llama.h), field for field."""

    _fields_ = [
        ("enabled", ctypes.c_bool),
        ("k1", ctypes.c_int32),
        ("k2", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("sinks", ctypes.c_int32),
        ("mean", ctypes.c_int32),
        ("policy", ctypes.c_int32),
        ("sparse_v_thresh", ctypes.c_float),
        ("default_layout", ctypes.c_bool),
        ("prefill", ctypes.c_bool),
        ("swa", ctypes.c_bool),
        ("min_n_kv", ctypes.c_int32),
        ("index", ctypes.c_int32),
        ("select", ctypes.c_int32),
    ]


# SPARQ_API struct llama_sparq_params llama_sparq_default_params(void);
@c_function(libllama, [], LlamaSparqParams)
def llama_sparq_default_params() -> LlamaSparqParams:
    """The default settings (SparQ off)."""


# SPARQ_API const char * llama_sparq_check(const struct llama_context * ctx, const struct llama_sparq_params * params);
@c_function(libllama, [ctypes.c_void_p, ctypes.POINTER(LlamaSparqParams)], ctypes.c_char_p)
def llama_sparq_check(ctx: int | None, params: Any, /) -> bytes | None:
    """NULL when valid (for ctx's model and context when ctx is not NULL), else what is wrong."""


# SPARQ_API int32_t llama_set_sparq(struct llama_context * ctx, const struct llama_sparq_params * params);
@c_function(libllama, [ctypes.c_void_p, ctypes.POINTER(LlamaSparqParams)], ctypes.c_int32)
def llama_set_sparq(ctx: int | None, params: Any, /) -> int:
    """Applies the settings from the next decode on: 0, or -1 with the reason in llama_sparq_last_error()."""


# SPARQ_API struct llama_sparq_params llama_get_sparq(const struct llama_context * ctx);
@c_function(libllama, [ctypes.c_void_p], LlamaSparqParams)
def llama_get_sparq(ctx: int | None, /) -> LlamaSparqParams:
    """The settings the context holds."""


# SPARQ_API const char * llama_sparq_last_error(void);
@c_function(libllama, [], ctypes.c_char_p)
def llama_sparq_last_error() -> bytes:
    """The reason for the last failed llama_set_sparq on this thread ("" if none)."""


# SPARQ_API int32_t llama_sparq_summary(const struct llama_context * ctx, char * buf, size_t size);
@c_function(libllama, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int32)
def llama_sparq_summary(ctx: int | None, buf: Any, size: int, /) -> int:
    """One line saying what the context runs (snprintf-like: the whole line's length, -1 for a NULL ctx)."""


# SPARQ_API void llama_sparq_log_summary(const struct llama_context * ctx);
@c_function(libllama, [ctypes.c_void_p], None)
def llama_sparq_log_summary(ctx: int | None, /) -> None:
    """Logs that line at INFO through llama.cpp's log callback."""


class LlamaSparqRun(ctypes.Structure):
    """struct llama_sparq_run (sparq-llama.h), field for field."""

    _fields_ = [
        ("n_tokens", ctypes.c_int32),
        ("n_layers_sparq", ctypes.c_int32),
        ("n_layers_centroid", ctypes.c_int32),
        ("n_layers_dense", ctypes.c_int32),
    ]


# SPARQ_API struct llama_sparq_run llama_sparq_last_run(const struct llama_context * ctx, int32_t seq_id);
@c_function(libllama, [ctypes.c_void_p, ctypes.c_int32], LlamaSparqRun)
def llama_sparq_last_run(ctx: int | None, seq_id: int, /) -> LlamaSparqRun:
    """What the attention layers of the last ubatch that held seq_id (-1: of the last ubatch) ran."""


# ===================================================================================================
# sparq-llama.h (libllama): centroid-sparse attention over a prepared fixed prefix

# bool (*progress_callback)(float progress, void * user_data)
ProgressFn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_float, ctypes.c_void_p)


class LlamaSqueezeParams(ctypes.Structure):
    """struct llama_squeeze_params (sparq-llama.h), field for field."""

    _fields_ = [
        ("centroids", ctypes.c_float),
        ("keep", ctypes.c_float),
        ("levels", ctypes.c_int32),
        ("centroids_coarse", ctypes.c_float),
        ("keep_coarse", ctypes.c_float),
        ("n_calib", ctypes.c_int32),
        ("n_iter", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("var_weight", ctypes.c_float),
        ("init", ctypes.c_int32),
        ("progress_callback", ProgressFn),
        ("progress_callback_user_data", ctypes.c_void_p),
    ]


class LlamaSqueezeInfo(ctypes.Structure):
    """struct llama_squeeze_info (sparq-llama.h)."""

    _fields_ = [
        ("prepared", ctypes.c_bool),
        ("seq_id", ctypes.c_int32),
        ("n_prefix", ctypes.c_int32),
        ("n_clustered", ctypes.c_int32),
        ("n_layers", ctypes.c_int32),
        ("levels", ctypes.c_int32),
        ("keep", ctypes.c_float),
        ("threshold_coarse", ctypes.c_float),
        ("kept_calib", ctypes.c_float),
        ("prefill", ctypes.c_int32),
        ("var_weight", ctypes.c_float),
    ]


# SPARQ_API struct llama_squeeze_params llama_squeeze_default_params(void);
@c_function(libllama, [], LlamaSqueezeParams)
def llama_squeeze_default_params() -> LlamaSqueezeParams:
    """The default preparation settings."""


# SPARQ_API const char * llama_squeeze_check(const struct llama_squeeze_params * params);
@c_function(libllama, [ctypes.POINTER(LlamaSqueezeParams)], ctypes.c_char_p)
def llama_squeeze_check(params: Any, /) -> bytes | None:
    """NULL when the values are valid, else what is wrong."""


# SPARQ_API int32_t llama_squeeze_prepare(struct llama_context * ctx, int32_t seq_id, const int32_t * tokens,
#                                         int32_t n_prefix, const struct llama_squeeze_params * params);
@c_function(libllama, [ctypes.c_void_p, ctypes.c_int32, c_int32_p, ctypes.c_int32, ctypes.POINTER(LlamaSqueezeParams)],
            ctypes.c_int32)
def llama_squeeze_prepare(ctx: int | None, seq_id: int, tokens: Any, n_prefix: int, params: Any, /) -> int:
    """Clusters and calibrates the prefix tokens[0, n_prefix) of seq_id: 0, or -1 (llama_squeeze_last_error())."""


# SPARQ_API int32_t llama_squeeze_save(struct llama_context * ctx, const char * path);
@c_function(libllama, [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_int32)
def llama_squeeze_save(ctx: int | None, path: bytes, /) -> int:
    """Writes the prepared prefix's sidecar file: 0, or -1."""


# SPARQ_API int32_t llama_squeeze_load(struct llama_context * ctx, int32_t seq_id, const char * path,
#                                      const int32_t * tokens, int32_t n_tokens);
@c_function(libllama, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p, c_int32_p, ctypes.c_int32], ctypes.c_int32)
def llama_squeeze_load(ctx: int | None, seq_id: int, path: bytes, tokens: Any, n_tokens: int, /) -> int:
    """Reads a sidecar into seq_id, whose cells already hold the prefix: 0, or -1."""


# SPARQ_API int32_t llama_squeeze_load_state_file(struct llama_context * ctx, int32_t seq_id, const char * path,
#                                                 int32_t * tokens_out, size_t n_token_capacity, size_t * n_token_out);
@c_function(libllama, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p, c_int32_p, ctypes.c_size_t, c_size_t_p],
            ctypes.c_int32)
def llama_squeeze_load_state_file(ctx: int | None, seq_id: int, path: bytes, tokens_out: Any, n_token_capacity: int,
                                  n_token_out: Any, /) -> int:
    """Loads a sequence state file into seq_id, its layout checked first: 0 with its tokens, or -1."""


# SPARQ_API int32_t llama_squeeze_save_files(struct llama_context * ctx, const char * state_path, const char * sidecar_path);
@c_function(libllama, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p], ctypes.c_int32)
def llama_squeeze_save_files(ctx: int | None, state_path: bytes, sidecar_path: bytes, /) -> int:
    """Writes the prepared prefix's KV state and its sidecar, which records the state's checksums: 0, or -1."""


# SPARQ_API int32_t llama_squeeze_load_files(struct llama_context * ctx, int32_t seq_id, const char * state_path,
#                                            const char * sidecar_path, int32_t * tokens_out, size_t n_token_capacity,
#                                            size_t * n_token_out);
@c_function(libllama, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p, ctypes.c_char_p, c_int32_p, ctypes.c_size_t,
                       c_size_t_p], ctypes.c_int32)
def llama_squeeze_load_files(ctx: int | None, seq_id: int, state_path: bytes, sidecar_path: bytes, tokens_out: Any,
                             n_token_capacity: int, n_token_out: Any, /) -> int:
    """Verifies a saved KV state and sidecar, then loads both into seq_id: 0 with the tokens, or -1 (nothing
    changed when a file fails its checks)."""


# SPARQ_API int32_t llama_squeeze_recalibrate(struct llama_context * ctx, float keep, float keep_coarse);
@c_function(libllama, [ctypes.c_void_p, ctypes.c_float, ctypes.c_float], ctypes.c_int32)
def llama_squeeze_recalibrate(ctx: int | None, keep: float, keep_coarse: float, /) -> int:
    """The prepared prefix's thresholds for a new keep (same clusters): 0, or -1."""


# SPARQ_API void llama_squeeze_clear(struct llama_context * ctx);
@c_function(libllama, [ctypes.c_void_p], None)
def llama_squeeze_clear(ctx: int | None, /) -> None:
    """Drops the prepared prefix."""


# SPARQ_API int32_t llama_squeeze_set_prefill(struct llama_context * ctx, enum llama_squeeze_prefill mode);
@c_function(libllama, [ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32)
def llama_squeeze_set_prefill(ctx: int | None, mode: int, /) -> int:
    """How a question's prefill attends to the prepared prefix (enum llama_squeeze_prefill): 0, or -1."""


# SPARQ_API struct llama_squeeze_info llama_squeeze_get_info(const struct llama_context * ctx);
@c_function(libllama, [ctypes.c_void_p], LlamaSqueezeInfo)
def llama_squeeze_get_info(ctx: int | None, /) -> LlamaSqueezeInfo:
    """What the context holds."""


# SPARQ_API bool llama_squeeze_seq_sparse(const struct llama_context * ctx, int32_t seq_id);
@c_function(libllama, [ctypes.c_void_p, ctypes.c_int32], ctypes.c_bool)
def llama_squeeze_seq_sparse(ctx: int | None, seq_id: int, /) -> bool:
    """Whether seq_id reads the prepared prefix sparsely."""


# SPARQ_API const char * llama_squeeze_last_error(void);
@c_function(libllama, [], ctypes.c_char_p)
def llama_squeeze_last_error() -> bytes:
    """The reason for the last failed llama_squeeze_* call on this thread ("" if none)."""


# ===================================================================================================
# ggml-sparq.h, ggml-centroid.h: the ops' parameters


class GgmlSparqParams(ctypes.Structure):
    """struct ggml_sparq_params (ggml-sparq.h)."""

    _fields_ = [("k1", ctypes.c_int32), ("k2", ctypes.c_int32), ("window", ctypes.c_int32),
                ("sinks", ctypes.c_int32), ("mean", ctypes.c_int32), ("policy", ctypes.c_int32),
                ("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("sparse_v_thresh", ctypes.c_float),
                ("select", ctypes.c_int32)]


class GgmlCentroidParams(ctypes.Structure):
    """struct ggml_centroid_params (ggml-centroid.h)."""

    _fields_ = [("keep", ctypes.c_float), ("threshold_coarse", ctypes.c_float), ("group", ctypes.c_int32),
                ("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("var_weight", ctypes.c_float)]


# ===================================================================================================
# sparq-llama-testing.h (libllama): one op evaluation or benchmark over host arrays (sparq_llama.ops).
# Each entry returns 0, or nonzero with a message in err[0, err_size).


class SparqEvalArgs(ctypes.Structure):
    """struct sparq_eval_args (sparq-llama-testing.h)."""

    _fields_ = [("device", ctypes.c_char_p), ("n_threads", ctypes.c_int)] + \
        [(n, ctypes.c_int) for n in ("k_type", "kt_type", "v_type")] + \
        [(n, ctypes.c_int64) for n in ("d", "d_v", "n_q", "n_head", "n_head_kv", "n_kv", "ns", "mask_ns")] + \
        [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("kt", ctypes.c_void_p), ("v", ctypes.c_void_p),
         ("mask", ctypes.c_void_p), ("vsum", ctypes.c_void_p), ("params", ctypes.POINTER(GgmlSparqParams)),
         ("out", ctypes.c_void_p), ("pos", ctypes.c_void_p), ("kstat", ctypes.c_void_p)]


class VsumRowsEvalArgs(ctypes.Structure):
    """struct vsum_rows_eval_args (sparq-llama-testing.h)."""

    _fields_ = [("device", ctypes.c_char_p), ("n_threads", ctypes.c_int), ("v_type", ctypes.c_int)] + \
        [(n, ctypes.c_int64) for n in ("d_v", "n_head_kv", "n_tokens", "n_seq", "v_ld")] + \
        [(n, ctypes.c_void_p) for n in ("table", "v", "idx", "out", "table_out")]


class KstatRowsEvalArgs(ctypes.Structure):
    """struct kstat_rows_eval_args (sparq-llama-testing.h)."""

    _fields_ = [("device", ctypes.c_char_p), ("n_threads", ctypes.c_int), ("k_type", ctypes.c_int)] + \
        [(n, ctypes.c_int64) for n in ("d", "n_head_kv", "n_tokens", "n_seq", "kv_size", "n_stream")] + \
        [(n, ctypes.c_void_p) for n in ("table", "k", "cells", "idx", "out", "table_out")]


class IndexWriteEvalArgs(ctypes.Structure):
    """struct index_write_eval_args (sparq-llama-testing.h)."""

    _fields_ = [("device", ctypes.c_char_p), ("n_threads", ctypes.c_int), ("kt_type", ctypes.c_int),
                ("k_type", ctypes.c_int)] + \
        [(n, ctypes.c_int64) for n in ("n_embd", "row_len", "kv_size", "n_stream", "n_blk", "ns")] + \
        [("s0", ctypes.c_int32)] + [(n, ctypes.c_void_p) for n in ("kt", "k", "cells", "mask", "blk", "kt_out")] + \
        [("head_dim", ctypes.c_int64)]  # the q4 index's (kt_type I8: n_head_kv = n_embd / head_dim); else 0


class CentroidEvalArgs(ctypes.Structure):
    """struct centroid_eval_args (sparq-llama-testing.h)."""

    _fields_ = [("device", ctypes.c_char_p), ("n_threads", ctypes.c_int), ("kv_type", ctypes.c_int)] + \
        [(n, ctypes.c_int64) for n in ("d", "d_v", "n_q", "n_head", "n_head_kv", "n_kv", "ns", "mask_ns",
                                       "n_cent", "n_coarse")] + \
        [(n, ctypes.c_void_p) for n in ("q", "k", "v", "mask", "cent", "cell", "coarse", "parent")] + \
        [("params", ctypes.POINTER(GgmlCentroidParams)), ("out", ctypes.c_void_p), ("table_width", ctypes.c_int64)]


class KmeansEvalArgs(ctypes.Structure):
    """struct kmeans_eval_args (sparq-llama-testing.h)."""

    _fields_ = [("device", ctypes.c_char_p), ("n_threads", ctypes.c_int)] + \
        [(n, ctypes.c_int64) for n in ("d", "P", "H", "n_clusters")] + \
        [("n_iter", ctypes.c_int), ("x", ctypes.c_void_p), ("table", ctypes.c_void_p), ("assignment", ctypes.c_void_p),
         ("n_iter_run", ctypes.POINTER(ctypes.c_int)), ("init", ctypes.c_int), ("center", ctypes.c_int),
         ("weights", ctypes.c_void_p)]


class KmeansBenchArgs(ctypes.Structure):
    """struct kmeans_bench_args (sparq-llama-testing.h)."""

    _fields_ = [("device", ctypes.c_char_p), ("n_threads", ctypes.c_int)] + \
        [(n, ctypes.c_int64) for n in ("d", "P", "H", "n_clusters")] + \
        [("n_iter", ctypes.c_int), ("n_layers", ctypes.c_int), ("layer_s", ctypes.POINTER(ctypes.c_double)),
         ("iters_out", ctypes.POINTER(ctypes.c_int)), ("phase_s", ctypes.POINTER(ctypes.c_double)), ("init", ctypes.c_int)]


class CentroidBenchArgs(ctypes.Structure):
    """struct centroid_bench_args (sparq-llama-testing.h)."""

    _fields_ = [("device", ctypes.c_char_p), ("n_threads", ctypes.c_int), ("kv_type", ctypes.c_int)] + \
        [(n, ctypes.c_int64) for n in ("d", "n_head", "n_head_kv", "n_kv", "n_prefix", "n_clusters")] + \
        [("keep", ctypes.c_float), ("n_runs", ctypes.c_int), ("centroid_us", ctypes.POINTER(ctypes.c_double)),
         ("flash_us", ctypes.POINTER(ctypes.c_double)), ("kept_out", ctypes.POINTER(ctypes.c_double))]


class SparqBenchArgs(ctypes.Structure):
    """struct sparq_bench_args (sparq-llama-testing.h)."""

    _fields_ = [("device", ctypes.c_char_p), ("n_threads", ctypes.c_int), ("kv_type", ctypes.c_int)] + \
        [(n, ctypes.c_int64) for n in ("d", "n_head", "n_head_kv", "n_kv")] + \
        [("use_kt", ctypes.c_int), ("n_runs", ctypes.c_int), ("params", ctypes.POINTER(GgmlSparqParams)),
         ("sparq_us", ctypes.POINTER(ctypes.c_double)), ("flash_us", ctypes.POINTER(ctypes.c_double)),
         ("n_seq", ctypes.c_int64), ("kt_type", ctypes.c_int)]


class SqueezeCalibArgs(ctypes.Structure):
    """struct squeeze_calib_args (sparq-llama-testing.h)."""

    _fields_ = [(n, ctypes.c_int64) for n in ("d", "n_head", "n_head_kv", "n_rows", "n_layers", "n_cent", "n_coarse")] + \
        [("q", ctypes.c_void_p), ("table", ctypes.c_void_p), ("coarse", ctypes.c_void_p), ("parent", ctypes.c_void_p),
         ("scale", ctypes.c_float), ("group", ctypes.c_int), ("keep", ctypes.c_float), ("keep_coarse", ctypes.c_float),
         ("n_threads", ctypes.c_int), ("threshold_coarse", ctypes.POINTER(ctypes.c_float)),
         ("kept", ctypes.POINTER(ctypes.c_float)),
         ("table_width", ctypes.c_int64), ("var_weight", ctypes.c_float)]


def _entry(args_type: type[ctypes.Structure]) -> list[Any]:
    """argtypes of `int entry(const struct <args_type> * args, char * err, size_t err_size)`."""
    return [ctypes.POINTER(args_type), ctypes.c_char_p, ctypes.c_size_t]


# SPARQ_API int sparq_llama_eval_sparq_attn(const struct sparq_eval_args * args, char * err, size_t err_size);
@c_function(libllama, _entry(SparqEvalArgs), ctypes.c_int)
def sparq_llama_eval_sparq_attn(args: Any, err: Any, err_size: int, /) -> int:
    """One ggml_sparq_attn graph over host arrays."""


# SPARQ_API int sparq_llama_read_kv_tensor(struct llama_context * ctx, int32_t il, int32_t what, float * out,
#                                          size_t n_out, int64_t * ne_out, char * err, size_t err_size);
@c_function(libllama, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t,
                       ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int)
def sparq_llama_read_kv_tensor(ctx: int | None, il: int, what: int, out: Any, n_out: int, ne_out: Any, err: Any,
                               err_size: int, /) -> int:
    """A layer's K (0), index K^T (1), V sums (2) or key statistics (3) as f32 host floats (tests)."""


# SPARQ_API int sparq_llama_memory_breakdown(const struct llama_context * ctx, size_t * out);
@c_function(libllama, [ctypes.c_void_p, c_size_t_p], ctypes.c_int)
def sparq_llama_memory_breakdown(ctx: int | None, out: Any, /) -> int:
    """llama.cpp's memory breakdown of a context over all buffer types: model, context, compute bytes (tests)."""


# SPARQ_API int sparq_llama_eval_vsum_rows(const struct vsum_rows_eval_args * args, char * err, size_t err_size);
@c_function(libllama, _entry(VsumRowsEvalArgs), ctypes.c_int)
def sparq_llama_eval_vsum_rows(args: Any, err: Any, err_size: int, /) -> int:
    """One ggml_sparq_vsum_rows graph over host arrays."""


# SPARQ_API int sparq_llama_eval_kstat_rows(const struct kstat_rows_eval_args * args, char * err, size_t err_size);
@c_function(libllama, _entry(KstatRowsEvalArgs), ctypes.c_int)
def sparq_llama_eval_kstat_rows(args: Any, err: Any, err_size: int, /) -> int:
    """One ggml_sparq_kstat_rows graph over host arrays."""


# SPARQ_API int sparq_llama_eval_index_write(const struct index_write_eval_args * args, char * err, size_t err_size);
@c_function(libllama, _entry(IndexWriteEvalArgs), ctypes.c_int)
def sparq_llama_eval_index_write(args: Any, err: Any, err_size: int, /) -> int:
    """One ggml_sparq_index_write graph over host arrays."""


# SPARQ_API int sparq_llama_eval_centroid_attn(const struct centroid_eval_args * args, char * err, size_t err_size);
@c_function(libllama, _entry(CentroidEvalArgs), ctypes.c_int)
def sparq_llama_eval_centroid_attn(args: Any, err: Any, err_size: int, /) -> int:
    """One ggml_centroid_attn graph over host arrays."""


# SPARQ_API int sparq_llama_eval_kmeans(const struct kmeans_eval_args * args, char * err, size_t err_size);
@c_function(libllama, _entry(KmeansEvalArgs), ctypes.c_int)
def sparq_llama_eval_kmeans(args: Any, err: Any, err_size: int, /) -> int:
    """Spherical k-means of host keys as ggml graphs on a backend."""


# SPARQ_API int sparq_llama_bench_kmeans(const struct kmeans_bench_args * args, char * err, size_t err_size);
@c_function(libllama, _entry(KmeansBenchArgs), ctypes.c_int)
def sparq_llama_bench_kmeans(args: Any, err: Any, err_size: int, /) -> int:
    """Times the clustering of random keys already on the backend, per layer and phase."""


# SPARQ_API int sparq_llama_bench_centroid(const struct centroid_bench_args * args, char * err, size_t err_size);
@c_function(libllama, _entry(CentroidBenchArgs), ctypes.c_int)
def sparq_llama_bench_centroid(args: Any, err: Any, err_size: int, /) -> int:
    """Times ggml_centroid_attn against ggml_flash_attn_ext on one random cache."""


# SPARQ_API int sparq_llama_bench_attn(const struct sparq_bench_args * args, char * err, size_t err_size);
@c_function(libllama, _entry(SparqBenchArgs), ctypes.c_int)
def sparq_llama_bench_attn(args: Any, err: Any, err_size: int, /) -> int:
    """Times ggml_sparq_attn against ggml_flash_attn_ext on one random cache."""


# SPARQ_API int sparq_llama_eval_squeeze_calibrate(const struct squeeze_calib_args * args, char * err, size_t err_size);
@c_function(libllama, _entry(SqueezeCalibArgs), ctypes.c_int)
def sparq_llama_eval_squeeze_calibrate(args: Any, err: Any, err_size: int, /) -> int:
    """llama_squeeze_prepare's threshold calibration over host arrays."""


# ===================================================================================================
# ggml-backend.h (libggml: the backend registry): the devices ggml sees


# GGML_API size_t ggml_backend_dev_count(void);
@c_function(libggml, [], ctypes.c_size_t)
def ggml_backend_dev_count() -> int:
    """Number of registered devices."""


# GGML_API ggml_backend_dev_t ggml_backend_dev_get(size_t index);
@c_function(libggml, [ctypes.c_size_t], ctypes.c_void_p)
def ggml_backend_dev_get(index: int, /) -> int | None:
    """Device `index` of the registry."""


# GGML_API const char * ggml_backend_dev_name(ggml_backend_dev_t device);
@c_function(libggml, [ctypes.c_void_p], ctypes.c_char_p)
def ggml_backend_dev_name(device: int | None, /) -> bytes:
    """The device's name ("CPU", "CUDA0")."""


# GGML_API const char * ggml_backend_dev_description(ggml_backend_dev_t device);
@c_function(libggml, [ctypes.c_void_p], ctypes.c_char_p)
def ggml_backend_dev_description(device: int | None, /) -> bytes:
    """The device's description."""


# GGML_API void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
@c_function(libggml, [ctypes.c_void_p, c_size_t_p, c_size_t_p], None)
def ggml_backend_dev_memory(device: int | None, free: Any, total: Any, /) -> None:
    """The device's free and total memory in bytes."""


# ===================================================================================================
# ggml.h, ggml-backend.h (libggml-base): reading a tensor in a scheduler's eval callback


# GGML_API const char * ggml_get_name(const struct ggml_tensor * tensor);
@c_function(libggml_base, [ctypes.c_void_p], ctypes.c_char_p)
def ggml_get_name(tensor: int | None, /) -> bytes | None:
    """The tensor's name."""


# GGML_API const char * ggml_op_desc(const struct ggml_tensor * t);
@c_function(libggml_base, [ctypes.c_void_p], ctypes.c_char_p)
def ggml_op_desc(t: int | None, /) -> bytes:
    """The name of the op (or unary op) that computes the tensor."""


# GGML_API int64_t ggml_nelements(const struct ggml_tensor * tensor);
@c_function(libggml_base, [ctypes.c_void_p], ctypes.c_int64)
def ggml_nelements(tensor: int | None, /) -> int:
    """Number of elements."""


# GGML_API size_t ggml_nbytes(const struct ggml_tensor * tensor);
@c_function(libggml_base, [ctypes.c_void_p], ctypes.c_size_t)
def ggml_nbytes(tensor: int | None, /) -> int:
    """Size of the tensor's data in bytes."""


# GGML_API bool ggml_is_contiguous(const struct ggml_tensor * tensor);
@c_function(libggml_base, [ctypes.c_void_p], ctypes.c_bool)
def ggml_is_contiguous(tensor: int | None, /) -> bool:
    """Whether the tensor's rows are packed."""


# GGML_API void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
@c_function(libggml_base, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t], None)
def ggml_backend_tensor_get(tensor: int | None, data: int, offset: int, size: int, /) -> None:
    """Copies size bytes from offset of the tensor's data (on any backend) to host memory."""
