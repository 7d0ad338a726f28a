#!/usr/bin/env python3
"""What limits each kernel of one SparQ decode step on CUDA, and flash attention's, measured by Nsight Compute.

One process of `bench/cuda_op.py --one S 1` (the op bench's decode step, B = 1) per attention shape and length, under
ncu with the sections that say what bounds a kernel: its time, DRAM and SM throughput, grid, registers, achieved
warps per SM, issued instructions per scheduler and cycle, the instructions each warp executes and the cycles a warp
waits per issued instruction (a kernel whose warps issue one instruction per ~4 cycles and leave DRAM idle takes the
time of its instructions per warp: fewer instructions, not more blocks, shorten it). ncu runs each kernel alone at its
locked base clock, so times are longer than the op bench's, and each is what the kernel adds to a serial chain. The last launch of each
kernel name is kept (the first op call warms up).

    python bench/cuda_op_profile.py                 # needs ncu and a CUDA build (SPARQ_LLAMA_LIB_DIR)
    python bench/cuda_op_profile.py --from-text DIR # the record from saved ncu output (DIR/<heads>_<S>.txt) and
                                                    # DIR/meta.json (the machine, commit and commands that made it)
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from cuda_kernels import short_name
from head_shapes import HEAD_SHAPES
from record import RESULTS, provenance, write_record

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats",
            "InstructionStats")
KERNELS = "regex:sparq_|flash_attn"
SPARQ = re.compile(r"^sparq_")
# (printed metric name, unit: a time, a rate, or as printed; None for any) -> record key
METRICS = {("Duration", "time"): "us", ("Memory Throughput", "rate"): "mem_gbps", ("DRAM Throughput", "%"): "dram_pct",
           ("Compute (SM) Throughput", "%"): "sm_pct", ("SM Frequency", "Ghz"): "sm_ghz", ("Grid Size", None): "grid",
           ("Registers Per Thread", None): "registers", ("Achieved Active Warps Per SM", None): "warps_per_sm",
           ("Issued Warp Per Scheduler", None): "issue_per_cycle", ("Achieved Occupancy", "%"): "occupancy_pct",
           ("Block Size", None): "block", ("Executed Instructions", "inst"): "instructions",
           ("Warp Cycles Per Issued Instruction", "cycle"): "cycles_per_issue"}
_TIME = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}        # to microseconds
_RATE = {"Mbyte/s": 1e-3, "Gbyte/s": 1.0, "Tbyte/s": 1e3}  # to GB/s
_HEADER = re.compile(r"^  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\), Context ")
_METRIC = re.compile(r"^    (\S.*?)\s{2,}(\S+)(?:\s{2,}(\S+))?\s*$")


def parse_ncu_text(text: str) -> list[dict[str, Any]]:
    """Every profiled launch of ncu's default text report, in launch order: its short name and the METRICS found."""
    launches: list[dict[str, Any]] = []
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            launches.append({"name": short_name(head.group(1))})
            continue
        m = _METRIC.match(line)
        if not m or not launches:
            continue
        name, unit, value = (m.group(1), m.group(2), m.group(3)) if m.group(3) else (m.group(1), None, m.group(2))
        kind = "time" if unit in _TIME else "rate" if unit in _RATE else unit
        key = METRICS.get((name, kind)) or METRICS.get((name, None))
        scale = _TIME.get(unit) or _RATE.get(unit) or 1.0
        if key is None or key in launches[-1]:
            continue
        try:
            launches[-1][key] = float(value.replace(",", "")) * scale
        except ValueError:
            continue
    if not launches:
        raise ValueError("no profiled kernel in the ncu output")
    return launches


