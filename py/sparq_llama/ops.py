"""Our ggml ops, callable from numpy: each call builds a one-node ggml graph on our library and runs it.

    from sparq_llama import ops, reference
    y = ops.sparq_attn(q, k, v, mask, k1=16, k2=128)        # same signature as reference.sparq_attn
    y_ref = reference.sparq_attn(q, k, v, mask, k1=16, k2=128)

Shapes follow the reference: q [n_head, n_q, d], k [n_head_kv, n_kv, d], v [n_head_kv, n_kv, d_v],
mask [n_q, n_kv] bool (True = visible). A leading stream axis is accepted too (q [ns, n_head, n_q, d],
k/v [ns, ...], mask [ns or 1, n_q, n_kv]): streams are independent KV caches, as in llama.cpp.
"""
from __future__ import annotations

import ctypes
import os
from typing import Literal

import numpy as np

from . import _bindings as C
from ._bindings import (
    CentroidBenchArgs,
    CentroidEvalArgs,
    GgmlCentroidParams,
    GgmlSparqParams,
    IndexWriteEvalArgs,
    KmeansBenchArgs,
    KmeansEvalArgs,
    KstatRowsEvalArgs,
    SparqBenchArgs,
    SparqEvalArgs,
    SqueezeCalibArgs,
    VsumRowsEvalArgs,
)
from ._system import devices
from .index import INDEXES, Q4_BLOCK, Q8_BLOCK, SELECTS, q4_index_bytes, q8_0_bytes, q8_0_quantize
from .sparq import MEAN_MODES, POLICIES
from .squeeze import GROUPS, INITS, Clusters

# ggml_type values (ggml.h): the float types, and the quantized KV cache types llama.cpp offers (-ctk/-ctv)
_GGML_TYPES = {"f32": 0, "f16": 1, "bf16": 30}
_QUANT_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8}
_Q8_0 = 8
_I8 = 24  # GGML_TYPE_I8: the q4 index's blocks (their own layout: sparq_llama.index)
_KT_TYPE = {"f16": _GGML_TYPES["f16"], "q8": _Q8_0, "q4": _I8}  # the op's kt type of each index
_MEAN = {name: i for i, name in enumerate(MEAN_MODES)}      # enum ggml_sparq_mean
_POLICY = {name: i for i, name in enumerate(POLICIES)}      # enum ggml_sparq_policy
_GROUP = {name: i for i, name in enumerate(GROUPS)}         # enum ggml_centroid_group


def _params(*, k1: int, k2: int, window: int | None = None, sinks: int = 0, mean: str = "auto",
            policy: str = "sparq", scale: float | None = None, softcap: float = 0.0,
            sparse_v_thresh: float = 0.0, select: str = "q") -> GgmlSparqParams:
    """The C params struct; None means the op's default (window k2/4, scale 1/sqrt(d))."""
    return GgmlSparqParams(k1=int(k1), k2=int(k2), window=-1 if window is None else int(window), sinks=int(sinks),
                           mean=_MEAN[mean], policy=_POLICY[policy], scale=0.0 if scale is None else float(scale),
                           softcap=float(softcap), sparse_v_thresh=float(sparse_v_thresh),
                           select=SELECTS.index(select))


def _kv_type(kv_dtype: str) -> int:
    """The ggml_type of a KV dtype name."""
    return _GGML_TYPES[kv_dtype] if kv_dtype in _GGML_TYPES else _QUANT_TYPES[kv_dtype]


def _device_name(backend: str) -> bytes | None:
    """The ggml device for a backend argument: None (the CPU) or b"CUDA<N>"; ValueError if there is none."""
    if backend == "cpu":
        return None
    kind, _, index = backend.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"backend must be 'cpu', 'cuda' or 'cuda:N', got {backend!r}")
    name, seen = f"CUDA{index or 0}", [dev["name"] for dev in devices()]
    if name not in seen:
        raise ValueError(f"backend {backend!r}: no ggml device {name} (this build sees {seen})")
    return name.encode()


def _call(entry: C.CFunction, args: ctypes.Structure) -> None:
    """Calls one of libllama's `int entry(const struct *args, char *err, size_t err_size)` functions (the eval and
    bench entries of sparq-llama-testing.h); ValueError with its message when it returns nonzero."""
    err = ctypes.create_string_buffer(1024)
    if entry(ctypes.byref(args), err, len(err)) != 0:
        raise ValueError(err.value.decode())


def _gguf_quant(kv_dtype: str):
    """gguf's numpy implementation of a ggml quantization type (bit-exact with ggml's reference quantizers)."""
    import gguf  # the test extra: only quantized KV caches need it

    return gguf.GGMLQuantizationType[kv_dtype.upper()]


