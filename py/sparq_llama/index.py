"""SparQ's index: the transposed key copy (K^T) that the approximate scores read, and how its k1 components are
chosen (docs/design.md, "SparQ: op semantics").

The q8 index stores each component row of K^T in ggml's q8_0 blocks: 32 cells share one f16 scale
d = max|x| / 127, and each cell holds round(x / d) as int8 (half away from zero), so a value reads back as
f32(d) * q. That is 34 bytes per 32 values against 64 for f16: twice the components for the same bytes.
"""
from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .sparq import INDEXES, Q8_BLOCK, Q8_BLOCK_BYTES, SELECTS

__all__ = ["INDEXES", "SELECTS", "Q8_BLOCK", "Q8_BLOCK_BYTES", "q8_0_quantize", "q8_0_dequantize", "q8_0_bytes",
           "q8_index_values"]


def q8_0_quantize(x: NDArray) -> tuple[NDArray[np.float16], NDArray[np.int8]]:
    """Rows of x (last axis, a multiple of 32) as q8_0 blocks: scales [..., n/32] f16, values [..., n/32, 32] i8.
    The arithmetic is f32, as ggml's reference quantizer does it."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % Q8_BLOCK != 0:
        raise ValueError(f"q8_0 rows must hold a multiple of {Q8_BLOCK} values, got {x.shape[-1]}")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // Q8_BLOCK, Q8_BLOCK)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = amax / np.float32(127.0)
    inv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d > 0)
    scaled = blocks * inv
    q = np.trunc(scaled + np.copysign(np.float32(0.5), scaled)).astype(np.int8)  # roundf: half away from zero
    return d[..., 0].astype(np.float16), q


def q8_0_dequantize(scales: NDArray[np.float16], q: NDArray[np.int8]) -> NDArray[np.float32]:
    """The values q8_0 blocks read back as: f32(scale) * q, rows flattened back to [..., n]."""
    y = scales.astype(np.float32)[..., None] * q.astype(np.float32)
    return y.reshape(*y.shape[:-2], y.shape[-2] * Q8_BLOCK)


def q8_0_bytes(scales: NDArray[np.float16], q: NDArray[np.int8]) -> NDArray[np.uint8]:
    """ggml's block_q8_0 memory layout of the blocks: per block the f16 scale, then its 32 int8 values."""
    nb = scales.shape[-1]
    out = np.empty((*scales.shape, Q8_BLOCK_BYTES), dtype=np.uint8)
    out[..., :2] = np.ascontiguousarray(scales).view(np.uint8).reshape(*scales.shape, 2)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(*scales.shape[:-1], nb * Q8_BLOCK_BYTES)


def q8_index_values(keys: NDArray) -> NDArray[np.float64]:
    """What a q8 index holds for keys [n_kv, d]: each component row of K^T (the keys as f32) quantized in blocks of
    32 cells (the last block padded with zeros), read back; returned as [n_kv, d] like the keys."""
    k = np.asarray(keys, dtype=np.float32)
    n_kv = k.shape[0]
    n_pad = -n_kv % Q8_BLOCK
    kt = np.pad(k.T, ((0, 0), (0, n_pad)))
    return q8_0_dequantize(*q8_0_quantize(kt))[:, :n_kv].T.astype(np.float64)
