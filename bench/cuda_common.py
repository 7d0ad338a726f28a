"""What every benchmark record holds (the machine and GPU, the commit, the command, the build), and writing it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparq_decode import build_info, git_commit, machine  # noqa: E402


def gpu() -> dict[str, Any]:
    """nvidia-smi's view of the GPUs (name, driver, memory), or the error."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, check=True).stdout
        return {"gpus": [dict(zip(("name", "driver", "memory", "max_sm_clock"), (f.strip() for f in line.split(","))))
                         for line in out.strip().splitlines()]}
    except (OSError, subprocess.CalledProcessError) as e:
        return {"error": str(e)}


def provenance() -> dict[str, Any]:
    """Machine, GPU, commit, command, build. $SPARQ_COMMIT, where set, names the commit: a lent machine's copy of
    the tree may carry a stale .git (seen: it reported the session's starting commit)."""
    commit = git_commit()
    if os.environ.get("SPARQ_COMMIT"):
        commit = {"commit": os.environ["SPARQ_COMMIT"], "dirty": None, "note": "given by $SPARQ_COMMIT"}
    env = {k: v for k, v in os.environ.items() if k.startswith("SPARQ_CUDA")}  # kernel variant switches
    return {"machine": machine(), "gpu": gpu(), "git": commit, "command": " ".join([sys.executable, *sys.argv]),
            "env": env, "build": build_info()}


def write_record(out: Path, record: dict[str, Any]) -> None:
    """The record as indented JSON at out (its folder made), and a line saying so."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
