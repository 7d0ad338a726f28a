"""Selection agreement: per layer and KV head, the fraction of the exact top-k2 cells that SparQ's
approximate scores select (the paper's Figure 4e), to explain the task results.

A dense prefill of a window of text runs on a second llama.cpp context of the same model whose eval
callback copies out each layer's roped queries and keys (the tensors llama.cpp names `Qcur-<il>` and
`Kcur-<il>` and computes by ROPE). For the last `agreement_rows` positions, per layer, KV head and query
row (causal: every earlier cell is visible), with the GQA group's heads summed as the op does:

    exact  = top-k2 cells of sum_g softmax(sigma q_g . K)
    approx = top-k2 cells of sum_g p_hat_g, p_hat as the op computes it with the default index and selection
             (float64 reference; the q8 and q4 indexes quantize the row's visible keys in blocks of 32 cells, empty
             cells 0, as a cache holds them)
    agreement = |exact & approx| / k2

at the k1 of each target transfer ratio for that length (labels "1/2", "1/4", "1/8"), and with the "f16-q"
ablation also for the paper's index (f16 K^T, components of largest |q|) at 1/4 and 1/8 ("1/8-f16-q"). No window or sinks: this isolates the score
approximation. sigma = 1/sqrt(head_dim) (Llama-family and Gemma-3's query_pre_attn_scalar = head_dim).
Every layer is measured; the means are over the layers SparQ runs on by default (read off the graph: the
capture context has SparQ on with k2 above the window length, which is exact attention, and sliding-window
layers carry no SparQ node), the per-layer list has them all.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from .. import _bindings as C
from .. import reference as ref
from ..sparq import SparqConfig
from ..sparq import apply as apply_sparq
from ..sparq import DEFAULT_INDEX, DEFAULT_SELECT
from .settings import K2, PAPER_INDEX, PAPER_INDEX_RATIOS, TARGET_RATIOS, k1_for_ratio, ratio_label
from .tasks import PPL_WORKS, _Corpus

if TYPE_CHECKING:
    from .engine import Engine
    from .runner import EvalConfig


# Tokens per ubatch of the capture context. Its compute buffers are reserved for a whole ubatch: with a 28k-token
# Gemma-3 prompt as one ubatch the context could not be created on a 24 GiB machine. The callback appends each
# ubatch's Q and K, so the prompt may take several.
CAPTURE_UBATCH = 2048


class QKCapture:
    """A llama.cpp context on `engine`'s model that records roped Q and K per layer while it prefills."""

    def __init__(self, engine: Engine, n_ctx: int, keep_q_from: int) -> None:
        from llama_cpp import llama_cpp as lc

        self._lc, self.engine = lc, engine
        self.n_head, self.n_head_kv = engine.shape.n_head, engine.shape.n_head_kv
        self.d = engine.shape.head_dim
        self.keep_q_from = keep_q_from
        self.k: dict[int, list[np.ndarray]] = {}
        self.q: dict[int, list[np.ndarray]] = {}
        self._n_q: dict[int, int] = {}
        self.error: str | None = None
        self._cb = lc.ggml_backend_sched_eval_callback(self._callback)
        params = lc.llama_context_default_params()
        params.n_ctx = params.n_batch = n_ctx  # the whole prompt in one llama_decode
        params.n_ubatch = min(n_ctx, CAPTURE_UBATCH)
        params.n_threads = params.n_threads_batch = engine.llm.context_params.n_threads
        params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.cb_eval = self._cb
        params.cb_eval_user_data = None
        self.ctx = lc.llama_init_from_model(engine.llm.model, params)
        if not self.ctx:
            raise RuntimeError("could not create the capture context")
        # SparQ on with k2 >= every row's visible cells: exact attention (dense to rounding), and the graph
        # shows which layers SparQ runs on by default (sliding-window layers stay dense)
        self.sparq_layers: set[int] = set()
        try:
            apply_sparq(self.ctx, SparqConfig(k2=n_ctx, prefill=True, min_n_kv=0))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.ctx:
            self._lc.llama_free(self.ctx)
            self.ctx = None

    def _callback(self, t: int, ask: bool, _user: int) -> bool:
        name = (C.ggml_get_name(t) or b"").decode()
        kind, _, il = name.partition("-")
        if kind == "sparq_attn" and il.isdigit():
            self.sparq_layers.add(int(il))
        if kind not in ("Qcur", "Kcur") or not il.isdigit() or C.ggml_op_desc(t) != b"ROPE":
            return not ask
        if ask:
            return True
        n_heads = self.n_head if kind == "Qcur" else self.n_head_kv
        n = C.ggml_nelements(t)
        if not C.ggml_is_contiguous(t) or C.ggml_nbytes(t) != 4 * n or n % (n_heads * self.d):
            self.error = f"{name}: expected a contiguous f32 [{self.d}, {n_heads}, n_tok] tensor"
            return True
        buf = np.empty(n, dtype=np.float32)
        C.ggml_backend_tensor_get(t, buf.ctypes.data, 0, buf.nbytes)
        x = buf.reshape(-1, n_heads, self.d)                 # [n_tok, heads, d]
        layer = int(il)
        if kind == "Kcur":
            self.k.setdefault(layer, []).append(x)
        else:
            start = self._n_q.get(layer, 0)
            self._n_q[layer] = start + x.shape[0]
            keep = max(0, self.keep_q_from - start)
            if keep < x.shape[0]:
                self.q.setdefault(layer, []).append(x[keep:])
        return True

    def prefill(self, tokens: list[int]) -> None:
        lc = self._lc
        ids = (lc.llama_token * len(tokens))(*tokens)      # must outlive the decode
        batch = lc.llama_batch_get_one(ids, len(tokens))
        rc = lc.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} on the capture context")
        lc.llama_synchronize(self.ctx)
        if self.error:
            raise RuntimeError(f"selection agreement: {self.error}")
        if not self.k:
            raise RuntimeError("selection agreement: the model's graph has no roped Qcur/Kcur tensors "
                               "(this measurement needs a RoPE attention model)")


