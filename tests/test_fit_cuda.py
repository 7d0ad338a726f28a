"""Memory fitting with SparQ on a GPU that the model nearly fills (skipped without a CUDA device).

llama.cpp's -fit shrinks an unset context (no -c: the trained one) until the model, the KV cache and the compute
buffers fit the device's free memory less a margin. A random-weight model of the Llama-3-8B layout
(sparq_llama.eval.random_gguf: Q8_0 weights, about 8.5 GB; 32 layers, 8 KV heads of 128) with a trained context
whose f16 KV is at least 1.25 times the GPU's free memory (1M tokens, 128 GiB, on an 80 GB H100; 2M on a 141 GB
H200), so fitting must shrink it. With SparQ (the default q8
index: 34 KiB a cell over 128 KiB of K and V) the fitted context must be smaller by about that share, and the fitted
configuration must run: a 16k-token prompt fills it and 64 decode steps run SparQ in every layer
(--sparq-min-kv 0), with no allocation failing. The context fitted without SparQ, run with SparQ, must not fit:
that is what fitting failed to see before it counted the derived state.

    bash bench/device.sh build fit         # on a lent H100; or, after a build:
    PYTHONPATH=$PWD/py:/tmp/site SPARQ_LLAMA_LIB_DIR=$PWD/build/cuda/bin \\
        python3 -m pytest -q -s -p no:cacheprovider tests/test_fit_cuda.py

About 2 to 3 minutes on an H100 (writing the 8.5 GB model, three model loads, a 16k prefill); prints a summary.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import sparq_llama
from conftest import REPO

from sparq_llama.eval import random_gguf

pytestmark = pytest.mark.skipif("CUDA0" not in [dev["name"] for dev in sparq_llama.devices()],
                                reason="no CUDA device")

VOCAB = REPO / "vendor" / "llama.cpp" / "models"  # the pinned tree's tokenizers
KV_CELL = 2 * 32 * 8 * 128 * 2              # K and V, f16, every layer: 128 KiB a cell
INDEX_CELL = 32 * 8 * 128 * 34 // 32        # the q8 index (K^T): 34 bytes per 32 components and cell
N_PREDICT = 64
# no -c: the trained context, which fitting may shrink (an explicit -c 0 asks for the full context, and fitting then
# moves layers to the CPU instead)
FIT = ["-fit", "on", "-fa", "on", "--temp", "0", "-no-cnv", "--no-warmup", "--ignore-eos"]
SPARQ = ["--sparq", "--sparq-min-kv", "0"]


def _shape() -> random_gguf.Shape:
    """The Llama-3-8B layout with a trained context (a power of two) whose KV exceeds the GPU's free memory."""
    free = next((d["memory_free"] for d in sparq_llama.devices() if d["name"] == "CUDA0"), 0)
    n_ctx_train = 1 << 20
    while n_ctx_train * KV_CELL < 1.25 * free:
        n_ctx_train *= 2
    return dataclasses.replace(random_gguf.SHAPES["llama3-8b"], name="llama3-8b-long", n_ctx_train=n_ctx_train)


SHAPE = _shape()


def fit_lines(log: str) -> str:
    """What fitting decided and what was placed where: the lines to read when an assertion fails."""
    keep = re.compile(r"fit|n_ctx|offload|buffer size|SparQ|out of memory|failed", re.IGNORECASE)
    return "\n".join(line for line in log.splitlines() if keep.search(line))[-6000:]


def _tool(name: str) -> str:
    """A tool of the build under test: SPARQ_LLAMA_LIB_DIR's (a plain CMake build's bin/), else PATH's."""
    lib = os.environ.get("SPARQ_LLAMA_LIB_DIR")
    if lib and (Path(lib) / name).is_file():
        return str(Path(lib) / name)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"no {name} in this build")
    return found


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    t0 = time.time()
    path = random_gguf.write_model(SHAPE, tmp_path_factory.mktemp("m") / "llama3-8b-long-q8_0.gguf", VOCAB)
    print(f"\nwrote {path.name} ({path.stat().st_size / 1e9:.1f} GB) in {time.time() - t0:.0f} s")
    return path


