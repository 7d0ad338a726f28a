"""Centroid-sparse ("Squeezed") attention over a fixed prefix: settings (`SqueezeConfig`), the names of its enums,
the k-means result (`Clusters`) and the C API.

    from sparq_llama import Llama
    llm = Llama(path)                                       # flash attention on (needed: row-major V)
    llm.prepare_fixed_context(document, keep=0.1)           # evaluate and cluster once
    llm.create_completion(document + question)              # reuses the prefix; reads ~10% of its keys
    llm.save_fixed_context("doc.state")                     # doc.state + doc.state.squeeze
    llm2 = Llama(path, fixed_context="doc.state")           # processed once, loaded since

`SqueezeConfig` mirrors `struct llama_squeeze_params` (ggml_ops/include/sparq-llama.h). Semantics: the C
header and ggml-centroid.h. Importing this module loads nothing native.
"""
from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

from . import _bindings as C
from ._bindings import LlamaSqueezeInfo, LlamaSqueezeParams, ProgressFn
from .sparq import _as_int, _ctx_ptr, _finite_float, _int32

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["GROUPS", "INITS", "Clusters", "SqueezeConfig", "SqueezeInfo", "clear", "info", "load", "prepare", "save",
           "sidecar_path"]

log = logging.getLogger(__name__)

GROUPS = ("max", "mean")  # index = enum ggml_centroid_group
Group = Literal["max", "mean"]
# k-means' initial centroids; index = enum llama_squeeze_init (ops.kmeans_cosine and the reference take these names)
INITS = ("even", "kpp")
Init = Literal["even", "kpp"]


@dataclass(frozen=True)
class Clusters:
    """One KV head's clustering of P keys (`ops.kmeans_cosine`, `reference_squeeze.kmeans_cosine`): centroids [c, d]
    (means of unnormalised member keys), sizes [c], assignment [P] (cluster of each key), the number of iterations
    run and variances [c, d] (the members' per-component variances about their centroid; 0 for an empty cluster)."""
    centroids: NDArray[np.float64]
    sizes: NDArray[np.int64]
    assignment: NDArray[np.int64]
    n_iter: int
    variances: NDArray[np.float64]


