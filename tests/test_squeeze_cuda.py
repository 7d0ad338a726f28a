"""Centroid-sparse attention through the model with the KV on a GPU (skipped without a CUDA device).

The prefill mode "auto" (the default) reads a prepared prefix densely for a question's multi-token ubatches where
the layer's KV is not in host memory, since per-row selection is slower than flash attention there
(docs/performance.md). The CPU tests (test_squeeze_decode.py) see only the sparse branch of
"auto"; this file checks the GPU branch against its oracle, the plain cache's prefill of the same cells (bit for
bit: the same flash-attention graph over the same KV), and that "sparse" takes the op there. A random-weight model
of the Llama-2 layout (sparq_llama.eval.random_gguf) stands in for SmolLM2, which the GPU machine has no registry to fetch.

The last test serves a prefix the Python API saved through llama-server on the GPU (--squeeze-load, -ngl 99) and checks
its greedy tokens against the Python API's over the same prepared prefix; a second slot (-kvu) shares the prefix's
cells and evaluates only the question.

Run on a GPU machine by `bench/device.sh test`. Writing the model imports gguf, which imports sentencepiece, which loads
the system libstdc++: a CUDA build that exported its statically linked copy of the C++ runtime crashed here in
llama_model_load_from_file (tests/test_lib_isolation.py guards against that).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import sparq_llama
from conftest import REPO, Server
from sparq_llama import Llama
from sparq_llama import squeeze as squeeze_api
from test_sparq_decode import Ctx
from test_squeeze_decode import prefill_in_each_mode, prefill_question

from sparq_llama.eval import random_gguf

from llama_cpp import llama_cpp as lc  # isort: skip

pytestmark = pytest.mark.skipif("CUDA0" not in [dev["name"] for dev in sparq_llama.devices()],
                                reason="no CUDA device")

VOCAB = REPO / "vendor" / "llama.cpp" / "models"  # the pinned tree's tokenizers
N_PREFIX = 600   # 500 clustered tokens + 100 calibration tokens
N_QUESTION = 24


@pytest.fixture(scope="module")
def gpu_llm(tmp_path_factory):
    path = random_gguf.write_model(random_gguf.SHAPES["tiny"], tmp_path_factory.mktemp("m") / "tiny.gguf", VOCAB)
    llm = Llama(str(path), n_ctx=1024, n_gpu_layers=99, flash_attn=True, verbose=False)
    yield llm
    llm.close()


def test_prefill_auto_reads_the_prefix_densely_on_the_gpu(gpu_llm):
    rng = np.random.default_rng(12)
    n_vocab = gpu_llm.n_vocab()
    doc = rng.integers(10, n_vocab, N_PREFIX).tolist()
    question = rng.integers(10, n_vocab, N_QUESTION).tolist()
    info = gpu_llm.prepare_fixed_context(doc, keep=0.1, centroids=0.1, progress=False)
    assert info.prefill == "auto"
    modes = prefill_in_each_mode(gpu_llm, question, N_PREFIX)
    auto, sparse, dense = modes["auto"], modes["sparse"], modes["dense"]
    gpu_llm.clear_fixed_context()
    plain = prefill_question(gpu_llm, question, N_PREFIX)
    assert np.isfinite(auto).all() and np.isfinite(sparse).all()
    np.testing.assert_array_equal(dense, plain)
    np.testing.assert_array_equal(auto, plain)
    # the sparse mode reads the kept clusters through the op: other kernels, so other logits
    assert not np.array_equal(sparse, plain), "the sparse prefill equals the plain cache's: is the op used?"


def test_a_copy_of_the_prefix_stream_reads_it_sparsely_on_the_gpu(gpu_llm):
    """One stream per sequence, KV on the GPU: a cross-stream copy of the prefix's stream (a mirror) reads the prefix
    through the op with the prefix's tables, the same bits as the preparing sequence; a removal inside the clustered
    prefix ends the mirror (its table slices cleared on the device: that stream reads densely again)."""
    rng = np.random.default_rng(14)
    n_vocab = gpu_llm.n_vocab()
    doc = rng.integers(10, n_vocab, N_PREFIX).tolist()
    question = rng.integers(10, n_vocab, N_QUESTION).tolist()
    with Ctx(gpu_llm.model, n_seq_max=2, kv_unified=False, n_ctx=2048) as ctx:
        ctx.prefill(doc)
        squeeze_api.prepare(ctx.ctx, doc, squeeze_api.SqueezeConfig(keep=0.1, centroids=0.1))
        squeeze_api.set_prefill(ctx.ctx, "sparse")
        want = ctx.prefill(question, pos0=N_PREFIX, all_logits=True)
        lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
        lc.llama_memory_seq_cp(ctx.mem, 0, 1, -1, -1)
        assert squeeze_api.seq_sparse(ctx.ctx, 1)
        np.testing.assert_array_equal(ctx.prefill(question, pos0=N_PREFIX, seq=1, all_logits=True), want)
        lc.llama_memory_seq_rm(ctx.mem, 1, N_PREFIX, -1)
        squeeze_api.set_prefill(ctx.ctx, "dense")
        dense = ctx.prefill(question, pos0=N_PREFIX, seq=1, all_logits=True)
        assert not np.array_equal(dense, want), "the copy read densely equals the sparse read: is the op used?"
        squeeze_api.set_prefill(ctx.ctx, "sparse")
        lc.llama_memory_seq_rm(ctx.mem, 1, N_PREFIX, -1)
        lc.llama_memory_seq_rm(ctx.mem, 1, 100, 101)
        assert not squeeze_api.seq_sparse(ctx.ctx, 1) and squeeze_api.seq_sparse(ctx.ctx, 0)
        # clearing stream 1's slices left the prefix's own stream as it was
        lc.llama_memory_seq_rm(ctx.mem, 0, N_PREFIX, -1)
        np.testing.assert_array_equal(ctx.prefill(question, pos0=N_PREFIX, all_logits=True), want)


def _server_binary() -> str | None:
    """llama-server of the build under test: SPARQ_LLAMA_LIB_DIR's (a plain CMake build's bin/), else PATH's."""
    lib = os.environ.get("SPARQ_LLAMA_LIB_DIR")
    if lib and (Path(lib) / "llama-server").is_file():
        return str(Path(lib) / "llama-server")
    return shutil.which("llama-server")


