#!/usr/bin/env python3
"""Medians of the SparQ CUDA op's kernel timeline (SPARQ_CUDA_TIMELINE=1 lines in a log) per (n_kv, rows).

Each line holds, per kernel, the first block's start, the first block past its wait on the predecessor, the last
warp's end and the last block's start, in microseconds from the chain's start (kernel A's starts are not recorded:
"-"). Printed per kernel: the medians of those, `gap` (past its wait minus the predecessor's end: the dependent
launch's hand-over) and `body` (its end minus the later of its wait and the predecessor's end).

    python bench/timeline_summary.py timeline.log [--json out.json]

The log comes from the instrumented build (the timeline compiles only under -DSPARQ_CUDA_INSTRUMENT), e.g.
    SPARQ_CUDA_TIMELINE=1 python bench/cuda_op.py --one 32768 1 --runs 21 > timeline.log 2>&1
(docs/performance.md, "Per-kernel times").
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"sparq timeline n_kv (\d+) rows (\d+) \(us: [a-z /]+\):(.*)")
KERNELS = ("Q", "A", "P", "B", "S", "PBS", "BS", "LV")


def parse(path: Path) -> dict[tuple[int, int], list[dict[str, list[float | None]]]]:
    runs: dict[tuple[int, int], list[dict[str, list[float | None]]]] = defaultdict(list)
    for line in path.read_text(errors="replace").splitlines():
        m = LINE.search(line)
        if not m:
            continue
        run = {}
        for part in m[3].split(";"):
            f = part.split()
            if len(f) in (4, 5) and f[0] in KERNELS:  # three marks (no last block start) are read too
                run[f[0]] = [None if x == "-" else float(x) for x in f[1:]] + [None] * (5 - len(f))
        runs[(int(m[1]), int(m[2]))].append(run)
    return runs


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarise(runs: list[dict[str, list[float | None]]]) -> dict[str, dict[str, float | None]]:
    out = {}
    for i, k in enumerate(KERNELS):
        fields = defaultdict(list)
        for run in runs:
            if k not in run:
                continue
            start, waited, end, last = run[k]
            prev = next((run[p][2] for p in reversed(KERNELS[:i]) if p in run), None)
            for name, v in (("start", start), ("waited", waited), ("end", end), ("last_start", last)):
                if v is not None:
                    fields[name].append(v)
            if waited is not None and prev is not None:
                fields["gap"].append(waited - prev)
            if prev is not None:
                fields["body"].append(end - max(prev, waited if waited is not None else prev))
        if fields:
            out[k] = {name: median(v) for name, v in fields.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result = {}
    for (n_kv, rows), runs in sorted(parse(args.log).items()):
        summary = summarise(runs)
        result[f"{n_kv}/{rows}"] = {"n_kv": n_kv, "rows": rows, "runs": len(runs), "kernels": summary}
        print(f"n_kv {n_kv}, rows {rows}, {len(runs)} runs (medians, us)")
        print(f"  {'kernel':6} {'start':>7} {'waited':>7} {'end':>7} {'last':>7} {'gap':>6} {'body':>6}")
        for k, f in summary.items():
            cells = [f.get(x) for x in ("start", "waited", "end", "last_start", "gap", "body")]
            print(f"  {k:6} " + " ".join("      -" if v is None else f"{v:7.2f}" for v in cells[:4]) + " "
                  + " ".join("     -" if v is None else f"{v:6.2f}" for v in cells[4:]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