@dataclass(frozen=True)
class SqueezeConfig:
    """How a fixed prefix is prepared; the fields of `struct llama_squeeze_params`.

    centroids: fine clusters per layer and KV head, as a fraction of the clustered prefix tokens. 10% (the
        default) finds 91.4% of dense's needles on SmolLM2 at keep = 0.1 with the variance rule below (two held-out
        sets); with the calibrated threshold that the per-row budget replaced, 10% found 96.3%, the paper's 5%
        89.7% (none without the variance rule) for 19% less decode time, 15% 98.2% for 25% more
        (docs/quality.md: the frontier).
    keep: fraction of the clustered prefix each query reads: its best-scored clusters until they hold that share of
        the clustered keys (a per-row budget).
    levels: 1, or 2 (coarse clusters prune before the fine ones).
    centroids_coarse: levels = 2: coarse clusters as a fraction of the clustered prefix.
    keep_coarse: levels = 2: kept fraction at the coarse level; None: min(1, 2 * keep).
    n_calib: the prefix's last tokens, read exactly (never clustered), whose queries calibrate the two-level rule's
        coarse threshold.
    n_iter: k-means iterations at most (stops early when no assignment moves).
    group: how the query heads of a GQA group decide together: "max" (a cluster is read when any head wants
        it) or "mean".
    var_weight: the kept rule's variance term (ggml-centroid.h): a cluster's score adds var_weight * scale^2 / 2
        * sum_e q_e^2 D_e (D: its members' per-component variances), the second-order estimate of its members'
        mean weight; 0 is the paper's rule (the centroid alone). In [0, 100].
    init: k-means' initial centroids: "even" (keys at evenly spaced positions, the default) or "kpp" (k-means++
        seeding, which gives rare keys clusters of their own; deterministic). On SmolLM2's retrieval sets kpp answered
        58 of dense's 64 against even's 57 (no gain beyond the spread) for ~4% more preparation time.
    """

    centroids: float = 0.1
    keep: float = 0.1
    levels: int = 1
    centroids_coarse: float = 0.01
    keep_coarse: float | None = None
    n_calib: int = 100
    n_iter: int = 8
    group: Group = "max"
    var_weight: float = 1.0
    init: Init = "even"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("centroids", "keep", "centroids_coarse", "var_weight"):
            set_(self, name, _finite_float(name, getattr(self, name)))
        if not 0.0 < self.keep <= 1.0:
            raise ValueError(f"keep must be in (0, 1], got {self.keep!r}")
        if not 0.0 < self.centroids <= 1.0:
            raise ValueError(f"centroids must be in (0, 1] (a fraction of the prefix), got {self.centroids!r}")
        if not 0.0 <= self.var_weight <= 100.0:
            raise ValueError(f"var_weight must be in [0, 100] (0: the mean rule), got {self.var_weight!r}")
        if self.keep_coarse is not None:
            set_(self, "keep_coarse", _finite_float("keep_coarse", self.keep_coarse))
        for name in ("levels", "n_calib", "n_iter"):
            set_(self, name, _int32(name, getattr(self, name)))
        if self.levels not in (1, 2):
            raise ValueError(f"levels must be 1 or 2, got {self.levels!r}")
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {', '.join(map(repr, GROUPS))}, got {self.group!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {', '.join(map(repr, INITS))}, got {self.init!r}")

    def to_c(self) -> LlamaSqueezeParams:
        return LlamaSqueezeParams(
            centroids=self.centroids, keep=self.keep, levels=self.levels, centroids_coarse=self.centroids_coarse,
            keep_coarse=0.0 if self.keep_coarse is None else self.keep_coarse, n_calib=self.n_calib,
            n_iter=self.n_iter, group=GROUPS.index(self.group), var_weight=self.var_weight, init=INITS.index(self.init))


@dataclass(frozen=True)
class SqueezeInfo:
    """What a context holds (llama_squeeze_get_info); `prepared` False: no valid prepared prefix."""

    prepared: bool
    seq_id: int
    n_prefix: int
    n_clustered: int
    n_layers: int
    levels: int
    keep: float  # the fine level's budget: each row reads its best clusters up to this share of the clustered cells
    threshold_coarse: float  # two levels: the calibrated coarse threshold
    kept_calib: float  # two levels: mean share of the clustered cells under kept coarse clusters on the calibration rows
    prefill: str = "auto"  # how a question's prefill reads the prefix: "auto", "sparse" or "dense" (set_prefill)
    var_weight: float = 0.0  # the kept rule's variance term (0: the mean rule; sidecars before version 3)


_C_FUNCTIONS = (C.llama_squeeze_default_params, C.llama_squeeze_check, C.llama_squeeze_prepare,
                C.llama_squeeze_save, C.llama_squeeze_load, C.llama_squeeze_load_state_file,
                C.llama_squeeze_save_files, C.llama_squeeze_load_files,
                C.llama_squeeze_recalibrate, C.llama_squeeze_set_prefill, C.llama_squeeze_clear,
                C.llama_squeeze_get_info, C.llama_squeeze_seq_sparse, C.llama_squeeze_last_error)


@lru_cache(maxsize=1)
def _api() -> Any:
    """The bound C functions (`_bindings`), once this libllama is known to have the centroid-sparse ones."""
    missing = C.missing(_C_FUNCTIONS)
    if missing:
        raise RuntimeError(f"this build of sparq-llama's libllama has no centroid-sparse API ({', '.join(missing)} "
                           f"missing); rebuild and reinstall the package")
    return C


def _error(what: str) -> ValueError:
    reason = (_api().llama_squeeze_last_error() or b"").decode(errors="replace") or "no reason given"
    return ValueError(f"{what} failed: {reason}")


def _tokens_array(tokens: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int32 * len(tokens))(*(_as_int("token", t) for t in tokens))


def check(config: SqueezeConfig) -> None:
    """ValueError with llama_squeeze_check's message if C rejects `config`."""
    p = config.to_c()
    msg = _api().llama_squeeze_check(ctypes.byref(p))
    if msg is not None:
        raise ValueError(f"invalid centroid-sparse settings: {msg.decode(errors='replace')}")


def prepare(ctx: Any, tokens: Sequence[int], config: SqueezeConfig, *, seq_id: int = 0,
            progress: Callable[[float], None] | None = None) -> SqueezeInfo:
    """llama_squeeze_prepare: the cache must hold exactly `tokens` as sequence `seq_id`. ValueError on failure."""
    check(config)
    p = config.to_c()
    error: list[BaseException] = []

    def report(fraction: float, _user: Any) -> bool:
        try:
            if progress is not None:
                progress(float(fraction))
            return True
        except BaseException as e:  # noqa: BLE001 (any exception, KeyboardInterrupt too, cancels; re-raised below)
            error.append(e)
            return False

    callback = ProgressFn(report)  # referenced until the call returns
    p.progress_callback = callback
    arr = _tokens_array(tokens)
    rc = _api().llama_squeeze_prepare(_ctx_ptr(ctx), _int32("seq_id", seq_id), arr, len(tokens), ctypes.byref(p))
    if error:
        raise error[0]
    if rc != 0:
        raise _error("llama_squeeze_prepare")
    return info(ctx)


def save(ctx: Any, path: str) -> None:
    if _api().llama_squeeze_save(_ctx_ptr(ctx), str(path).encode()) != 0:
        raise _error("llama_squeeze_save")


def load(ctx: Any, path: str, tokens: Sequence[int] | None = None, *, seq_id: int = 0) -> SqueezeInfo:
    arr = _tokens_array(tokens) if tokens is not None else None
    n = len(tokens) if tokens is not None else 0
    if _api().llama_squeeze_load(_ctx_ptr(ctx), _int32("seq_id", seq_id), str(path).encode(), arr, n) != 0:
        raise _error("llama_squeeze_load")
    return info(ctx)


def load_state_file(ctx: Any, path: str, capacity: int, *, seq_id: int = 0) -> list[int]:
    """llama_squeeze_load_state_file: a saved KV state (llama_state_seq_save_file's) into seq_id, its layout checked
    first (a damaged or cut-short file is a ValueError, not llama.cpp's abort); the state's tokens. ValueError on
    failure."""
    tokens = (ctypes.c_int32 * capacity)()
    n_out = ctypes.c_size_t(0)
    if _api().llama_squeeze_load_state_file(_ctx_ptr(ctx), _int32("seq_id", seq_id), str(path).encode(), tokens,
                                            capacity, ctypes.byref(n_out)) != 0:
        raise _error("llama_squeeze_load_state_file")
    return list(tokens[:n_out.value])


def save_files(ctx: Any, state_path: str, sidecar_path: str) -> None:
    """llama_squeeze_save_files: the prepared prefix's KV state, then its sidecar recording the state's checksums."""
    if _api().llama_squeeze_save_files(_ctx_ptr(ctx), str(state_path).encode(), str(sidecar_path).encode()) != 0:
        raise _error("llama_squeeze_save_files")


def load_files(ctx: Any, state_path: str, sidecar_path: str, capacity: int, *, seq_id: int = 0) -> list[int]:
    """llama_squeeze_load_files: both files verified (checksums, pairing, model), then loaded into seq_id; the state's
    tokens. ValueError naming the file and the part on failure, the context then unchanged by a file that fails its
    checks."""
    tokens = (ctypes.c_int32 * capacity)()
    n_out = ctypes.c_size_t(0)
    if _api().llama_squeeze_load_files(_ctx_ptr(ctx), _int32("seq_id", seq_id), str(state_path).encode(),
                                       str(sidecar_path).encode(), tokens, capacity, ctypes.byref(n_out)) != 0:
        raise _error("llama_squeeze_load_files")
    return list(tokens[:n_out.value])


def recalibrate(ctx: Any, keep: float, keep_coarse: float = 0.0) -> SqueezeInfo:
    """llama_squeeze_recalibrate: a new keep for the prepared prefix (same clusters; two levels: the coarse threshold
    calibrated again). ValueError on failure."""
    if _api().llama_squeeze_recalibrate(_ctx_ptr(ctx), float(keep), float(keep_coarse)) != 0:
        raise _error("llama_squeeze_recalibrate")
    return info(ctx)


PREFILL_MODES: tuple[str, ...] = ("auto", "sparse", "dense")  # enum llama_squeeze_prefill, in order


def set_prefill(ctx: Any, mode: str) -> SqueezeInfo:
    """llama_squeeze_set_prefill: how a prompt's tokens after the prepared prefix (a question) attend to it:
    "sparse" (each row reads its kept clusters), "dense" (exact attention over the whole cache) or "auto" (sparse where
    the KV is in host memory, dense on a GPU). Decodes always read the kept clusters. ValueError on failure."""
    if mode not in PREFILL_MODES:
        raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {mode!r}")
    if _api().llama_squeeze_set_prefill(_ctx_ptr(ctx), PREFILL_MODES.index(mode)) != 0:
        raise _error("llama_squeeze_set_prefill")
    return info(ctx)


def clear(ctx: Any) -> None:
    _api().llama_squeeze_clear(_ctx_ptr(ctx))


def info(ctx: Any) -> SqueezeInfo:
    c = _api().llama_squeeze_get_info(_ctx_ptr(ctx))
    return SqueezeInfo(prepared=bool(c.prepared), seq_id=int(c.seq_id), n_prefix=int(c.n_prefix),
                       n_clustered=int(c.n_clustered), n_layers=int(c.n_layers), levels=int(c.levels),
                       keep=float(c.keep), threshold_coarse=float(c.threshold_coarse),
                       kept_calib=float(c.kept_calib),
                       prefill=PREFILL_MODES[c.prefill] if 0 <= c.prefill < len(PREFILL_MODES) else str(c.prefill),
                       var_weight=float(c.var_weight))


def seq_sparse(ctx: Any, seq_id: int) -> bool:
    """llama_squeeze_seq_sparse: whether sequence `seq_id` reads the prepared prefix sparsely (it holds every clustered
    cell, in the prefix's cache stream or in a stream a cross-stream llama_memory_seq_cp filled from one)."""
    return bool(_api().llama_squeeze_seq_sparse(_ctx_ptr(ctx), _as_int("seq_id", seq_id)))


def sidecar_path(state_path: str) -> str:
    """Where the clusters of a saved fixed context live, next to its KV state file."""
    return f"{state_path}.squeeze"
