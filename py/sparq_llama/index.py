"""SparQ's index: the transposed key copy (K^T) that the approximate scores read, and how its k1 components are
chosen (docs/design.md, "SparQ: op semantics").

The q8 index stores each component row of K^T in ggml's q8_0 blocks: 32 cells share one f16 scale
d = max|x| / 127, and each cell holds round(x / d) as int8 (half away from zero), so a value reads back as
f32(d) * q. That is 34 bytes per 32 values against 64 for f16: twice the components for the same bytes.

The q4 index holds every key component in 4 bits: per KV head, blocks of 32 cells, each component's 32 values in
ggml's q4_0 (scale s = the value of largest magnitude / -8, nibbles n = min(15, trunc(x / s + 8.5)), reading back
(n - 8) * f32(s)), laid out cell by cell so that one cell's components sit side by side for integer dot products.
A block of head dim d is 18*d bytes: bytes [0, 16d) the nibbles as little-endian u32 words, word k (k < d/8) of cell
c at byte 4*(32*k + c), its byte t holding component 8k + t in the low nibble and 8k + 4 + t in the high one; bytes
[16d, 18d) the d f16 scales. Its scores are integer dot products (`q4_block_scores`): per query head and block,
the products w_i = q_i * s_i rounded to int8 with one scale m / 127 (m = max |w_i|), against the nibbles less 8.
"""
from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .sparq import INDEXES, Q4_BLOCK, Q4_DIM_BYTES, Q8_BLOCK, Q8_BLOCK_BYTES, SELECTS

__all__ = ["INDEXES", "SELECTS", "Q8_BLOCK", "Q8_BLOCK_BYTES", "Q4_BLOCK", "Q4_DIM_BYTES", "q8_0_quantize",
           "q8_0_dequantize", "q8_0_bytes", "q8_index_values", "q4_0_quantize", "q4_0_dequantize",
           "q4_index_quantize", "q4_index_dequantize", "q4_index_pack", "q4_index_unpack", "q4_index_bytes",
           "q4_index_values", "q4_block_scores", "q4_scores"]

Q4_WORD = 8  # components per u32 nibble word of a cell


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


# ---------------------------------------------------------------------------------------------------
# The q4 index


