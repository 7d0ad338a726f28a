"""Point llama-cpp-python at our libraries and load them.

llama-cpp-python binds every symbol of libllama at import time, so `LLAMA_CPP_LIB_PATH` must name our
library directory *before* `llama_cpp` is first imported. This module does that once, then exposes the
loaded libraries (our functions in them are declared in `_bindings`). It is the only global state of the
package: the loaded libraries themselves.
"""
from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def lib_dir() -> Path:
    """Directory holding our libllama and ggml libraries.

    `SPARQ_LLAMA_LIB_DIR` overrides it (a plain CMake build's `build/bin`, for developers).
    """
    override = os.environ.get("SPARQ_LLAMA_LIB_DIR")
    return Path(override).resolve() if override else PACKAGE_DIR / "lib"


def _libllama_file(directory: Path) -> Path:
    names = {"win32": "llama.dll", "darwin": "libllama.dylib"}
    return directory / names.get(sys.platform, "libllama.so")


def claim_llama_cpp() -> None:
    """Make the next `import llama_cpp` load our libllama; ImportError if it already loaded another.

    Cheap (no import): runs when `sparq_llama` is imported.
    """
    ours = lib_dir()
    loaded = sys.modules.get("llama_cpp.llama_cpp")
    if loaded is not None:
        base = getattr(loaded, "_base_path", None)
        if base is None or Path(base).resolve() != ours:
            raise ImportError(
                f"llama_cpp was imported before sparq_llama and loaded libllama from {base}, not sparq-llama's "
                f"({ours}). Import sparq_llama before llama_cpp (or start Python with "
                f"LLAMA_CPP_LIB_PATH={ours}); a process can hold only one libllama.")
        return
    previous = os.environ.get("LLAMA_CPP_LIB_PATH")
    if previous and Path(previous).resolve() != ours:
        raise ImportError(f"LLAMA_CPP_LIB_PATH={previous} names another libllama; sparq-llama needs its own "
                          f"({ours}). Unset it, or set SPARQ_LLAMA_LIB_DIR to choose our library directory.")
    os.environ["LLAMA_CPP_LIB_PATH"] = str(ours)
    os.environ.setdefault("MTMD_CPP_LIB", str(ours))


@lru_cache(maxsize=1)
def llama_cpp_bindings():
    """llama-cpp-python's low-level module, bound to our libllama."""
    libfile = _libllama_file(lib_dir())
    if not libfile.is_file():
        raise ImportError(f"sparq-llama's native library is missing ({libfile}): the package was installed "
                          "without its CMake build. Reinstall with `pip install .` from the source tree.")
    claim_llama_cpp()
    import llama_cpp.llama_cpp as bindings
    return bindings


@lru_cache(maxsize=1)
def libllama() -> ctypes.CDLL:
    """Our libllama as loaded by llama-cpp-python (our own functions are declared in `_bindings`)."""
    return llama_cpp_bindings()._lib


def _ggml_library(stem: str) -> ctypes.CDLL:
    """One of ggml's libraries in our directory, after libllama (which loads it as a dependency: same copy)."""
    names = {"win32": f"{stem}.dll", "darwin": f"lib{stem}.dylib"}
    libllama()
    return ctypes.CDLL(str(lib_dir() / names.get(sys.platform, f"lib{stem}.so")))


@lru_cache(maxsize=1)
def libggml() -> ctypes.CDLL:
    """libggml (the backend registry)."""
    return _ggml_library("ggml")


@lru_cache(maxsize=1)
def libggml_base() -> ctypes.CDLL:
    """libggml-base (tensors, the backend tensor API)."""
    return _ggml_library("ggml-base")
