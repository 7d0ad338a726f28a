"""Memory fitting counts SparQ's derived KV state: llama.cpp's memory breakdown (which its parameter fitting, -fit,
reads) includes the index, the V sums and the key statistics, also in the contexts that fitting creates only to
measure (a model loaded without allocating), and a fitted context with SparQ on is smaller by what the state takes.

Host memory only (no device: the CPU is the fitted device, its total memory the limit); the GPU check is
tests/test_fit_cuda.py. SmolLM2-135M: 30 layers, 3 KV heads of 64, 9 query heads (GQA), trained context 8192."""
from __future__ import annotations

import ctypes
import os
import re

import pytest
from conftest import run
from sparq_llama import SparqConfig
from sparq_llama import _bindings as C
from sparq_llama import sparq as sparq_api
from test_sparq_decode import Ctx, llm  # noqa: F401 (fixture)

from llama_cpp import llama_cpp as lc

N_LAYER, N_HEAD_KV, HEAD_DIM = 30, 3, 64
N_EMBD_KV = N_HEAD_KV * HEAD_DIM
ALIGN = 32  # the CPU buffer type's tensor alignment
MiB = 1 << 20


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def derived_state_bytes(cfg: SparqConfig, n_ctx: int, n_seq_max: int) -> int:
    """What design.md ("Derived KV state") says SparQ keeps per layer, in the CPU buffer's aligned tensors."""
    per_layer = []
    if not cfg.default_layout:
        if cfg.index == "q8":  # q8_0: 34 bytes per block of 32 cells, the row padded to whole blocks
            per_layer.append(_pad(n_ctx, 32) // 32 * 34 * N_EMBD_KV)
        else:
            per_layer.append(n_ctx * N_EMBD_KV * 2)
    if cfg.mean == "on":  # auto is off for SmolLM2's GQA layers
        per_layer.append((HEAD_DIM + 1) * N_HEAD_KV * n_seq_max * 4)
    if cfg.select == "qsigma":
        per_layer.append((2 * HEAD_DIM + 1) * N_HEAD_KV * n_seq_max * 4)
    return N_LAYER * sum(_pad(b, ALIGN) for b in per_layer)


def breakdown(ctx) -> tuple[int, int, int]:
    """(model, context, compute) bytes of llama.cpp's memory breakdown, over every buffer type."""
    out = (ctypes.c_size_t * 3)()
    assert C.sparq_llama_memory_breakdown(ctx, out) == 0
    return out[0], out[1], out[2]


CONFIGS = [
    SparqConfig(),                                            # the defaults: q8 index, key statistics
    SparqConfig(index="f16", select="q"),                     # the index alone
    SparqConfig(index="f16", mean="on"),                      # index, V sums, key statistics
    SparqConfig(default_layout=True, index="f16", select="q"),  # nothing kept
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["q8-qsigma", "f16-q", "f16-mean", "default-layout"])
@pytest.mark.parametrize("n_seq_max", [1, 3])
def test_breakdown_counts_the_derived_state(llm, cfg, n_seq_max):
    n_ctx = 1000 * n_seq_max  # not a multiple of 32: the q8 rows are padded
    with Ctx(llm.model, n_seq_max=n_seq_max, kv_unified=True, n_ctx=n_ctx) as c:
        model0, ctx0, _ = breakdown(c.ctx)
        c.set_sparq(cfg)
        model1, ctx1, _ = breakdown(c.ctx)
        n_ctx_real = lc.llama_n_ctx(c.ctx)
        c.set_sparq(SparqConfig(enabled=False))
        assert breakdown(c.ctx)[1] == ctx0  # switched off: freed
    assert model1 == model0
    assert ctx1 - ctx0 == derived_state_bytes(cfg, n_ctx_real, n_seq_max)


def _measuring_context(model_path: str, n_ctx: int, cfg: SparqConfig | None):
    """A context as -fit makes them: on a model loaded without allocating, no device; SparQ applied after creation
    (as the fit hook does). Returns (model, ctx); the caller frees both."""
    mp = lc.llama_model_default_params()
    mp.no_alloc, mp.load_mode = True, lc.LLAMA_LOAD_MODE_NONE
    no_devices = (ctypes.c_void_p * 1)(None)  # -dev none: host memory only, also in a CUDA build
    mp.devices = ctypes.cast(no_devices, ctypes.c_void_p)
    model = lc.llama_model_load_from_file(model_path.encode(), mp)
    assert model
    cp = lc.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = lc.llama_init_from_model(model, cp)
    assert ctx
    if cfg is not None:
        sparq_api.apply(ctx, cfg)
    return model, ctx, no_devices


def measured_total(model_path: str, n_ctx: int, cfg: SparqConfig | None) -> tuple[int, int, int]:
    model, ctx, _keep = _measuring_context(model_path, n_ctx, cfg)
    try:
        return breakdown(ctx)
    finally:
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def test_a_measuring_context_counts_what_an_allocated_one_holds(llm, smollm2_path):
    cfg = SparqConfig()
    model, ctx, _keep = _measuring_context(str(smollm2_path), 1024, cfg)
    try:
        assert "runs in 30 of 30 layers" in sparq_api.summary(ctx)
        measured = breakdown(ctx)
    finally:
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    dense = measured_total(str(smollm2_path), 1024, None)
    with Ctx(llm.model, n_ctx=1024) as c:
        c.set_sparq(cfg)
        allocated = breakdown(c.ctx)
    assert measured[1] == allocated[1]  # the KV cache with the derived state, byte for byte
    assert measured[1] - dense[1] == derived_state_bytes(cfg, 1024, 1)
    assert measured[2] >= dense[2] > 0  # compute buffers reserved again with SparQ's graphs


def _fitted_n_ctx(model_path: str, budget_mib: int, extra: list[str]) -> int:
    """llama-completion's context after -fit on with host memory minus budget_mib as its margin: the model, the
    context and the compute buffers must fit in budget_mib. Fitting interpolates linearly between its measurements at
    the smallest context it may choose (-fitc) and the trained one; from n_ubatch (512) cells on the compute
    buffers stay the same, so the memory is linear in the context over that range."""
    total_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // MiB  # what ggml's CPU device reports
    res = run(["llama-completion", "-m", model_path, "-dev", "none", "-fit", "on", "-fitt", str(total_mib - budget_mib),
               "-fitc", "512", "-p", "The capital of France is", "-n", "4", "--temp", "0", "-no-cnv", "-t", "2",
               "--no-warmup", *extra], timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    found = re.findall(r"generate: n_ctx = (\d+)", res.stdout + res.stderr)
    assert len(found) == 1, (res.stdout + res.stderr)[-3000:]
    return int(found[0])


@pytest.mark.parametrize("budget_mib", [300, 330])
def test_fit_leaves_room_for_the_derived_state(smollm2_path, budget_mib):
    path = str(smollm2_path)
    n_dense = _fitted_n_ctx(path, budget_mib, [])
    n_sparq = _fitted_n_ctx(path, budget_mib, ["--sparq"])
    assert 512 <= n_sparq < n_dense < 8192, (n_sparq, n_dense)  # both shrunk from the trained 8192, SparQ's more
    budget = budget_mib * MiB
    # what -fit measures, at the sizes it chose: SparQ's context fits the budget with its state, whereas the size
    # fitted without counting the state would not
    assert sum(measured_total(path, n_sparq, SparqConfig())) <= budget
    assert sum(measured_total(path, n_dense, SparqConfig())) > budget
    assert sum(measured_total(path, n_dense, None)) <= budget
    # and it is no smaller than it needs to be: 256 cells more (fit's rounding) would not fit
    assert sum(measured_total(path, n_sparq + 256, SparqConfig())) > budget


def test_llama_bench_fit_counts_the_derived_state(smollm2_path):
    # llama-bench fits each test's layers to memory at the context the test needs (here 1024 cells); with a budget
    # between what the test takes dense and with SparQ, only the SparQ test must be found not to fit
    path = str(smollm2_path)
    dense = sum(measured_total(path, 1024, None))
    sparq = sum(measured_total(path, 1024, SparqConfig()))
    assert sparq - dense >= derived_state_bytes(SparqConfig(), 1024, 1) > 4 * MiB
    budget_mib = (dense + sparq) // 2 // MiB
    total_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // MiB
    logs = {}
    for on in (0, 1):
        res = run(["llama-bench", "-m", path, "-dev", "none", "-fa", "1", "-p", "1024", "-n", "0", "-r", "1",
                   "--no-warmup", "-t", "2", "-fitt", str(total_mib - budget_mib), "-sparq", str(on), "-o", "jsonl"],
                  timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        logs[on] = res.stdout + res.stderr
    unable = "failed to fit params to free device memory: was unable to fit model into system memory"
    assert unable not in logs[0] and unable in logs[1], logs