def summarise(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """The last launch of each kernel name (in first-launch order), and the SparQ op's and flash attention's sums."""
    last = {k["name"]: k for k in launches}  # insertion order is first launch, values the last launch
    kernels = list(last.values())
    missing = [k["name"] for k in kernels if "us" not in k]
    if missing:
        raise ValueError(f"no Duration for {', '.join(missing)}")
    for k in kernels:  # the instructions one warp executes: all of them over the launch's warps
        if all(key in k for key in ("instructions", "grid", "block")):
            k["instructions_per_warp"] = k["instructions"] / (k["grid"] * -(-k["block"] // 32))
    sparq = [k for k in kernels if SPARQ.search(k["name"])]
    return {"kernels": kernels, "sparq_us": sum(k["us"] for k in sparq),
            "flash_us": sum(k["us"] for k in kernels if not SPARQ.search(k["name"]))}


def ncu_command(ncu: str, heads: str, s: int) -> list[str]:
    sections = [a for sec in SECTIONS for a in ("--section", sec)]
    return [ncu, "--kernel-name", KERNELS, "--launch-skip", "0", "--launch-count", "12", *sections,
            sys.executable, str(Path(__file__).with_name("cuda_op.py")), "--heads", heads, "--one", str(s), "1",
            "--runs", "2"]


def measure(args: argparse.Namespace) -> None:
    args.keep.mkdir(parents=True, exist_ok=True)
    commands = {}
    for heads in args.heads:
        for s in args.seqs:
            cmd = ncu_command(args.ncu, heads, s)
            print("running:", " ".join(cmd), flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"ncu exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
            (args.keep / f"{heads}_{s}.txt").write_text(proc.stdout)
            commands[f"{heads}_{s}"] = " ".join(cmd)
    meta = {**provenance("cuda_op_profile"), "ncu_commands": commands, "params": {"heads": args.heads, "seqs": args.seqs}}
    (args.keep / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def record_from(text_dir: Path, summary_command: str) -> dict[str, Any]:
    meta = json.loads((text_dir / "meta.json").read_text())
    rows, raw = [], {}
    for heads in meta["params"]["heads"]:
        for s in meta["params"]["seqs"]:
            launches = parse_ncu_text((text_dir / f"{heads}_{s}.txt").read_text())
            rows.append({"heads": heads, "S": s, "B": 1, **summarise(launches)})
            raw[f"{heads}_{s}"] = launches
    return {**meta, "summary_command": summary_command, "rows": rows, "raw": raw}


def print_table(rec: dict[str, Any]) -> None:
    for row in rec["rows"]:
        print(f"{row['heads']} at {row['S']}: SparQ {row['sparq_us']:.1f} us, flash attention {row['flash_us']:.1f} us")
        for k in row["kernels"]:
            print(f"  {k['us']:6.2f} us  grid {k.get('grid', 0):5.0f}  warps/SM {k.get('warps_per_sm', 0):5.2f}  "
                  f"issue {k.get('issue_per_cycle', 0):.2f}  DRAM {k.get('dram_pct', 0):5.1f}%  "
                  f"inst/warp {k.get('instructions_per_warp', 0):7.0f}  cycles/issue {k.get('cycles_per_issue', 0):5.2f}  "
                  f"{k['name']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="llama2-7b,llama3-8b", help="attention shapes (bench/head_shapes.py)")
    ap.add_argument("--seqs", default="8192", help="cells per row")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--keep", type=Path, default=Path("/tmp/cuda_op_profile"), help="where the ncu output goes")
    ap.add_argument("--from-text", type=Path, help="summarise saved ncu output instead of measuring")
    ap.add_argument("--out", type=Path, default=RESULTS / "cuda_op_profile.json")
    args = ap.parse_args()
    args.heads = args.heads.split(",")
    unknown = [h for h in args.heads if h not in HEAD_SHAPES]
    if unknown:
        ap.error(f"--heads: unknown {', '.join(unknown)} (known: {', '.join(HEAD_SHAPES)})")
    try:
        args.seqs = [int(s) for s in args.seqs.split(",")]
    except ValueError:
        ap.error(f"--seqs: expected comma-separated integers, got {args.seqs!r}")
    text_dir = args.from_text
    if text_dir is None:
        measure(args)
        text_dir = args.keep
    rec = record_from(text_dir, " ".join([Path(sys.executable).name, *sys.argv]))
    print_table(rec)
    write_record(args.out, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
