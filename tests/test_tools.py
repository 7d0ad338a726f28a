"""Every installed llama.cpp tool is ours, runs, and does real work on the default model."""
import json
import shutil
from pathlib import Path

import pytest
import sparq_llama
from conftest import PIN, Server, run
from sparq_llama.tools import TOOLS, tool_path

# tools built on common's argument parser print our build line with --version
COMMON_TOOLS = ["llama-cli", "llama-completion", "llama-batched-bench", "llama-perplexity", "llama-server",
                "llama-tokenize"]


def test_every_tool_is_on_path_and_is_ours():
    for name in TOOLS:
        exe = shutil.which(name)
        assert exe, f"{name} is not on PATH"
        assert Path(exe).parent == Path(shutil.which("sparq-llama")).parent
        assert tool_path(name).is_file()


@pytest.mark.parametrize("name", COMMON_TOOLS)
def test_version_names_sparq_llama(name):
    res = run([name, "--version"], timeout=60)
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    assert f"commit {PIN['llama_cpp_commit']}" in out
    line = next(l for l in out.splitlines() if l.startswith("{"))
    assert json.loads(line) == sparq_llama.build_info()


@pytest.mark.parametrize("name", ["llama-bench", "llama-gguf-split"])
def test_help_exits_zero(name):
    res = run([name, "--help"], timeout=60)
    assert res.returncode == 0, res.stderr
    assert "usage" in res.stdout.lower()


def test_quantize_usage():
    res = run(["llama-quantize", "--help"], timeout=60)  # upstream prints usage and exits 1
    assert res.returncode == 1 and "usage:" in res.stdout


def test_bad_option_is_an_error():
    res = run(["llama-completion", "--no-such-option"], timeout=60)
    assert res.returncode != 0
    assert "no-such-option" in res.stderr


def test_llama_bench_json(smollm2_path):
    res = run(["llama-bench", "-m", str(smollm2_path), "-p", "16", "-n", "4", "-r", "1", "-o", "json"])
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [(16, 0), (0, 4)]
    for r in rows:
        assert r["build_commit"] == PIN["llama_cpp_commit"]
        assert r["avg_ts"] > 0
        assert r["model_type"].startswith("llama")


def test_llama_completion_greedy(smollm2_path):
    res = run(["llama-completion", "-m", str(smollm2_path), "-p", "The capital of France is", "-n", "8",
               "--temp", "0", "-no-cnv", "--no-warmup", "-t", "2"], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("The capital of France is")
    assert "Paris" in res.stdout


def test_llama_server_http_api(smollm2_path, tmp_path):
    srv = Server(["llama-server", "-m", str(smollm2_path), "-c", "512", "-t", "2", "--no-warmup"],
                 tmp_path / "server.log", timeout=120)
    try:
        status, out = srv.post("/completion", {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0})
        assert status == 200, out
        assert "Paris" in out["content"]
        assert out["tokens_predicted"] == 8 or out["stop"]
    finally:
        srv.close()
