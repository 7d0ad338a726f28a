"""ggml_sparq_vsum_rows (a decode step's running V sums in one node) and ggml_sparq_kstat_rows (the same op with the
keys' squares, over the keys as the cache holds them: the running key statistics) against their float64 oracles.

The op's column t is table[idx[t]] + [round(v[t]), 1] per KV head, with v rounded to the cache's type, and is
written back into table[idx[t]] (the rows are distinct: a decode step's one token per sequence); each component is
one float32 addition of two float32 values, so the float64 oracle rounded to float32 is exact and the comparison
is bit for bit. The key statistics read each token's keys from the cache (row cells[t] of k, dequantized); the
squares of f16 and bf16 keys are exact in float32, so their statistics are too; for f32 and quantized keys the square
is one more rounding, and a compiler may fuse it with the addition (1 ulp). The CUDA kernel runs the same cases in
tests/test_op_sparq_attn_cuda.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from sparq_llama import ops

VSUM_CASES = [
    # (n_seq, n_head_kv, d_v, n_tokens, v_ld, v_dtype)
    (1, 1, 64, 1, None, "f16"),
    (4, 8, 128, 4, None, "f16"),
    (3, 4, 64, 3, 200, "f16"),      # v as a strided view (a fused QKV projection's V part)
    (16, 2, 80, 16, None, "bf16"),
    (5, 3, 256, 2, 300, "bf16"),
    (2, 32, 128, 2, None, "f32"),
    (7, 1, 1, 5, 4, "f16"),
    (9, 5, 96, 9, None, "f16"),
]


def vsum_case(rng: np.random.Generator, n_seq: int, n_head_kv: int, d_v: int, n_tokens: int):
    """A table of running sums (large values, integer counts), values spread over several binades (so the
    rounding to f16 / bf16 matters), and each token's own row (a decode step: distinct rows)."""
    table = rng.normal(0.0, 300.0, (n_seq, n_head_kv, d_v + 1)).astype(np.float32)
    table[..., d_v] = rng.integers(0, 50000, (n_seq, n_head_kv))
    v = (rng.normal(0.0, 1.0, (n_tokens, n_head_kv, d_v)) * np.exp2(rng.integers(-8, 8, (n_tokens, n_head_kv, d_v))))
    idx = rng.permutation(n_seq)[:n_tokens].astype(np.int32)
    return table, v.astype(np.float32), idx


def vsum_rows_reference(table: np.ndarray, v: np.ndarray, idx: np.ndarray, v_dtype: str = "f16") -> np.ndarray:
    """float64 oracle of `ops.vsum_rows`: table[idx] + [kv_round(v), 1] per KV head."""
    tab = np.asarray(table, dtype=np.float32).astype(np.float64)
    aug = np.concatenate([ops.kv_round(np.asarray(v, dtype=np.float32), v_dtype),
                          np.ones(np.shape(v)[:2] + (1,))], axis=-1)
    return tab[np.asarray(idx)] + aug


def expected(table, v, idx, v_dtype):
    return vsum_rows_reference(table, v, idx, v_dtype).astype(np.float32)


