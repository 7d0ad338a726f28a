#!/usr/bin/env python3
"""Cluster recall of centroid-sparse attention, per layer, in numpy: which clustering and scoring rule keeps the
cells that matter, measured on real queries and keys before any kernel changes.

Per retrieval example (the quality harness's: needles with distractors in a haystack, `sparq_llama.eval.tasks`),
the context, the question and the right answer are prefilled on a capture context (`eval.agreement.QKCapture`: each
layer's roped Q and K). As `prepare_fixed_context` does, the context's last `n_calib` tokens stay unclustered and
their queries calibrate one threshold over every layer and KV head for `keep`; the cells before them are clustered
per layer and KV head (spherical k-means, `reference_squeeze.kmeans_cosine`). The measured rows are the ones that
predict the answer's tokens (the question's last token, then the answer but its last token). Per layer, KV head and
row, over the clustered cells only (the others are read exactly anyway):

    recall = |top-k of the clustered cells by sum_g softmax_g  &  cells of kept clusters| / k        (k = 128)
    mass   = share of the group's mean attention weight on the clustered cells that kept clusters hold
    kept   = share of the clustered cells read
    needle = share of the asked needle's tokens ("The secret number of <name> is <number>.") in kept clusters
and the same three at the row's own budget (suffix _b: the row's best-scoring clusters up to `keep` of the clustered
cells), which takes the calibration's transfer from the prefix's last rows to the question out of the comparison.

Rules (name: clustering / scoring; every one scores with the variance term, w = 1, group max, 10% clusters unless it
says otherwise):
    centred        k-means of the keys minus the prefix's mean key (the mean shifts every score of a query alike but
                   dominates the keys' directions); the table (centroid, variances) of the keys themselves: the
                   default on models without a query norm
    keys           k-means of the keys themselves (the paper's, and the default before centring)
    w0             the keys' clusters, the paper's centroid-only score (w = 0)
    q-weighted     k-means of (k - mean) * rms(q) per component (rms over the calibration queries of the group):
                   distances that follow the score's, not the keys' raw geometry
    q-norm         k-means of (k - mean) * w, w per component from the model's query norm weights (QK-norm models;
                   the rms of each rotary pair's two weights, as RoPE mixes the pair): q-weighted without queries,
                   the default on QK-norm models (sparq-squeeze-cluster.cpp, query_weights)
    20%            k-means of the keys, 20% clusters
    group-mean     the keys' clusters, group mean

    python bench/squeeze_recall.py --model gemma3 --length 4096 --n 6 --seed 31
    python bench/squeeze_recall.py --model gemma3 --length 8192 --n 6 --seed 32 --rules keys,w0,centred,q-weighted,20% --append
    python bench/squeeze_recall.py --model smollm2 --length 4096 --n 3 --rules keys,centred,q-weighted,20%
    python bench/squeeze_recall.py --model gemma3 --length 4096 --n 6 --seed 31 --rules centred,q-weighted,q-norm --append
Writes bench/results/squeeze_recall_<model>.json (per rule: means per layer and overall, per-example rows).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from record import RESULTS, append_run, provenance, write_record
from sparq_llama import reference_squeeze as rs
from sparq_llama.eval import tasks
from sparq_llama.eval.agreement import QKCapture
from sparq_llama.eval.engine import Engine, EngineConfig
from sparq_llama.models import fetch
from tqdm import tqdm

TOP_K = 128
METRICS = ("recall", "mass", "kept", "needle", "recall_b", "mass_b", "needle_b")


@dataclass(frozen=True)
class Rule:
    cluster: str          # "keys", "centred", "q-weighted"
    centroids: float = 0.1
    var_weight: float = 1.0
    group: str = "max"


RULES = {
    "centred": Rule("centred"),
    "keys": Rule("keys"),
    "w0": Rule("keys", var_weight=0.0),
    "q-weighted": Rule("q-weighted"),
    "q-norm": Rule("q-norm"),
    "20%": Rule("keys", centroids=0.2),
    "group-mean": Rule("keys", group="mean"),
}


def table(keys: np.ndarray, assignment: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Centroids, sizes and per-component variances of the original keys [P, d] under an assignment."""
    sizes = np.bincount(assignment, minlength=n).astype(np.float64)
    cent = np.zeros((n, keys.shape[1]))
    np.add.at(cent, assignment, keys)
    live = sizes > 0
    cent[live] /= sizes[live, None]
    var = np.zeros_like(cent)
    np.add.at(var, assignment, (keys - cent[assignment]) ** 2)
    var[live] /= sizes[live, None]
    return cent, sizes, var


