#!/usr/bin/env python3
"""Each kernel's time in one decode step of a model on CUDA, dense and SparQ, measured by Nsight Compute.

llama-bench tg on random-weight Q8_0 models of the Llama-2-7B and Llama-3-8B layouts cut to a few layers
(`sparq_llama.eval.random_gguf`), at one context depth, under `ncu --metrics gpu__time_duration.sum` with every kernel
profiled: ncu runs the kernels one at a time, so each time is the kernel alone (no overlap with its neighbours, caches
as the previous kernel left them), the cost a kernel adds to a serial chain however small its work. The last decode
token's launches are taken (the token's kernel sequence repeats: the shortest period at the end of the launch list),
and summed per kernel name; the kernels of attention (flash attention, SparQ's, the derived-state upkeep, RoPE and
the cache writes) are also given per layer. The op bench (bench/cuda_op.py) times the SparQ op alone; this shows
what the model's step pays around it.

    python bench/cuda_kernels.py --bin build/cuda/bin --models /tmp/models     # needs ncu and a CUDA build
    python bench/cuda_kernels.py --from-csv DIR    # the record from saved ncu output (DIR/<shape>_<mode>.csv) and
                                                   # DIR/meta.json (the machine, commit and commands that made it)
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

from cuda_e2e import SPARQ_ARGS, model_path, run_tool
from record import RESULTS, provenance, write_record
from sparq_llama.eval.random_gguf import SHAPES

MODES = ("dense", "sparq")
# kernels of the attention step: flash attention, the SparQ op's, the derived-state upkeep, RoPE and the cache writes
ATTENTION = re.compile(r"flash_attn|sparq_|upkeep_kernel|rope_|set_rows")
_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def short_name(name: str) -> str:
    """A kernel's name without its parameter list, return type and anonymous namespace."""
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the parameter list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    name = name[:cut].replace("<unnamed>::", "").strip()
    return name[5:] if name.startswith("void ") else name


def parse_ncu_csv(text: str) -> list[tuple[str, float]]:
    """(kernel name, microseconds) of every profiled launch, in launch order, from `ncu --csv` output (other lines,
    such as the profiled program's own, are skipped)."""
    start = text.find('"ID"')
    if start < 0:
        raise ValueError("no ncu CSV table in the output")
    lines = [ln for ln in text[start:].splitlines() if ln.startswith('"')]
    out = []
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = _UNITS.get(row["Metric Unit"])
        if unit is None:
            raise ValueError(f"unknown time unit {row['Metric Unit']!r}")
        out.append((short_name(row["Kernel Name"]), float(row["Metric Value"].replace(",", "")) * unit))
    return out