def written_back(table: np.ndarray, rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The table as the op leaves it: the result's columns in their rows, every other row untouched."""
    out = np.array(table, dtype=np.float32, copy=True)
    out[np.asarray(idx)] = rows
    return out


@pytest.mark.parametrize("case", VSUM_CASES, ids=lambda c: "-".join(map(str, c)))
def test_vsum_rows_equals_reference_bit_for_bit(case):
    n_seq, n_head_kv, d_v, n_tokens, v_ld, v_dtype = case
    rng = np.random.default_rng(n_seq * 1000 + d_v)
    table, v, idx = vsum_case(rng, n_seq, n_head_kv, d_v, n_tokens)
    got, table_after = ops.vsum_rows(table, v, idx, v_dtype=v_dtype, v_ld=v_ld, n_threads=2)
    want = expected(table, v, idx, v_dtype)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(table_after, written_back(table, want, idx))


def test_rounding_follows_the_cache_type():
    # values between two f16 (and bf16) numbers: the sums must take the rounded value, not the float32 one
    table = np.zeros((1, 1, 5), dtype=np.float32)
    v = np.array([[[1.0 + 2.0**-12, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-9, -3.0 - 2.0**-12]]], dtype=np.float32)
    idx = np.array([0], dtype=np.int32)
    f16, _ = ops.vsum_rows(table, v, idx, v_dtype="f16")
    np.testing.assert_array_equal(f16[0, 0, :3], [1.0, 1.0 + 2.0**-9, 1.0 + 2.0**-9])  # ties to even, exact
    bf16, _ = ops.vsum_rows(table, v, idx, v_dtype="bf16")
    np.testing.assert_array_equal(bf16[0, 0, :3], [1.0, 1.0, 1.0])
    f32, _ = ops.vsum_rows(table, v, idx, v_dtype="f32")
    np.testing.assert_array_equal(f32[0, 0, :3], v[0, 0, :3])
    for out in (f16, bf16, f32):
        assert out[0, 0, 4] == 1.0  # the count


def test_repeated_rows_are_refused():
    # the op writes each token's row back, so two tokens of one sequence would race for it: the evaluation refuses
    # them (llama's graph uses the op only for decode steps, one token per sequence)
    rng = np.random.default_rng(7)
    table, v, _ = vsum_case(rng, 3, 2, 64, 4)
    with pytest.raises(ValueError, match="distinct"):
        ops.vsum_rows(table, v, np.array([1, 2, 0, 1], dtype=np.int32), v_dtype="f16", n_threads=2)
    with pytest.raises(ValueError, match="distinct"):
        ops.kstat_rows(np.concatenate([table[..., :64], table], axis=-1), v.reshape(1, 4, 128), np.arange(4),
                       np.array([0, 0, 1, 2], dtype=np.int32))


def test_bad_arguments_fail_clearly():
    rng = np.random.default_rng(3)
    table, v, idx = vsum_case(rng, 2, 2, 8, 2)
    with pytest.raises(ValueError, match="not a table row"):
        ops.vsum_rows(table, v, np.array([0, 2], dtype=np.int32))
    with pytest.raises(ValueError, match="not a table row"):
        ops.vsum_rows(table, v, np.array([-1, 0], dtype=np.int32))
    with pytest.raises(ValueError, match="shapes do not agree"):
        ops.vsum_rows(table[..., :-1], v, idx)
    with pytest.raises(ValueError, match="v_dtype"):
        ops.vsum_rows(table, v, idx, v_dtype="q8_0")
    with pytest.raises(ValueError, match="v_ld"):
        ops.vsum_rows(table, v, idx, v_ld=4)


KSTAT_CASES = [
    # (n_seq, n_head_kv, d, n_tokens, kv_size, n_stream, kv_dtype)
    (1, 1, 64, 1, 8, 1, "f16"),
    (4, 8, 128, 4, 40, 1, "f16"),
    (3, 4, 64, 3, 16, 2, "f16"),     # rows of two streams
    (16, 2, 80, 16, 20, 1, "bf16"),
    (5, 3, 256, 2, 7, 3, "bf16"),
    (2, 32, 128, 2, 4, 1, "f32"),
    (7, 1, 1, 5, 9, 1, "f16"),
    (9, 5, 96, 9, 12, 1, "f16"),
    (4, 2, 128, 3, 10, 2, "q8_0"),   # quantized caches: the keys as stored are their blocks dequantized
    (3, 4, 64, 3, 6, 1, "q4_0"),
    (2, 1, 32, 2, 5, 1, "q5_1"),
]


def kstat_rows_reference(table: np.ndarray, k: np.ndarray, cells: np.ndarray, idx: np.ndarray,
                         kv_dtype: str = "f16") -> np.ndarray:
    """float64 oracle of `ops.kstat_rows`: table[idx] + [r, r*r, 1] per KV head, r the cache's rows cells as stored
    (kv_round), r*r in float32."""
    n_seq, n_head_kv, width = np.shape(table)
    d = (width - 1) // 2
    stored = ops.kv_round(np.asarray(k, dtype=np.float32), kv_dtype).reshape(-1, n_head_kv, d)
    r = stored[np.asarray(cells)].astype(np.float32)
    sq = (r * r).astype(np.float32)
    aug = np.concatenate([r.astype(np.float64), sq.astype(np.float64), np.ones(r.shape[:2] + (1,))], axis=-1)
    return (np.asarray(table, dtype=np.float32).astype(np.float64)[np.asarray(idx)] + aug).astype(np.float32)


def kstat_case(rng: np.random.Generator, n_seq: int, n_head_kv: int, d: int, n_tokens: int, kv_size: int,
               n_stream: int):
    """A table of running sums, sums of squares (non-negative) and counts; a cache of keys spread over several
    binades [n_stream, kv_size, n_head_kv * d]; each token's own cache row (distinct, any stream) and table row."""
    table, _, idx = vsum_case(rng, n_seq, n_head_kv, d, n_tokens)
    sq = np.abs(rng.normal(0.0, 3000.0, (n_seq, n_head_kv, d))).astype(np.float32)
    k = (rng.normal(0.0, 1.0, (n_stream, kv_size, n_head_kv * d)) *
         np.exp2(rng.integers(-8, 8, (n_stream, kv_size, n_head_kv * d)))).astype(np.float32)
    cells = rng.permutation(n_stream * kv_size)[:n_tokens].astype(np.int32)
    return np.concatenate([table[..., :d], sq, table[..., d:]], axis=-1), k, cells, idx


def assert_kstat_equal(got: np.ndarray, want: np.ndarray, kv_dtype: str) -> None:
    if kv_dtype in ("f16", "bf16"):
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_array_almost_equal_nulp(got, want, nulp=1)


@pytest.mark.parametrize("case", KSTAT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kstat_rows_equals_reference(case):
    n_seq, n_head_kv, d, n_tokens, kv_size, n_stream, kv_dtype = case
    rng = np.random.default_rng(n_seq * 1000 + d + 1)
    table, k, cells, idx = kstat_case(rng, n_seq, n_head_kv, d, n_tokens, kv_size, n_stream)
    got, table_after = ops.kstat_rows(table, k, cells, idx, kv_dtype=kv_dtype, n_threads=2)
    assert got.shape == (n_tokens, n_head_kv, 2 * d + 1)
    assert_kstat_equal(got, kstat_rows_reference(table, k, cells, idx, kv_dtype), kv_dtype)
    np.testing.assert_array_equal(table_after, written_back(table, got, idx))


def test_kstat_rows_bad_arguments_fail_clearly():
    rng = np.random.default_rng(4)
    table, k, cells, idx = kstat_case(rng, 2, 2, 8, 2, 6, 1)
    with pytest.raises(ValueError, match="shapes do not agree"):
        ops.kstat_rows(table[..., :-1], k, cells, idx)
    with pytest.raises(ValueError, match="shapes do not agree"):
        ops.kstat_rows(table[..., 8:], k, cells, idx)  # a V-sum table: d + 1 wide
    with pytest.raises(ValueError, match="kv_dtype"):
        ops.kstat_rows(table, k, cells, idx, kv_dtype="q3_k")
    with pytest.raises(ValueError, match="blocks of 32"):
        ops.kstat_rows(table, k, cells, idx, kv_dtype="q4_0")  # rows of 16 keys: no whole block
    table16, k16, cells16, idx16 = kstat_case(rng, 2, 2, 16, 2, 6, 1)
    with pytest.raises(ValueError, match="d whole blocks of q4_0"):
        ops.kstat_rows(table16, k16, cells16, idx16, kv_dtype="q4_0")  # rows of 32, but each head's 16 split a block
    with pytest.raises(ValueError, match="not a table row"):
        ops.kstat_rows(table, k, cells, np.array([0, 5], dtype=np.int32))
    with pytest.raises(ValueError, match="not a row of k"):
        ops.kstat_rows(table, k, np.array([0, 6], dtype=np.int32), idx)