def clusters(rule: Rule, keys: np.ndarray, q_calib: np.ndarray, q_norm: np.ndarray | None,
             cache: dict) -> tuple[np.ndarray, ...]:
    """(assignment, centroids, sizes, variances) of the clustered keys [P, d] under the rule's clustering."""
    n = max(1, round(rule.centroids * len(keys)))
    key = (rule.cluster, n)
    if key not in cache:
        if rule.cluster == "keys":
            x = keys
        elif rule.cluster == "centred":
            x = keys - keys.mean(axis=0)
        elif rule.cluster == "q-norm":
            x = (keys - keys.mean(axis=0)) * (1.0 if q_norm is None else q_norm)
        else:  # q-weighted
            x = (keys - keys.mean(axis=0)) * np.sqrt((q_calib.reshape(-1, keys.shape[1]) ** 2).mean(axis=0))
        assignment = rs.kmeans_cosine(x, n).assignment
        cache[key] = (assignment, *table(keys, assignment, n))
    return cache[key]


def kept_clusters(s: np.ndarray, sizes: np.ndarray, threshold: float) -> np.ndarray:
    """The op's rule: live clusters scoring >= threshold, and always the best one (ties: lower index)."""
    live = sizes > 0
    kept = live & (s >= threshold)
    kept[int(np.argmax(np.where(live, s, -np.inf)))] = True
    return kept


def softmax_group(qg: np.ndarray, keys: np.ndarray, scale: float) -> np.ndarray:
    """Per head g of qg [G, d] the softmax over keys [n, d]: [G, n]."""
    z = scale * (qg @ keys.T)
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=1, keepdims=True)


def shares(kept_cell: np.ndarray, pc: np.ndarray, top: np.ndarray, needle: np.ndarray) -> dict[str, float]:
    return dict(recall=float(kept_cell[top].mean()), mass=float(pc[kept_cell].sum() / pc.sum()),
                kept=float(kept_cell.mean()), needle=float(kept_cell[needle].mean()) if needle.size else float("nan"))


def find(seq: list[int], part: list[int]) -> int:
    """Start of the first occurrence of part in seq (-1: none)."""
    for i in range(len(seq) - len(part) + 1):
        if seq[i:i + len(part)] == part:
            return i
    return -1


def query_norm_weights(model: Path) -> dict[int, np.ndarray]:
    """Per layer with a query norm (attn_q_norm): the k-means weights of its keys (rs.query_norm_weights)."""
    import gguf
    return {int(t.name.split(".")[1]): rs.query_norm_weights(t.data) for t in gguf.GGUFReader(str(model)).tensors
            if t.name.startswith("blk.") and t.name.endswith(".attn_q_norm.weight")}


def measure_example(cap: QKCapture, layers: list[int], n_ctx: int, n_calib: int, first_row: int, n_rows: int,
                    rules: list[str], keep: float, needle: np.ndarray,
                    q_norm: dict[int, np.ndarray]) -> dict[str, dict]:
    """Per rule: recall / mass / kept per (layer, KV head, measured row), the threshold calibrated over every
    layer and KV head."""
    d, n_head_kv = cap.d, cap.n_head_kv
    group = cap.n_head // n_head_kv
    scale = 1.0 / np.sqrt(d)
    n_clustered = n_ctx - n_calib
    keys = {il: np.concatenate(cap.k[il]).astype(np.float64) for il in layers}           # [n_tok, kv, d]
    queries = {il: np.concatenate(cap.q[il]).astype(np.float64) for il in layers}        # [rows from n_ctx - n_calib]
    out: dict[str, dict] = {}
    caches = {(il, h): {} for il in layers for h in range(n_head_kv)}
    for name in rules:
        rule = RULES[name]
        calib_rows, per = [], []
        for il in layers:
            for h in range(n_head_kv):
                kh = keys[il][:, h]
                qh = queries[il][:, h * group:(h + 1) * group]                           # [rows, G, d]
                asg, cent, sizes, var = clusters(rule, kh[:n_clustered], qh[:n_calib], q_norm.get(il),
                                                 caches[(il, h)])
                for t in range(n_calib):
                    calib_rows.append((rs.group_scores(qh[t], cent, sizes, scale, rule.group, None, var,
                                                       rule.var_weight), sizes))
                per.append((il, h, kh, qh, asg, cent, sizes, var))
        threshold = rs.calibrate_threshold(calib_rows, keep)
        rows = []
        for il, h, kh, qh, asg, cent, sizes, var in per:
            for r in range(first_row, first_row + n_rows):
                t = r - (n_ctx - n_calib)                                                # index into qh
                s = rs.group_scores(qh[t], cent, sizes, scale, rule.group, None, var, rule.var_weight)
                kept_cl = kept_clusters(s, sizes, threshold)
                kept_cell = kept_cl[asg]
                p = softmax_group(qh[t], kh[:r + 1], scale)                              # causal: cells 0..r
                pc = p[:, :n_clustered].sum(axis=0)
                top = np.argsort(-pc, kind="stable")[:TOP_K]
                order = np.argsort(-s, kind="stable")
                n_take = int(np.searchsorted(np.cumsum(sizes[order]), keep * n_clustered)) + 1
                budget = np.zeros(len(sizes), dtype=bool)
                budget[order[:n_take]] = True
                rows.append(dict(layer=il, head=h, row=r, **shares(kept_cl[asg], pc, top, needle),
                                 **{f"{k}_b": v for k, v in shares(budget[asg], pc, top, needle).items()
                                    if k != "kept"}))
        out[name] = dict(threshold=threshold, rows=rows)
    return out