def window_agreement(q: np.ndarray, k: np.ndarray, first_row: int, k1s: dict[str, tuple[int, str, str]], k2: int,
                     n_head_kv: int) -> dict[str, np.ndarray]:
    """Mean agreement [n_head_kv] per label for query rows q [n_rows, n_head, d] at positions first_row.. against
    keys k [n_tok, n_head_kv, d] (row t sees cells 0..first_row + t); k1s: label -> (k1, select, index)."""
    n_rows, n_head, d = q.shape
    group = n_head // n_head_kv
    sigma = 1.0 / math.sqrt(d)
    out = {label: np.zeros(n_head_kv) for label in k1s}
    for h in range(n_head_kv):
        for t in range(n_rows):
            n_vis = first_row + t + 1
            kk = k[:n_vis, h].astype(np.float64)
            qg = q[t, h * group:(h + 1) * group].astype(np.float64)
            exact = ref.exact_top_cells(qg, kk, k2, scale=sigma)
            for label, (k1, select, index) in k1s.items():
                approx = ref.approx_top_cells(qg, kk, k1, k2, scale=sigma, select=select, index=index)
                out[label][h] += np.intersect1d(exact, approx).size / k2 / n_rows
    return out


def variants(n_kv: int, head_dim: int, mean: bool, ablations: tuple[str, ...]) -> dict[str, list]:
    """label -> [k1, select, index]: the default index and selection at each target ratio, and with the "f16-q"
    ablation the paper's at its ratios (k1 by each index's bytes)."""
    out = {ratio_label(r): [k1, DEFAULT_SELECT, DEFAULT_INDEX] for r in TARGET_RATIOS
           if (k1 := k1_for_ratio(r, n_kv, head_dim, K2, mean, index=DEFAULT_INDEX))}
    if "f16-q" in ablations:
        index, select = PAPER_INDEX
        out.update({f"{ratio_label(r)}-f16-q": [k1, select, index] for r in PAPER_INDEX_RATIOS
                    if (k1 := k1_for_ratio(r, n_kv, head_dim, K2, mean, index=index))})
    if "q4" in ablations and head_dim % 8 == 0:
        out["q4"] = [head_dim, DEFAULT_SELECT, "q4"]  # every component; select plays no part
    return out


def measure(engine: Engine, cfg: EvalConfig, done: dict[str, Any], *, progress: bool = True,
            save: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Agreement per length, window, layer and KV head (resumes from `done`); with per-ratio means."""
    corpus = _Corpus(engine)
    result = dict(done)
    jobs = [(n, w) for n in cfg.agreement_lengths for w in range(cfg.agreement_windows)]
    for length, w in tqdm(jobs, desc="selection agreement", unit="window", disable=not progress):
        key = f"{length}/{w}"
        first_row = length - cfg.agreement_rows
        k1s = variants(first_row, engine.shape.head_dim, engine.shape.mean_auto, cfg.ablations)
        if result.get("windows", {}).get(key, {}).get("k1") == k1s:
            continue
        rng = random.Random(f"agreement/{cfg.seed}/{length}/{w}")
        tokens = [engine.bos] + corpus.window(PPL_WORKS[w % len(PPL_WORKS)], length - 1, rng)
        cap = QKCapture(engine, length, keep_q_from=first_row)
        try:
            cap.prefill(tokens)
            per_layer = {label: [] for label in k1s}
            for layer in sorted(cap.k):
                k = np.concatenate(cap.k[layer])
                q = np.concatenate(cap.q[layer])
                agree = window_agreement(q, k, first_row, k1s, K2, engine.shape.n_head_kv)
                for label in k1s:
                    per_layer[label].append(agree[label].round(4).tolist())
        finally:
            cap.close()
        result.setdefault("windows", {})[key] = {"length": length, "k1": k1s, "k2": K2, "rows": cfg.agreement_rows,
                                                 "per_layer": per_layer, "sparq_layers": sorted(cap.sparq_layers)}
        save()
    result["summary"] = _summary(result.get("windows", {}))
    return result


def _summary(windows: dict[str, Any]) -> dict[str, Any]:
    """Per length and ratio: mean agreement, its SE over (layer, head) cells, the per-layer means."""
    out: dict[str, Any] = {}
    for win in windows.values():
        for label, layers in win["per_layer"].items():
            k1, select, index = win["k1"][label]
            slot = out.setdefault(str(win["length"]), {}).setdefault(
                label, {"k1": k1, "select": select, "index": index, "sparq_layers": win["sparq_layers"], "cells": []})
            slot["cells"].append(np.asarray(layers))         # [n_layer, n_head_kv]
    for by_ratio in out.values():
        for slot in by_ratio.values():
            cells = np.mean(slot.pop("cells"), axis=0)      # mean over windows
            flat = cells[slot["sparq_layers"]].ravel()      # the layers SparQ runs on by default
            slot["mean"] = float(flat.mean())
            slot["se"] = float(flat.std(ddof=1) / math.sqrt(flat.size)) if flat.size > 1 else float("nan")
            slot["per_layer"] = cells.mean(axis=1).round(4).tolist()
            layer_means = cells.mean(axis=1)
            slot["min_layer"] = min(slot["sparq_layers"], key=lambda il: layer_means[il])
    return out
