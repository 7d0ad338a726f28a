#!/usr/bin/env python3
"""Centroid-sparse kept rules that look past a cluster's mean (issue 7), measured in numpy on SmolLM2's real Q and K.

    python bench/squeeze_kept_rule.py                  # examples 0 and 6 of squeeze_quality's 10, ~15 min on 2 cores
    python bench/squeeze_kept_rule.py --examples 2,5,7,8 --rules mean,var_diag_zr --keeps 0.1 --no-emulate \\
        --reference-centroids 0.5 --out bench/results/squeeze_kept_rule_more.json

The op keeps cluster i of a prepared prefix when its group score max_g exp(s q_g.C_i) / Z_g >= T (Z_g =
sum_j N_j exp(s q_g.C_j), s the kq scale, T one global threshold calibrated so that the prefix's last n_calib
queries keep `keep` of the clustered keys). exp(s q.C_i) / Z estimates a cluster's *mean* member weight, and
misses a retrieval head's single high-scoring key in a cluster of low mean score (bench/notes_squeeze_quality.md,
item 3). This script compares kept rules on the same captured tensors, three ways: covered softmax mass, the
needle's mass kept in the heads that read it, and the answer generated end to end.

1. Capture (llama.cpp's eval callback on a second context of the same model): per layer the post-RoPE "Qcur-<il>"
   and "Kcur-<il>" (the ROPE nodes), "Vcur-<il>" and the attention output "kqv_out-<il>", while the context is
   prefilled densely, the question runs, and dense's greedy answer is fed back token by token (as in
   squeeze_quality: example i of its --n 10 set). Checked (`verify_capture`) against llama.cpp's kqv_out on every
   captured row and layer: float64 softmax attention for the prefill rows (which ran through the f32 tiled
   kernel), and an emulation of the CPU kernel's own arithmetic (f16 Q, f16 V accumulator, split-KV decode) for
   the question and answer rows.
2. Cluster as the op does (sparq_llama.reference_squeeze.kmeans_cosine; lround(centroids * n_clustered) clusters
   per layer and KV head over the prefix minus its last n_calib cells).
3. Rules (`parse_rule`): cluster i's score for head g is exp(s z_g[i] - log Z_g), Z_g the op's normaliser (or,
   with _zr, sum_j N_j exp(s z_g[j]) of the rule's own z), the group decides by the max over its heads, the best
   cluster is always kept, T is calibrated per rule exactly as reference_squeeze.calibrate_threshold does:
     mean          q.C_i                                   (the op now)
     radius        q.C_i + |q| r_i, r_i = max_k |k - C_i|  (an upper bound on max_k q.k); radius_p90: r_i the
                                                             90th percentile of |k - C_i| (not a bound)
     quest         sum_d max(q_d lo_id, q_d hi_id)         (the members' per-component box: an upper bound)
     cap           |q| M cos(max(0, phi - theta_i))        (spherical cap about C_i/|C_i|: a bound)
     var_diag      q.C_i + (s/2) sum_d q_d^2 D_id          (E_k exp(s q.k) for keys Gaussian about C_i with the
                                                             members' per-component variances D_i); var_iso uses
                                                             tr(Sigma_i)/d, var_pc1 the top principal direction,
                                                             var_full the whole covariance
     oracle_pmean  the members' exact mean weight          (what `mean` estimates; reads every key)
     oracle_pmax   the best member's exact weight          (reads every key)
     oracle_max    max_k q.k over the members              (reads every key)
   Suffixes: _l<lam> z = q.C + lam (bound - q.C) (var_*: lam scales the variance term); _ln z = max(q.C, z -
   log(N_i)/s) (the mean of exp over the members is at least the best member's share); _rel the slack over the
   head's size-weighted mean slack only; _top<m> the mean rule plus each head's m best clusters by the rule.
4. On the question's rows (the question tail and dense's answer tokens fed back): per (layer, query head, row) the
   exact softmax mass (all visible cells) that the kept cells cover (cells not clustered are always kept); per
   (layer, KV head, row) the fraction of clustered keys kept; on needle rows (exact mass on the asked needle's
   sentence >= 0.3) the fraction of that needle mass kept.
5. End to end (`NumpyLlama`): the question and a greedy answer through SmolLM2 in numpy (GGUF weights
   dequantized, activations rounded to 8 bits as llama.cpp's CPU matmuls do), the prefix's K and V from the capture
   (the dense prefill, as with a prepared prefix), attention restricted per row to the rule's kept cells. Checked
   (`check_numpy_model`): with dense attention it reproduces the captured Q, K, V of the question and llama.cpp's
   answer tokens.

Writes bench/results/squeeze_kept_rule.json (per clustering, rule and keep: summaries pooled and per example,
answers; the capture and numpy-model checks; provenance).
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_common import provenance, write_record
from sparq_llama.reference_squeeze import calibrate_threshold, kmeans_cosine

log = logging.getLogger("squeeze_kept_rule")

F32 = NDArray[np.float32]
F64 = NDArray[np.float64]
I64 = NDArray[np.int64]

CAPTURED = ("Qcur", "Kcur", "Vcur", "kqv_out")
DEFAULT_RULES = ("mean,radius,radius_p90,radius_l0.25,quest,quest_l0.25,cap,radius_l0.25_ln_zr,quest_l0.25_ln_zr,"
                 "radius_top2,quest_top2,var_iso_zr,var_diag_zr,var_diag_l0.5,oracle_max_ln_zr,oracle_pmax,oracle_pmean")


# ---------------------------------------------------------------------------------------------------------------
# 1. Capture


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor of the pinned ggml (ggml.h: GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10,
    GGML_MAX_NAME 64); the layout is checked against ggml_get_name / ggml_nelements at the first call."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def _tensor_array(t: GgmlTensor) -> F32:
    """A float32 copy of an f32 tensor in host memory, shape (ne[3], ne[2], ne[1], ne[0]) with its strides."""
    if t.type != 0:
        raise RuntimeError(f"{t.name.decode()}: type {t.type}, expected f32 (0)")
    ne, nb = list(t.ne), list(t.nb)
    n_float = (sum((n - 1) * s for n, s in zip(ne, nb)) + 4 + 3) // 4
    flat = np.ctypeslib.as_array((ctypes.c_float * n_float).from_address(t.data))
    arr = np.lib.stride_tricks.as_strided(flat, shape=ne[::-1], strides=nb[::-1])
    return np.array(arr, dtype=np.float32, copy=True)


class TensorCapture:
    """The eval callback: copies Qcur (ROPE node), Kcur (ROPE node), Vcur and kqv_out of every layer.

    K and V are kept for every position; Q and kqv_out only for positions >= keep_from. `pos0` must hold the
    first position of the ubatch being computed (one sequence; n_batch == n_ubatch, so one ubatch per decode)."""

    def __init__(self, n_layer: int, n_pos: int, n_head: int, n_head_kv: int, d: int, keep_from: int) -> None:
        from sparq_llama._lib import libggml

        self.g = libggml()
        self.g.ggml_op_desc.argtypes = [ctypes.c_void_p]
        self.g.ggml_op_desc.restype = ctypes.c_char_p
        self.g.ggml_get_name.argtypes = [ctypes.c_void_p]
        self.g.ggml_get_name.restype = ctypes.c_char_p
        self.g.ggml_nelements.argtypes = [ctypes.c_void_p]
        self.g.ggml_nelements.restype = ctypes.c_int64
        self.keep_from = keep_from
        self.k = np.zeros((n_layer, n_pos, n_head_kv, d), np.float32)
        self.v = np.zeros((n_layer, n_pos, n_head_kv, d), np.float32)
        self.q = np.zeros((n_layer, n_pos - keep_from, n_head, d), np.float32)
        self.out = np.zeros((n_layer, n_pos - keep_from, n_head * d), np.float32)
        self.seen = {name: np.zeros((n_layer, n_pos), bool) for name in CAPTURED}
        self.pos0 = 0
        self.layout_checked = False
        self.error: BaseException | None = None
        from llama_cpp import llama_cpp as lc

        self.callback = lc.ggml_backend_sched_eval_callback(self._cb)  # referenced as long as the context lives

    def _wanted(self, t: GgmlTensor, ptr: int) -> tuple[str, int] | None:
        name = t.name.split(b"\0", 1)[0].decode(errors="replace")
        base, _, il = name.rpartition("-")
        if base not in CAPTURED or not il.isdigit():
            return None
        if base in ("Qcur", "Kcur") and self.g.ggml_op_desc(ptr) != b"ROPE":
            return None  # the pre-RoPE view carries the same name
        return base, int(il)

    def _check_layout(self, t: GgmlTensor, ptr: int) -> None:
        if self.g.ggml_get_name(ptr) != t.name.split(b"\0", 1)[0] or \
                self.g.ggml_nelements(ptr) != int(np.prod(list(t.ne))):
            raise RuntimeError("struct ggml_tensor layout mismatch (name or element count differs from ggml's)")
        self.layout_checked = True

    def _cb(self, ptr: int, ask: bool, _user: Any) -> bool:
        try:
            t = GgmlTensor.from_address(ptr)
            if not self.layout_checked:
                self._check_layout(t, ptr)
            hit = self._wanted(t, ptr)
            if ask or hit is None:
                return hit is not None
            base, il = hit
            a = _tensor_array(t)  # [.., n_tok, n_head, d] or [.., n_tok, n_head*d] (ggml order reversed)
            width = int(np.prod(self.q.shape[2:] if base in ("Qcur", "kqv_out") else self.k.shape[2:]))
            if a.size % width:
                raise RuntimeError(f"{base}-{il}: shape {a.shape} is not tokens x {width}")
            n_tok = a.size // width
            pos = np.arange(self.pos0, self.pos0 + n_tok)
            if base == "kqv_out":
                sel = pos >= self.keep_from
                self.out[il, pos[sel] - self.keep_from] = a.reshape(n_tok, -1)[sel]
            elif base == "Qcur":
                sel = pos >= self.keep_from
                self.q[il, pos[sel] - self.keep_from] = a.reshape(n_tok, *self.q.shape[2:])[sel]
            else:
                (self.k if base == "Kcur" else self.v)[il, pos] = a.reshape(n_tok, *self.k.shape[2:])
            self.seen[base][il, pos] = True
            return True
        except BaseException as e:  # noqa: BLE001 (reported after llama_decode returns)
            self.error = e
            return False


@dataclass
class Capture:
    """One example's captured tensors: k, v [L, n_pos, n_head_kv, d] (all positions); q [L, n_rows, n_head, d] and
    out [L, n_rows, n_head*d] for positions row0 .. n_pos-1; the prefix length, the question tail length, and the
    cells [start, end) of the asked needle's sentence in the prefix."""

    example_id: str
    q: F32
    k: F32
    v: F32
    out: F32
    row0: int
    n_prefix: int
    n_tail: int
    answer_text: str
    answer_expected: int
    scale: float
    needle: tuple[int, int]
    tail_tokens: list[int]
    answer_tokens: list[int]


