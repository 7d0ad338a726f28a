#!/usr/bin/env python3
"""The SparQ op on CUDA with each index against flash attention, one decode step (B = 1), in one run.

For each head shape (Llama-2-7B: 32 KV heads; Llama-3-8B: 8 KV heads, 4 query heads each) and cell count S, each
index at its default k1 (q8: d/2 components; q4: every component) is measured by `bench/cuda_op.py --one` (its own
process: a CUDA error is recorded, not fatal), the indexes one after another per (shape, S), so their ratio is taken
on the same machine state. Flash attention is measured in each call; the table shows each index's speedup and the
q4 index's time over the q8 index's.

    python bench/cuda_op_index.py [--seqs 4096,32768,131072] [--runs 30] [--out bench/results/cuda_op_index.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from record import RESULTS, provenance, write_record

INDEXES = ("q8", "q4")
SHAPES = ("llama2-7b", "llama3-8b")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="4096,32768,131072")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", type=Path, default=RESULTS / "cuda_op_index.json")
    args = ap.parse_args()
    op = Path(__file__).with_name("cuda_op.py")
    rows, commands = [], []
    print(f"{'heads':>10} {'S':>7} {'index':>5} {'sparq us':>9} {'flash us':>9} {'speedup':>8}", flush=True)
    for heads in SHAPES:
        for s in (int(x) for x in args.seqs.split(",")):
            for index in INDEXES:
                cmd = [sys.executable, str(op), "--one", str(s), "1", "--runs", str(args.runs), "--heads", heads,
                       "--index", index]
                commands.append(" ".join(cmd[1:]))
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    rows.append(dict(heads=heads, S=s, index=index, error=proc.stderr[-2000:]))
                    print(f"{heads:>10} {s:>7} {index:>5} failed", flush=True)
                    continue
                row = dict(heads=heads, index=index, **json.loads(proc.stdout.strip().splitlines()[-1]))
                rows.append(row)
                print(f"{heads:>10} {s:>7} {index:>5} {row['sparq_us']:>9.1f} {row['flash_us']:>9.1f} "
                      f"{row['speedup']:>7.2f}x", flush=True)
    summary = []
    for heads in SHAPES:
        for s in (int(x) for x in args.seqs.split(",")):
            by = {r["index"]: r for r in rows if r["heads"] == heads and r["S"] == s and "error" not in r}
            if set(by) == set(INDEXES):
                summary.append(dict(heads=heads, S=s, q8_speedup=by["q8"]["speedup"], q4_speedup=by["q4"]["speedup"],
                                    q4_over_q8_time=by["q4"]["sparq_us"] / by["q8"]["sparq_us"]))
    for r in summary:
        print(f"{r['heads']} S = {r['S']}: q4 / q8 time {r['q4_over_q8_time']:.3f}")
    write_record(args.out, dict(provenance("cuda_op_index"), params=dict(runs=args.runs, k2=128, kv="f16", B=1,
                                                                          select="qsigma (q8; q4 chooses none)",
                                                                          statistic="median"),
                                commands=commands, summary=summary, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
