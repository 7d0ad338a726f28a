"""SparQ's index and key statistics with the KV cache on a GPU (skipped without a CUDA device): the index writes and
the rebuild (ggml_sparq_index_write into f16 or q8_0 rows, or the q4 index's blocks), the decode steps' key statistics (ggml_sparq_kstat_rows)
and the rebuild's one-hot sums run on the CUDA backend; the checks are test_sparq_kv_index.py's (the index and the key statistics against the cache's
own keys, read back), after decodes, a removal in the middle, a state load and two sequences decoding in one
batch. SparQ decodes from the first step (min_n_kv = 0: the state is kept only where a step may read it), so the
SparQ op runs on the GPU too; its own tests are test_op_sparq_attn_cuda.py's. A random-weight model of the Llama-2 layout (sparq_llama.eval.random_gguf,
2 layers, 2 KV heads, d = 64) stands in for SmolLM2, which the GPU machine has no registry to fetch.

Run on a GPU machine: bench/device.sh build, then python3 -m pytest tests/test_sparq_kv_index_cuda.py with the
environment device.sh sets (PYTHONPATH, SPARQ_LLAMA_LIB_DIR).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import sparq_llama
from conftest import REPO
from test_sparq_kv_index import KV_TYPES, SPARSE, check_index, check_stats, make_ctx, occupied

from sparq_llama.eval import random_gguf

from llama_cpp import llama_cpp as lc  # isort: skip

pytestmark = pytest.mark.skipif("CUDA0" not in [dev["name"] for dev in sparq_llama.devices()],
                                reason="no CUDA device")

VOCAB = REPO / "vendor" / "llama.cpp" / "models"  # the pinned tree's tokenizers
LAYERS, N_HEAD_KV, D = (0, 1), 2, 64


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    path = random_gguf.write_model(random_gguf.SHAPES["tiny"], tmp_path_factory.mktemp("m") / "tiny.gguf", VOCAB)
    p = lc.llama_model_default_params()
    p.n_gpu_layers = 99
    m = lc.llama_model_load_from_file(str(path).encode(), p)
    assert m
    yield m
    lc.llama_model_free(m)


def check(ctx, index: str, what: str) -> None:
    check_index(ctx, index, what, LAYERS, N_HEAD_KV, D)
    check_stats(ctx, index, what, LAYERS, N_HEAD_KV, D)


@pytest.mark.parametrize("kv", list(KV_TYPES))
@pytest.mark.parametrize("index", ["f16", "q8", "q4"])
def test_state_follows_the_cache_on_the_gpu(gpu_model, index, kv):
    rng = np.random.default_rng(3)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(gpu_model))
    toks = rng.integers(10, n_vocab, 400).tolist()
    cfg = SPARSE
    n0, n1 = 150, 190
    with make_ctx(gpu_model, kv, cfg, index=index, select="qsigma") as ctx:
        ctx.prefill(toks[:n0])
        ctx.steps(toks[n0:n1], n0)
        check(ctx, index, "after a prefill and decodes")
        assert lc.llama_memory_seq_rm(ctx.mem, 0, 40, 100)
        ctx.steps(toks[n1:n1 + 3], n1)
        assert occupied(ctx, 0).sum() == n1 - 60 + 3
        check(ctx, index, "after seq_rm in the middle and decodes")
        state = (ctypes.c_uint8 * lc.llama_state_seq_get_size(ctx.ctx, 0))()
        assert lc.llama_state_seq_get_data(ctx.ctx, state, len(state), 0) == len(state)
    with make_ctx(gpu_model, kv, cfg, index=index, select="qsigma") as ctx:
        ctx.prefill(toks[200:400])
        assert lc.llama_memory_seq_rm(ctx.mem, 0, -1, -1)
        assert lc.llama_state_seq_set_data(ctx.ctx, state, len(state), 0) == len(state)
        check(ctx, index, "after a state load")
    with make_ctx(gpu_model, kv, cfg, index=index, select="qsigma", n_seq_max=2, kv_unified=True) as ctx:
        ctx.prefill(toks[:150], seq=0)
        ctx.prefill(toks[200:297], seq=1)
        for i in range(40):
            ctx.decode([(toks[150 + i], 150 + i, 0, True), (toks[297 + i], 97 + i, 1, True)])
        check(ctx, index, "after decodes of two sequences in one batch (unified)")
