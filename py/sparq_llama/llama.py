"""`sparq_llama.Llama`: llama-cpp-python's `Llama` on sparq-llama's libllama, with SparQ and strict kwargs."""
from __future__ import annotations

import inspect
from typing import Any

from . import sparq as _sparq
from ._lib import llama_cpp_bindings
from .sparq import SparqConfig

llama_cpp_bindings()  # must load our libllama before llama_cpp.llama binds it
from llama_cpp import Llama as _UpstreamLlama
from llama_cpp import llama_cpp as _lc


def _upstream_kwargs() -> frozenset[str]:
    params = inspect.signature(_UpstreamLlama.__init__).parameters
    return frozenset(name for name, p in params.items()
                     if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and name != "self"))


_FLASH_ATTN_NEEDED = ("SparQ needs flash attention: it reads V row-major, the layout llama.cpp keeps only with "
                      "flash attention on (without it V is stored transposed)")


class Llama(_UpstreamLlama):
    """A drop-in `llama_cpp.Llama` running on sparq-llama's build of llama.cpp, with SparQ attention.

    Every keyword argument of `llama_cpp.Llama` works as documented there. Unlike upstream, an unknown
    keyword argument raises `TypeError` instead of being silently dropped, so a misspelt option never
    runs a different configuration than the one asked for.

    SparQ (fields documented in `SparqConfig`):

        Llama(path, sparq=False, k1=None, k2=128, sparq_window=None, sparq_sinks=0, sparq_mean="auto",
              sparq_default_layout=False, sparq_prefill=False, sparq_policy="sparq", sparse_v_thresh=0.0,
              sparq_swa=False, sparq_min_n_kv=None, ...)

    `sparq=True` turns flash attention on unless `flash_attn` is given (`flash_attn=False` with it is a
    ValueError: SparQ needs flash attention's row-major V cache). The SparQ values are checked before the
    model is loaded; a bad one raises ValueError with the reason. At run time: `llm.set_sparq(...)`;
    `llm.sparq` reads back what llama.cpp holds.
    """

    _SPARQ_KWARGS: frozenset[str] = frozenset(_sparq.KWARG_FIELDS)
    _ACCEPTED_KWARGS: frozenset[str] = _upstream_kwargs() | _SPARQ_KWARGS

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - self._ACCEPTED_KWARGS)
        if unknown:
            raise TypeError(_sparq.unknown_kwarg_message(type(self).__name__, unknown, self._ACCEPTED_KWARGS))
        sparq_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in self._SPARQ_KWARGS}
        config = None
        if sparq_kwargs:
            # everything about SparQ that can be checked without the model, before loading it
            config = _sparq.config_from_kwargs(sparq_kwargs, SparqConfig(enabled=False), owner=type(self).__name__,
                                               field_names=False)
            if config.enabled:
                if kwargs.get("flash_attn") is None:
                    kwargs["flash_attn"] = True
                elif not kwargs["flash_attn"]:
                    raise ValueError(f"sparq=True with flash_attn=False: {_FLASH_ATTN_NEEDED}. Leave flash_attn "
                                     f"out (sparq=True turns it on) or set it to True")
            _sparq.check(config)
        super().__init__(model_path=model_path, **kwargs)
        if config is not None:
            # also with sparq=False: the values given are stored, and set_sparq(enabled=True) starts from them
            try:
                self.set_sparq(config)
            except BaseException:
                self.close()
                raise

    @property
    def sparq(self) -> SparqConfig:
        """The SparQ settings this context holds, as llama.cpp reports them (llama_get_sparq)."""
        return _sparq.read(self.ctx)

    def set_sparq(self, config: SparqConfig | None = None, /, **kwargs: Any) -> SparqConfig:
        """Change the SparQ settings; effective at the next decode. Returns the settings now held.

        `set_sparq(SparqConfig(...))` sets exactly that config; keyword arguments change single settings
        of it, or of the current settings when no config is given. Keywords are the constructor's names
        (`k2`, `sparq_window`, ...) or SparqConfig's field names (`window`, `enabled`, ...). Without
        a config, SparQ is switched on unless `enabled` (or `sparq`) says otherwise:

            llm.set_sparq(k2=64)                 # on, k2 = 64, the rest as currently held
            llm.set_sparq(enabled=False)         # dense again (the values stay stored)

        Enabling on a context that already holds tokens builds SparQ's derived state from the cache.
        ValueError with llama.cpp's reason if the settings are invalid (nothing is changed then).
        """
        if config is not None and not isinstance(config, SparqConfig):
            raise TypeError(f"set_sparq() takes a SparqConfig or keyword arguments, got {type(config).__name__}")
        if config is None:
            config = self.sparq
            if not ({"enabled", "sparq"} & set(kwargs)):
                kwargs["enabled"] = True
        new = _sparq.config_from_kwargs(kwargs, config, owner="set_sparq")
        if new.enabled and self.context_params.flash_attn_type == _lc.LLAMA_FLASH_ATTN_TYPE_DISABLED:
            raise ValueError(f"{_FLASH_ATTN_NEEDED}; this Llama was made with flash_attn=False. Make it with "
                             f"flash_attn=True (sparq=True does that by default)")
        _sparq.apply(self.ctx, new)
        return self.sparq

    def __getstate__(self) -> dict[str, Any]:
        # pickling re-creates the Llama from its constructor arguments: carry the SparQ settings too
        state = super().__getstate__()
        if _sparq.available():
            config = self.sparq
            if config != _sparq.c_defaults():
                try:
                    _sparq.check(config)
                except ValueError:  # values C would not take back (a context never given any): leave them
                    return state
                state.update(_sparq.to_kwargs(config))
        return state

    def __del__(self) -> None:
        # upstream's __del__ assumes __init__ got far enough to create its resources
        if hasattr(self, "_stack"):
            super().__del__()