def needle_span(engine: Any, ex: Any) -> tuple[int, int]:
    """Cells [start, end) of the asked needle's sentence (its tokens, as the task inserted them) in the context."""
    from sparq_llama.eval import tasks

    needle = engine.tokenize(tasks._needle(ex.meta["name"], ex.meta["answer"]))
    ctx = ex.context
    hits = [i for i in range(len(ctx) - len(needle) + 1) if ctx[i:i + len(needle)] == needle]
    if len(hits) != 1:
        raise RuntimeError(f"{ex.id}: the needle's tokens occur {len(hits)} times in the context")
    return hits[0], hits[0] + len(needle)


def _decode(lc: Any, ctx: Any, batch: Any, cap: TensorCapture, tokens: list[int], pos0: int, n_batch: int,
            logits_last: bool) -> None:
    for start in range(0, len(tokens), n_batch):
        chunk = tokens[start:start + n_batch]
        for i, tok in enumerate(chunk):
            batch.token[i] = tok
            batch.pos[i] = pos0 + start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = logits_last and start + i == len(tokens) - 1
        batch.n_tokens = len(chunk)
        cap.pos0 = pos0 + start
        rc = lc.llama_decode(ctx, batch)
        if cap.error is not None:
            raise RuntimeError("eval callback failed") from cap.error
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} at position {pos0 + start}")


def capture_example(engine: Any, ex: Any, n_calib: int, n_answer: int, threads: int) -> Capture:
    """Prefill the context, run the question and feed back dense's greedy answer through a context that captures
    Q, K, V and the attention output of every layer."""
    from llama_cpp import llama_cpp as lc

    shape = engine.shape
    n_layer = lc.llama_model_n_layer(engine.llm.model)
    p = len(ex.context)
    n_pos = p + len(ex.tail) + n_answer
    cap = TensorCapture(n_layer, n_pos, shape.n_head, shape.n_head_kv, shape.head_dim, p - n_calib)
    params = lc.llama_context_params()
    ctypes.memmove(ctypes.byref(params), ctypes.byref(engine.llm.context_params), ctypes.sizeof(params))
    params.n_ctx = max(params.n_ctx, n_pos + 8)
    params.n_threads = params.n_threads_batch = threads
    params.cb_eval = cap.callback
    params.cb_eval_user_data = None
    ctx = lc.llama_init_from_model(engine.llm.model, params)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    n_batch = int(params.n_batch)
    if params.n_ubatch != params.n_batch:
        raise RuntimeError("capture needs n_ubatch == n_batch (one ubatch per decode)")
    batch = lc.llama_batch_init(n_batch, 0, 1)
    try:
        t0 = time.time()
        _decode(lc, ctx, batch, cap, ex.context, 0, n_batch, False)
        log.info("%s: prefilled %d tokens in %.1f s", ex.id, p, time.time() - t0)
        _decode(lc, ctx, batch, cap, ex.tail, p, n_batch, True)
        pos, answer = p + len(ex.tail), []
        vocab = lc.llama_model_get_vocab(engine.llm.model)
        while True:
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(engine.n_vocab,))
            tok = int(np.argmax(logits))
            if lc.llama_vocab_is_eog(vocab, tok) or len(answer) == n_answer:
                break
            answer.append(tok)
            _decode(lc, ctx, batch, cap, [tok], pos, n_batch, True)
            pos += 1
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
    text = engine.detokenize(answer, prev=ex.context + ex.tail)
    log.info("%s: dense answer %r (expected %d)", ex.id, text, ex.meta["answer"])
    n_used = pos
    for name, seen in cap.seen.items():
        lo = 0 if name in ("Kcur", "Vcur") else p - n_calib
        if not seen[:, lo:n_used].all():
            raise RuntimeError(f"{name}: not every (layer, position) was captured")
    rows = n_used - (p - n_calib)
    return Capture(ex.id, cap.q[:, :rows], cap.k[:, :n_used], cap.v[:, :n_used], cap.out[:, :rows], p - n_calib, p,
                   len(ex.tail), text, int(ex.meta["answer"]), 1.0 / math.sqrt(shape.head_dim), needle_span(engine, ex),
                   list(ex.tail), answer)


def _fa_f16_partial(q: F32, t: I64, hk: I64, k16: F32, v16: F32, scale: float, lo: int,
                    hi: int) -> tuple[F32, F32, F32]:
    """ggml-cpu's flash_attn_ext_f16_one_chunk (f16 K and V) for rows q [N, d] (already rounded to f16) at
    positions t [N] (causal mask: cells > t skipped) reading KV head hk [N] over cells lo .. hi-1 of k16, v16
    [n, n_head_kv, d] (f16 values in f32): the f32 online softmax with the V accumulator held in f16 (one rounding
    per step).
    Returns M [N], S [N], VKQ [N, d]."""
    n_row, d = q.shape
    m = np.full(n_row, -np.inf, np.float32)
    ssum = np.zeros(n_row, np.float32)
    acc = np.zeros((n_row, d), np.float16)
    for ic in range(lo, min(hi, k16.shape[0])):
        s = (np.einsum("nd,nd->n", k16[ic, hk], q) * np.float32(scale)).astype(np.float32)
        s = np.where(ic <= t, s, np.float32(-np.inf))
        new = s > m
        ms = np.where(new, np.exp(np.where(new, m - s, 0.0)).astype(np.float32), np.float32(1.0))
        vs = np.where(new | (s == -np.inf), np.float32(1.0), np.exp(np.minimum(s - m, 0.0)).astype(np.float32))
        vs = np.where(s == -np.inf, np.float32(0.0), vs).astype(np.float32)
        m = np.where(new, s, m)
        acc = (acc.astype(np.float32) * ms[:, None]).astype(np.float16)
        acc = (acc.astype(np.float32) + v16[ic, hk] * vs[:, None]).astype(np.float16)
        ssum = (ssum * ms + vs).astype(np.float32)
    return m, ssum, acc.astype(np.float32)


