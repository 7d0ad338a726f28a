"""sparq-llama: llama.cpp that reads less of its KV cache while it decodes.

Importing this package points llama-cpp-python at sparq-llama's libllama (nothing heavy is imported
yet); import it before `llama_cpp`, or get an ImportError that says so.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ._lib import claim_llama_cpp, lib_dir
from ._system import build_info, devices
from .sparq import (  # plain Python: no native library, no numpy
    SparqConfig,
    transfer_ratio,
)

claim_llama_cpp()

try:
    __version__ = version("sparq-llama")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"

__all__ = ["Llama", "SparqConfig", "__version__", "build_info", "devices", "lib_dir", "transfer_ratio"]


def __getattr__(name: str):
    # Llama is imported lazily so `import sparq_llama` stays cheap (the tool entry points import it).
    if name == "Llama":
        from .llama import Llama
        return Llama
    raise AttributeError(f"module 'sparq_llama' has no attribute {name!r}")