def _to_kv(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """x as a C-contiguous array of the KV type's bits (bf16 rounded to nearest even; quantized types as ggml's
    blocks along the last axis)."""
    if kv_dtype in _QUANT_TYPES:
        from gguf.quants import quantize

        if x.shape[-1] % 32 != 0:
            raise ValueError(f"{kv_dtype} stores rows in blocks of 32 values: the head dims must be multiples of 32, "
                             f"got {x.shape[-1]}")
        return np.ascontiguousarray(quantize(np.ascontiguousarray(x, dtype=np.float32), _gguf_quant(kv_dtype)))
    if kv_dtype == "f32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if kv_dtype == "f16":
        return np.ascontiguousarray(x, dtype=np.float16)
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.ascontiguousarray((rounded >> np.uint32(16)).astype(np.uint16))


def kv_round(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """x rounded to the KV type and back to float64: what the op actually sees (for exact comparisons)."""
    y = _to_kv(x, kv_dtype)
    if kv_dtype in _QUANT_TYPES:
        from gguf.quants import dequantize

        return dequantize(y, _gguf_quant(kv_dtype)).astype(np.float64)
    if kv_dtype == "bf16":
        return (y.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return y.astype(np.float64)


def _mask_f16(mask: np.ndarray | None, n_q: int, n_kv: int) -> tuple[np.ndarray | None, int]:
    """A boolean mask [n_q, n_kv] (or [ns, n_q, n_kv]) as the ops' f16 0 / -inf mask, and its stream count."""
    if mask is None:
        return None, 1
    m = np.asarray(mask, dtype=bool)
    m = m[None] if m.ndim == 2 else m
    if m.ndim != 3 or m.shape[1:] != (n_q, n_kv):
        raise ValueError(f"mask must be [n_q={n_q}, n_kv={n_kv}] (or [ns, n_q, n_kv]), got {np.shape(mask)}")
    return np.ascontiguousarray(np.where(m, 0.0, -np.inf).astype(np.float16)), m.shape[0]


def sparq_attn(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
               k1: int, k2: int, window: int | None = None, sinks: int = 0,
               mean: Literal["auto", "on", "off"] = "auto", scale: float | None = None, softcap: float = 0.0,
               policy: Literal["sparq", "exact", "window"] = "sparq", sparse_v_thresh: float = 0.0,
               vsum: np.ndarray | None = None, kv_dtype: str = "f16", v_dtype: str | None = None,
               layout: Literal["kt", "default"] = "kt", n_threads: int | None = None,
               backend: str = "cpu", pos: np.ndarray | None = None, select: str = "q", index: str = "f16",
               kstat: np.ndarray | None = None) -> np.ndarray:
    """ggml_sparq_attn on our library; arguments as `reference.sparq_attn` (pos, select and index included), plus:

    kv_dtype: type K is stored in (f32, f16, bf16, or a quantized cache type: q8_0, q4_0, q4_1, q5_0, q5_1);
    v_dtype: V's (None: kv_dtype); layout: "kt" passes the index (K^T in f16, in q8_0 blocks with index="q8", or
    with index="q4" the q4 index's blocks as i8 bytes [ns, n_head_kv, ceil(n_kv/32), 18*d], k1 then d),
    "default" lets the op gather from row-major K (the f16 index only); n_threads: CPU threads (None:
    all cores); backend: "cpu", "cuda" (the first CUDA device) or "cuda:N" (`sparq_llama.devices()` lists them);
    vsum: per-row running sums [ns, n_q, n_head_kv, d_v + 1] (None: computed); kstat: per-row key sums
    [ns, n_q, n_head_kv, 2d + 1] (sum of k, of k^2, count; None: the op computes them for select="qsigma").
    The op sees K and V as the types hold them: compare with the reference on `kv_round`ed arrays.
    Bad arguments raise ValueError with the op's own message. Returns float64 in the input's layout.
    """
    v_dtype = kv_dtype if v_dtype is None else v_dtype
    for name, dtype in (("kv_dtype", kv_dtype), ("v_dtype", v_dtype)):
        if dtype not in _GGML_TYPES and dtype not in _QUANT_TYPES:
            raise ValueError(f"{name} must be one of {sorted(_GGML_TYPES) + sorted(_QUANT_TYPES)}, got {dtype!r}")
    if select not in SELECTS:
        raise ValueError(f"select must be one of {SELECTS}, got {select!r}")
    if index not in INDEXES:
        raise ValueError(f"index must be one of {INDEXES}, got {index!r}")
    if index != "f16" and layout == "default":
        raise ValueError(f"index={index!r} is a transposed key copy; layout='default' keeps none")
    if layout not in ("kt", "default"):
        raise ValueError(f"layout must be 'kt' or 'default', got {layout!r}")
    if mean not in MEAN_MODES:
        raise ValueError(f"mean must be one of {MEAN_MODES}, got {mean!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    q, k, v = (np.asarray(x) for x in (q, k, v))
    single = q.ndim == 3
    if single:
        q, k, v = q[None], k[None], v[None]
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be [n_head, n_q, d] / [n_head_kv, n_kv, d] (or with a leading stream axis)")
    ns, n_head, n_q, d = q.shape
    _, n_head_kv, n_kv, _ = k.shape
    d_v = v.shape[-1]
    if k.shape[0] != ns or k.shape[3] != d:
        raise ValueError(f"head dim of q ({d}) and k ({k.shape[3]}) differ, or their stream counts do")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {v.shape} must match k {k.shape} in streams, KV heads and cells")

    q32 = np.ascontiguousarray(q, dtype=np.float32)
    k_dev = _to_kv(k, kv_dtype)
    v_dev = _to_kv(v, v_dtype)
    # the index holds the keys as K does (dequantized): transposed (f16, q8), or in the q4 index's blocks
    kt_type = _KT_TYPE[index]
    kt_dev = None
    if layout == "kt" and index == "q4":
        kt_dev = q4_index_bytes(kv_round(k, kv_dtype))
    elif layout == "kt":
        kt_src = np.swapaxes(kv_round(k, kv_dtype), -1, -2)
        if index == "q8":
            kt_pad = np.pad(kt_src, [(0, 0)] * (kt_src.ndim - 1) + [(0, -n_kv % Q8_BLOCK)])
            kt_dev = np.ascontiguousarray(q8_0_bytes(*q8_0_quantize(kt_pad)))
        else:
            kt_dev = _to_kv(kt_src, "f16")
    mask_dev, mask_ns = _mask_f16(mask, n_q, n_kv)
    vsum_dev = None if vsum is None else np.ascontiguousarray(vsum, dtype=np.float32)
    if vsum_dev is not None and vsum_dev.shape != (ns, n_q, n_head_kv, d_v + 1):
        raise ValueError(f"vsum must be [ns, n_q, n_head_kv, d_v + 1] = {(ns, n_q, n_head_kv, d_v + 1)}")
    kstat_dev = None if kstat is None else np.ascontiguousarray(kstat, dtype=np.float32)
    if kstat_dev is not None and kstat_dev.shape != (ns, n_q, n_head_kv, 2 * d + 1):
        raise ValueError(f"kstat must be [ns, n_q, n_head_kv, 2d + 1] = {(ns, n_q, n_head_kv, 2 * d + 1)}")
    pos_dev = None
    if pos is not None:
        pos_dev = np.ascontiguousarray(np.broadcast_to(np.asarray(pos), (ns, n_kv)), dtype=np.int32)
    out = np.zeros((ns, n_q, n_head, d_v), dtype=np.float32)

    params = _params(k1=k1, k2=k2, window=window, sinks=sinks, mean=mean, policy=policy, scale=scale,
                     softcap=softcap, sparse_v_thresh=sparse_v_thresh, select=select)
    ptr = lambda a: None if a is None else a.ctypes.data
    args = SparqEvalArgs(device=_device_name(backend), n_threads=int(n_threads or os.cpu_count() or 1),
                         k_type=_kv_type(kv_dtype), kt_type=kt_type, v_type=_kv_type(v_dtype), d=d, d_v=d_v, n_q=n_q,
                         n_head=n_head, n_head_kv=n_head_kv,
                         n_kv=n_kv, ns=ns, mask_ns=mask_ns, q=ptr(q32), k=ptr(k_dev), kt=ptr(kt_dev), v=ptr(v_dev),
                         mask=ptr(mask_dev), vsum=ptr(vsum_dev), params=ctypes.pointer(params), out=ptr(out),
                         pos=ptr(pos_dev), kstat=ptr(kstat_dev))
    _call(C.sparq_llama_eval_sparq_attn, args)
    y = np.swapaxes(out, 1, 2).astype(np.float64)  # [ns, n_head, n_q, d_v]
    return y[0] if single else y


def vsum_rows(table: np.ndarray, v: np.ndarray, idx: np.ndarray, *, v_dtype: str = "f16", v_ld: int | None = None,
              n_threads: int | None = None, backend: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """ggml_sparq_vsum_rows on a backend: a decode step's V sums. table [n_seq, n_head_kv, d_v + 1] (per sequence
    and KV head the sum of V, then the count), v [n_tokens, n_head_kv, d_v] (the tokens' values, rounded to v_dtype
    by the op, as the cache stores them), idx [n_tokens] (each token's table row, distinct: the op writes them back).
    With v_ld the op reads v through a strided view (v_ld >= d_v components per row). Returns the result
    [n_tokens, n_head_kv, d_v + 1] float32, table[idx] + [round(v), 1] (`kv_round` gives round(v)), and the table as
    the op left it (those rows written back, the others as they were)."""
    tab, ix = _table_rows(table, idx, 1)
    vv = np.asarray(v, dtype=np.float32)
    n_seq, n_head_kv, tab_width = tab.shape
    if vv.ndim != 3 or vv.shape[1] != n_head_kv or tab_width != vv.shape[2] + 1 or ix.shape[0] != vv.shape[0]:
        raise ValueError(f"shapes do not agree: table {tab.shape}, rows {vv.shape}, idx {ix.shape}")
    n_tokens, _, d_v = vv.shape
    if v_dtype not in _GGML_TYPES:
        raise ValueError(f"v_dtype must be one of {sorted(_GGML_TYPES)}, got {v_dtype!r}")
    ld = d_v if v_ld is None else int(v_ld)
    padded = np.zeros((n_tokens, n_head_kv, max(ld, d_v)), dtype=np.float32)
    padded[..., :d_v] = vv
    padded[..., d_v:] = np.nan  # never read: a kernel that reads past d_v turns its sums into NaN
    out = np.zeros((n_tokens, n_head_kv, d_v + 1), dtype=np.float32)
    table_out = np.full_like(tab, np.nan)
    args = VsumRowsEvalArgs(device=_device_name(backend), n_threads=int(n_threads or os.cpu_count() or 1),
                            v_type=_GGML_TYPES[v_dtype], d_v=d_v, n_head_kv=n_head_kv, n_tokens=n_tokens, n_seq=n_seq,
                            v_ld=ld, table=tab.ctypes.data, v=padded.ctypes.data, idx=ix.ctypes.data,
                            out=out.ctypes.data, table_out=table_out.ctypes.data)
    _call(C.sparq_llama_eval_vsum_rows, args)
    return out, table_out


def kstat_rows(table: np.ndarray, k: np.ndarray, cells: np.ndarray, idx: np.ndarray, *, kv_dtype: str = "f16",
               n_threads: int | None = None, backend: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """ggml_sparq_kstat_rows on a backend: a decode step's key statistics over the keys as the cache holds them.
    table [n_seq, n_head_kv, 2d + 1] (per sequence and KV head the sum of the keys, the sum of their squares, the
    count), k [n_stream, kv_size, n_head_kv * d] (the cache's keys, stored as kv_dtype: a float type or a quantized
    KV type), cells [n_tokens] (each token's row of k over all streams: stream * kv_size + cell), idx [n_tokens]
    (each token's table row, distinct). Returns the result [n_tokens, n_head_kv, 2d + 1] float32, table[idx] +
    [r, r*r, 1] with r the row's keys as stored (`kv_round`), and the table as the op left it."""
    tab, ix = _table_rows(table, idx, 2)
    kk = np.asarray(k, dtype=np.float32)
    cc = np.ascontiguousarray(cells, dtype=np.int32)
    n_seq, n_head_kv, tab_width = tab.shape
    if kk.ndim != 3 or cc.shape != ix.shape or (tab_width - 1) % 2 or kk.shape[2] != n_head_kv * ((tab_width - 1) // 2):
        raise ValueError(f"shapes do not agree: table {tab.shape}, k {kk.shape}, cells {cc.shape}, idx {ix.shape}")
    if kv_dtype not in _GGML_TYPES and kv_dtype not in _QUANT_TYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(_GGML_TYPES) + sorted(_QUANT_TYPES)}, got {kv_dtype!r}")
    n_stream, kv_size, _ = kk.shape
    d, n_tokens = (tab_width - 1) // 2, ix.shape[0]
    k_dev = _to_kv(kk, kv_dtype)
    out = np.zeros((n_tokens, n_head_kv, 2 * d + 1), dtype=np.float32)
    table_out = np.full_like(tab, np.nan)
    args = KstatRowsEvalArgs(device=_device_name(backend), n_threads=int(n_threads or os.cpu_count() or 1),
                             k_type=_kv_type(kv_dtype), d=d, n_head_kv=n_head_kv, n_tokens=n_tokens, n_seq=n_seq,
                             kv_size=kv_size, n_stream=n_stream, table=tab.ctypes.data, k=k_dev.ctypes.data,
                             cells=cc.ctypes.data, idx=ix.ctypes.data, out=out.ctypes.data,
                             table_out=table_out.ctypes.data)
    _call(C.sparq_llama_eval_kstat_rows, args)
    return out, table_out


def _table_rows(table: np.ndarray, idx: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A sum table [n_seq, n_head_kv, width*d + 1] and its rows idx [n_tokens] as the evaluations take them."""
    tab = np.ascontiguousarray(table, dtype=np.float32)
    ix = np.ascontiguousarray(idx, dtype=np.int32)
    if tab.ndim != 3 or ix.ndim != 1:
        raise ValueError(f"table must be [n_seq, n_head_kv, {width}*d + 1] and idx [n_tokens], got {tab.shape} and "
                         f"{ix.shape}")
    return tab, ix


def index_bytes(kt: np.ndarray, kt_dtype: str, *, head_dim: int | None = None) -> np.ndarray:
    """An index [..., n_embd, row_len] (per key component a row of cells) as the bytes of kt_dtype: f32, f16, bf16
    or q8_0 (blocks of 32 cells along the row), uint8 [..., n_embd, row bytes] in ggml's layout; or "q4", the q4
    index of KV heads of head_dim components (n_embd = n_head_kv * head_dim, row_len a multiple of 32), uint8
    [..., row_len/32, n_head_kv, 18*head_dim]: per block of 32 cells every head's block (`sparq_llama.index`)."""
    kt = np.asarray(kt, dtype=np.float32)
    if kt_dtype == "q4":
        if kt.ndim < 2 or head_dim is None or head_dim < 1 or kt.shape[-2] % head_dim != 0:
            raise ValueError(f"a q4 index [..., n_embd, row_len] needs a head_dim dividing n_embd, got kt {kt.shape} "
                             f"and head_dim={head_dim!r}")
        if kt.shape[-1] % Q4_BLOCK != 0:
            raise ValueError(f"a q4 index holds rows of whole {Q4_BLOCK}-cell blocks, got {kt.shape[-1]} cells")
        *lead, n_embd, row_len = kt.shape
        keys = np.swapaxes(kt.reshape(*lead, n_embd // head_dim, head_dim, row_len), -1, -2)  # [..., h, cells, d]
        return np.ascontiguousarray(np.swapaxes(q4_index_bytes(keys), -3, -2))              # [..., blocks, h, 18d]
    if kt_dtype == "q8_0":
        if kt.shape[-1] % Q8_BLOCK != 0:
            raise ValueError(f"a q8_0 index holds rows of whole {Q8_BLOCK}-cell blocks, got {kt.shape[-1]} cells")
        return np.ascontiguousarray(q8_0_bytes(*q8_0_quantize(kt)))
    if kt_dtype not in _GGML_TYPES:
        raise ValueError(f"kt_dtype must be one of {sorted(_GGML_TYPES) + ['q4', 'q8_0']}, got {kt_dtype!r}")
    return _to_kv(kt, kt_dtype).view(np.uint8).reshape(*kt.shape[:-1], -1)


def index_write(kt: np.ndarray, k: np.ndarray, cells: np.ndarray, blk: np.ndarray, *, mask: np.ndarray | None = None,
                s0: int = 0, kt_dtype: str = "q8_0", kv_dtype: str = "f16", head_dim: int | None = None,
                n_threads: int | None = None, backend: str = "cpu") -> np.ndarray:
    """ggml_sparq_index_write on a backend: blocks of the index recomputed from the cache's keys.
    kt [n_stream, n_embd, row_len]: the index before the op as float values, stored as kt_dtype (f32, f16, bf16,
    q8_0: blocks of B = 32 cells along the row, or q4: the q4 index of KV heads of head_dim components, B = 32, as
    `index_bytes` stores it); k [n_stream, kv_size, n_embd]: the cache's keys, stored as kv_dtype; cells
    [ns * n_blk * B] (rows of k over all streams: stream * kv_size + cell), mask [ns * n_blk * B] or None, blk
    [ns, n_blk] (block numbers in streams s0 .. s0 + ns - 1), as the op takes them (ggml-sparq.h). Returns the index
    after the op as its bytes in ggml's layout of kt_dtype: uint8 [n_stream, n_embd, row bytes], or with q4
    [n_stream, row_len/32, n_head_kv, 18*head_dim]."""
    kt_types = {**_GGML_TYPES, "q8_0": _Q8_0, "q4": _I8}
    if kt_dtype not in kt_types:
        raise ValueError(f"kt_dtype must be one of {sorted(kt_types)}, got {kt_dtype!r}")
    if kv_dtype not in _GGML_TYPES and kv_dtype not in _QUANT_TYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(_GGML_TYPES) + sorted(_QUANT_TYPES)}, got {kv_dtype!r}")
    if (kt_dtype == "q4") != (head_dim is not None):
        raise ValueError(f"head_dim goes with kt_dtype='q4' (the q4 index's KV heads) and only with it, got "
                         f"kt_dtype={kt_dtype!r}, head_dim={head_dim!r}")
    kt, k = np.asarray(kt), np.asarray(k)
    if kt.ndim != 3 or k.ndim != 3 or kt.shape[0] != k.shape[0] or kt.shape[1] != k.shape[2]:
        raise ValueError(f"kt must be [n_stream, n_embd, row_len] and k [n_stream, kv_size, n_embd], got {kt.shape} "
                         f"and {k.shape}")
    n_stream, n_embd, row_len = kt.shape
    kt_dev = index_bytes(kt, kt_dtype, head_dim=head_dim)
    k_dev = _to_kv(k, kv_dtype)
    cells_dev = np.ascontiguousarray(cells, dtype=np.int32)
    blk_dev = np.ascontiguousarray(blk, dtype=np.int64)
    if blk_dev.ndim != 2:
        raise ValueError(f"blk must be [ns, n_blk], got {blk_dev.shape}")
    n_block = Q8_BLOCK if kt_dtype == "q8_0" else Q4_BLOCK if kt_dtype == "q4" else 1
    if cells_dev.shape != (blk_dev.size * n_block,):
        raise ValueError(f"cells must hold {n_block} cells per block: [{blk_dev.size * n_block}], got {cells_dev.shape}")
    mask_dev = None if mask is None else np.ascontiguousarray(mask, dtype=np.float32)
    if mask_dev is not None and mask_dev.shape != cells_dev.shape:
        raise ValueError(f"mask must be shaped as cells {cells_dev.shape}, got {mask_dev.shape}")
    out = np.zeros(kt_dev.nbytes, dtype=np.uint8)
    args = IndexWriteEvalArgs(device=_device_name(backend), n_threads=int(n_threads or os.cpu_count() or 1),
                              kt_type=kt_types[kt_dtype], k_type=_kv_type(kv_dtype), n_embd=n_embd, row_len=row_len,
                              kv_size=k.shape[1], n_stream=n_stream, n_blk=blk_dev.shape[1], ns=blk_dev.shape[0],
                              s0=int(s0), kt=kt_dev.ctypes.data, k=k_dev.ctypes.data, cells=cells_dev.ctypes.data,
                              mask=None if mask_dev is None else mask_dev.ctypes.data, blk=blk_dev.ctypes.data,
                              kt_out=out.ctypes.data, head_dim=0 if head_dim is None else int(head_dim))
    _call(C.sparq_llama_eval_index_write, args)
    return out.reshape(kt_dev.shape)


def bench_attn(*, d: int, n_head: int, n_head_kv: int, n_kv: int, k1: int, k2: int, n_runs: int = 20,
               n_threads: int | None = None, kv_dtype: str = "f16", layout: str = "kt", mean: str = "auto",
               backend: str = "cpu", n_seq: int = 1, index: str = "f16", select: str = "q"
               ) -> tuple[np.ndarray, np.ndarray]:
    """Decode-step times (µs) of ggml_sparq_attn and ggml_flash_attn_ext on the same random cache of
    `n_seq` sequences of `n_kv` cells, `n_runs` interleaved runs each after a warm-up. Returns (sparq_us, flash_us).
    kv_dtype: K and V's type (float or quantized); index: f16, q8 or q4 (the last two with layout "kt"; q4 with
    k1 = d); select q or qsigma (the op then reads key sums, as in a model)."""
    if index not in INDEXES or select not in SELECTS:
        raise ValueError(f"index must be one of {INDEXES} and select one of {SELECTS}, got {index!r}, {select!r}")
    params = _params(k1=k1, k2=k2, mean=mean, select=select)
    sparq_us = (ctypes.c_double * n_runs)()
    flash_us = (ctypes.c_double * n_runs)()
    args = SparqBenchArgs(device=_device_name(backend), n_threads=int(n_threads or os.cpu_count() or 1),
                          kv_type=_kv_type(kv_dtype), d=d, n_head=n_head, n_head_kv=n_head_kv, n_kv=n_kv,
                          use_kt=int(layout == "kt"), n_runs=n_runs, params=ctypes.pointer(params),
                          sparq_us=sparq_us, flash_us=flash_us, n_seq=int(n_seq),
                          kt_type=_KT_TYPE[index])
    _call(C.sparq_llama_bench_attn, args)
    return np.array(sparq_us[:]), np.array(flash_us[:])


# ---- centroid-sparse attention ----------------------------------------------------------------------

def _table(centroids: np.ndarray, sizes: np.ndarray, variances: np.ndarray | None, ns: int, n_head_kv: int, d: int,
           name: str) -> np.ndarray:
    """[ns, n_head_kv, n, d + 1] f32: each centroid's components, then its cluster size; with variances
    [ns, n_head_kv, n, 2d + 1]: then the variances."""
    c = np.asarray(centroids, dtype=np.float64)
    n = np.asarray(sizes, dtype=np.float64)
    c, n = (c[None], n[None]) if c.ndim == 3 else (c, n)
    if c.ndim != 4 or c.shape[:2] != (ns, n_head_kv) or c.shape[3] != d or n.shape != c.shape[:3]:
        raise ValueError(f"{name} must be [n_head_kv={n_head_kv}, n, d={d}] with sizes [n_head_kv, n] (or with a "
                         f"leading stream axis), got {c.shape} and {n.shape}")
    parts = [c, n[..., None]]
    if variances is not None:
        var = np.asarray(variances, dtype=np.float64)
        var = var[None] if var.ndim == 3 else var
        if var.shape != c.shape:
            raise ValueError(f"the variances of {name} must have the centroids' shape {c.shape}, got {var.shape}")
        parts.append(var)
    return np.ascontiguousarray(np.concatenate(parts, axis=-1), dtype=np.float32)


def _index_map(x: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
    m = np.asarray(x)
    m = m[None] if m.ndim == len(shape) - 1 else m
    if m.shape != shape:
        raise ValueError(f"{name} must be {shape[1:]} (or with a leading stream axis {shape}), got {np.shape(x)}")
    return np.ascontiguousarray(m, dtype=np.int32)


def centroid_attn(q: np.ndarray, k: np.ndarray, v: np.ndarray, centroids: np.ndarray, sizes: np.ndarray,
                  cell_cluster: np.ndarray, keep: float, mask: np.ndarray | None = None, *,
                  scale: float | None = None, softcap: float = 0.0, group: Literal["max", "mean"] = "max",
                  coarse: tuple[np.ndarray, ...] | None = None, threshold_coarse: float = 0.0,
                  variances: np.ndarray | None = None, var_weight: float = 0.0,
                  kv_dtype: Literal["f16", "bf16", "f32"] = "f16", n_threads: int | None = None,
                  backend: str = "cpu") -> np.ndarray:
    """ggml_centroid_attn on our library; arguments as `reference_squeeze.centroid_attn`, plus kv_dtype,
    n_threads and backend as for `sparq_attn`. Bad arguments raise ValueError with the op's own message."""
    if kv_dtype not in _GGML_TYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(_GGML_TYPES)}, got {kv_dtype!r}")
    if group not in _GROUP:
        raise ValueError(f"group must be one of {sorted(_GROUP)}, got {group!r}")
    q, k, v = (np.asarray(x) for x in (q, k, v))
    single = q.ndim == 3
    if single:
        q, k, v = q[None], k[None], v[None]
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be [n_head, n_q, d] / [n_head_kv, n_kv, d] (or with a leading stream axis)")
    ns, n_head, n_q, d = q.shape
    _, n_head_kv, n_kv, _ = k.shape
    d_v = v.shape[-1]
    if k.shape[0] != ns or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"q {q.shape}, k {k.shape} and v {v.shape} do not match (streams, heads, cells, head dim)")
    cent = _table(centroids, sizes, variances, ns, n_head_kv, d, "centroids")
    cell = _index_map(cell_cluster, (ns, n_head_kv, n_kv), "cell_cluster")
    # the kernels never select a cell of an out-of-range cluster: refuse such maps here, where they are seen
    if ((cell < -1) | (cell >= cent.shape[2])).any() or (cent[..., d] < 0).any():
        raise ValueError("cell_cluster entries must be -1 (not clustered) or a cluster index < n_cent, sizes >= 0")
    coarse_dev = parent = None
    if coarse is not None:
        c_cent, c_sizes, c_parent = coarse[:3]
        c_var = coarse[3] if len(coarse) > 3 else None
        if (c_var is None) != (variances is None):
            raise ValueError("give the variances of both levels (variances and coarse[3]) or of neither")
        coarse_dev = _table(c_cent, c_sizes, c_var, ns, n_head_kv, d, "coarse centroids")
        parent = _index_map(c_parent, (ns, n_head_kv, cent.shape[2]), "parent")
        if ((parent < 0) | (parent >= coarse_dev.shape[2])).any():
            raise ValueError("parent entries must be coarse cluster indices < n_coarse")
    mask_dev, mask_ns = _mask_f16(mask, n_q, n_kv)
    q32 = np.ascontiguousarray(q, dtype=np.float32)
    k_dev, v_dev = _to_kv(k, kv_dtype), _to_kv(v, kv_dtype)
    out = np.zeros((ns, n_q, n_head, d_v), dtype=np.float32)
    params = GgmlCentroidParams(keep=float(keep), threshold_coarse=float(threshold_coarse),
                                group=_GROUP[group], scale=0.0 if scale is None else float(scale),
                                softcap=float(softcap), var_weight=float(var_weight))
    ptr = lambda a: None if a is None else a.ctypes.data
    args = CentroidEvalArgs(device=_device_name(backend), n_threads=int(n_threads or os.cpu_count() or 1),
                            kv_type=_GGML_TYPES[kv_dtype], d=d, d_v=d_v, n_q=n_q, n_head=n_head,
                            n_head_kv=n_head_kv, n_kv=n_kv, ns=ns, mask_ns=mask_ns, n_cent=cent.shape[2],
                            n_coarse=0 if coarse_dev is None else coarse_dev.shape[2], q=ptr(q32), k=ptr(k_dev),
                            v=ptr(v_dev), mask=ptr(mask_dev), cent=ptr(cent), cell=ptr(cell),
                            coarse=ptr(coarse_dev), parent=ptr(parent), params=ctypes.pointer(params), out=ptr(out),
                            table_width=cent.shape[3])
    _call(C.sparq_llama_eval_centroid_attn, args)
    y = np.swapaxes(out, 1, 2).astype(np.float64)  # [ns, n_head, n_q, d_v]
    return y[0] if single else y


# ---- spherical k-means (the clustering of a fixed prefix) --------------------------------------------

def kmeans_cosine(keys: np.ndarray, n_clusters: int, n_iter: int = 8, *, init: str = "even", center: bool = False,
                  weights: np.ndarray | None = None, n_threads: int | None = None,
                  backend: str = "cpu") -> Clusters | list[Clusters]:
    """Spherical k-means as ggml graphs on a backend; semantics and result as `reference_squeeze.kmeans_cosine`
    (problem h of keys [H, P, d] is its `head` h; `center` and `weights` as there, weights [d] for every problem or
    [H, d]). keys [P, d] gives one Clusters, keys [H, P, d] a list of H
    (independent problems, clustered together: they iterate until none changes, so n_iter is the largest any of
    them needed; an unchanged one keeps its result)."""
    x = np.asarray(keys, dtype=np.float32)
    single = x.ndim == 2
    x = x[None] if single else x
    if x.ndim != 3 or min(x.shape) < 1:
        raise ValueError(f"keys must be [P, d] or [H, P, d], got shape {np.shape(keys)}")
    H, P, d = x.shape
    if not isinstance(n_clusters, (int, np.integer)) or not 1 <= n_clusters <= P:
        raise ValueError(f"n_clusters must be an integer in [1, P = {P}], got {n_clusters!r}")
    if not isinstance(n_iter, (int, np.integer)) or n_iter < 1:
        raise ValueError(f"n_iter must be an integer >= 1, got {n_iter!r}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    x = np.ascontiguousarray(x)
    w = None
    if weights is not None:
        if np.shape(weights) not in ((d,), (H, d)):
            raise ValueError(f"weights must be [d] or [H, d] = [{H}, {d}], got shape {np.shape(weights)}")
        w = np.ascontiguousarray(np.broadcast_to(np.asarray(weights, dtype=np.float32), (H, d)))
    table = np.zeros((H, n_clusters, 2 * d + 1), dtype=np.float32)
    assignment = np.zeros((H, P), dtype=np.int32)
    n_run = ctypes.c_int(0)
    args = KmeansEvalArgs(device=_device_name(backend), n_threads=int(n_threads or os.cpu_count() or 1), d=d, P=P, H=H,
                          n_clusters=int(n_clusters), n_iter=int(n_iter), x=x.ctypes.data, table=table.ctypes.data,
                          assignment=assignment.ctypes.data, n_iter_run=ctypes.pointer(n_run),
                          init=INITS.index(init), center=int(bool(center)),
                          weights=None if w is None else w.ctypes.data)
    _call(C.sparq_llama_eval_kmeans, args)
    out = [Clusters(table[h, :, :d].astype(np.float64), table[h, :, d].astype(np.int64),
                    assignment[h].astype(np.int64), n_run.value, table[h, :, d + 1:].astype(np.float64))
           for h in range(H)]
    return out[0] if single else out


def bench_kmeans(*, d: int, P: int, H: int, n_clusters: int, n_iter: int, n_layers: int, init: str = "even",
                 n_threads: int | None = None, backend: str = "cpu") -> tuple[list[float], list[int], np.ndarray]:
    """The clustering of a fixed prefix with its keys already on the backend (sparq_llama_bench_kmeans): per layer
    of n_layers, H problems of P random rows of d components clustered into n_clusters (n_iter iterations at
    most; `init` as kmeans_cosine's). Returns (seconds per layer, iterations each layer ran, phase seconds
    [n_layers, 3]: setup (state, normalising, seeding), iterations (with their read-backs), the table (with its
    read-back))."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    layer_s, iters_out = (ctypes.c_double * n_layers)(), (ctypes.c_int * n_layers)()
    phase_s = (ctypes.c_double * (3 * n_layers))()
    args = KmeansBenchArgs(device=_device_name(backend), n_threads=int(n_threads or os.cpu_count() or 1), d=d, P=P,
                           H=H, n_clusters=n_clusters, n_iter=n_iter, n_layers=n_layers, layer_s=layer_s,
                           iters_out=iters_out, phase_s=phase_s, init=INITS.index(init))
    _call(C.sparq_llama_bench_kmeans, args)
    return list(layer_s), list(iters_out), np.array(phase_s[:]).reshape(n_layers, 3)


def bench_centroid(*, d: int, n_head: int, n_head_kv: int, n_kv: int, n_prefix: int, n_clusters: int, keep: float,
                   n_runs: int = 20, n_threads: int | None = None, kv_dtype: str = "f16",
                   backend: str = "cpu") -> tuple[np.ndarray, np.ndarray, float]:
    """Decode-step times (µs) of ggml_centroid_attn and ggml_flash_attn_ext on the same random cache whose first
    `n_prefix` cells are clustered, each row reading its best clusters up to `keep` of them; `n_runs` interleaved
    runs each after a warm-up. Returns (centroid_us, flash_us, fraction of the clustered cells read)."""
    centroid_us = (ctypes.c_double * n_runs)()
    flash_us = (ctypes.c_double * n_runs)()
    kept = ctypes.c_double(0.0)
    args = CentroidBenchArgs(device=_device_name(backend), n_threads=int(n_threads or os.cpu_count() or 1),
                             kv_type=_GGML_TYPES[kv_dtype], d=d, n_head=n_head, n_head_kv=n_head_kv, n_kv=n_kv,
                             n_prefix=n_prefix, n_clusters=n_clusters, keep=float(keep), n_runs=n_runs,
                             centroid_us=centroid_us, flash_us=flash_us, kept_out=ctypes.pointer(kept))
    _call(C.sparq_llama_bench_centroid, args)
    return np.array(centroid_us[:]), np.array(flash_us[:]), kept.value


# ---- coarse threshold calibration of a two-level prepared prefix (llama_squeeze_prepare's, over arrays) ----

def squeeze_calibrate(q: np.ndarray, table: np.ndarray, *, scale: float, keep: float, group: str = "max",
                      coarse: np.ndarray | None = None, parent: np.ndarray | None = None, keep_coarse: float = 0.0,
                      n_threads: int | None = None, var_weight: float = 0.0) -> tuple[float, float]:
    """The calibration llama_squeeze_prepare runs (two levels: the coarse threshold; the fine level is kept by the op's
    per-row budget and needs none), on arrays: q [L, n_rows, n_head, d] (calibration queries per
    layer), table [L, n_head_kv, n_cent, d + 1 or 2d + 1] (centroids, sizes, then variances); two levels: coarse
    [L, n_head_kv, n_coarse, same width] and parent [L, n_head_kv, n_cent]; var_weight: the kept rule's variance
    term (needs width 2d + 1). Returns (threshold_coarse, the mean share of the clustered cells under the kept coarse
    clusters); one level: (0, 1). Semantics: `reference_squeeze.calibrate_threshold` of the coarse scores at
    keep_coarse (0: min(1, 2 keep)) over every (layer, KV head, row)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    table = np.ascontiguousarray(table, dtype=np.float32)
    if q.ndim != 4 or table.ndim != 4 or q.shape[0] != table.shape[0] or table.shape[3] not in (q.shape[3] + 1,
                                                                                              2 * q.shape[3] + 1):
        raise ValueError(f"q must be [L, n_rows, n_head, d] and table [L, n_head_kv, n_cent, d + 1 or 2d + 1], got "
                         f"{q.shape} and {table.shape}")
    if (coarse is None) != (parent is None):
        raise ValueError("coarse and parent go together (two levels)")
    n_layers, n_rows, n_head, d = q.shape
    n_coarse = 0
    if coarse is not None:
        coarse = np.ascontiguousarray(coarse, dtype=np.float32)
        parent = np.ascontiguousarray(parent, dtype=np.int32)
        n_coarse = coarse.shape[2]
    tc, kept = ctypes.c_float(), ctypes.c_float()
    args = SqueezeCalibArgs(d=d, n_head=n_head, n_head_kv=table.shape[1], n_rows=n_rows, n_layers=n_layers,
                            n_cent=table.shape[2], n_coarse=n_coarse, q=q.ctypes.data, table=table.ctypes.data,
                            coarse=None if coarse is None else coarse.ctypes.data,
                            parent=None if parent is None else parent.ctypes.data, scale=float(scale),
                            group=_GROUP[group], keep=float(keep), keep_coarse=float(keep_coarse),
                            n_threads=int(n_threads or os.cpu_count() or 1), threshold_coarse=ctypes.pointer(tc),
                            kept=ctypes.pointer(kept),
                            table_width=table.shape[3], var_weight=float(var_weight))
    _call(C.sparq_llama_eval_squeeze_calibrate, args)
    return tc.value, kept.value
