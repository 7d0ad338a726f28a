"""What every benchmark record holds, and writing it: one JSON per claim in bench/results/<name>.json with the
machine (and GPUs, where nvidia-smi answers), the commit, the command, the build, then the script's own fields and
its raw output. Every script of bench/ builds its record with `provenance()` and writes it with `write_record()`.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("bench.record")

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """The host: CPU model, cores (all and usable), platform, Python, AVX2 / AVX-512."""
    cpu, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not cpu:
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "usable_cores": usable,
            "platform": platform.platform(), "python": platform.python_version(),
            "avx2": " avx2 " in flags, "avx512": " avx512f " in flags}


def gpu() -> dict[str, Any]:
    """nvidia-smi's view of the GPUs (name, driver, memory, max SM clock), or why there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return {"error": str(e)}
    return {"gpus": [dict(zip(("name", "driver", "memory", "max_sm_clock"), (f.strip() for f in line.split(","))))
                     for line in out.strip().splitlines()]}


def git_commit() -> dict[str, Any]:
    """The commit measured. $SPARQ_COMMIT, where set, names it: a device machine's copy of the tree may carry no
    .git, or a stale one."""
    if os.environ.get("SPARQ_COMMIT"):
        return {"commit": os.environ["SPARQ_COMMIT"], "dirty": None}

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False,
                              cwd=Path(__file__).parent).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(git("status", "--porcelain"))}
    except OSError:
        return {"commit": "unknown", "dirty": None}


def build_info() -> dict[str, Any] | None:
    """sparq_llama.build_info() of the library measured (backends, flags), or None where it cannot load."""
    try:
        import sparq_llama
        return sparq_llama.build_info()
    except Exception as e:  # noqa: BLE001 - a record without it is still useful
        log.warning("no build info: %s", e)
        return None


def provenance(bench: str) -> dict[str, Any]:
    """The fields every record starts with."""
    env = {k: v for k, v in os.environ.items() if k.startswith("SPARQ_CUDA")}  # the CUDA op's testing switch
    return {"bench": bench, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
            "gpu": gpu(), "git": git_commit(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "env": env, "build": build_info()}


def write_record(out: Path, record: dict[str, Any]) -> None:
    """The record as indented JSON at out (its folder made)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}", flush=True)


Checkpoint = Callable[[dict[str, Any], str], None]


def checkpointer(out: Path, record: dict[str, Any]) -> Checkpoint:
    """For a script of several long runs: checkpoint(part, done) writes the record so far (record, then part's keys)
    to out, with "partial" saying what it holds (done). A run stopped before its end (a device call's time limit, a
    tool that fails) leaves what it measured; the script's final write_record replaces it."""
    def checkpoint(part: dict[str, Any], done: str) -> None:
        write_record(out, {**record, **part, "partial": f"{done}; the run stopped before the rest"})
    return checkpoint


def append_run(out: Path, record: dict[str, Any]) -> None:
    """Adds the record as one more run of `out` ({"bench": ..., "runs": [...]}; a single-run file becomes the first
    run). For claims resting on several runs of one script: repeats of the same code, or variants side by side."""
    runs: list[dict[str, Any]] = []
    if out.exists():
        old = json.loads(out.read_text())
        runs = old["runs"] if "runs" in old and "bench" in old and len(old) == 2 else [old]
    write_record(out, {"bench": record.get("bench"), "runs": [*runs, record]})