def test_server_serves_a_saved_prefix_on_the_gpu(gpu_llm, tmp_path):
    server = _server_binary()
    if server is None:
        pytest.skip("no llama-server in this build")
    rng = np.random.default_rng(13)
    n_vocab = gpu_llm.n_vocab()
    doc = rng.integers(10, n_vocab, N_PREFIX).tolist()
    question = rng.integers(10, n_vocab, N_QUESTION).tolist()
    n_gen = 8
    gpu_llm.prepare_fixed_context(doc, keep=0.1, centroids=0.1, progress=False)
    state = tmp_path / "doc.state"
    gpu_llm.save_fixed_context(str(state))
    # the oracle: greedy tokens of the Python API over the prepared prefix (only the question is evaluated after it)
    want = []
    for tok in gpu_llm.generate(doc + question, temp=0.0):
        want.append(tok)
        if len(want) == n_gen:
            break
    assert gpu_llm.fixed_context.prepared
    gpu_llm.clear_fixed_context()
    srv = Server([server, "-m", gpu_llm.model_path, "-c", "1024", "-np", "2", "-kvu", "-ngl", "99", "-fa", "on",
                  "--no-warmup", "--squeeze", "--squeeze-load", str(state)], tmp_path / "server.log")
    try:
        body = {"prompt": doc + question, "n_predict": n_gen, "temperature": 0, "ignore_eos": True, "return_tokens": True}
        status, out = srv.post("/completion", body)
        assert status == 200, out
        # slot 1 shares the prefix's cells (one stream): only the question is evaluated there too; its cells sit
        # elsewhere in the cache, so its tokens are not compared bit for bit
        status, shared = srv.post("/completion", {**body, "id_slot": 1})
        assert status == 200, shared
    finally:
        srv.close()
    log = srv.log()
    assert f"loaded a prepared prefix of {N_PREFIX} tokens" in log and "no longer prepared" not in log, log[-3000:]
    assert out["timings"]["prompt_n"] == N_QUESTION, out
    assert out["tokens"] == want
    assert f"shares the prepared fixed prefix's cells with slot 0 ({N_PREFIX} tokens)" in log, log[-3000:]
    assert shared["id_slot"] == 1 and shared["timings"]["prompt_n"] == N_QUESTION, shared
    assert len(shared["tokens"]) == n_gen
