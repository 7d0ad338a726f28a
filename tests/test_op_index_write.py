"""ggml_sparq_index_write (the index blocks a ubatch's new keys fall in, recomputed from the cache) against the keys it
derives from: each written block holds its cells' key components (times the mask) converted to the index type, and
every other byte of the index is as it was.

Float index types hold the converted values exactly (quantized keys: up to the backends' rounding of the
dequantization). A q8_0 block is checked as the model tests check it: each value within half a quantization step of
its key, the block's largest value at 127 steps (its own scale), to the rounding of the f16 scale: ggml's CPU
quantizer and the CUDA one (compiled with fast math) may differ by one step where a value sits on a rounding tie.

The shapes cover what the CUDA kernel splits by: component counts that leave a partial warp of 32 lanes (72, 33) or a
partial block of 128 threads (160, 1056), several streams written from s0 > 0, masks with empty cells and blocks with
no occupied cell. The CUDA kernel runs the same cases in tests/test_op_sparq_attn_cuda.py, compared with the CPU too.
"""
from __future__ import annotations

import numpy as np
import pytest
from sparq_llama import ops
from sparq_llama.index import Q4_BLOCK, Q8_BLOCK, Q8_BLOCK_BYTES, q4_index_bytes

INDEX_WRITE_CASES = [
    # (kt_dtype, kv_dtype, n_embd, kv_size, n_stream, s0, ns, n_blk, masked)
    ("q8_0", "f16", 128, 96, 1, 0, 1, 1, False),   # a decode step of one stream: one block
    ("q8_0", "f16", 72, 128, 2, 1, 1, 3, True),    # a partial warp
    ("q8_0", "f32", 160, 64, 3, 0, 3, 2, True),    # a partial block of threads, three streams
    ("q8_0", "q8_0", 256, 128, 2, 0, 2, 4, False),
    ("q8_0", "q4_1", 96, 64, 1, 0, 1, 2, True),
    ("q8_0", "bf16", 1056, 256, 1, 0, 1, 8, True),
    ("f16", "f16", 72, 40, 2, 0, 2, 7, True),
    ("f16", "q5_0", 64, 40, 1, 0, 1, 5, False),
    ("bf16", "f32", 33, 20, 1, 0, 1, 4, True),
    ("f32", "q4_0", 128, 20, 2, 1, 1, 6, True),
]
FLOAT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def index_write_case(case: tuple, seed: int):
    """The op's inputs for a case: an index of random values, keys spread over several binades, per stream written
    n_blk distinct blocks of random cells (any stream's), a 0/1 mask (one block with no occupied cell)."""
    kt_dtype, kv_dtype, n_embd, kv_size, n_stream, s0, ns, n_blk, masked = case[:9]
    rng = np.random.default_rng(seed)
    B = Q8_BLOCK if kt_dtype == "q8_0" else Q4_BLOCK if kt_dtype == "q4" else 1
    row_len = -(-kv_size // B) * B
    kt = rng.normal(0.0, 2.0, (n_stream, n_embd, row_len)).astype(np.float32)
    k = (rng.normal(0.0, 1.0, (n_stream, kv_size, n_embd)) *
         np.exp2(rng.integers(-6, 6, (n_stream, kv_size, n_embd)))).astype(np.float32)
    blk = np.stack([rng.choice(row_len // B, n_blk, replace=False) for _ in range(ns)]).astype(np.int64)
    cells = rng.integers(0, kv_size * n_stream, ns * n_blk * B).astype(np.int32)
    mask = None
    if masked:
        mask = (rng.random(cells.shape) < 0.7).astype(np.float32)
        mask[:B] = 0.0
    return kt, k, cells, blk, mask


def index_values(raw: np.ndarray, kt_dtype: str, row_len: int) -> np.ndarray:
    """An index's bytes [..., row bytes] read back as float64 [..., row_len]."""
    if kt_dtype == "q8_0":
        blocks = raw.reshape(*raw.shape[:-1], row_len // Q8_BLOCK, Q8_BLOCK_BYTES)
        scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float64)
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float64)
        return (q * scale).reshape(*raw.shape[:-1], row_len)
    if kt_dtype == "bf16":
        return (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return raw.view(np.float32 if kt_dtype == "f32" else np.float16).astype(np.float64)


def check_index_write(got: np.ndarray, case: tuple, kt, k, cells, blk, mask) -> None:
    """The op's result `got` (ops.index_write's bytes) against the keys: written blocks, and everything else as the
    index was before the op."""
    kt_dtype, kv_dtype, n_embd, kv_size, n_stream, s0, ns, n_blk, _ = case
    B = Q8_BLOCK if kt_dtype == "q8_0" else 1
    row_len = kt.shape[2]
    blk_bytes = Q8_BLOCK_BYTES if kt_dtype == "q8_0" else FLOAT_BYTES[kt_dtype]
    raw_before = ops.index_bytes(kt, kt_dtype)
    keys = ops.kv_round(k, kv_dtype).reshape(n_stream * kv_size, n_embd)
    written = np.zeros(got.shape, dtype=bool)
    for j in range(ns):
        for b in range(n_blk):
            t = j * n_blk + b
            sel = cells[t * B:(t + 1) * B]
            x = keys[sel].T * (1.0 if mask is None else mask[t * B:(t + 1) * B])  # [n_embd, B]
            s, first = s0 + j, int(blk[j, b]) * B
            written[s, :, int(blk[j, b]) * blk_bytes:(int(blk[j, b]) + 1) * blk_bytes] = True
            vals = index_values(np.ascontiguousarray(got[s]), kt_dtype, row_len)[:, first:first + B]
            where = f"stream {s} block {int(blk[j, b])}"
            if kt_dtype == "q8_0":
                d = np.abs(x).max(axis=1, keepdims=True) / 127.0
                err = np.abs(vals - x)
                assert (err <= 0.5 * d * (1 + 2e-3) + np.abs(x) * 2e-3 + 1e-9).all(), (
                    f"{where}: q8_0 values off the keys by {(err / np.maximum(d, 1e-30)).max():.3g} steps")
                assert np.allclose(np.abs(vals).max(axis=1, keepdims=True), 127 * d, rtol=2e-3, atol=1e-9), (
                    f"{where}: the q8_0 scales are not the blocks' own")
            else:
                want = index_values(ops.index_bytes(x, kt_dtype), kt_dtype, B)
                if kv_dtype in ("f32", "f16", "bf16"):
                    np.testing.assert_array_equal(vals, want, err_msg=where)
                else:  # dequantized keys: a backend may fuse the block's scale and offset (one rounding)
                    np.testing.assert_allclose(vals, want, rtol=2.0 ** -7 if kt_dtype == "bf16" else 1e-3, atol=0,
                                               err_msg=where)
    assert np.array_equal(got[~written], raw_before[~written]), "bytes outside the written blocks changed"


@pytest.mark.parametrize("seed", range(len(INDEX_WRITE_CASES)),
                         ids=["-".join(map(str, c)) for c in INDEX_WRITE_CASES])
def test_index_write_holds_the_keys_of_its_cells(seed):
    case = INDEX_WRITE_CASES[seed]
    kt, k, cells, blk, mask = index_write_case(case, seed)
    got = ops.index_write(kt, k, cells, blk, mask=mask, s0=case[5], kt_dtype=case[0], kv_dtype=case[1], n_threads=2)
    check_index_write(got, case, kt, k, cells, blk, mask)


# The q4 index: (kt_dtype, kv_dtype, n_embd, kv_size, n_stream, s0, ns, n_blk, masked, head_dim). Every KV head's block
# of a written block of cells; head dims a whole number of the quantized K types' blocks.
Q4_WRITE_CASES = [
    ("q4", "f16", 128, 96, 1, 0, 1, 1, False, 64),    # a decode step of one stream: one block, two heads
    ("q4", "f16", 72, 128, 2, 1, 1, 3, True, 8),     # nine heads of 8 components (one nibble word a cell)
    ("q4", "f32", 160, 64, 3, 0, 3, 2, True, 80),    # three streams; a head dim not a multiple of 32
    ("q4", "q8_0", 256, 128, 2, 0, 2, 4, False, 128),
    ("q4", "q4_1", 96, 64, 1, 0, 1, 2, True, 32),
    ("q4", "bf16", 1024, 256, 1, 0, 1, 8, True, 256),
    ("q4", "q5_0", 64, 40, 2, 1, 1, 2, True, 64),    # kv_size 40: the row's last block partly past the cache
    ("q4", "q4_0", 128, 20, 2, 0, 2, 1, True, 64),
]


def q4_index_after(kt, k, cells, blk, mask, kv_dtype: str, s0: int, head_dim: int) -> np.ndarray:
    """The q4 index [n_stream, row_len/32, n_head_kv, 18*head_dim] the op must leave: the index before it
    (`ops.index_bytes`), each written block replaced by the q4 blocks of its 32 cells' keys (as the cache holds them,
    times the mask), head by head (`sparq_llama.index.q4_index_bytes`)."""
    n_stream, n_embd, _ = kt.shape
    ns, n_blk = blk.shape
    want = ops.index_bytes(kt, "q4", head_dim=head_dim).copy()
    keys = ops.kv_round(k, kv_dtype).reshape(-1, n_embd)
    for j in range(ns):
        for b in range(n_blk):
            t = j * n_blk + b
            x = keys[cells[t * Q4_BLOCK:(t + 1) * Q4_BLOCK]]                       # [32 cells, n_embd]
            if mask is not None:
                x = x * mask[t * Q4_BLOCK:(t + 1) * Q4_BLOCK, None]
            per_head = np.swapaxes(x.reshape(Q4_BLOCK, n_embd // head_dim, head_dim), 0, 1)  # [heads, 32, d]
            want[s0 + j, int(blk[j, b])] = q4_index_bytes(per_head.astype(np.float32))[:, 0]
    return want


@pytest.mark.parametrize("seed", range(len(Q4_WRITE_CASES)), ids=["-".join(map(str, c)) for c in Q4_WRITE_CASES])
def test_q4_index_write_holds_the_q4_blocks_of_its_cells(seed):
    case = Q4_WRITE_CASES[seed]
    kt, k, cells, blk, mask = index_write_case(case, 100 + seed)
    kv_dtype, s0, head_dim = case[1], case[5], case[9]
    got = ops.index_write(kt, k, cells, blk, mask=mask, s0=s0, kt_dtype="q4", kv_dtype=kv_dtype, head_dim=head_dim,
                          n_threads=2)
    assert got.shape == (kt.shape[0], kt.shape[2] // Q4_BLOCK, kt.shape[1] // head_dim, 18 * head_dim)
    want = q4_index_after(kt, k, cells, blk, mask, kv_dtype, s0, head_dim)
    written = np.zeros(got.shape[:2], dtype=bool)
    written[s0 + np.arange(blk.shape[0])[:, None], blk] = True
    assert np.array_equal(got[~written], want[~written]), "bytes outside the written blocks changed"
    for s, b in zip(*np.nonzero(written)):
        np.testing.assert_array_equal(got[s, b], want[s, b], err_msg=f"stream {s} block {b}")
    if mask is not None:  # the fully masked block: every component's scale -0 (ggml's q4_0 of zeros), nibbles 8
        zero = got[s0, int(blk[0, 0])]
        assert np.all(zero[:, :16 * head_dim] == 0x88)
        assert np.all(zero[:, 16 * head_dim:].copy().view(np.uint16) == 0x8000)


def test_q4_index_write_needs_its_head_dim():
    case = Q4_WRITE_CASES[1]
    kt, k, cells, blk, mask = index_write_case(case, 101)
    with pytest.raises(ValueError, match="head_dim"):
        ops.index_write(kt, k, cells, blk, mask=mask, s0=1, kt_dtype="q4", kv_dtype="f16")
    with pytest.raises(ValueError, match="head_dim"):
        ops.index_write(kt, k, cells, blk, mask=mask, s0=1, kt_dtype="q4", kv_dtype="f16", head_dim=7)
    with pytest.raises(ValueError, match="head_dim"):
        ops.index_write(kt, k, cells, blk, mask=mask, s0=1, kt_dtype="q8_0", kv_dtype="f16", head_dim=8)
    with pytest.raises(ValueError, match="multiple of 8"):  # 72 = 6 * 12: heads of 12 components cannot be packed
        ops.index_write(kt, k, cells, blk, mask=mask, s0=1, kt_dtype="q4", kv_dtype="f16", head_dim=12)


def test_index_write_rejects_blocks_and_cells_outside_the_tensors():
    case = INDEX_WRITE_CASES[1]
    kt, k, cells, blk, mask = index_write_case(case, seed=1)
    with pytest.raises(ValueError, match="not a block of kt's rows"):
        ops.index_write(kt, k, cells, blk + kt.shape[2], mask=mask, s0=1, kv_dtype="f16")
    bad = cells.copy()
    bad[5] = k.shape[0] * k.shape[1]
    with pytest.raises(ValueError, match="not a row of k"):
        ops.index_write(kt, k, bad, blk, mask=mask, s0=1, kv_dtype="f16")
    with pytest.raises(ValueError, match="s0"):
        ops.index_write(kt, k, cells, blk, mask=mask, s0=2, kv_dtype="f16")