def q4_0_quantize(x: NDArray) -> tuple[NDArray[np.float16], NDArray[np.uint8]]:
    """Rows of x (last axis, a multiple of 32) as ggml's q4_0 blocks: scales [..., n/32] f16 and nibbles
    [..., n/32, 32] uint8 (0..15). Per block, as ggml's reference quantizer in f32: s = the first value of largest
    magnitude / -8 (an all-zero block: +0 / -8 = -0, as ggml's loop from max = 0 gives it), id = 1/s (0 when s is
    0), n = min(15, trunc(x*id + 8.5)); the nibbles come from the f32 s, the stored scale is f16(s)."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % Q4_BLOCK != 0:
        raise ValueError(f"q4_0 rows must hold a multiple of {Q4_BLOCK} values, got {x.shape[-1]}")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // Q4_BLOCK, Q4_BLOCK)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)  # first largest |x|
    # an all-zero block keeps ggml's initial +0 (its scale is then -0, whatever the zeros' signs)
    extreme = np.where(extreme != 0, extreme, np.float32(0.0))
    s = extreme / np.float32(-8.0)
    inv = np.divide(np.float32(1.0), s, out=np.zeros_like(s), where=s != 0)
    nib = np.minimum(np.float32(15.0), np.trunc(blocks * inv + np.float32(8.5)))
    return s[..., 0].astype(np.float16), nib.astype(np.uint8)


def q4_0_dequantize(scales: NDArray[np.float16], nibbles: NDArray[np.uint8]) -> NDArray[np.float32]:
    """The values q4_0 blocks read back as: (n - 8) * f32(scale), rows flattened back to [..., n]."""
    y = scales.astype(np.float32)[..., None] * (nibbles.astype(np.float32) - np.float32(8.0))
    return y.reshape(*y.shape[:-2], y.shape[-2] * Q4_BLOCK)


def q4_index_quantize(keys: NDArray) -> tuple[NDArray[np.float16], NDArray[np.uint8]]:
    """The q4 index of keys [..., n_kv, d] (as f32; the cells past n_kv count as zero keys): per block of 32 cells
    each component's q4_0 quantization over them. Returns the scales [..., nb, d] f16 and the nibbles
    [..., nb, 32, d] uint8 (cell by cell, as the keys), nb = ceil(n_kv / 32)."""
    k = np.asarray(keys, dtype=np.float32)
    if k.ndim < 2:
        raise ValueError(f"keys must be [..., n_kv, d], got shape {k.shape}")
    n_kv, d = k.shape[-2:]
    k = np.pad(k, [(0, 0)] * (k.ndim - 2) + [(0, -n_kv % Q4_BLOCK), (0, 0)])
    blocks = k.reshape(*k.shape[:-2], -1, Q4_BLOCK, d)           # [..., nb, 32, d]
    scales, nib = q4_0_quantize(np.swapaxes(blocks, -1, -2))      # rows: a component's 32 cells
    return scales[..., 0], np.swapaxes(nib[..., 0, :], -1, -2)


def q4_index_dequantize(scales: NDArray[np.float16], nibbles: NDArray[np.uint8],
                        n_kv: int | None = None) -> NDArray[np.float32]:
    """The keys a q4 index (scales [..., nb, d], nibbles [..., nb, 32, d]) reads back as: (n - 8) * f32(s),
    [..., n_kv, d] (n_kv None: all nb*32 cells)."""
    y = (nibbles.astype(np.float32) - np.float32(8.0)) * scales.astype(np.float32)[..., None, :]
    y = y.reshape(*y.shape[:-3], -1, y.shape[-1])
    return y if n_kv is None else y[..., :n_kv, :]


def q4_index_pack(scales: NDArray[np.float16], nibbles: NDArray[np.uint8]) -> NDArray[np.uint8]:
    """The q4 index's bytes: per block (scales [..., nb, d], nibbles [..., nb, 32, d]) 18*d bytes, the nibble words
    of the 32 cells then the d f16 scales (module doc). Returns uint8 [..., nb, 18*d]; d must be a multiple of 8."""
    *lead, nb, cells, d = nibbles.shape
    if cells != Q4_BLOCK or d % Q4_WORD != 0 or scales.shape != (*lead, nb, d):
        raise ValueError(f"a q4 index needs nibbles [..., nb, {Q4_BLOCK}, d] with d a multiple of {Q4_WORD} and "
                         f"scales [..., nb, d], got {nibbles.shape} and {scales.shape}")
    n = nibbles.astype(np.uint8).reshape(*lead, nb, Q4_BLOCK, d // Q4_WORD, 2, Q4_WORD // 2)
    words = n[..., 0, :] | (n[..., 1, :] << np.uint8(4))          # [..., nb, 32 cells, d/8 words, 4 bytes]
    words = np.swapaxes(words, -3, -2).reshape(*lead, nb, 16 * d)   # word k of cell c at byte 4*(32k + c)
    scale_bytes = np.ascontiguousarray(scales, dtype=np.float16).view(np.uint8).reshape(*lead, nb, 2 * d)
    return np.ascontiguousarray(np.concatenate([words, scale_bytes], axis=-1))


def q4_index_unpack(blocks: NDArray[np.uint8]) -> tuple[NDArray[np.float16], NDArray[np.uint8]]:
    """The scales [..., nb, d] f16 and nibbles [..., nb, 32, d] uint8 of q4 index bytes [..., nb, 18*d]."""
    raw = np.asarray(blocks, dtype=np.uint8)
    if raw.shape[-1] % (Q4_DIM_BYTES * Q4_WORD) != 0:
        raise ValueError(f"a q4 index block is {Q4_DIM_BYTES}*d bytes with d a multiple of {Q4_WORD}, got "
                         f"{raw.shape[-1]} bytes")
    d = raw.shape[-1] // Q4_DIM_BYTES
    lead = raw.shape[:-1]
    scales = np.ascontiguousarray(raw[..., 16 * d:]).view(np.float16)
    words = raw[..., :16 * d].reshape(*lead, d // Q4_WORD, Q4_BLOCK, Q4_WORD // 2)
    words = np.swapaxes(words, -3, -2)                              # [..., 32 cells, d/8 words, 4 bytes]
    nib = np.stack([words & np.uint8(15), words >> np.uint8(4)], axis=-2)
    return scales, nib.reshape(*lead, Q4_BLOCK, d)


def q4_index_bytes(keys: NDArray) -> NDArray[np.uint8]:
    """The q4 index of keys [..., n_kv, d] as its bytes, uint8 [..., ceil(n_kv/32), 18*d]."""
    return q4_index_pack(*q4_index_quantize(keys))


def q4_index_values(keys: NDArray) -> NDArray[np.float64]:
    """What a q4 index holds for keys [n_kv, d] (or [..., n_kv, d]): the keys (as f32) quantized per block of 32
    cells and component, read back; float64 shaped as the keys."""
    k = np.asarray(keys)
    return q4_index_dequantize(*q4_index_quantize(k), n_kv=k.shape[-2]).astype(np.float64)


def q4_block_scores(q: NDArray, scales: NDArray[np.float16], nibbles: NDArray[np.uint8]) -> NDArray[np.float32]:
    """The q4 index's approximate scores of query heads q [G, d] (rounded to f32, as the op gets them) over the
    blocks (scales [nb, d], nibbles [nb, 32, d]): float32 [G, nb*32], in float32 arithmetic as the op computes them.

    Per head and block: w_i = f32(q_i * f32(s_i)), m = max_i |w_i|; m = 0: the block's cells score 0; else
    inv = f32(127/m), C = f32(m/127), a_i = rint(f32(w_i * inv)) (half to even), A = sum_i a_i, and cell c scores
    f32(C * f32(sum_i a_i*n_i,c - 8*A)), the sum an exact integer."""
    qf = np.asarray(q, dtype=np.float32)
    if qf.ndim != 2 or scales.ndim != 2 or nibbles.shape != (scales.shape[0], Q4_BLOCK, scales.shape[1]) or \
            qf.shape[1] != scales.shape[1]:
        raise ValueError(f"need q [G, d], scales [nb, d] and nibbles [nb, {Q4_BLOCK}, d], got {qf.shape}, "
                         f"{scales.shape} and {nibbles.shape}")
    w = qf[:, None, :] * scales.astype(np.float32)[None]             # [G, nb, d] f32 products
    m = np.abs(w).max(axis=-1, keepdims=True)                       # [G, nb, 1]
    live = m > 0
    safe_m = np.where(live, m, np.float32(1.0))
    inv = np.float32(127.0) / safe_m
    c = safe_m / np.float32(127.0)
    a = np.rint(w * inv)                                            # int8 coefficients, exact in f32
    a_sum = a.sum(axis=-1, dtype=np.float64)                        # [G, nb], |A| <= 127 d: exact
    # sum_i a_i n_i,c in float64: integers below 2^53, so the matmul is exact
    dots = np.einsum("gbd,bcd->gbc", a.astype(np.float64), nibbles.astype(np.float64), optimize=True)
    dots = dots - 8.0 * a_sum[..., None]                            # |dot| <= 1016 d: exact in f32 too
    out = np.where(live, c * dots.astype(np.float32), np.float32(0.0))
    return out.reshape(qf.shape[0], -1).astype(np.float32)


def q4_scores(q: NDArray, keys: NDArray) -> NDArray[np.float32]:
    """The q4 index's approximate scores [G, n_kv] of query heads q [G, d] over keys [n_kv, d] (`q4_block_scores`
    over the keys' q4 index)."""
    k = np.asarray(keys)
    return q4_block_scores(q, *q4_index_quantize(k))[:, :k.shape[0]]
