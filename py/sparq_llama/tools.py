"""Console-script entry points for the llama.cpp tools shipped inside this package.

The binaries live in sparq_llama/bin with an RPATH to sparq_llama/lib; each entry point replaces the
Python process with the binary (os.execv), so signals, stdin and the exit code are the tool's own.
This module imports nothing heavy: starting `llama-cli` costs one small Python start-up.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

BIN_DIR = Path(__file__).resolve().parent / "bin"

TOOLS = (
    "llama-cli", "llama-completion", "llama-bench", "llama-batched-bench", "llama-perplexity",
    "llama-server", "llama-tokenize", "llama-quantize", "llama-gguf-split", "ggml-rpc-server",
)


def tool_path(name: str) -> Path:
    """Path of a shipped tool binary; FileNotFoundError if this build lacks it."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; shipped tools: {', '.join(TOOLS)}")
    path = BIN_DIR / (name + (".exe" if os.name == "nt" else ""))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: sparq-llama was installed without its native build")
    return path


def _exec(name: str) -> None:
    try:
        path = tool_path(name)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    argv = [name, *sys.argv[1:]]
    if os.name == "nt":  # no real exec on Windows
        import subprocess
        sys.exit(subprocess.call([str(path), *argv[1:]]))
    os.execv(path, argv)


def llama_cli() -> None: _exec("llama-cli")
def llama_completion() -> None: _exec("llama-completion")
def llama_bench() -> None: _exec("llama-bench")
def llama_batched_bench() -> None: _exec("llama-batched-bench")
def llama_perplexity() -> None: _exec("llama-perplexity")
def llama_server() -> None: _exec("llama-server")
def llama_tokenize() -> None: _exec("llama-tokenize")
def llama_quantize() -> None: _exec("llama-quantize")
def llama_gguf_split() -> None: _exec("llama-gguf-split")
def ggml_rpc_server() -> None: _exec("ggml-rpc-server")
