"""SparQ's index (K^T in f16 or q8_0, or the q4 index) and key statistics (select qsigma) in llama.cpp's KV cache, over f16 and
quantized (q8_0, q4_0) K/V caches, on the real default model (SmolLM2-135M: 30 layers, 3 KV heads, d = 64).

Oracles:
* the cache's own keys, read back: the index must be the transposed keys (q8_0: each block of 32 cells quantized
  from the dequantized keys, empty cells counting as 0; q4: each block's components quantized as
  sparq_llama.index.q4_index_quantize does, bit for bit) and the key statistics the per-sequence sums of the keys
  and their squares, after decodes, a removal in the middle and a state load;
* dense attention with the same cache types, which SparQ with k2 covering the context must equal;
* the same tokens computed another way (a fresh context, SparQ enabled after the cache was filled, a state
  loaded into a fresh context), where the derived state must have followed or been rebuilt.
Tolerances as in test_sparq_decode.py (whose context helper this file uses).
"""
from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
from sparq_llama import SparqConfig
from sparq_llama import _bindings as C
from sparq_llama.index import q4_index_dequantize, q4_index_quantize
from sparq_llama.sparq import SparqRun, last_run
from test_sparq_decode import N_CTX, N_THREADS, TOL, TOL_DENSE, Ctx, assert_logits_agree

from llama_cpp import llama_cpp as lc  # isort: skip  (after sparq_llama, which points it at our libllama)