def emulate_cpu_fattn(c: Capture, il: int, rows: I64, split_threads: int) -> F32:
    """llama.cpp's CPU flash attention output [len(rows), n_head*d] for captured rows that ran in small ubatches:
    rows of the question tail (one_chunk over every cell) or, with split_threads > 0, single-token decode rows
    (the split-KV path: the padded KV view, 256-cell multiples, cut into split_threads chunks, partials combined
    in f32)."""
    n_head, d = c.q.shape[2], c.q.shape[3]
    group = n_head // c.k.shape[2]
    heads = np.arange(n_head)
    q = c.q[il, rows].astype(np.float16).astype(np.float32).reshape(-1, d)             # [R*H, d]
    t = np.repeat(c.row0 + rows, n_head)
    hk = np.tile(heads // group, len(rows))
    k16 = c.k[il].astype(np.float16).astype(np.float32)                                 # [n, n_head_kv, d]
    v16 = c.v[il].astype(np.float16).astype(np.float32)
    if split_threads <= 0:
        m, ssum, acc = _fa_f16_partial(q, t, hk, k16, v16, c.scale, 0, k16.shape[0])
        return (acc / ssum[:, None]).reshape(len(rows), n_head * d)
    out = np.zeros((len(rows) * n_head, d), np.float32)
    n_kv_of = -(-(c.row0 + rows + 1) // 256) * 256      # each decode step's padded KV view
    for n_kv in np.unique(n_kv_of):                     # steps with the same view run together
        sl = np.repeat(n_kv_of == n_kv, n_head)
        chunk = -(-int(n_kv) // split_threads)
        n = int(sl.sum())
        mf, sf, vf = np.full(n, -np.inf, np.float32), np.zeros(n, np.float32), np.zeros((n, d), np.float32)
        for lo in range(0, int(n_kv), chunk):
            m, ssum, acc = _fa_f16_partial(q[sl], t[sl], hk[sl], k16, v16, c.scale, lo, lo + chunk)
            live = ssum != 0
            mn = np.maximum(mf, m)
            so = np.where(live, np.exp(mf - mn), 1.0).astype(np.float32)
            sn = np.where(live, np.exp(np.where(live, m - mn, 0.0)), 0.0).astype(np.float32)
            vf = np.where(live[:, None], vf * so[:, None] + acc * sn[:, None], vf)
            sf = np.where(live, sf * so + ssum * sn, sf)
            mf = np.where(live, mn, mf)
        out[sl] = vf / sf[:, None]
    return out.reshape(len(rows), n_head * d)


def verify_capture(c: Capture, threads: int, emulate: bool = True) -> dict[str, Any]:
    """Checks the capture against llama.cpp's kqv_out on every captured row of every layer: (1) dense softmax
    attention in float64 (K and V rounded to f16, as the cache holds them); (2) where emulate, the CPU kernel's
    own arithmetic for the rows that did not run in a large (tiled, f32) ubatch: the question tail (f16 V
    accumulator) and the answer's decode steps (split-KV path over `threads` chunks). Relative errors are
    max |y - ref| / max |ref| per (layer, row, head)."""
    n_layer, n_rows, n_head, d = c.q.shape
    group = n_head // c.k.shape[2]
    n_calib = c.n_prefix - c.row0
    kinds = {"prefill": np.arange(n_calib), "tail": np.arange(n_calib, n_calib + c.n_tail),
             "answer": np.arange(n_calib + c.n_tail, n_rows)}
    rel64 = np.zeros((n_layer, n_rows, n_head))
    rel_emul = {"tail": 0.0, "answer": 0.0}
    for il in range(n_layer):
        k = c.k[il].astype(np.float16).astype(np.float64)
        v = c.v[il].astype(np.float16).astype(np.float64)
        ref = c.out[il].astype(np.float64).reshape(n_rows, n_head, d)
        for g in range(n_head):
            h = g // group
            z = c.scale * (c.q[il, :, g].astype(np.float64) @ k[:, h].T)                 # [rows, n]
            z = np.where(np.arange(k.shape[0])[None, :] <= (c.row0 + np.arange(n_rows))[:, None], z, -np.inf)
            w = np.exp(z - z.max(axis=1, keepdims=True))
            y = (w / w.sum(axis=1, keepdims=True)) @ v[:, h]
            rel64[il, :, g] = np.abs(y - ref[:, g]).max(axis=1) / np.maximum(np.abs(ref[:, g]).max(axis=1), 1e-6)
        if emulate:
            for kind, split in (("tail", 0), ("answer", threads)):
                rows = kinds[kind]
                if rows.size:
                    y = emulate_cpu_fattn(c, il, rows, split).reshape(len(rows), n_head, d)
                    err = np.abs(y - ref[rows]).max(axis=2) / np.maximum(np.abs(ref[rows]).max(axis=2), 1e-6)
                    rel_emul[kind] = max(rel_emul[kind], float(err.max()))
    out: dict[str, Any] = {f"f64_max_rel_err_{kind}_rows": float(rel64[:, rows].max()) if rows.size else None
                           for kind, rows in kinds.items()}
    out["f64_median_rel_err"] = float(np.median(rel64))
    if emulate:
        out.update({f"cpu_kernel_emulation_max_rel_err_{k}_rows": v for k, v in rel_emul.items()})
    out["rows_checked"] = int(n_rows * n_layer * n_head)
    return out


def save_capture(path: Path, c: Capture) -> None:
    np.savez(path, q=c.q, k=c.k, v=c.v, out=c.out,
             tail_tokens=np.array(c.tail_tokens, np.int64), answer_tokens=np.array(c.answer_tokens, np.int64),
             meta=np.array([c.example_id, c.row0, c.n_prefix, c.n_tail, c.answer_text, c.answer_expected, c.scale,
                            c.needle[0], c.needle[1]], dtype=object))


def load_capture(path: Path) -> Capture:
    z = np.load(path, allow_pickle=True)
    eid, row0, n_prefix, n_tail, text, expected, scale, n0, n1 = z["meta"].tolist()
    return Capture(eid, z["q"], z["k"], z["v"], z["out"], int(row0), int(n_prefix), int(n_tail), text, int(expected),
                   float(scale), (int(n0), int(n1)), z["tail_tokens"].tolist(), z["answer_tokens"].tolist())


# ---------------------------------------------------------------------------------------------------------------
# 2. Clusters and their bounds


@dataclass(eq=False)
class ClusterStats:
    """One KV head's clusters with what the rules read: centroids [c, d], sizes [c], member order (cells sorted
    by cluster) and segment starts for the live clusters, radii (max and percentiles of |k - C|), the members'
    per-component box (mid, half-width), the spherical cap (cos of the widest member angle from C/|C|, largest
    and smallest member norm), and (when asked for) the members' covariance about C as the var_* rules read it:
    its diagonal [c, d], trace [c], top eigenvector [c, d] and eigenvalue [c], and the whole of it [c, d, d]."""

    centroids: F64
    sizes: I64
    assignment: I64
    order: I64
    starts: I64
    live: NDArray[np.bool_]
    radius: dict[int, F64]
    box_mid: F64
    box_half: F64
    cap_cos: F64
    norm_max: F64
    norm_min: F64
    var_diag: F64 | None = None
    var_tr: F64 | None = None
    pc1_vec: F64 | None = None
    pc1_val: F64 | None = None
    cov: F64 | None = None


def seeds_kpp(keys: F64, n_clusters: int, seed: int = 0) -> NDArray[np.int64]:
    """k-means++ seeding on the unit sphere (D^2 = 2 - 2 cos to the nearest chosen seed), deterministic by `seed`;
    the first seed is the first key (the op's even spacing starts there too)."""
    xn = keys / np.maximum(np.linalg.norm(keys, axis=1, keepdims=True), 1e-30)
    rng = np.random.default_rng(seed)
    chosen = [0]
    d2 = np.maximum(2.0 - 2.0 * xn @ xn[0], 0.0)
    for _ in range(1, n_clusters):
        tot = d2.sum()
        i = int(rng.choice(len(xn), p=d2 / tot)) if tot > 0 else int(np.argmax(d2))
        chosen.append(i)
        d2 = np.minimum(d2, np.maximum(2.0 - 2.0 * xn @ xn[i], 0.0))
    return np.asarray(chosen, dtype=np.int64)


def seeds_kpp_batched(keys: F64, n_clusters: int, batch: int, seed: int = 0) -> NDArray[np.int64]:
    """k-means++ seeding in rounds of `batch` seeds drawn together (weighted sampling without replacement by D^2,
    Efraimidis-Spirakis keys u^(1/w)), D^2 updated once per round: n_clusters / batch passes over the keys."""
    xn = keys / np.maximum(np.linalg.norm(keys, axis=1, keepdims=True), 1e-30)
    rng = np.random.default_rng(seed)
    chosen = [0]
    d2 = np.maximum(2.0 - 2.0 * xn @ xn[0], 0.0)
    while len(chosen) < n_clusters:
        b = min(batch, n_clusters - len(chosen))
        u = rng.random(len(xn))
        with np.errstate(divide="ignore"):
            key = np.where(d2 > 0, np.log(u) / d2, -np.inf)
        pick = np.argsort(-key, kind="stable")[:b]
        chosen.extend(int(i) for i in pick)
        d2 = np.minimum(d2, np.maximum(2.0 - 2.0 * (xn @ xn[pick].T).max(axis=1), 0.0))
    return np.asarray(chosen, dtype=np.int64)


def kmeans_from(keys: F64, n_clusters: int, n_iter: int, init: str) -> Any:
    """The op's spherical k-means (reference_squeeze.kmeans_cosine) from another set of initial keys: 'even' (the
    op's: evenly spaced positions) or 'kpp' (k-means++ seeding)."""
    if init == "even":
        return kmeans_cosine(keys, n_clusters, n_iter)
    rows = seeds_kpp_batched(keys, n_clusters, int(init[4:])) if init.startswith("kppb") else \
        seeds_kpp(keys, n_clusters, int(init[3:] or 0))
    return kmeans_cosine(keys, n_clusters, n_iter, init=rows)


def cluster_stats(keys: F64, n_clusters: int, n_iter: int, percentiles: tuple[int, ...],
                  need_cov: bool = False, keep_cov: bool = False, init: str = "even") -> ClusterStats:
    cl = kmeans_from(keys, n_clusters, n_iter, init)
    c, d = cl.centroids.shape
    live = cl.sizes > 0
    order = np.argsort(cl.assignment, kind="stable")
    starts = np.concatenate([[0], np.cumsum(cl.sizes[live])[:-1]]).astype(np.int64)
    dist = np.linalg.norm(keys - cl.centroids[cl.assignment], axis=1)[order]
    radius = {100: np.zeros(c)}
    radius[100][live] = np.maximum.reduceat(dist, starts)
    seg = np.split(dist, starts[1:])
    for p in percentiles:
        radius[p] = np.zeros(c)
        radius[p][live] = [np.percentile(s, p) for s in seg]
    ks = keys[order]
    lo, hi = np.zeros((c, d)), np.zeros((c, d))
    lo[live] = np.minimum.reduceat(ks, starts, axis=0)
    hi[live] = np.maximum.reduceat(ks, starts, axis=0)
    cnorm = np.linalg.norm(cl.centroids, axis=1)
    cdir = cl.centroids / np.where(cnorm > 0, cnorm, 1.0)[:, None]
    knorm = np.linalg.norm(keys, axis=1)
    cos = np.einsum("pd,pd->p", keys, cdir[cl.assignment]) / np.maximum(knorm, 1e-30)
    cap_cos, nmax, nmin = np.ones(c), np.zeros(c), np.zeros(c)
    cap_cos[live] = np.minimum.reduceat(np.clip(cos[order], -1, 1), starts)
    nmax[live] = np.maximum.reduceat(knorm[order], starts)
    nmin[live] = np.minimum.reduceat(knorm[order], starts)
    cs = ClusterStats(cl.centroids, cl.sizes, cl.assignment, order, starts, live, radius, (hi + lo) / 2,
                      (hi - lo) / 2, cap_cos, nmax, nmin)
    if need_cov:
        cov = np.zeros((c, d, d))
        res = np.split((keys - cl.centroids[cl.assignment])[order], starts[1:])
        for i, r in zip(np.flatnonzero(live), res):
            cov[i] = r.T @ r / r.shape[0]
        w, v = np.linalg.eigh(cov)                                  # ascending
        cs.var_diag, cs.var_tr = np.einsum("cdd->cd", cov).copy(), np.einsum("cdd->c", cov).copy()
        cs.pc1_vec, cs.pc1_val = v[:, :, -1].copy(), w[:, -1].copy()
        cs.cov = cov if keep_cov else None
    return cs


# ---------------------------------------------------------------------------------------------------------------
# 3. Rules


@dataclass(frozen=True)
class Rule:
    name: str
    bound: str          # mean, radius, quest, cap, oracle_max, oracle_pmax, oracle_pmean, var_{iso,diag,pc1,full}
    percentile: int     # radius: 100 = max
    lam: float          # z = q.C + lam (bound - q.C)
    rel: bool           # z = q.C + lam max(0, slack - the head's size-weighted mean slack), slack = bound - q.C
    top: int            # > 0: clusters kept by the mean rule's score and T, plus each head's top `top` by z
    zr: bool            # the normaliser from the rule's own z (sum_j N_j exp(s z_j)) instead of the op's
    ln: bool            # z = max(q.C, z - log(N_i) / s): mean exp(s q.k) over members >= exp(s max_k q.k) / N_i


def parse_rule(name: str) -> Rule:
    """mean | radius[_p<pct>] | quest | cap | var_{iso,diag,pc1,full} | oracle_{max,pmax,pmean}, then optional
    suffixes _l<lam>, _rel, _top<m>, _zr, _ln."""
    parts = name.split("_")
    if parts[:2] == ["oracle", "max"]:
        parts = ["oracle_max"] + parts[2:]
    if parts[:2] in (["oracle", "pmax"], ["oracle", "pmean"]) or parts[0] == "var":
        parts = ["_".join(parts[:2])] + parts[2:]
    bound, pct, lam, rel, top, zr, ln = parts[0], 100, 1.0, False, 0, False, False
    if bound not in ("mean", "radius", "quest", "cap", "oracle_max", "oracle_pmax", "oracle_pmean", "var_iso",
                     "var_diag", "var_pc1", "var_full"):
        raise ValueError(f"unknown rule {name!r}")
    for p in parts[1:]:
        if p.startswith("p") and bound == "radius":
            pct = int(p[1:])
        elif p == "ln":
            ln = True
        elif p.startswith("l"):
            lam = float(p[1:])
        elif p == "rel":
            rel = True
        elif p.startswith("top"):
            top = int(p[3:])
        elif p == "zr":
            zr = True
        else:
            raise ValueError(f"unknown rule suffix {p!r} in {name!r}")
    return Rule(name, bound, pct, lam, rel, top, zr, ln)


def quad_form(bound: str, q: F64, cs: ClusterStats) -> F64:
    """q^T Sigma_i q [n_q, c] for the members' covariance Sigma_i, exactly (var_full) or approximated from what a
    cluster would store: var_iso tr(Sigma)/d (1 scalar), var_diag its diagonal (d), var_pc1 its top principal
    direction and eigenvalue plus tr(Sigma) for an isotropic rest (d + 2)."""
    d = q.shape[1]
    if bound == "var_full":
        return np.einsum("nd,cde,ne->nc", q, cs.cov, q)
    if bound == "var_diag":
        return (q * q) @ cs.var_diag.T
    qq = (q * q).sum(axis=1, keepdims=True)
    if bound == "var_iso":
        return qq * (cs.var_tr / d)[None, :]
    proj = q @ cs.pc1_vec.T                     # [n_q, c]
    return cs.pc1_val[None, :] * proj ** 2 + (qq - proj ** 2) * ((cs.var_tr - cs.pc1_val) / max(d - 1, 1))[None, :]


def rule_logits(rule: Rule, q: F64, cs: ClusterStats, keys: F64, scale: float) -> F64:
    """z [n_q, c] (before the kq scale) for queries q [n_q, d] of one head; -inf for empty clusters."""
    qc = q @ cs.centroids.T
    if rule.bound == "mean":
        z = qc
    elif rule.bound.startswith("var_"):
        # E exp(s q.k) over members ~ exp(s q.C + s^2 q^T Sigma q / 2) (keys Gaussian about C)
        z = qc + rule.lam * 0.5 * scale * quad_form(rule.bound, q, cs)
    else:
        qn = np.linalg.norm(q, axis=1, keepdims=True)
        if rule.bound == "radius":
            b = qc + qn * cs.radius[rule.percentile][None, :]
        elif rule.bound == "quest":
            b = q @ cs.box_mid.T + np.abs(q) @ cs.box_half.T
        elif rule.bound == "cap":
            cnorm = np.linalg.norm(cs.centroids, axis=1)
            cos_phi = np.clip(qc / np.maximum(qn * cnorm[None, :], 1e-30), -1, 1)
            phi, theta = np.arccos(cos_phi), np.arccos(cs.cap_cos)[None, :]
            cos_gap = np.cos(np.maximum(phi - theta, 0.0))
            b = qn * np.where(cos_gap >= 0, cs.norm_max[None, :], cs.norm_min[None, :]) * cos_gap
        else:  # oracle_max
            member = (q @ keys[cs.order].T)
            b = qc.copy()
            b[:, cs.live] = np.maximum.reduceat(member, cs.starts, axis=1)
        slack = np.where(cs.live[None, :], b - qc, 0.0)
        if rule.rel:
            mean_slack = (slack * cs.sizes[None, :]).sum(axis=1, keepdims=True) / cs.sizes.sum()
            slack = np.maximum(slack - mean_slack, 0.0)
        z = qc + rule.lam * slack
    if rule.ln:
        z = np.maximum(qc, z - np.log(np.maximum(cs.sizes, 1))[None, :] / scale)
    return np.where(cs.live[None, :], z, -np.inf)


def log_norm(z: F64, cs: ClusterStats, scale: float) -> F64:
    """log Z [n_q] = log sum_j N_j exp(scale z_j) (the op's normaliser with z = q.C)."""
    zl = np.where(cs.live[None, :], scale * z + np.log(np.maximum(cs.sizes, 1))[None, :], -np.inf)
    m = zl.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(zl - m).sum(axis=1, keepdims=True)))[:, 0]


def _top_mask(z: F64, m: int) -> NDArray[np.bool_]:
    """[n, c]: the m largest entries of each row of z (finite ones only)."""
    m = min(m, z.shape[1])
    idx = np.argpartition(-z, m - 1, axis=1)[:, :m]
    mask = np.zeros(z.shape, bool)
    np.put_along_axis(mask, idx, True, axis=1)
    return mask & np.isfinite(z)


def group_decision(rule: Rule, qg: F64, cs: ClusterStats, keys: F64, scale: float) -> tuple[F64, NDArray[np.bool_]]:
    """For a group's queries qg [G, n_q, d]: the group scores s [n_q, c] that the threshold is compared with, and
    the clusters kept whatever T is, forced [n_q, c] (the best by s, the op's rule, and with rule.top > 0 each
    head's top clusters by the rule's z, while s is then the mean rule's score).

    s = max over g of exp(scale z_g - log Z_g), 0 for empty clusters, Z_g the op's normaliser."""
    s = np.zeros((qg.shape[1], cs.sizes.size))
    forced = np.zeros(s.shape, bool)
    score_rule = parse_rule("mean") if rule.top else rule
    for q in qg:
        z = rule_logits(score_rule, q, cs, keys, scale)
        lz = log_norm(z if rule.zr else q @ cs.centroids.T, cs, scale)
        sg = np.exp(np.minimum(scale * z - lz[:, None], 700.0))
        s = np.maximum(s, np.where(cs.live[None, :], sg, 0.0))
        if rule.top:
            forced |= _top_mask(rule_logits(rule, q, cs, keys, scale), rule.top)
    best = np.argmax(np.where(cs.live[None, :], s, -np.inf), axis=1)
    forced[np.arange(s.shape[0]), best] = True
    return s, forced


def calibrate(rows: list[tuple[F64, NDArray[np.bool_], I64]], keep: float) -> float:
    """The global threshold T at which the mean kept fraction of clustered keys over every calibration row (forced
    clusters always kept) reaches `keep`: calibrate_threshold's rule (the largest such T) with the forced set in
    place of the best cluster. rows: (s [n, c], forced [n, c], sizes [c]) per (layer, KV head)."""
    base, scores, weights, n_rows = 0.0, [], [], 0
    for s, forced, sizes in rows:
        frac = sizes / sizes.sum()
        base += float((forced * frac[None, :]).sum())
        other = ~forced & (sizes > 0)[None, :]
        scores.append(s[other])
        weights.append(np.broadcast_to(frac[None, :], s.shape)[other])
        n_rows += s.shape[0]
    s_all, w_all = np.concatenate(scores), np.concatenate(weights)
    if keep >= 1.0:
        return 0.0
    if base / n_rows >= keep:
        return float(np.nextafter(s_all.max(), np.inf)) if s_all.size else 0.0
    order = np.argsort(-s_all, kind="stable")
    cum = (base + np.cumsum(w_all[order])) / n_rows
    at = int(np.searchsorted(cum, keep - 1e-12))
    return float(s_all[order[min(at, s_all.size - 1)]])


# ---------------------------------------------------------------------------------------------------------------
# 4. Exact mass per cluster and the evaluation


@dataclass
class HeadData:
    """One (layer, KV head) of one clustering: sizes and liveness; per rule the group scores and forced clusters on
    the calibration rows and on the question rows ((s, forced), each [n_rows, c]); per query head of the group
    the exact softmax mass of the non-clustered visible cells [G, n_q] and of each cluster [G, n_q, c] on the
    question rows; the same for the asked needle's cells alone (needle_base, needle_mass)."""

    sizes: I64
    live: NDArray[np.bool_]
    calib: dict[str, tuple[F64, NDArray[np.bool_]]]
    question: dict[str, tuple[F64, NDArray[np.bool_]]]
    base: F64
    mass: F64
    needle_base: F64
    needle_mass: F64
    clusters: ClusterStats


def exact_probs(q: F64, keys_all: F64, positions: I64, scale: float) -> F64:
    """Causal softmax [G, n, n_pos] of queries q [G, n, d] at positions [n] over keys_all [n_pos, d]."""
    z = scale * np.einsum("gqd,pd->gqp", q, keys_all)
    z = np.where((np.arange(keys_all.shape[0])[None, :] <= positions[:, None])[None], z, -np.inf)
    p = np.exp(z - z.max(axis=2, keepdims=True))
    return p / p.sum(axis=2, keepdims=True)


def cluster_reduce(p: F64, cs: ClusterStats, op: np.ufunc) -> F64:
    """op.reduceat of p [..., n_clustered] over each live cluster's members; [..., c] (0 for empty clusters)."""
    out = np.zeros(p.shape[:-1] + (cs.sizes.size,))
    out[..., cs.live] = op.reduceat(p[..., cs.order], cs.starts, axis=-1)
    return out


def oracle_decision(rule: Rule, p: F64, cs: ClusterStats) -> tuple[F64, NDArray[np.bool_]]:
    """Oracle scores from the exact probabilities p [G, n, n_pos] (the clustered cells first): oracle_pmax, a
    cluster's best member's probability; oracle_pmean, its members' mean probability (what the mean rule
    estimates). Group max; the best cluster forced."""
    pc = p[:, :, :cs.assignment.size]
    if rule.bound == "oracle_pmax":
        sg = cluster_reduce(pc, cs, np.maximum)
    else:
        sg = cluster_reduce(pc, cs, np.add) / np.maximum(cs.sizes, 1)[None, None, :]
    s = sg.max(axis=0)
    forced = np.zeros(s.shape, bool)
    forced[np.arange(s.shape[0]), np.argmax(np.where(cs.live[None, :], s, -np.inf), axis=1)] = True
    return s, forced


def head_data(c: Capture, il: int, h: int, frac: float, rules: list[Rule], n_iter: int, init: str = "even") -> HeadData:
    n_head, n_head_kv = c.q.shape[2], c.k.shape[2]
    group = n_head // n_head_kv
    n_cl = c.row0                                  # clustered cells: the prefix minus its last n_calib
    keys_all = c.k[il, :, h].astype(np.float16).astype(np.float64)
    keys = keys_all[:n_cl]
    pcts = tuple(sorted({r.percentile for r in rules if r.bound == "radius" and r.percentile != 100}))
    cs = cluster_stats(keys, max(1, round(frac * n_cl)), n_iter, pcts,
                       need_cov=any(r.bound.startswith("var_") for r in rules),
                       keep_cov=any(r.bound == "var_full" for r in rules), init=init)
    n_calib = c.n_prefix - c.row0
    qg = c.q[il, :, h * group:(h + 1) * group].astype(np.float64).transpose(1, 0, 2)  # [G, rows, d]
    p = exact_probs(qg, keys_all, c.row0 + np.arange(qg.shape[1]), c.scale)
    parts = {"calib": slice(0, n_calib), "question": slice(n_calib, None)}
    dec: dict[str, dict[str, tuple[F64, NDArray[np.bool_]]]] = {k: {} for k in parts}
    for r in rules:
        for part, sl in parts.items():
            dec[part][r.name] = (oracle_decision(r, p[:, sl], cs) if r.bound.startswith("oracle_p")
                                 else group_decision(r, qg[:, sl], cs, keys, c.scale))
    pq = p[:, n_calib:]
    pn = np.zeros_like(pq)
    pn[:, :, c.needle[0]:c.needle[1]] = pq[:, :, c.needle[0]:c.needle[1]]
    return HeadData(cs.sizes, cs.live, dec["calib"], dec["question"], pq[:, :, n_cl:].sum(axis=2),
                    cluster_reduce(pq[:, :, :n_cl], cs, np.add), pn[:, :, n_cl:].sum(axis=2),
                    cluster_reduce(pn[:, :, :n_cl], cs, np.add), cs)


def _kept(s: F64, forced: NDArray[np.bool_], live: NDArray[np.bool_], threshold: float) -> NDArray[np.bool_]:
    return forced | (live[None, :] & (s >= threshold))


def evaluate(heads: list[list[HeadData]], rule: Rule, keep: float, n_answer_rows: int) -> dict[str, Any]:
    """Calibrate T for `rule` over every (layer, KV head, calibration row), then coverage and kept fraction on the
    question rows. heads[il][h]."""
    rows = [(*hd.calib[rule.name], hd.sizes) for layer in heads for hd in layer]
    threshold = calibrate(rows, keep)
    if not rule.top:  # the op's calibration (best cluster forced) must give the same T
        ref = calibrate_threshold([(s, hd.sizes) for layer in heads for hd in layer for s in hd.calib[rule.name][0]],
                                  keep)
        if not math.isclose(ref, threshold, rel_tol=1e-12, abs_tol=0.0):
            raise RuntimeError(f"{rule.name}: calibrate {threshold} != reference calibrate_threshold {ref}")
    n_layer, n_head_kv = len(heads), len(heads[0])
    group, n_q = heads[0][0].base.shape
    cover = np.zeros((n_layer, n_head_kv * group, n_q))
    needle = np.zeros((2, n_layer, n_head_kv * group, n_q))      # (kept, total) needle mass
    kept_frac = np.zeros((n_layer, n_head_kv, n_q))
    kept_calib = np.zeros((n_layer, n_head_kv))
    for il, layer in enumerate(heads):
        for h, hd in enumerate(layer):
            frac = hd.sizes / hd.sizes.sum()
            kq = _kept(*hd.question[rule.name], hd.live, threshold)
            kept_frac[il, h] = kq @ frac
            cover[il, h * group:(h + 1) * group] = hd.base + (hd.mass * kq[None]).sum(axis=2)
            needle[0, il, h * group:(h + 1) * group] = hd.needle_base + (hd.needle_mass * kq[None]).sum(axis=2)
            needle[1, il, h * group:(h + 1) * group] = hd.needle_base + hd.needle_mass.sum(axis=2)
            kept_calib[il, h] = (_kept(*hd.calib[rule.name], hd.live, threshold) @ frac).mean()
    return {"threshold": threshold, "cover": cover, "needle": needle, "kept": kept_frac,
            "kept_calib": float(kept_calib.mean()),
            "n_answer_rows": n_answer_rows}


def summarise(results: list[dict[str, Any]], needle_rows: float = 0.3) -> dict[str, Any]:
    """Pooled over examples: covered-mass statistics over (layer, head, row), all question rows and the answer
    rows alone; (layer, head) pairs with a row under 0.5; the kept fractions. Needle rows: (layer, head, row)
    whose exact mass on the asked needle's cells is >= needle_rows (the retrieval heads at work): the fraction of
    that needle mass the kept cells hold (mean, min) and the (layer, head) pairs with a needle row under 0.5."""
    ret, ret_low, ret_worst = [], [], []
    for r in results:
        kept, total = r["needle"]
        rows = total >= needle_rows
        frac = np.where(rows, kept / np.maximum(total, 1e-300), np.inf)
        ret.append(frac[rows])
        ret_low.append(int((frac.min(axis=2) < 0.5).sum()))
        if rows.any():
            il, g, row = np.unravel_index(int(np.argmin(frac)), frac.shape)
            ret_worst.append({"layer": int(il), "head": int(g), "row": int(row), "kept": float(frac[il, g, row]),
                              "needle_mass": float(total[il, g, row])})
    ret_all = np.concatenate(ret)
    allc = np.concatenate([r["cover"].ravel() for r in results])
    ans = np.concatenate([r["cover"][:, :, r["cover"].shape[2] - r["n_answer_rows"]:].ravel() for r in results])
    low = [int((r["cover"].min(axis=2) < 0.5).sum()) for r in results]
    worst = []
    for r in results:
        il, g, row = np.unravel_index(int(np.argmin(r["cover"])), r["cover"].shape)
        worst.append({"layer": int(il), "head": int(g), "row": int(row), "cover": float(r["cover"].min())})
    return {
        "cover_mean": float(allc.mean()), "cover_min": float(allc.min()), "cover_p1": float(np.percentile(allc, 1)),
        "cover_p5": float(np.percentile(allc, 5)),
        "answer_rows_cover_mean": float(ans.mean()) if ans.size else None,
        "answer_rows_cover_min": float(ans.min()) if ans.size else None,
        "pairs_below_0.5": low, "pairs_below_0.5_total": int(sum(low)),
        "needle_rows": int(ret_all.size), "needle_kept_mean": float(ret_all.mean()) if ret_all.size else None,
        "needle_kept_min": float(ret_all.min()) if ret_all.size else None,
        "needle_pairs_below_0.5": ret_low, "needle_pairs_below_0.5_total": int(sum(ret_low)),
        "needle_worst": ret_worst,
        "kept_question": float(np.mean([r["kept"].mean() for r in results])),
        "kept_calib": float(np.mean([r["kept_calib"] for r in results])),
        "thresholds": [r["threshold"] for r in results], "worst": worst,
    }


# ---------------------------------------------------------------------------------------------------------------
# 5. End to end: the question and the answer through a numpy SmolLM2 whose attention applies the kept rule


def _quant8(x: NDArray[np.float32]) -> NDArray[np.float32]:
    """x rounded as llama.cpp's CPU matmul quantizes activations for Q4_1 / Q8_0 weights (Q8_1 / Q8_0: blocks of 32,
    scale max|x| / 127 stored in f16, values rounded to integers)."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    d = np.abs(b).max(axis=-1, keepdims=True) / 127.0
    q = np.round(b / np.where(d > 0, d, 1.0))
    return (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape).astype(np.float32)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed (character -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class NumpyLlama:
    """The GGUF's llama-architecture model in numpy: weights dequantized to f32 and activations rounded to 8 bits
    before each quantized matmul (as llama.cpp's CPU path), RMSNorm, RoPE on adjacent pairs (LLAMA_ROPE_TYPE_NORM),
    SwiGLU, tied output. Attention runs in float64 over f16-rounded K and V cells with a pluggable cell selection;
    the prefix's K and V come from a capture (the dense prefill), so only the question and the answer run here."""

    def __init__(self, path: Path) -> None:
        import gguf

        r = gguf.GGUFReader(str(path))
        f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.") or k in (
            "tokenizer.ggml.tokens", "tokenizer.ggml.eos_token_id")}
        self.n_layer = int(f["llama.block_count"])
        self.n_head = int(f["llama.attention.head_count"])
        self.n_head_kv = int(f["llama.attention.head_count_kv"])
        self.d = int(f["llama.embedding_length"]) // self.n_head
        self.eps = float(f["llama.attention.layer_norm_rms_epsilon"])
        self.base = float(f["llama.rope.freq_base"])
        self.eos = int(f["tokenizer.ggml.eos_token_id"])
        self.vocab = list(f["tokenizer.ggml.tokens"])
        self.w: dict[str, tuple[NDArray[np.float32], bool]] = {}
        for t in r.tensors:
            arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            self.w[t.name] = (arr, t.tensor_type.name in ("Q4_1", "Q8_0"))
        self._bytes = _byte_decoder()

    def detokenize(self, tokens: list[int]) -> str:
        raw = bytes(self._bytes[ch] for t in tokens for ch in self.vocab[t] if ch in self._bytes)
        return raw.decode("utf-8", errors="replace")

    def _mm(self, x: NDArray[np.float32], name: str) -> NDArray[np.float32]:
        w, quantized = self.w[name]
        return (_quant8(x) if quantized else x) @ w.T

    def _norm(self, x: NDArray[np.float32], name: str) -> NDArray[np.float32]:
        return (x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps)) * self.w[name][0]

    def _rope(self, x: NDArray[np.float32], pos: I64) -> NDArray[np.float32]:
        theta = pos[:, None] * self.base ** (-np.arange(0, self.d, 2) / self.d)[None, :]       # [n, d/2]
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def forward(self, tokens: list[int], pos0: int, k_cache: list[F64], v_cache: list[F64], select: Any,
                trace: dict[int, tuple[F32, F32, F32]] | None = None) -> NDArray[np.float32]:
        """Run tokens at positions pos0.. (cells pos0.. of the caches [n_cells, n_head_kv, d] are written, f16-rounded);
        select(il, q [n_head, n, d] float64, positions [n], n_cells) -> visible-and-kept mask [n_head_kv, n, n_cells].
        Returns the logits of the last row; trace[il] = (q, k, v) post-RoPE when given."""
        n = len(tokens)
        pos = np.arange(pos0, pos0 + n)
        x = self.w["token_embd.weight"][0][tokens]
        group = self.n_head // self.n_head_kv
        scale = 1.0 / math.sqrt(self.d)
        for il in range(self.n_layer):
            b = f"blk.{il}."
            h_in = self._norm(x, b + "attn_norm.weight")
            q = self._rope(self._mm(h_in, b + "attn_q.weight").reshape(n, self.n_head, self.d), pos)
            k = self._rope(self._mm(h_in, b + "attn_k.weight").reshape(n, self.n_head_kv, self.d), pos)
            v = self._mm(h_in, b + "attn_v.weight").reshape(n, self.n_head_kv, self.d)
            if trace is not None:
                trace[il] = (q.copy(), k.copy(), v.copy())
            k_cache[il][pos] = k.astype(np.float16)
            v_cache[il][pos] = v.astype(np.float16)
            n_cells = pos0 + n
            qh = q.astype(np.float64).transpose(1, 0, 2)                                   # [H, n, d]
            mask = select(il, qh, pos, n_cells)
            out = np.zeros((n, self.n_head, self.d))
            for g in range(self.n_head):
                h = g // group
                z = scale * (qh[g] @ k_cache[il][:n_cells, h].T)
                z = np.where(mask[h], z, -np.inf)
                w = np.exp(z - z.max(axis=1, keepdims=True))
                out[:, g] = (w / w.sum(axis=1, keepdims=True)) @ v_cache[il][:n_cells, h]
            x = x + self._mm(out.reshape(n, -1).astype(np.float32), b + "attn_output.weight")
            h2 = self._norm(x, b + "ffn_norm.weight")
            gate, up = self._mm(h2, b + "ffn_gate.weight"), self._mm(h2, b + "ffn_up.weight")
            x = x + self._mm((gate / (1.0 + np.exp(-gate)) * up).astype(np.float32), b + "ffn_down.weight")
        last = self._norm(x[-1:], "output_norm.weight")
        return self._mm(last, "token_embd.weight")[0]


