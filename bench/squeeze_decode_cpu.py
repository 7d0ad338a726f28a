#!/usr/bin/env python3
"""Centroid-sparse attention end to end on the CPU: a fixed prefix prepared once, then questions against it.

    python bench/squeeze_decode_cpu.py                  # SmolLM2, 8k prefix (a play), keep 30/20/10% vs dense
    python bench/squeeze_decode_cpu.py --keeps 0.1 --centroids 0.05,0.1,0.15   # cluster fractions side by side
    python bench/squeeze_decode_cpu.py --model gemma3 --keeps 0.2,0.1,0.05 --append   # Gemma-3-270M

One process; per keep and cluster fraction: the preparation time (clustering, and calibration with two levels;
the prefix evaluation excluded), the user-input prefill of a question (one batch) and greedy decode steps after it, each against dense
attention over the same cache (the prepared prefix cleared). Per keep, every fraction is prepared first and saved;
each of `--reps` repetitions then loads each fraction in turn and runs it and dense, so fractions and dense
interleave (the cache is cut back to the prefix between runs). Times are medians over the repetitions; the ratios
are taken in this one run.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from record import RESULTS, append_run, provenance, write_record
from sparq_llama import Llama, squeeze, texts
from sparq_llama.models import fetch
from tqdm import tqdm

from llama_cpp import llama_cpp as lc  # isort: skip

QUESTION = "\n\nQuestion: Who speaks the first line of this scene, and to whom?\nAnswer:"


def decode(llm: Llama, tokens: list[int], pos0: int, want_last: bool = True) -> None:
    batch = lc.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, pos0 + i, 1, want_last and i == len(tokens) - 1
            batch.seq_id[i][0] = 0
        rc = lc.llama_decode(llm.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
    finally:
        lc.llama_batch_free(batch)


def answer_times(llm: Llama, n_prefix: int, question: list[int], n_steps: int) -> tuple[float, float]:
    """(question prefill s, mean decode step s) after the prefix; the cache is cut back to it first."""
    lc.llama_memory_seq_rm(lc.llama_get_memory(llm.ctx), 0, n_prefix, -1)
    t0 = time.perf_counter()
    decode(llm, question, n_prefix)
    t1 = time.perf_counter()
    tok = question[-1]
    for i in range(n_steps):
        decode(llm, [tok], n_prefix + len(question) + i)
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) / n_steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, default=8000)
    ap.add_argument("--keeps", default="0.3,0.2,0.1")
    ap.add_argument("--centroids", default=f"{squeeze.SqueezeConfig().centroids:g}",
                    help="comma-separated cluster fractions (default: SqueezeConfig's)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2", help="a model of sparq_llama.models (smollm2, gemma3)")
    ap.add_argument("--out", type=Path, default=RESULTS / "squeeze_decode_cpu.json")
    ap.add_argument("--append", action="store_true", help="add this run to --out's runs instead of replacing it")
    args = ap.parse_args()

    llm = Llama(str(fetch(args.model)), n_ctx=8192, n_batch=512, n_ubatch=512, flash_attn=True,
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    text = texts.read("hamlet_gut")
    prefix = llm.tokenize(text.encode(), add_bos=True)[:args.prefix]
    question = llm.tokenize(QUESTION.encode(), add_bos=False)
    t0 = time.perf_counter()
    llm.reset()
    llm.eval(prefix)
    prefill_s = time.perf_counter() - t0
    fractions = [float(c) for c in args.centroids.split(",")]
    rows = []
    for keep in [float(k) for k in args.keeps.split(",")]:
        prepared = {}
        for cent in fractions:
            # the cache holds exactly the prefix here: prepare it (the clustering only), keep it aside
            lc.llama_memory_seq_rm(lc.llama_get_memory(llm.ctx), 0, len(prefix), -1)
            t0 = time.perf_counter()
            info = squeeze.prepare(llm.ctx, prefix, squeeze.SqueezeConfig(centroids=cent, keep=keep))
            prepared[cent] = (info, time.perf_counter() - t0, Path(f"/tmp/squeeze_bench_{cent:g}.squeeze"))
            squeeze.save(llm.ctx, str(prepared[cent][2]))
            squeeze.clear(llm.ctx)
        times: dict[float, dict[str, list[float]]] = {c: {"decode_s": [], "dense_decode_s": [], "prefill_s": [],
                                                          "dense_prefill_s": []} for c in fractions}
        for _ in tqdm(range(args.reps), desc=f"keep {keep}"):
            for cent in fractions:
                t = times[cent]
                lc.llama_memory_seq_rm(lc.llama_get_memory(llm.ctx), 0, len(prefix), -1)
                squeeze.load(llm.ctx, str(prepared[cent][2]), prefix)
                pf, dec = answer_times(llm, len(prefix), question, args.steps)
                t["prefill_s"].append(pf)
                t["decode_s"].append(dec)
                squeeze.clear(llm.ctx)  # dense over the same cache
                pf, dec = answer_times(llm, len(prefix), question, args.steps)
                t["dense_prefill_s"].append(pf)
                t["dense_decode_s"].append(dec)
        for cent in fractions:
            info, prepare_s, _ = prepared[cent]
            t = times[cent]
            row = {"keep": keep, "centroids": cent, "rule": "budget", "n_layers": info.n_layers, "prepare_s": prepare_s, "n_clustered": info.n_clustered,
                   "decode_ms": 1e3 * statistics.median(t["decode_s"]),
                   "dense_decode_ms": 1e3 * statistics.median(t["dense_decode_s"]),
                   "prefill_ms": 1e3 * statistics.median(t["prefill_s"]),
                   "dense_prefill_ms": 1e3 * statistics.median(t["dense_prefill_s"]), "raw": t}
            row["decode_speedup"] = row["dense_decode_ms"] / row["decode_ms"]
            row["prefill_speedup"] = row["dense_prefill_ms"] / row["prefill_ms"]
            rows.append(row)
            print(f"keep {keep}, centroids {cent:g}: prepare {prepare_s:.1f} s ({info.n_layers} centroid-sparse "
                  f"layers); decode {row['decode_ms']:.1f} vs dense {row['dense_decode_ms']:.1f} ms "
                  f"({row['decode_speedup']:.2f}x); question prefill ({len(question)} tokens) {row['prefill_ms']:.0f} "
                  f"vs {row['dense_prefill_ms']:.0f} ms ({row['prefill_speedup']:.2f}x)")
    record = {**provenance("squeeze_decode_cpu"), "model": args.model, "prefix": len(prefix), "question_tokens": len(question),
              "threads": args.threads, "centroids": fractions, "prefix_eval_s": prefill_s, "steps": args.steps,
              "reps": args.reps, "rows": rows}
    (append_run if args.append else write_record)(args.out, record)
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
