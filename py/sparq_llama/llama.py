"""`sparq_llama.Llama`: llama-cpp-python's `Llama` on sparq-llama's libllama, with SparQ and strict kwargs."""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from . import sparq as _sparq
from . import squeeze as _squeeze
from ._lib import llama_cpp_bindings
from .sparq import SparqConfig, SparqRun
from .squeeze import SqueezeConfig, SqueezeInfo

llama_cpp_bindings()  # must load our libllama before llama_cpp.llama binds it
from llama_cpp import Llama as _UpstreamLlama
from llama_cpp import llama_cpp as _lc


def _upstream_kwargs() -> frozenset[str]:
    params = inspect.signature(_UpstreamLlama.__init__).parameters
    return frozenset(name for name, p in params.items()
                     if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and name != "self"))


# The evaluation's share of prepare_fixed_context's progress bar, the clustering and calibration taking the rest:
# an 8k-token prefix of SmolLM2 on 2 x86 cores takes about 18 s to evaluate and 3 s to prepare.
_EVAL_SHARE = 0.85

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
              sparq_swa=False, sparq_min_n_kv=None, index=None, select=DEFAULT_SELECT, ...)

    `index` is the key index the approximate scores read, "f16", "q8" or "q4" (None: `sparq.DEFAULT_INDEX`, or
    f16 with sparq_default_layout; q4 scores every component: k1 None or the model's head dim); `select` how the k1
    components are chosen, "q" or "qsigma" (default: `sparq.DEFAULT_SELECT`; no part with q4).

    `sparq=True` turns flash attention on unless `flash_attn` is given (`flash_attn=False` with it is a
    ValueError: SparQ needs flash attention's row-major V cache). The SparQ values are checked before the
    model is loaded; a bad one raises ValueError with the reason. At run time: `llm.set_sparq(...)`;
    `llm.sparq` reads back what llama.cpp holds.
    """

    _SPARQ_KWARGS: frozenset[str] = frozenset(_sparq.KWARG_FIELDS)
    _ACCEPTED_KWARGS: frozenset[str] = _upstream_kwargs() | _SPARQ_KWARGS | {"fixed_context"}

    def __init__(self, model_path: str, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - self._ACCEPTED_KWARGS)
        if unknown:
            raise TypeError(_sparq.unknown_kwarg_message(type(self).__name__, unknown, self._ACCEPTED_KWARGS))
        sparq_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in self._SPARQ_KWARGS}
        fixed_context = kwargs.pop("fixed_context", None)
        if fixed_context is not None:
            if kwargs.get("flash_attn") is False:
                raise ValueError("fixed_context with flash_attn=False: centroid-sparse attention reads V row-major, "
                                 "the layout llama.cpp keeps only with flash attention on")
            kwargs.setdefault("flash_attn", True)
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
        try:
            if config is not None:
                # also with sparq=False: the values given are stored, and set_sparq(enabled=True) starts from them
                self.set_sparq(config)
            if fixed_context is not None:
                self.load_fixed_context(fixed_context)
            _sparq.log_summary(self.ctx)
        except BaseException:
            self.close()
            raise

    @property
    def sparq_summary(self) -> str:
        """What this context runs, in one line: SparQ on or off; when on, k1/k2/index/select, in how many layers, why
        the others stay dense, and below how many cached cells layers stay dense. Logged when the Llama is made."""
        return _sparq.summary(self.ctx)

    @property
    def sparq_last_run(self) -> SparqRun:
        """What the attention layers of the last ubatch this Llama computed ran (SparQ, centroid-sparse or dense, in
        how many layers each): whether the newest logits came from SparQ (`.ran_sparq`). SparQ runs in decode steps
        once the cache holds `sparq_min_n_kv` cells, not while a prompt is evaluated (unless `sparq_prefill`)."""
        return _sparq.last_run(self.ctx)

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

    # ---- centroid-sparse attention over a fixed prefix (sparq_llama.squeeze) -----------------------

    def prepare_fixed_context(self, text_or_tokens: str | bytes | Sequence[int], centroids: float = 0.1,
                              keep: float = 0.1, levels: int = 1, progress: bool = True,
                              **settings: Any) -> SqueezeInfo:
        """Evaluate a fixed prefix (a document, a system prompt) once and prepare it for centroid-sparse attention.

        The prefix is tokenized as `create_completion` tokenizes a prompt, evaluated from an empty cache, and
        its keys are clustered per layer and KV head (`centroids`: clusters as a fraction of its tokens); each
        query then reads its best-scored clusters until they hold `keep` of the clustered keys (a per-row budget).
        Later prompts that start with the prefix reuse it (`create_completion(document + question)`): only
        the question is evaluated, and attention reads the kept clusters of the prefix and every other token
        exactly. More settings: the fields of `SqueezeConfig` (levels, centroids_coarse, keep_coarse, n_calib,
        n_iter, group, var_weight, init). Quality depends on the cluster fraction and the kept rule: at keep=0.1
        with the defaults (10% clusters, var_weight=1) a needle in a document is found in 91.4% of the cases dense
        finds it on SmolLM2 (4k, two held-out sets) and in 84.8% / 89.3% on Gemma-3-270M (4k / 8k, 40 examples
        each); with var_weight=0 (the paper's centroid-only rule) SmolLM2 found none (docs/quality.md); measure on
        your task (bench/squeeze_quality.py).
        progress: one tqdm bar on stderr over the evaluation and the clustering. Needs flash attention (the default
        with sparq-llama's fixed_context/sparq options; `Llama(..., flash_attn=True)` otherwise). ValueError with the
        reason when the prefix does not fit the context or llama.cpp cannot prepare it.
        """
        config = SqueezeConfig(centroids=centroids, keep=keep, levels=levels, **settings)
        if isinstance(text_or_tokens, (str, bytes)):
            text = text_or_tokens.encode("utf-8") if isinstance(text_or_tokens, str) else text_or_tokens
            tokens = self.tokenize(text, special=True)
        else:
            tokens = [int(t) for t in text_or_tokens]
        if len(tokens) < 2:
            raise ValueError(f"the fixed context needs at least 2 tokens, got {len(tokens)}")
        if len(tokens) >= self.n_ctx():
            raise ValueError(f"the fixed context has {len(tokens)} tokens, more than this context holds with room "
                             f"for a question (n_ctx = {self.n_ctx()}); make the Llama with a larger n_ctx")
        _squeeze.check(config)
        self.reset()
        self._ctx.kv_cache_clear()
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=100, desc="evaluating the fixed context", unit="%", leave=False)

        def report(fraction: float) -> None:
            if bar is not None:
                bar.update(max(0, round(100 * fraction) - bar.n))

        try:
            # one batch at a time (as eval() splits them) so that the bar moves while the prefix is evaluated
            for start in range(0, len(tokens), self.n_batch):
                end = min(len(tokens), start + self.n_batch)
                self.eval(tokens[start:end])
                report(_EVAL_SHARE * end / len(tokens))
            if bar is not None:
                bar.set_description("clustering the fixed context")
            return _squeeze.prepare(self.ctx, tokens, config,
                                    progress=lambda f: report(_EVAL_SHARE + (1.0 - _EVAL_SHARE) * f))
        finally:
            if bar is not None:
                bar.close()

    @property
    def fixed_context(self) -> SqueezeInfo:
        """The prepared prefix this context holds (`prepared` False when none, or after a change dropped it)."""
        return _squeeze.info(self.ctx)

    def clear_fixed_context(self) -> None:
        """Drop the prepared prefix (dense attention over it again; the cache keeps its tokens)."""
        _squeeze.clear(self.ctx)

    def save_fixed_context(self, path: str) -> None:
        """Save the prepared prefix: its KV state to `path` and its clusters to `path + ".squeeze"`.

        The cache is trimmed back to the prefix first (a question and answer after it are removed), so what is
        saved is the document alone. Load with `Llama(model, fixed_context=path)` or `load_fixed_context`.
        """
        info = self.fixed_context
        if not info.prepared:
            raise ValueError("no prepared fixed context to save (prepare_fixed_context first)")
        n = info.n_prefix
        tokens = list(self._input_ids[:n])
        if len(tokens) != n:
            raise ValueError("the cache no longer holds the whole fixed context")
        self._ctx.kv_cache_seq_rm(-1, n, -1)
        self.n_tokens = n
        _squeeze.save_files(self.ctx, path, _squeeze.sidecar_path(path))

    def recalibrate_fixed_context(self, keep: float, keep_coarse: float = 0.0) -> SqueezeInfo:
        """Read a different fraction of the prepared fixed context: each query's budget becomes `keep` of the
        clustered keys, with the same clusters, as `prepare_fixed_context(..., keep=keep)` would give. With two
        levels the coarse threshold is calibrated again for `keep_coarse` (0: min(1, 2*keep)) on the calibration
        queries kept since preparing (sidecar format 2 and later); one level needs none. ValueError on failure."""
        return _squeeze.recalibrate(self.ctx, keep, keep_coarse)

    def set_fixed_context_prefill(self, mode: str) -> SqueezeInfo:
        """How the tokens after the prepared fixed context (a question) attend to it when they are evaluated:
        "sparse" (each reads its kept clusters, as decoding does), "dense" (exact attention over the whole cache) or
        "auto" (the default after preparing or loading: sparse where the KV is in host memory, dense on a GPU, where
        each row reading its own clusters is slower than flash attention's single pass). ValueError on failure."""
        return _squeeze.set_prefill(self.ctx, mode)

    def load_fixed_context(self, path: str) -> SqueezeInfo:
        """Load a fixed context saved by `save_fixed_context` (KV state and clusters); replaces the cache.

        Both files are verified first (each part's checksum, that they were saved together, the model): a damaged
        or mismatched file is a ValueError naming the file and the part, and the context is left as it was."""
        sidecar = _squeeze.sidecar_path(path)
        import os
        for p in (path, sidecar):
            if not os.path.exists(p):
                raise ValueError(f"fixed context {path}: {p} does not exist")
        try:
            tokens = _squeeze.load_files(self.ctx, path, sidecar, self.n_ctx())
        except ValueError as e:
            raise ValueError(f"loading the fixed context {path} failed: {e}") from None
        n = len(tokens)  # sequence 0, this Llama's one sequence, now holds the prefix alone
        self.reset()
        self.input_ids[:n] = tokens
        self.n_tokens = n
        self._requires_eval = True  # logits of restored state are not live: replay the last token
        return _squeeze.info(self.ctx)

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