def dense_select(il: int, q: F64, pos: I64, n_cells: int, n_head_kv: int) -> NDArray[np.bool_]:
    return np.broadcast_to((np.arange(n_cells)[None, :] <= pos[:, None])[None], (n_head_kv, len(pos), n_cells))


def kept_select(heads: list[list[HeadData]], rule: Rule, threshold: float, row0: int, scale: float,
                k_cache: list[F64]) -> Any:
    """The op's cell selection with `rule`: per KV head and row, the clustered cells (< row0) of kept clusters
    (group decision against threshold, forced clusters) and every visible cell from row0 on."""
    def select(il: int, q: F64, pos: I64, n_cells: int) -> NDArray[np.bool_]:
        n_head_kv = len(heads[il])
        group = q.shape[0] // n_head_kv
        visible = np.arange(n_cells)[None, :] <= pos[:, None]
        mask = np.zeros((n_head_kv, len(pos), n_cells), bool)
        for h, hd in enumerate(heads[il]):
            cs, qg = hd.clusters, q[h * group:(h + 1) * group]
            keys_all = k_cache[il][:n_cells, h]
            if rule.bound.startswith("oracle_p"):
                s, forced = oracle_decision(rule, exact_probs(qg, keys_all, pos, scale), cs)
            else:
                s, forced = group_decision(rule, qg, cs, keys_all[:row0], scale)
            kept = _kept(s, forced, cs.live, threshold)                                 # [n, c]
            mask[h, :, :row0] = kept[:, cs.assignment]
            mask[h, :, row0:] = visible[:, row0:]
        return mask
    return select