INDEX = {"f16": 0, "q8": 1, "q4": 2}  # enum llama_sparq_index
SELECT = {"q": 0, "qsigma": 1}       # enum llama_sparq_select
KV_TYPES = {"f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0, "q4_0": lc.GGML_TYPE_Q4_0}
CACHE_TYPES = {**KV_TYPES, "f32": lc.GGML_TYPE_F32}  # f32 once (test_f32_cache_keeps_the_state), not in every combo
SPARSE = SparqConfig(k1=8, k2=32, min_n_kv=0, mean="on")
N_LAYER, N_HEAD_KV, D = 30, 3, 64
LAYERS = (0, 13, 29)                 # the layers whose tensors the state tests read

# the q4 index chooses no components: one select (the default) covers it
COMBOS = [(i, s, t) for t in KV_TYPES for i in INDEX for s in SELECT if i != "q4" or s == "qsigma"]
COMBO_IDS = [f"{i}-{s}-{t}" for i, s, t in COMBOS]


def make_ctx(model, kv: str, cfg: SparqConfig | None = None, *, index: str = "f16", select: str = "q",
             n_seq_max: int = 1, kv_unified: bool = False) -> Ctx:
    """A context (flash attention, N_THREADS) with K and V caches of type kv, SparQ applied when cfg is given."""
    p = lc.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch = N_CTX, 512, 512
    p.type_k = p.type_v = CACHE_TYPES[kv]
    p.n_seq_max, p.kv_unified = n_seq_max, kv_unified
    p.n_threads = p.n_threads_batch = N_THREADS
    p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
    p.no_perf = True
    ctx = Ctx.__new__(Ctx)
    ctx.ctx = lc.llama_init_from_model(model, p)
    assert ctx.ctx, "llama_init_from_model failed"
    ctx._owned, ctx.n_batch = True, 512
    ctx.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    if cfg is not None:
        set_sparq(ctx, cfg, index, select)
    return ctx


def set_sparq(ctx: Ctx, cfg: SparqConfig, index: str, select: str) -> None:
    p = cfg.to_c()
    p.index, p.select = INDEX[index], SELECT[select]
    if index == "q4":
        p.k1 = 0                             # it scores every component
    msg = C.llama_sparq_check(ctx.ctx, ctypes.byref(p))
    assert msg is None, msg
    assert C.llama_set_sparq(ctx.ctx, ctypes.byref(p)) == 0, C.llama_sparq_last_error()


def read(ctx: Ctx, il: int, what: int) -> np.ndarray | None:
    """A layer's K (0), K^T (1), V sums (2) or key statistics (3) as f32, shaped [ne2, ne1, ne0]; None if absent."""
    ne = (ctypes.c_int64 * 3)()
    err = ctypes.create_string_buffer(256)
    if C.sparq_llama_read_kv_tensor(ctx.ctx, il, what, None, 0, ne, err, len(err)) != 0:
        return None
    out = np.zeros(ne[0] * ne[1] * ne[2], dtype=np.float32)
    rc = C.sparq_llama_read_kv_tensor(ctx.ctx, il, what, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                      out.size, ne, err, len(err))
    assert rc == 0, err.value.decode()
    return out.reshape(ne[2], ne[1], ne[0])


def occupied(ctx: Ctx, il: int = LAYERS[0]) -> np.ndarray:
    """Which cells of each stream hold a token, as the cache says: [n_stream, kv_size] bool."""
    occ = read(ctx, il, 4)
    assert occ is not None
    return occ[0] > 0


def held(ctx: Ctx, il: int = LAYERS[0]) -> np.ndarray:
    """Which cells of its stream each sequence holds: [n_seq_max, kv_size] bool."""
    return read(ctx, il, 5)[0] > 0


def check_index(ctx: Ctx, index: str, what: str, layers: tuple[int, ...] = LAYERS, n_head_kv: int = N_HEAD_KV,
                d: int = D) -> None:
    """K^T of every checked layer and stream against the cache's keys: the occupied cells (f16), or every block
    holding an occupied cell (q8_0: the block quantized from the keys, empty cells as 0)."""
    occ = occupied(ctx, layers[0])
    assert occ.any()
    for il in layers:
        k_all, kt_all = read(ctx, il, 0), read(ctx, il, 1)   # [n_stream, kv_size, n_embd], [n_stream, n_embd, row]
        assert kt_all is not None, f"{what}: layer {il} has no index"
        for s, used in enumerate(occ):
            k, kt = k_all[s], kt_all[s]
            where = f"{what}: layer {il} stream {s}"
            kv_size, n_embd = k.shape
            if index == "q4":
                check_q4_blocks(k, kt, used, where, n_head_kv, d)
                continue
            if index == "f16":
                assert kt.shape == (n_embd, kv_size)
                want = k.T.astype(np.float16).astype(np.float32)   # f16 K: exact; quantized K: rounded once
                got = kt[:, used]
                assert np.array_equal(got, want[:, used]), (
                    f"{where}: the f16 index differs from the keys by up to {np.abs(got - want[:, used]).max():.3g}")
                continue
            row_len = -(-kv_size // 32) * 32
            assert kt.shape == (n_embd, row_len)
            used_p = np.zeros(row_len, dtype=bool)
            used_p[:kv_size] = used
            x = np.zeros((n_embd, row_len), dtype=np.float32)
            x[:, :kv_size] = k.T
            x[:, ~used_p] = 0.0                            # empty cells count as 0
            blocks = used_p.reshape(-1, 32).any(axis=1)    # the blocks that hold a token
            xb = x.reshape(n_embd, -1, 32)[:, blocks]
            got = kt.reshape(n_embd, -1, 32)[:, blocks]
            d = np.abs(xb).max(axis=2, keepdims=True) / 127.0
            # q8_0: q * f16(amax/127), q = round(x/d): within half a step (and the f16 rounding of d) of x
            err = np.abs(got - xb)
            bound = 0.5 * d * (1 + 2e-3) + np.abs(xb) * 2e-3 + 1e-7
            assert (err <= bound).all(), (
                f"{where}: the q8 index is off the keys by {(err / np.maximum(d, 1e-30)).max():.3g} steps")
            # the block's largest value is stored as +-127 steps: the scale is the block's own (empty cells as 0)
            assert np.allclose(np.abs(got).max(axis=2, keepdims=True), 127 * d, rtol=2e-3, atol=1e-7), (
                f"{where}: q8 block scales differ from the keys'")
            empty = ~used_p.reshape(-1, 32)[blocks]
            assert (got[:, empty] == 0).all(), f"{where}: the q8 index holds values in empty cells"


def check_q4_blocks(k: np.ndarray, kt: np.ndarray, used: np.ndarray, where: str, n_head_kv: int, d: int) -> None:
    """One stream's q4 index as read back (K^T values [n_embd, row_len]) against the blocks quantized from its keys
    k [kv_size, n_embd] with the empty cells as 0: equal in every block that holds a token."""
    kv_size, n_embd = k.shape
    row_len = -(-kv_size // 32) * 32
    assert kt.shape == (n_embd, row_len)
    x = np.where(used[:, None], k, 0.0).astype(np.float32)
    heads = x.reshape(kv_size, n_head_kv, d).transpose(1, 0, 2)          # [n_head_kv, kv_size, d]
    want = q4_index_dequantize(*q4_index_quantize(heads))                 # [n_head_kv, row_len, d]
    want = want.transpose(0, 2, 1).reshape(n_embd, row_len)
    used_p = np.zeros(row_len, dtype=bool)
    used_p[:kv_size] = used
    blocks = np.repeat(used_p.reshape(-1, 32).any(axis=1), 32)
    got = kt[:, blocks]
    assert np.array_equal(got, want[:, blocks]), (
        f"{where}: the q4 index differs from the keys' blocks by up to {np.abs(got - want[:, blocks]).max():.3g}")


def check_stats(ctx: Ctx, index: str, what: str, layers: tuple[int, ...] = LAYERS, n_head_kv: int = N_HEAD_KV,
                d: int = D) -> None:
    """The key statistics where the index needs them (check_kstat); the q4 index keeps none."""
    if index == "q4":
        assert read(ctx, layers[0], 3) is None, "the q4 index keeps no key statistics"
    else:
        check_kstat(ctx, what, layers, n_head_kv, d)


def check_kstat(ctx: Ctx, what: str, layers: tuple[int, ...] = LAYERS, n_head_kv: int = N_HEAD_KV,
                d: int = D) -> None:
    """The key statistics of every sequence against sums over the cache's keys of the cells it holds."""
    cells = held(ctx, layers[0])
    for il in layers:
        k_all, st_all = read(ctx, il, 0), read(ctx, il, 3)
        assert st_all is not None, f"{what}: layer {il} keeps no key statistics"
        for q, mine in enumerate(cells):
            k = k_all[q if len(k_all) > 1 else 0][mine].astype(np.float64)   # [n, n_embd]
            st = st_all[0, q].reshape(n_head_kv, 2 * d + 1)
            kh = k.reshape(-1, n_head_kv, d)
            want = np.concatenate([kh.sum(0), (kh ** 2).sum(0), np.full((n_head_kv, 1), len(k))], axis=1)
            err = np.abs(st - want) / np.maximum(np.abs(want).max(axis=1, keepdims=True), 1e-30)
            # f32 running sums: the classical bound of a sum of n terms is n unit roundoffs (2^-24) of its scale; the
            # GPU's one-hot products sum in another order than the CPU's (measured up to 1.4e-5 at ~100 cells)
            tol = max(1e-5, 2 * len(k) * 2.0 ** -24)
            assert err.max() <= tol, (
                f"{what}: layer {il} sequence {q} key statistics off by {err.max():.3g} of their scale")


@pytest.fixture(scope="module")
def model(smollm2_path):
    m = lc.llama_model_load_from_file(str(smollm2_path).encode(), lc.llama_model_default_params())
    assert m
    yield m
    lc.llama_model_free(m)


@pytest.fixture(scope="module")
def toks(model) -> list[int]:
    from test_sparq_decode import TEXT
    vocab = lc.llama_model_get_vocab(model)
    text = TEXT.encode()
    buf = (lc.llama_token * (len(text) + 8))()
    n = lc.llama_tokenize(vocab, text, len(text), buf, len(buf), True, False)
    assert n >= 800, n
    return list(buf[:n])


# ---------------------------------------------------------------------------------------------------
# The derived state against the cache's keys (min_n_kv = 0: kept from the first step; below min_n_kv it is not
# kept at all, test_state_is_kept_from_where_a_step_may_read_it)


@pytest.mark.parametrize("index,select,kv", COMBOS, ids=COMBO_IDS)
def test_state_follows_the_cache(model, toks, index, select, kv):
    cfg = SPARSE
    n0, n1 = 150, 190

    def check(ctx: Ctx, what: str) -> None:
        check_index(ctx, index, what)
        if select == "qsigma":
            check_stats(ctx, index, what)
        else:
            assert read(ctx, LAYERS[0], 3) is None, "select q keeps no key statistics"

    with make_ctx(model, kv, cfg, index=index, select=select) as ctx:
        ctx.prefill(toks[:n0])                       # one batch
        ctx.steps(toks[n0:n1], n0)                   # decode steps (cells 150..189: blocks shared with the batch)
        check(ctx, "after a prefill and decodes")
        assert occupied(ctx).sum() == n1

        assert lc.llama_memory_seq_rm(ctx.mem, 0, 40, 100)          # a hole in the middle (blocks 32..127)
        ctx.steps(toks[n1:n1 + 3], n1)               # rebuilt before the first of these decodes
        assert occupied(ctx).sum() == n1 - 60 + 3
        check(ctx, "after seq_rm in the middle and decodes")

        state = (ctypes.c_uint8 * lc.llama_state_seq_get_size(ctx.ctx, 0))()
        assert lc.llama_state_seq_get_data(ctx.ctx, state, len(state), 0) == len(state)
    with make_ctx(model, kv, cfg, index=index, select=select) as ctx:
        ctx.prefill(toks[500:700])                   # other keys over the cells the state will take
        assert lc.llama_memory_seq_rm(ctx.mem, 0, -1, -1)
        assert lc.llama_state_seq_set_data(ctx.ctx, state, len(state), 0) == len(state)
        assert occupied(ctx).sum() == n1 - 60 + 3
        check(ctx, "after a state load")
        ctx.steps(toks[n1 + 3:n1 + 40], n1 + 3)      # decodes after the load
        check(ctx, "after a state load and decodes")


@pytest.mark.parametrize("kv_unified", [False, True], ids=["streams", "unified"])
@pytest.mark.parametrize("index", ["f16", "q8", "q4"])
def test_two_sequences_in_one_batch(model, toks, index, kv_unified):
    """Both sequences decode in each batch: one stream each (a write per stream), or one shared stream, where the
    two new cells fall in one q8 block or in two as the steps go on (graphs built for one block are not reused
    then). The state is checked after each phase and after removing a sequence."""
    cfg = SPARSE
    with make_ctx(model, "q8_0", cfg, index=index, select="qsigma", n_seq_max=2, kv_unified=kv_unified) as ctx:
        ctx.prefill(toks[:150], seq=0)
        ctx.prefill(toks[300:397], seq=1)
        check_index(ctx, index, "after two prefills")
        check_stats(ctx, index, "after two prefills")
        for i in range(40):
            ctx.decode([(toks[150 + i], 150 + i, 0, True), (toks[397 + i], 97 + i, 1, True)])
        check_index(ctx, index, "after decodes of both sequences in one batch")
        check_stats(ctx, index, "after decodes of both sequences in one batch")
        assert lc.llama_memory_seq_rm(ctx.mem, 1, -1, -1)
        ctx.decode([(toks[190], 190, 0, True)])
        check_index(ctx, index, "after removing sequence 1 and a decode")
        check_stats(ctx, index, "after removing sequence 1 and a decode")


def test_rebuild_over_eight_streams(model, toks):
    """One stream per sequence, 8 of them, each with a hole removed: the rebuild reads every stream's cells in one
    product per table (the graph budget holds it) and each stream's index and each sequence's statistics match."""
    cfg = SPARSE
    with make_ctx(model, "q4_0", cfg, index="q8", select="qsigma", n_seq_max=8) as ctx:
        for q in range(8):
            ctx.prefill(toks[q * 50:q * 50 + 40 + q], seq=q)
        for q in range(8):
            assert lc.llama_memory_seq_rm(ctx.mem, q, 10, 20)
        ctx.decode([(toks[500 + q], 40 + q, q, True) for q in range(8)])
        check_index(ctx, "q8", "8 streams after seq_rm in each and a decode")
        check_kstat(ctx, "8 streams after seq_rm in each and a decode")


def test_state_is_kept_from_where_a_step_may_read_it(model, toks):
    """Below min_n_kv no step reads the derived state, so the graphs skip its upkeep and it stays stale; it is
    rebuilt before the first step whose cache view may reach min_n_kv and kept from there. A batch that reaches it
    by more cells than that look-ahead reads densely and asks for the state; a removal makes it stale, and below
    min_n_kv it waits again. llama.cpp's cache view grows in steps of 256 cells."""
    cfg = dataclasses.replace(SPARSE, min_n_kv=512, prefill=True)
    with make_ctx(model, "q8_0", cfg, index="q8", select="qsigma") as ctx:
        ctx.prefill(toks[:250])
        ctx.steps(toks[250:256], 250)                # views of 256 cells: dense, the state not kept
        assert last_run(ctx.ctx) == SparqRun(1, 0, 0, N_LAYER)
        ctx.steps(toks[256:260], 256)                # cell 256 makes the view 512: rebuilt before that step
        assert last_run(ctx.ctx) == SparqRun(1, N_LAYER, 0, 0)
        check_index(ctx, "q8", "after the view reached min_n_kv and decodes")
        check_kstat(ctx, "after the view reached min_n_kv and decodes")

        assert lc.llama_memory_seq_rm(ctx.mem, 0, 100, -1)
        ctx.steps(toks[100:102], 100)                # stale, and the view is back to 256 cells
        assert last_run(ctx.ctx) == SparqRun(1, 0, 0, N_LAYER)
        ctx.prefill(toks[102:300], pos0=102)         # a selecting batch whose view is 512: read densely
        assert last_run(ctx.ctx) == SparqRun(198, 0, 0, N_LAYER)
        ctx.steps(toks[300:302], 300)                # wanted, so rebuilt before the next step
        assert last_run(ctx.ctx) == SparqRun(1, N_LAYER, 0, 0)
        check_index(ctx, "q8", "after a batch crossed min_n_kv and decodes")
        check_kstat(ctx, "after a batch crossed min_n_kv and decodes")


@pytest.mark.parametrize("index", list(INDEX))
def test_f32_cache_keeps_the_state(model, toks, index):
    """-ctk f32: the index write reads K's rows as they are (ggml's f32 has no dequantizer to call)."""
    with make_ctx(model, "f32", SPARSE, index=index, select="qsigma") as ctx:
        ctx.prefill(toks[:150])
        ctx.steps(toks[150:170], 150)
        check_index(ctx, index, "an f32 cache after a prefill and decodes")
        check_stats(ctx, index, "an f32 cache after a prefill and decodes")


def test_quantized_indexes_are_refused_with_the_default_layout(model):
    with make_ctx(model, "f16") as ctx:
        for index in ("q8", "q4"):
            p = dataclasses.replace(SPARSE, k1=None, default_layout=True).to_c()
            p.index = INDEX[index]
            msg = C.llama_sparq_check(ctx.ctx, ctypes.byref(p))
            assert msg is not None and b"use the f16 index" in msg and index.encode() in msg, msg
        p = SPARSE.to_c()
        p.index = INDEX["q4"]                        # k1 = 8: the q4 index scores every component
        msg = C.llama_sparq_check(ctx.ctx, ctypes.byref(p))
        assert msg is not None and b"k1 must be 0" in msg, msg
        for field, value in (("index", 3), ("select", 2), ("index", -1), ("select", -1)):
            p = SPARSE.to_c()
            setattr(p, field, value)
            msg = C.llama_sparq_check(ctx.ctx, ctypes.byref(p))
            assert msg is not None and field.encode() in msg, (field, value, msg)


def test_defaults_are_the_q8_index_and_qsigma():
    p = C.llama_sparq_default_params()
    assert (p.index, p.select) == (INDEX["q8"], SELECT["qsigma"])


# ---------------------------------------------------------------------------------------------------
# SparQ decodes over the index (the op reads it)


@pytest.fixture(scope="module")
def dense_greedy(model, toks):
    memo: dict = {}

    def run(kv: str):
        if kv not in memo:
            with make_ctx(model, kv) as ctx:
                memo[kv] = ctx.greedy(toks[:300], 16)
        return memo[kv]

    return run


# Teacher-forced steps on dense's tokens that must agree to TOL_DENSE. The decoded tokens' own K and V come from
# two attention kernels, and a q4_0 cache rounds their difference to 4-bit steps (a sixteenth of a block's range),
# so it compounds: measured 0.028 of the logit scale at the first step, 0.062 by the 8th, 0.147 by the 12th
# (q8_0 and f16: at most 0.034 and 0.038 over all 15). Greedy tokens are compared where it does not compound.
STEPS_AGREE = {"f16": 15, "q8_0": 15, "q4_0": 8}


@pytest.mark.parametrize("index,select,kv", COMBOS, ids=COMBO_IDS)
def test_k2_covering_the_context_is_dense(model, toks, dense_greedy, index, select, kv):
    d_tokens, d_logits = dense_greedy(kv)
    cfg = SparqConfig(k2=N_CTX, min_n_kv=0)
    with make_ctx(model, kv, cfg, index=index, select=select) as ctx:
        ctx.prefill(toks[:300])
        forced = ctx.steps(d_tokens[:15], 300)
    n = STEPS_AGREE[kv]
    assert_logits_agree(forced[:n], d_logits[1:1 + n], f"SparQ k2 = n_ctx vs dense, teacher-forced ({kv} cache)",
                        tol=TOL_DENSE)
    if n == 15:
        with make_ctx(model, kv, cfg, index=index, select=select) as ctx:
            s_tokens, _ = ctx.greedy(toks[:300], 16)
        assert s_tokens == d_tokens, f"SparQ with k2 = n_ctx generated {s_tokens}, dense {d_tokens} ({kv} cache)"


@pytest.mark.parametrize("index,select,kv", COMBOS, ids=COMBO_IDS)
def test_derived_state_rebuilt_or_followed(model, toks, index, select, kv):
    """Small k2 (selection happens); each way of reaching the same cache must give the same logits: a removal of
    the decoded tokens, a hole in the middle, a context shift, a state load."""
    p, x, y = toks[:160], toks[160:210], toks[600:612]
    n = len(p) + len(x)

    def sparse(**kw) -> Ctx:
        return make_ctx(model, kv, SPARSE, index=index, select=select, **kw)

    # the removal of decoded tokens at the end: as if they had never been there (a fresh context)
    with sparse() as ctx:
        ctx.prefill(p)
        ctx.steps(x, len(p))
        assert lc.llama_memory_seq_rm(ctx.mem, 0, len(p), -1)
        got = ctx.steps(y, len(p))
    with sparse() as ctx:
        ctx.prefill(p)
        want = ctx.steps(y, len(p))
    assert_logits_agree(got, want, "after seq_rm of the decoded tokens vs a fresh context")

    # a hole in the middle: the state kept through the removal vs the state built from the cache afterwards
    with sparse() as ctx:
        ctx.prefill(p + x)                           # a multi-token batch: dense, the same K and V as below
        assert lc.llama_memory_seq_rm(ctx.mem, 0, 40, 100)
        got = ctx.steps(y, n)
    with make_ctx(model, kv) as ctx:
        ctx.prefill(p + x)
        assert lc.llama_memory_seq_rm(ctx.mem, 0, 40, 100)
        set_sparq(ctx, SPARSE, index, select)      # built from the cache as it is now
        want = ctx.steps(y, n)
    assert_logits_agree(got, want, "after seq_rm in the middle vs SparQ enabled after it")

    # a context shift (seq_rm of the older half, seq_add): the keys are rotated in place by the K-shift, which
    # makes the index and the key statistics stale; oracle: the same shifted cache with SparQ switched off, a dense
    # decode that applies the shift, the decode removed again, and SparQ switched on (built from the cache)
    n_keep, n_discard = 4, (n - 4) // 2
    pos = n - n_discard

    def shifted(c: Ctx) -> Ctx:
        c.prefill(p + x)
        assert lc.llama_memory_can_shift(c.mem)
        assert lc.llama_memory_seq_rm(c.mem, 0, n_keep, n_keep + n_discard)
        lc.llama_memory_seq_add(c.mem, 0, n_keep + n_discard, n, -n_discard)
        return c

    with shifted(sparse()) as ctx:
        got = ctx.steps(y, pos)
    with shifted(sparse()) as ctx:
        set_sparq(ctx, dataclasses.replace(SPARSE, enabled=False), index, select)
        ctx.decode([(y[0], pos, 0, True)])
        assert lc.llama_memory_seq_rm(ctx.mem, 0, pos, -1)
        set_sparq(ctx, SPARSE, index, select)
        want = ctx.steps(y, pos)
    assert_logits_agree(got, want, "after a context shift vs SparQ state built from the shifted cache")

    # a sequence state saved and loaded into a fresh context that held other tokens
    with sparse() as ctx:
        ctx.prefill(p + x)
        state = (ctypes.c_uint8 * lc.llama_state_seq_get_size(ctx.ctx, 0))()
        assert lc.llama_state_seq_get_data(ctx.ctx, state, len(state), 0) == len(state)
        want = ctx.steps(y, n)
    with sparse() as ctx:
        ctx.prefill(toks[300:600])
        assert lc.llama_memory_seq_rm(ctx.mem, 0, -1, -1)
        assert lc.llama_state_seq_set_data(ctx.ctx, state, len(state), 0) == len(state)
        got = ctx.steps(y, n)
    assert_logits_agree(got, want, "after a state load vs the context that saved it")


@pytest.mark.parametrize("index", ["f16", "q8"])
def test_sparq_prefill_equals_step_by_step_decode(model, toks, index):
    """--sparq-prefill with qsigma: every row of a batch selects with the key statistics of its visible cells (the
    batch's later tokens taken out again) and the index as the batch wrote it, as a decode step would.

    Not bit for bit: the statistics are f32 running sums, and the sums of squares (k*k of an f16 key needs 22
    bits) round differently when a batch adds its rows at once than when decode steps add one each; this model
    turns that into logit differences of the size two dense kernels show (measured: at most 0.036 of the logit
    scale with the f16 index, 0.054 with q8, where a block's scale also covers the batch's later cells of it;
    the op's own statistics from K, without the running sums, give bit-identical rows), so the bound is
    TOL_DENSE. The running sums themselves are checked against the cache's keys in test_state_follows_the_cache."""
    p = toks[:160]
    t0 = 160 - 24
    cfg = dataclasses.replace(SPARSE, prefill=True)
    with make_ctx(model, "f16", cfg, index=index, select="qsigma") as ctx:
        forced = ctx.prefill(p, all_logits=True)
    with make_ctx(model, "f16", cfg, index=index, select="qsigma") as ctx:
        ctx.prefill(p[:t0])
        stepped = ctx.steps(p[t0:], t0)
    assert_logits_agree(forced[t0:], stepped, f"sparq_prefill batch rows vs step-by-step decode ({index} index)",
                        tol=TOL_DENSE)