@pytest.fixture(scope="module")
def prompt(tmp_path_factory) -> Path:
    # the repository's own prose: the GPU machine has no registry to fetch the quality harness's texts from
    path = tmp_path_factory.mktemp("p") / "prompt.txt"
    prose = "\n".join(f.read_text() for f in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"])
    path.write_text(prose[:60000])  # about 16k tokens
    return path


def completion(model: Path, args: list[str], timeout: int = 300) -> tuple[int, str]:
    t0 = time.time()
    # a random-weight model generates arbitrary bytes: decode the tool's output leniently
    proc = subprocess.run([_tool("llama-completion"), "-m", str(model), *args], capture_output=True, text=True,
                          encoding="utf-8", errors="replace", timeout=timeout)
    print(f"  llama-completion {' '.join(args[-6:])}: exit {proc.returncode} in {time.time() - t0:.0f} s")
    return proc.returncode, proc.stdout + proc.stderr


def n_ctx_of(log: str) -> int:
    found = re.findall(r"generate: n_ctx = (\d+)", log)
    assert len(found) == 1, log[-4000:]
    return int(found[0])


def test_fit_counts_sparq_derived_state_and_the_fitted_context_runs(model, prompt):
    rc, dense_log = completion(model, [*FIT, "-lv", "4", "-p", "Hello", "-n", "1"])
    assert rc == 0, dense_log[-4000:]
    n_dense = n_ctx_of(dense_log)

    rc, sparq_log = completion(model, [*FIT, *SPARQ, "-lv", "4", "-f", str(prompt), "-n", str(N_PREDICT)])
    assert rc == 0, sparq_log[-4000:]
    n_sparq = n_ctx_of(sparq_log)
    index = re.search(r"CUDA0 SparQ K\^T \(q8_0\) \+ V-sum \+ key-stat buffer size = +([\d.]+) MiB", sparq_log)
    prompt_eval = re.search(r"prompt eval time = .*?/ +(\d+) tokens", sparq_log)
    decode_eval = re.search(r"\beval time = .*?/ +(\d+) runs", sparq_log)

    # the context fitted without SparQ's state, run with it (no fitting of the context: -c set; all layers on the GPU)
    rc_over, over_log = completion(model, ["-c", str(n_dense), "-ngl", "99", "-fit", "off", "-fa", "on", *SPARQ,
                                           "-p", "Hello", "-n", "1", "-no-cnv", "--no-warmup"])

    ratio = n_sparq / n_dense
    gpu = next(d for d in sparq_llama.devices() if d["name"] == "CUDA0")
    print(f"\nfit on {gpu['description']} ({gpu['memory_free'] / 2**30:.1f} GiB free): trained context "
          f"{SHAPE.n_ctx_train}; fitted {n_dense} cells dense, {n_sparq} with SparQ ({ratio:.3f}; KV alone predicts "
          f"{KV_CELL / (KV_CELL + INDEX_CELL):.3f}); index + statistics {index and index.group(1)} MiB; "
          f"prompt {prompt_eval and prompt_eval.group(1)} tokens, {decode_eval and decode_eval.group(1)} decode steps "
          f"with SparQ; SparQ at the dense fit's {n_dense} cells: exit {rc_over}")

    assert n_dense < SHAPE.n_ctx_train, "fitting did not shrink the context: " + fit_lines(dense_log)
    n_layers = SHAPE.n_layer + 1  # the repeating layers and the output layer
    for log in (dense_log, sparq_log):
        assert f"offloaded {n_layers}/{n_layers} layers to GPU" in log, fit_lines(log)
    assert n_sparq < n_dense, fit_lines(sparq_log)
    assert 0.74 < ratio < 0.84, (ratio, fit_lines(sparq_log))  # the index takes 34 of every 162 KiB a cell costs
    assert "runs in 32 of 32 layers" in sparq_log, sparq_log[-4000:]
    assert index and float(index.group(1)) * 2**20 >= 0.95 * n_sparq * INDEX_CELL, sparq_log[-4000:]
    assert prompt_eval and int(prompt_eval.group(1)) >= 12000, sparq_log[-4000:]
    assert decode_eval and int(decode_eval.group(1)) >= N_PREDICT - 1, sparq_log[-4000:]
    assert not re.search(r"out of memory|failed to allocate", sparq_log, re.IGNORECASE), sparq_log[-4000:]
    assert rc_over != 0 and re.search(r"out of memory|failed to allocate|failed to enable SparQ", over_log,
                                      re.IGNORECASE), over_log[-4000:]