def generate(model: NumpyLlama, c: Capture, select: Any, n_answer: int,
             trace: dict[int, tuple[F32, F32, F32]] | None = None, k_cache: list[F64] | None = None) -> list[int]:
    """Greedy answer: the question tail, then up to n_answer tokens, each through `select`, the prefix's K and V
    from the capture. k_cache, when given (empty), is filled with the K cache the selection may read."""
    n_cells = c.n_prefix + len(c.tail_tokens) + n_answer + 1
    if k_cache is None:
        k_cache = []
    k_cache[:] = [np.zeros((n_cells, model.n_head_kv, model.d)) for _ in range(model.n_layer)]
    v_cache = [np.zeros((n_cells, model.n_head_kv, model.d)) for _ in range(model.n_layer)]
    for il in range(model.n_layer):
        k_cache[il][:c.n_prefix] = c.k[il, :c.n_prefix].astype(np.float16)
        v_cache[il][:c.n_prefix] = c.v[il, :c.n_prefix].astype(np.float16)
    logits = model.forward(c.tail_tokens, c.n_prefix, k_cache, v_cache, select, trace)
    pos, out = c.n_prefix + len(c.tail_tokens), []
    while len(out) < n_answer:
        tok = int(np.argmax(logits))
        if tok == model.eos:
            break
        out.append(tok)
        if len(out) == n_answer:
            break
        logits = model.forward([tok], pos, k_cache, v_cache, select)
        pos += 1
    return out


