"""What this process runs: the build of our library and the devices ggml sees."""
from __future__ import annotations

import ctypes
import json

from . import _bindings as C

__all__ = ["build_info", "devices"]


def build_info() -> dict:
    """What this build holds: version, pinned llama.cpp commit, our ops and the backends compiled in."""
    return json.loads(C.sparq_llama_build_info().decode())


def devices() -> list[dict]:
    """The devices ggml sees in this process (name, description, free and total memory in bytes)."""
    out = []
    for i in range(C.ggml_backend_dev_count()):
        dev = C.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        C.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append({"name": C.ggml_backend_dev_name(dev).decode(),
                    "description": C.ggml_backend_dev_description(dev).decode(),
                    "memory_free": free.value, "memory_total": total.value})
    return out