def last_token(launches: list[tuple[str, float]], min_len: int) -> list[tuple[str, float]]:
    """The launches of the last decode token: the shortest run of at least min_len kernels at the end whose names
    repeat just before it (every decode token runs the same graph)."""
    names = [n for n, _ in launches]
    for n in range(min_len, len(names) // 2 + 1):
        if names[-n:] == names[-2 * n:-n]:
            return launches[-n:]
    raise ValueError(f"no repeating decode step of at least {min_len} kernels in {len(names)} launches")


def summarise(token: list[tuple[str, float]], n_layer: int) -> dict[str, Any]:
    """Per kernel name (in first-launch order): launches, total and mean microseconds; the token's total; the
    attention kernels' time per layer."""
    per: OrderedDict[str, dict[str, float]] = OrderedDict()
    for name, us in token:
        k = per.setdefault(name, {"launches": 0, "total_us": 0.0})
        k["launches"] += 1
        k["total_us"] += us
    kernels = [{"name": n, "launches": int(k["launches"]), "total_us": k["total_us"],
                "mean_us": k["total_us"] / k["launches"]} for n, k in per.items()]
    attn = [k for k in kernels if ATTENTION.search(k["name"])]
    return {"token_us": sum(us for _, us in token), "kernels": kernels,
            "attention_per_layer_us": sum(k["total_us"] for k in attn) / n_layer,
            "attention_kernels_per_layer": sum(k["launches"] for k in attn) / n_layer}


def ncu_command(ncu: str, bench: Path, model: Path, depth: int, mode: str) -> list[str]:
    sparq = ["-sparq", "1", *SPARQ_ARGS] if mode == "sparq" else []
    return [ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv", "-k", "regex:.",
            str(bench), "-m", str(model), "-p", "0", "-n", "3", "-d", str(depth), "-fa", "1", "-ngl", "99", "-r", "1",
            "-ub", "2048", *sparq]


def measure(args: argparse.Namespace) -> None:
    """Runs ncu over llama-bench for every shape and mode; writes the CSVs and meta.json into args.keep_csv."""
    args.keep_csv.mkdir(parents=True, exist_ok=True)
    commands = {}
    for shape in args.shapes:
        model = model_path(args.models, shape, args.layers)
        for mode in MODES:
            cmd = ncu_command(args.ncu, args.bin / "llama-bench", model, args.depth, mode)
            (args.keep_csv / f"{shape}_{mode}.csv").write_text(run_tool(cmd, timeout=1800))
            commands[f"{shape}_{mode}"] = " ".join(cmd)
    meta = {**provenance("cuda_kernels"), "ncu_commands": commands,
            "params": {"shapes": args.shapes, "layers": args.layers, "depth": args.depth}}
    (args.keep_csv / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def record_from(csv_dir: Path, summary_command: str) -> dict[str, Any]:
    meta = json.loads((csv_dir / "meta.json").read_text())
    params = meta["params"]
    rows, raw = [], {}
    for shape in params["shapes"]:
        for mode in MODES:
            launches = parse_ncu_csv((csv_dir / f"{shape}_{mode}.csv").read_text())
            token = last_token(launches, min_len=4 * params["layers"])
            rows.append({"model_shape": shape, "mode": mode, "depth": params["depth"], "layers": params["layers"],
                         **summarise(token, params["layers"])})
            raw[f"{shape}_{mode}"] = {"launches_profiled": len(launches), "last_token": token}
    return {**meta, "summary_command": summary_command, "rows": rows, "raw": raw}


def print_table(rec: dict[str, Any]) -> None:
    for row in rec["rows"]:
        print(f"{row['model_shape']} {row['mode']} at depth {row['depth']}: token {row['token_us']:.1f} us, attention "
              f"{row['attention_per_layer_us']:.1f} us a layer in {row['attention_kernels_per_layer']:g} kernels")
        for k in row["kernels"]:
            if ATTENTION.search(k["name"]):
                print(f"  {k['launches'] / row['layers']:4g} x {k['mean_us']:6.2f} us  {k['name']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", type=Path, help="directory with llama-bench (a CUDA build)")
    ap.add_argument("--models", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--shapes", default="llama2-7b,llama3-8b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=int, default=4, help="layers of the cut models")
    ap.add_argument("--depth", type=int, default=8192)
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--keep-csv", type=Path, default=Path("/tmp/cuda_kernels"), help="where the ncu output goes")
    ap.add_argument("--from-csv", type=Path, help="summarise saved ncu output instead of measuring")
    ap.add_argument("--out", type=Path, default=RESULTS / "cuda_kernels.json")
    args = ap.parse_args()
    args.shapes = args.shapes.split(",")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    if args.layers < 1:
        ap.error("--layers must be >= 1")
    csv_dir = args.from_csv
    if csv_dir is None:
        if args.bin is None:
            ap.error("--bin is required to measure (or --from-csv DIR)")
        measure(args)
        csv_dir = args.keep_csv
    rec = record_from(csv_dir, " ".join([Path(sys.executable).name, *sys.argv]))
    print_table(rec)
    write_record(args.out, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