def first_number_correct(text: str, expected: int) -> bool:
    """tasks.score's rule: the first number in the answer equals the needle's."""
    import re

    m = re.search(r"\d+", text)
    return bool(m) and int(m.group()) == expected


def check_numpy_model(model: NumpyLlama, c: Capture) -> dict[str, Any]:
    """The numpy model with dense attention against the capture: post-RoPE Q, K and V of the question tail per
    layer (max relative error over the tail rows) and the greedy answer."""
    trace: dict[int, tuple[F32, F32, F32]] = {}
    answer = generate(model, c, lambda il, q, pos, n: dense_select(il, q, pos, n, model.n_head_kv),
                      len(c.answer_tokens), trace)
    n_calib = c.n_prefix - c.row0
    rel = {}
    for name, idx in (("q", 0), ("k", 1), ("v", 2)):
        worst = 0.0
        for il in range(model.n_layer):
            mine = trace[il][idx]
            ref = (c.q[il, n_calib:n_calib + c.n_tail] if name == "q" else
                   (c.k if name == "k" else c.v)[il, c.n_prefix:c.n_prefix + c.n_tail])
            worst = max(worst, float(np.abs(mine - ref).max() / np.abs(ref).max()))
        rel[f"{name}_tail_max_rel_err"] = worst
    rel["layer0_q_max_rel_err"] = float(np.abs(trace[0][0] - c.q[0, n_calib:n_calib + c.n_tail]).max() /
                                        np.abs(c.q[0, n_calib:n_calib + c.n_tail]).max())
    text = model.detokenize(answer)
    return {**rel, "answer_tokens": answer, "answer": text, "llama_cpp_answer_tokens": c.answer_tokens,
            "same_tokens": answer == c.answer_tokens, "correct": first_number_correct(text, c.answer_expected)}


