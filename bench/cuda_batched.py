#!/usr/bin/env python3
"""Benchmark (c): batched decode on CUDA, dense flash attention vs SparQ, with llama-batched-bench.

Random-weight GGUFs of the Llama-2-7B and Llama-3-8B shapes (as bench/cuda_e2e.py), llama-batched-bench -fa on
-ngl 99 -ntg 32 -npl 1,8,16 with 8k prompts for Llama-2 and 16k for Llama-3, SparQ at the default index and k1,
k2 = 128 on every layer, and dense with 16-token prompts (the step's cost outside attention: `bound` is the speedup
that free attention would give). Writes bench/results/cuda_batched.json: aggregate generation tokens/s per batch
size, the targets at B = 16, and the tool's raw output. K and V are f16 unless --cache-type says otherwise (q8_0: 34
bytes per 32 values, as llama.cpp's -ctk/-ctv q8_0). A batch size whose cache (K, V and SparQ's q8 index) and weights
do not fit the GPU's memory is not run; its row says so (the Llama-2 shape's 16 sequences of 8k cells need ~90 GiB with
f16 K and V, ~60 GiB with q8_0).

    python bench/cuda_batched.py --bin build/cuda/bin --models /tmp/models
    python bench/cuda_batched.py --bin build/cuda/bin --batches 16 --cache-type q8_0 \
        --out bench/results/cuda_batched_q8_0.json
    python bench/cuda_batched.py --from-log batched.log     # the table of a saved llama-batched-bench output, as JSON
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from cuda_e2e import model_path, run_tool
from record import RESULTS, Checkpoint, checkpointer, provenance, write_record
from sparq_llama.eval.random_gguf import SHAPES

TARGETS = {"llama2-7b": 2.0, "llama3-8b": 1.8}  # speedup at B = TARGET_B
TARGET_B = 16
PROMPT = {"llama2-7b": 8192, "llama3-8b": 16384}
SPARQ_ARGS = ["--sparq", "--k2", "128", "--sparq-min-kv", "0"]  # the default index and k1
SHORT_PROMPT = 16  # prompts of the attention-free step: what the matmuls and the rest cost at each batch size
GIB = 1 << 30
CACHE_BYTES = {"f16": 2.0, "q8_0": 34 / 32}  # bytes per K or V value of each cache type


def gpu_memory_bytes() -> int:
    """The first GPU's memory (nvidia-smi), 0 where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[0]) << 20
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return 0


def needed_bytes(shape: str, model: Path, n_ctx: int, cache_type: str = "f16") -> int:
    """Weights, K and V of `cache_type` and the q8_0 index (K^T, 34 bytes per 32 cells and component) of n_ctx cells,
    plus 2 GiB for compute buffers: what a SparQ run of this context holds on the GPU."""
    sh = SHAPES[shape]
    kv_width = sh.n_head_kv * (sh.n_embd // sh.n_head)
    per_cell = sh.n_layer * kv_width * (2 * CACHE_BYTES[cache_type] + 34 / 32)
    return model.stat().st_size + int(per_cell * n_ctx) + 2 * GIB

_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6)


def parse_table(text: str) -> list[dict[str, float]]:
    """The table llama-batched-bench prints: PP, TG, B, N_KV, T_PP, S_PP, T_TG, S_TG, T, S."""
    rows = []
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if m:
            pp, tg, b, n_kv = (int(m.group(i)) for i in range(1, 5))
            t_pp, s_pp, t_tg, s_tg, t, s = (float(m.group(i)) for i in range(5, 11))
            rows.append(dict(pp=pp, tg=tg, B=b, n_kv=n_kv, t_pp=t_pp, s_pp=s_pp, t_tg=t_tg, s_tg=s_tg, t=t, s=s))
    if not rows:
        raise RuntimeError(f"no table in llama-batched-bench output:\n{text[-2000:]}")
    return rows


