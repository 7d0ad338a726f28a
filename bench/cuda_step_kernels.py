#!/usr/bin/env python3
"""A decode step's GPU kernels by name at a given depth, dense vs SparQ, through PyTorch's profiler (CUPTI).

    python bench/cuda_step_kernels.py --model random-llama2-7b-q8_0.gguf --depth 32768 --steps 16

Per mode, one process's model: the depth's tokens prefilled (random ids), a few decode steps to warm up (CUDA graphs
captured), then `--steps` decode steps under the profiler. CUPTI sees every kernel of the process, also the ones our
libllama launches from its CUDA graphs. Prints, per mode, each kernel's launches and microseconds per step and the sum
(GPU busy time, not wall time), and the steps' wall time; writes the table to --out. The device machine has no nsys;
this is what stands in for it.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from sparq_llama import Llama
from torch.profiler import ProfilerActivity, profile


def device_us(avg: object) -> float:
    """An averaged event's total device time in microseconds (the attribute's name differs between versions)."""
    for name in ("device_time_total", "cuda_time_total"):
        if hasattr(avg, name):
            return float(getattr(avg, name))
    raise AttributeError("profiler event without a device time")


def step_kernels(model: str, depth: int, steps: int, sparq: bool) -> dict:
    extra = {"sparq": True, "k1": 32, "k2": 128, "sparq_min_n_kv": 0} if sparq else {}
    llm = Llama(model, n_ctx=depth + steps + 64, n_gpu_layers=99, n_batch=2048, n_ubatch=512, flash_attn=True,
                verbose=False, **extra)
    rng = random.Random(0)
    n_vocab = llm.n_vocab()
    llm.eval([rng.randrange(100, n_vocab) for _ in range(depth)])
    for _ in range(4):
        llm.eval([rng.randrange(100, n_vocab)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.eval([rng.randrange(100, n_vocab)])
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    rows = [(a.key[:80], a.count / steps, device_us(a) / steps) for a in prof.key_averages() if device_us(a) > 0]
    rows.sort(key=lambda r: -r[2])
    llm.close()
    return {"wall_ms_per_step": wall_ms, "kernels": [{"name": n, "per_step": c, "us_per_step": t} for n, c, t in rows]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--depth", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--modes", default="dense,sparq")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = {"model": args.model, "depth": args.depth, "steps": args.steps}
    for mode in args.modes.split(","):
        r = result[mode] = step_kernels(args.model, args.depth, args.steps, mode == "sparq")
        total = sum(k["us_per_step"] for k in r["kernels"])
        print(f"{mode}: {r['wall_ms_per_step']:.2f} ms per step (wall), GPU busy {total / 1e3:.2f} ms in "
              f"{sum(k['per_step'] for k in r['kernels']):.0f} kernels")
        for k in r["kernels"][:args.top]:
            print(f"  {k['name']:80s} {k['per_step']:6.1f} x {k['us_per_step'] / max(k['per_step'], 1e-9):7.2f} us = "
                  f"{k['us_per_step']:8.1f} us per step")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