# ---------------------------------------------------------------------------------------------------------------


def examples_and_captures(args: argparse.Namespace) -> list[Capture]:
    """Captures of the chosen examples of squeeze_quality's retrieval set (from --cache-dir where present)."""
    caps: list[Capture] = []
    engine, examples = None, None
    for idx in args.examples:
        tag = f"_s{args.seed}n{args.n_set}" if args.seed else ""
        path = args.cache_dir / f"kept_rule_capture_{args.length}_{idx}{tag}.npz"
        if path.is_file() and not args.recapture:
            log.info("example %d: capture from %s", idx, path)
            caps.append(load_capture(path))
            continue
        if engine is None:
            from squeeze_quality import retrieval_setup

            engine, examples = retrieval_setup(args.length, args.n_set, args.threads, args.seed)
        c = capture_example(engine, examples[idx], args.n_calib, args.n_answer, args.threads)
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        save_capture(path, c)
        caps.append(c)
    if engine is not None:
        engine.close()
    return caps


def run_config(caps: list[Capture], frac: float, rules: list[Rule], keeps: list[float], n_iter: int,
               model: NumpyLlama | None, init: str = "even") -> dict[str, dict[str, Any]]:
    """Per example: cluster, score every rule, calibrate per keep, measure coverage; with a model, also generate
    the answer through the rule (end to end). Summaries per rule and keep, pooled and per example."""
    per_example: dict[str, dict[str, list]] = {r.name: {str(k): [] for k in keeps} for r in rules}
    answers: dict[str, dict[str, list]] = {r.name: {str(k): [] for k in keeps} for r in rules}
    for c in caps:
        t0 = time.time()
        n_layer, n_head_kv = c.k.shape[0], c.k.shape[2]
        heads = [[head_data(c, il, h, frac, rules, n_iter, init) for h in range(n_head_kv)] for il in range(n_layer)]
        n_answer_rows = c.q.shape[1] - (c.n_prefix - c.row0) - c.n_tail
        log.info("%s: centroids %g, clustered and scored in %.1f s", c.example_id, frac, time.time() - t0)
        for r in rules:
            for k in keeps:
                res = evaluate(heads, r, k, n_answer_rows)
                per_example[r.name][str(k)].append(res)
                if model is not None:
                    k_cache: list[F64] = []
                    select = kept_select(heads, r, res["threshold"], c.row0, c.scale, k_cache)
                    toks = generate(model, c, select, len(c.answer_tokens), k_cache=k_cache)
                    text = model.detokenize(toks)
                    answers[r.name][str(k)].append({"id": c.example_id, "answer": text,
                                                    "correct": first_number_correct(text, c.answer_expected),
                                                    "same_as_dense": toks == c.answer_tokens})
        del heads
    out: dict[str, dict[str, Any]] = {}
    for r in rules:
        out[r.name] = {}
        for k in keeps:
            res = per_example[r.name][str(k)]
            summ = summarise(res)
            summ["per_example"] = [summarise([x]) for x in res]
            ans = answers[r.name][str(k)]
            if ans:
                summ["answers"] = ans
                summ["accuracy"] = sum(a["correct"] for a in ans) / len(ans)
            out[r.name][str(k)] = summ
            log.info("centroids %-4g %-20s keep %-4g cover mean %.4f min %.4f p1 %.4f  pairs<0.5 %3d | needle rows %d "
                     "kept mean %s min %s pairs<0.5 %d | kept q %.3f (calib %.3f)%s", frac, r.name, k,
                     summ["cover_mean"], summ["cover_min"], summ["cover_p1"], summ["pairs_below_0.5_total"],
                     summ["needle_rows"], _f3(summ["needle_kept_mean"]), _f3(summ["needle_kept_min"]),
                     summ["needle_pairs_below_0.5_total"], summ["kept_question"], summ["kept_calib"],
                     " | answers " + " / ".join(repr(a["answer"]) for a in ans) if ans else "")
    return out


