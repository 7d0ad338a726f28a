"""Shared fixtures: the real default model, fetched once per machine (cached under $SPARQ_LLAMA_CACHE)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PIN = json.loads((REPO / "vendor" / "pin.json").read_text())

# The console scripts (sparq-llama, llama-cli, ...) sit next to this interpreter, also when the
# environment is not activated (`.venv/bin/python -m pytest`).
os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from sparq_llama import models

    return models.fetch("smollm2")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """One loaded SmolLM2 shared by the tests that only read from it."""
    from sparq_llama import Llama

    llm = Llama(str(smollm2_path), n_ctx=1024, flash_attn=True, seed=1, verbose=False)
    yield llm
    llm.close()


def run(cmd: list[str], *, env: dict | None = None, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """Run a command and capture its output as text (the environment is ours plus `env`)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, **kw)


def python(code: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-c", code], **kw)