def summarise(results: list[dict], layers: list[int]) -> dict[str, dict]:
    summary = {}
    for name in results[0]:
        rows = [r for ex in results for r in ex[name]["rows"]]
        per_layer = {il: {m: float(np.nanmean([r[m] for r in rows if r["layer"] == il])) for m in METRICS}
                     for il in layers}
        summary[name] = dict(per_layer=per_layer, **{m: float(np.nanmean([r[m] for r in rows]))
                                                     for m in METRICS})
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--n", type=int, default=6, help="examples (needle depths spread over 0.1 .. 0.9)")
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--keep", type=float, default=0.1)
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-calib", type=int, default=100)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--append", action="store_true", help="add this run to --out's runs instead of replacing it")
    args = ap.parse_args()
    rules = args.rules.split(",")
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        ap.error(f"unknown rules {unknown}; known: {', '.join(RULES)}")
    out = args.out or RESULTS / f"squeeze_recall_{args.model}.json"

    engine = Engine(EngineConfig(str(fetch(args.model)), n_ctx=args.length + 64, n_threads=args.threads))
    q_norm = query_norm_weights(fetch(args.model))
    depths = tuple(round(0.1 + 0.8 * i / max(1, args.n - 1), 3) for i in range(args.n))
    examples = tasks.retrieval_examples(engine, lengths=(args.length,), depths=depths, n_per_cell=1,
                                        n_distractors=2, seed=args.seed)
    results, per_example, layers = [], [], []
    t0 = time.time()
    for ex in tqdm(examples, desc="examples"):
        answer = engine.tokenize(f" {ex.meta['answer']}")
        tokens = ex.context + ex.tail + answer
        cap = QKCapture(engine, n_ctx=len(tokens), keep_q_from=len(ex.context) - args.n_calib)
        try:
            cap.prefill(tokens)
            layers = sorted(cap.sparq_layers) or sorted(cap.k)
            first = len(ex.context) + len(ex.tail) - 1
            part = engine.tokenize(tasks._needle(ex.meta["name"], ex.meta["answer"]))
            at = find(ex.context, part)
            needle = np.arange(at, at + len(part)) if 0 <= at and at + len(part) <= len(ex.context) - args.n_calib \
                else np.arange(0)
            res = measure_example(cap, layers, len(ex.context), args.n_calib, first, len(answer), rules, args.keep,
                                  needle, q_norm)
        finally:
            cap.close()
        results.append(res)
        per_example.append(dict(id=ex.id, depth=ex.meta["depth"], **{
            name: {m: float(np.nanmean([r[m] for r in res[name]["rows"]])) for m in METRICS}
            for name in rules}))
    summary = summarise(results, layers)
    print(f"{args.model}, {len(examples)} examples of {args.length} tokens, keep {args.keep}, layers {layers} "
          f"({time.time() - t0:.0f} s)")
    print(f"{'rule':>14} {'recall@128':>10} {'mass':>6} {'kept':>6} {'needle':>6} | at the row's budget: "
          f"{'recall':>6} {'mass':>6} {'needle':>6} | recall / needle per layer")
    for name, s in summary.items():
        pl = " ".join(f"{il}:{v['recall']:.2f}/{v['needle']:.2f}" for il, v in s["per_layer"].items())
        print(f"{name:>14} {s['recall']:>10.3f} {s['mass']:>6.3f} {s['kept']:>6.3f} {s['needle']:>6.3f} | "
              f"{'':>20} {s['recall_b']:>6.3f} {s['mass_b']:>6.3f} {s['needle_b']:>6.3f} | {pl}")
    (append_run if args.append else write_record)(out, dict(provenance("squeeze_recall"),
                           params=dict(model=args.model, length=args.length, n=args.n, seed=args.seed, keep=args.keep,
                                       n_calib=args.n_calib, top_k=TOP_K, rules={r: RULES[r].__dict__ for r in rules}),
                           layers=layers, summary=summary, examples=per_example))
    return 0


if __name__ == "__main__":
    sys.exit(main())