def _f3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_table(results: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> None:
    print("| centroids | rule | keep | cover mean | min | p1 | pairs < 0.5 | needle kept mean | min "
          "| needle pairs < 0.5 | kept (question) | kept (calib) | answers right |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for frac, by_rule in results.items():
        for rule, by_keep in by_rule.items():
            for keep, s in by_keep.items():
                acc = (f"{sum(a['correct'] for a in s['answers'])}/{len(s['answers'])}" if "answers" in s else "")
                print(f"| {frac} | {rule} | {keep} | {s['cover_mean']:.4f} | {s['cover_min']:.3f} | {s['cover_p1']:.3f}"
                      f" | {s['pairs_below_0.5_total']} | {_f3(s['needle_kept_mean'])} | {_f3(s['needle_kept_min'])} | "
                      f"{s['needle_pairs_below_0.5_total']} | {s['kept_question']:.3f} | {s['kept_calib']:.3f} | "
                      f"{acc} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--n-set", type=int, default=10, help="size of squeeze_quality's example set (depths spread)")
    ap.add_argument("--examples", type=lambda s: [int(x) for x in s.split(",")], default=[0, 6],
                    help="indices into that set (0: depth 0.1, 6: depth 0.633; dense answers both right)")
    ap.add_argument("--n-calib", type=int, default=100)
    ap.add_argument("--n-answer", type=int, default=8, help="dense answer tokens fed back as extra query rows")
    ap.add_argument("--n-iter", type=int, default=8)
    ap.add_argument("--centroids", type=float, default=0.05)
    ap.add_argument("--init", default="even",
                    help="k-means initial keys for --centroids: 'even' (the op's evenly spaced ones), 'kpp[S]' (k-means++ "
                         "seeding, generator seed S, default 0) or 'kppb<B>' (k-means++ in rounds of B seeds)")
    ap.add_argument("--seed", type=int, default=0, help="squeeze_quality's set (another seed: a held-out set)")
    ap.add_argument("--rules", default=DEFAULT_RULES, help="comma-separated rule names (module doc)")
    ap.add_argument("--keeps", default="0.3,0.2,0.1")
    ap.add_argument("--reference-centroids", default="0.1,0.15,0.3,0.5",
                    help="extra clusterings, mean rule only ('' none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/sparq_kept_rule"))
    ap.add_argument("--recapture", action="store_true")
    ap.add_argument("--no-emulate", action="store_true", help="skip the CPU flash-attention emulation check")
    ap.add_argument("--no-e2e", action="store_true", help="skip the end-to-end answers through the numpy model")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "squeeze_kept_rule.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    t0 = time.time()
    caps = examples_and_captures(args)
    checks = {}
    for c in caps:
        chk = verify_capture(c, args.threads, not args.no_emulate)
        chk.update({"answer": c.answer_text, "expected": c.answer_expected, "n_prefix": c.n_prefix,
                    "n_tail": c.n_tail, "n_answer_rows": int(c.q.shape[1] - (c.n_prefix - c.row0) - c.n_tail)})
        log.info("%s: capture check %s", c.example_id, chk)
        checks[c.example_id] = chk
    keeps = [float(k) for k in args.keeps.split(",")]
    rules = [parse_rule(r) for r in args.rules.split(",")]
    model, model_check = None, {}
    if not args.no_e2e:
        from sparq_llama.models import fetch

        model = NumpyLlama(fetch("smollm2"))
        for c in caps:
            model_check[c.example_id] = check_numpy_model(model, c)
            log.info("%s: numpy model check %s", c.example_id, model_check[c.example_id])
    results: dict[str, Any] = {str(args.centroids): run_config(caps, args.centroids, rules, keeps, args.n_iter, model,
                                                               args.init)}
    for frac in filter(None, args.reference_centroids.split(",")):
        results[frac] = run_config(caps, float(frac), [parse_rule("mean")], keeps, args.n_iter, model)
    print_table(results)
    commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    uname = subprocess.run(["uname", "-a"], capture_output=True, text=True, check=False).stdout.strip()
    write_record(args.out, {**provenance(), "commit": commit, "uname": uname or " ".join(platform.uname()),
                            "model": "smollm2", "length": args.length, "examples": [c.example_id for c in caps],
                            "n_calib": args.n_calib, "n_iter": args.n_iter, "init": args.init, "seed": args.seed, "group": "max", "keeps": keeps,
                            "capture_check": checks, "numpy_model_check": model_check, "results": results,
                            "wall_s": round(time.time() - t0, 1)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