def measure(bin_dir: Path, models: Path, batch_sizes: list[int], cache_type: str = "f16",
            checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """Per shape the three llama-batched-bench runs (dense, SparQ, short prompts) at the batch sizes that fit; the rows
    so far go to checkpoint after each shape."""
    rows, raw, targets = [], {}, []
    memory = gpu_memory_bytes()
    for shape in ("llama2-7b", "llama3-8b"):
        model = model_path(models, shape)
        pp = PROMPT[shape]
        batches = [b for b in batch_sizes
                   if not memory or needed_bytes(shape, model, b * (pp + 32), cache_type) <= memory]
        for b in sorted(set(batch_sizes) - set(batches)):
            need = needed_bytes(shape, model, b * (pp + 32), cache_type)
            rows.append(dict(model_shape=shape, prompt=pp, B=b, cache_type=cache_type,
                             skipped=f"needs ~{need / GIB:.0f} GiB, the GPU has {memory / GIB:.0f} GiB"))
            print(f"{shape} pp {pp} B {b}: not run, {rows[-1]['skipped']}", flush=True)
        if not batches:
            continue
        n_ctx = max(batches) * (pp + 32)
        base = [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", str(n_ctx), "-b", "2048", "-ub", "512",
                "-ngl", "99", "-fa", "on", "-ctk", cache_type, "-ctv", cache_type,
                "-npp", str(pp), "-ntg", "32", "-npl", ",".join(map(str, batches))]
        # the same batches over a SHORT_PROMPT-token context: the step with attention reading almost nothing, i.e.
        # the matmuls and the rest; dense / short is the share of the step that is not attention
        short = base[:base.index("-npp")] + ["-npp", str(SHORT_PROMPT)] + base[base.index("-npp") + 2:]
        tables = {}
        for mode, cmd in (("dense", base), ("sparq", base + SPARQ_ARGS), ("short", short)):
            out = run_tool(cmd, timeout=3000)
            tables[mode] = parse_table(out)
            raw[f"{shape}/{mode}"] = {"command": " ".join(cmd), "output": out}
        for b in batches:
            dense, sparq, floor = (next(r["s_tg"] for r in tables[m] if r["B"] == b) for m in ("dense", "sparq", "short"))
            rows.append(dict(model_shape=shape, prompt=pp, B=b, cache_type=cache_type, dense_tg_tps=dense,
                             sparq_tg_tps=sparq, speedup=sparq / dense, short_tg_tps=floor,
                             not_attention_share=dense / floor, bound=floor / dense))
            print(f"{shape} pp {pp} B {b}: dense {dense:.1f} t/s, SparQ {sparq:.1f} t/s, {sparq / dense:.2f}x; "
                  f"{SHORT_PROMPT}-token prompts {floor:.1f} t/s: attention-free bound {floor / dense:.2f}x",
                  flush=True)
        if checkpoint:
            checkpoint(dict(rows=rows, raw=raw), f"{shape} measured")
    for shape, target in TARGETS.items():
        row = next((r for r in rows if r["model_shape"] == shape and r["B"] == TARGET_B and "speedup" in r), None)
        targets.append(dict(model_shape=shape, B=TARGET_B, target=target, measured=row["speedup"] if row else None,
                            met=bool(row and row["speedup"] >= target)))
    return dict(rows=rows, targets=targets, raw=raw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", type=Path, help="directory with llama-batched-bench")
    ap.add_argument("--models", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--cache-type", choices=sorted(CACHE_BYTES), default="f16", help="K and V cache type")
    ap.add_argument("--out", type=Path, default=RESULTS / "cuda_batched.json")
    ap.add_argument("--from-log", type=Path, metavar="LOG",
                    help="print the table of a saved output as JSON, run nothing")
    args = ap.parse_args()
    if args.from_log:
        print(json.dumps(parse_table(args.from_log.read_text(errors="replace"))))
        return 0
    if args.bin is None:
        ap.error("--bin is required (or --from-log)")
    record = provenance("cuda_batched")
    record.update(measure(args.bin, args.models, [int(x) for x in args.batches.split(",")], args.cache_type,
                          checkpointer(args.out, record)))
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
