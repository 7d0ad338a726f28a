#!/usr/bin/env python3
"""Median duration per kernel from `ncu --metrics gpu__time_duration.sum --csv` output (for bench notes).

    python bench/ncu_summary.py FILE.csv            # name, count, median, max, in first-seen order
    python bench/ncu_summary.py FILE.csv --total    # also the total per name, largest total first, and the sum
"""
from __future__ import annotations

import collections
import csv
import sys

SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def main(path: str, total: bool = False) -> int:
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if len(r) > 10]
    if not rows:
        print(f"{path}: no ncu rows")
        return 1
    hdr = rows[0]
    ki, vi, ui = hdr.index("Kernel Name"), hdr.index("Metric Value"), hdr.index("Metric Unit")
    times: dict[str, list[float]] = collections.defaultdict(list)
    for r in rows[1:]:
        times[r[ki].split("(")[0][:60]].append(float(r[vi].replace(",", "")) * SCALE.get(r[ui], 1.0))
    items = sorted(times.items(), key=lambda kv: -sum(kv[1])) if total else list(times.items())
    for name, ts in items:
        line = f"{name:60s} n={len(ts):4d} median={sorted(ts)[len(ts) // 2]:9.1f} max={max(ts):9.1f} us"
        print(line + (f" total={sum(ts):10.1f} us" if total else ""))
    if total:
        print(f"{'all kernels':60s} n={sum(map(len, times.values())):4d} total={sum(map(sum, times.values())):10.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--total" in sys.argv[2:]))
