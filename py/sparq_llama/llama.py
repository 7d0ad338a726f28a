"""`sparq_llama.Llama`: llama-cpp-python's `Llama` on sparq-llama's libllama, with strict keyword arguments."""
from __future__ import annotations

import difflib
import inspect
from typing import Any

from ._lib import llama_cpp_bindings

llama_cpp_bindings()  # must load our libllama before llama_cpp.llama binds it
from llama_cpp import Llama as _UpstreamLlama  # noqa: E402


def _upstream_kwargs() -> frozenset[str]:
    params = inspect.signature(_UpstreamLlama.__init__).parameters
    return frozenset(name for name, p in params.items()
                     if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and name != "self"))


class Llama(_UpstreamLlama):
    """A drop-in `llama_cpp.Llama` running on sparq-llama's build of llama.cpp.

    Every keyword argument of `llama_cpp.Llama` works as documented there. Unlike upstream, an unknown
    keyword argument raises `TypeError` instead of being silently dropped, so a misspelt option never
    runs a different configuration than the one asked for.
    """

    _ACCEPTED_KWARGS: frozenset[str] = _upstream_kwargs()

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - self._ACCEPTED_KWARGS)
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, self._ACCEPTED_KWARGS, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"{type(self).__name__}() got unexpected keyword argument(s): {', '.join(hints)}")
        super().__init__(model_path=model_path, **kwargs)

    def __del__(self) -> None:
        # upstream's __del__ assumes __init__ got far enough to create its resources
        if hasattr(self, "_stack"):
            super().__del__()
