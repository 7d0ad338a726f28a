#!/usr/bin/env python3
"""GPU kernel time per decode token, by kernel name, from two `nsys stats --report cuda_gpu_kern_sum --format csv` runs
of the same command that differ only in the number of generated tokens (llama-bench `-n N1` and `-n N2`).

    python bench/nsys_step.py SHORT.csv LONG.csv TOKENS            # TOKENS = N2 - N1 (times the repetitions)
    python bench/nsys_step.py SHORT.csv LONG.csv TOKENS --top 40

Everything both runs do alike (model load, the depth's prefill, warm-up) cancels in the difference, so what is left is
the decode steps' own kernels: per name, instances and microseconds per token; then the sum. The sum is GPU busy time,
not the step's wall time (gaps between kernels and host work are not in it).
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path


def short_name(name: str) -> str:
    """A demangled kernel name up to its argument list (template arguments kept: they tell instances apart)."""
    depth = 0
    for i, ch in enumerate(name):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0 and i > 0:
            return name[:i].strip()[:70]
    return name.strip()[:70]


def kernel_totals(path: Path) -> dict[str, tuple[float, int]]:
    """Kernel name (up to its argument list) -> (total ns, instances)."""
    with path.open(newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    start = next(i for i, r in enumerate(rows) if "Total Time (ns)" in r)
    hdr = rows[start]
    ti, ni, ki = hdr.index("Total Time (ns)"), hdr.index("Instances"), hdr.index("Name")
    out: dict[str, tuple[float, int]] = {}
    for r in rows[start + 1:]:
        if len(r) <= max(ti, ni, ki):
            continue
        name = short_name(r[ki])
        t, n = out.get(name, (0.0, 0))
        out[name] = (t + float(r[ti].replace(",", "")), n + int(r[ni].replace(",", "")))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("short", type=Path)
    ap.add_argument("long", type=Path)
    ap.add_argument("tokens", type=int, help="decode tokens the long run makes beyond the short one")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    if args.tokens <= 0:
        ap.error("tokens must be > 0")
    a, b = kernel_totals(args.short), kernel_totals(args.long)
    per_token = []
    for name in set(a) | set(b):
        ta, na = a.get(name, (0.0, 0))
        tb, nb = b.get(name, (0.0, 0))
        per_token.append((name, (tb - ta) / args.tokens / 1e3, (nb - na) / args.tokens))
    per_token.sort(key=lambda x: -x[1])
    for name, us, n in per_token[:args.top]:
        print(f"{name:70s} {n:7.1f} per token {us:9.1f} us per token")
    print(f"{'all kernels':70s} {sum(x[2] for x in per_token):7.1f} per token "
          f"{sum(x[1] for x in per_token):9.1f} us per token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
