#!/usr/bin/env python3
"""llama-bench's centroid-sparse sweep: the -d prefix prepared at each keep vs dense, question prefill and decode.

    python bench/squeeze_llama_bench.py --depth 8192 --keep 0,0.3,0.2,0.1            # SmolLM2, this machine
    python bench/squeeze_llama_bench.py --model /tmp/models/llama2.gguf --ngl 99 --fa 1 --depth 65536

Runs `llama-bench -d DEPTH -p N_PROMPT -n N_GEN -squeeze-keep KEEPS -o json` (the prefix is clustered once per test,
untimed; every repetition removes only what follows it) and writes bench/results/squeeze_llama_bench[_TAG].json:
the rows, the speedups over the keep-0 (dense) rows, machine, commit, command and raw output.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

from cuda_common import provenance, write_record
from sparq_llama.models import fetch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: SmolLM2)")
    ap.add_argument("--bench", default=shutil.which("llama-bench") or "llama-bench")
    ap.add_argument("--depth", type=int, default=8192)
    ap.add_argument("--n-prompt", type=int, default=32, help="the question's tokens (a user-input prefill)")
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--keep", default="0,0.3,0.2,0.1")
    ap.add_argument("--centroids", default="0.05")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ngl", type=int, default=0)
    ap.add_argument("--fa", default=None, help="llama-bench -fa (0 or 1; default: llama-bench's own)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    model = args.model or str(fetch("smollm2"))
    cmd = [args.bench, "-m", model, "-d", str(args.depth), "-p", str(args.n_prompt), "-n", str(args.n_gen),
           "-r", str(args.reps), "-t", str(args.threads), "-ngl", str(args.ngl), "-squeeze-keep", args.keep,
           "-squeeze-centroids", args.centroids, "-o", "json", *(["-fa", args.fa] if args.fa is not None else [])]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"llama-bench failed ({res.returncode}):\n{res.stderr[-3000:]}")
    rows = json.loads(res.stdout)
    dense = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in rows if r["squeeze_keep"] == 0}
    speedups = []
    for r in rows:
        if r["squeeze_keep"] > 0 and (r["n_prompt"], r["n_gen"]) in dense:
            test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
            speedups.append({"keep": r["squeeze_keep"], "centroids": r["squeeze_centroids"], "test": test,
                             "tokens_per_s": r["avg_ts"], "speedup": r["avg_ts"] / dense[(r["n_prompt"], r["n_gen"])]})
            print(f"keep {r['squeeze_keep']:g} centroids {r['squeeze_centroids']:g} {test} @ d{args.depth}: "
                  f"{r['avg_ts']:.2f} t/s, {speedups[-1]['speedup']:.2f}x dense")
    out = Path(__file__).parent / "results" / f"squeeze_llama_bench{'_' + args.tag if args.tag else ''}.json"
    record = {**provenance(), "bench_command": cmd, "depth": args.depth, "speedups": speedups, "rows": rows,
              "stderr_tail": res.stderr[-6000:], "wall_s": round(time.time() - t0, 1)}
    write_record(out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
