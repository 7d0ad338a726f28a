"""Centroid-sparse attention through the model with the KV on a GPU (skipped without a CUDA device).

The prefill mode "auto" (the default) reads a prepared prefix densely for a question's multi-token ubatches where
the layer's KV is not in host memory, since per-row selection is slower than flash attention there
(bench/notes_squeeze_cuda.md, session 10). The CPU tests (test_squeeze_decode.py) see only the sparse branch of
"auto"; this file checks the GPU branch against its oracle, the plain cache's prefill of the same cells (bit for
bit: the same flash-attention graph over the same KV), and that "sparse" takes the op there. A random-weight model
of the Llama-2 layout (bench/random_gguf.py) stands in for SmolLM2, which the GPU machine has no registry to fetch.

Passed on an H100 (session 13, `bench/device_cuda.sh build isolation pycrash squeezegpu`). Its first run (session 12)
had crashed in llama_model_load_from_file: writing the model imports gguf, which imports sentencepiece, which loads the
system libstdc++, and the CUDA build exported its statically linked copy of the C++ runtime (tests/test_lib_isolation.py).
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
import sparq_llama
from conftest import REPO
from sparq_llama import Llama
from test_squeeze_decode import prefill_in_each_mode, prefill_question

sys.path.insert(0, str(REPO / "bench"))
import random_gguf

pytestmark = pytest.mark.skipif("CUDA0" not in [dev["name"] for dev in sparq_llama.devices()],
                                reason="no CUDA device")

N_PREFIX = 600   # 500 clustered tokens + 100 calibration tokens
N_QUESTION = 24


@pytest.fixture(scope="module")
def gpu_llm(tmp_path_factory):
    path = random_gguf.write_model(random_gguf.SHAPES["tiny"], tmp_path_factory.mktemp("m") / "tiny.gguf")
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
