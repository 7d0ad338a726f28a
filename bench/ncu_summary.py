#!/usr/bin/env python3
"""Median duration per kernel from `ncu --metrics gpu__time_duration.sum --csv` output (for bench notes)."""
from __future__ import annotations

import collections
import csv
import sys

SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def main(path: str) -> int:
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
    for name, ts in times.items():
        print(f"{name:60s} n={len(ts):3d} median={sorted(ts)[len(ts) // 2]:9.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
