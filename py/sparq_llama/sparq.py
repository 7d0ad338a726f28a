"""SparQ in llama.cpp's decode path: the settings (`SparqConfig`), their C mirror and the transfer model.

    from sparq_llama import Llama, SparqConfig
    llm = Llama(path, sparq=True, k1=16, k2=64)          # flash attention is switched on for SparQ
    llm.set_sparq(k2=128)                                  # at run time; effective at the next decode
    llm.set_sparq(SparqConfig(k2=32, policy="exact"))
    llm.set_sparq(index="q8", select="qsigma")             # the int8 key index, components by |q|·σ
    llm.set_sparq(index="q4")                              # the 4-bit index: every component (k1 None), integer scores
    print(llm.sparq)                                       # what the C side holds (llama_get_sparq)

`SparqConfig` mirrors `struct llama_sparq_params` (ggml_ops/include/sparq-llama.h) with Python values:
None where C uses 0 / -1 for "automatic", strings for the enums. Constructing one checks types and enum
names (ValueError); the value rules that depend on each other or on the model (k2 >= window + sinks,
k1 <= head_dim, flash attention, ...) are C's: `check` and `apply` raise ValueError with its message.

Importing this module loads nothing native and no numpy; the C functions (`_bindings`) are bound on first
use, on the libllama llama-cpp-python has loaded (which `sparq_llama` made ours).
"""
from __future__ import annotations

import ctypes
import difflib
import math
import operator
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal

from . import _bindings as C
from ._bindings import LlamaSparqParams

__all__ = [
    "DEFAULT_INDEX",
    "DEFAULT_SELECT",
    "INDEXES",
    "KV_TYPE_BYTES",
    "KWARG_FIELDS",
    "MEAN_MODES",
    "POLICIES",
    "SELECTS",
    "LlamaSparqParams",
    "SparqConfig",
    "SparqRun",
    "apply",
    "available",
    "c_defaults",
    "check",
    "config_from_kwargs",
    "index_bytes",
    "last_run",
    "read",
    "to_kwargs",
    "transfer_bytes",
    "transfer_ratio",
]

MEAN_MODES = ("auto", "on", "off")           # index = enum llama_sparq_mean / ggml_sparq_mean
POLICIES = ("sparq", "exact", "window")      # index = enum llama_sparq_policy / ggml_sparq_policy
INDEXES = ("f16", "q8", "q4")                # index = enum llama_sparq_index
SELECTS = ("q", "qsigma")                    # index = enum llama_sparq_select

MeanMode = Literal["auto", "on", "off"]
Policy = Literal["sparq", "exact", "window"]
Index = Literal["f16", "q8", "q4"]
Select = Literal["q", "qsigma"]

# llama_sparq_default_params()'s index and selection, which SparqConfig, Llama and the transfer model default to
# (test_sparq_api checks that they agree with the library's)
DEFAULT_INDEX: Index = "q8"
DEFAULT_SELECT: Select = "qsigma"

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


# ---------------------------------------------------------------------------------------------------
# The settings


@dataclass(frozen=True)
class SparqConfig:
    """SparQ settings of a llama.cpp context; the fields of `struct llama_sparq_params`, in its order.

    enabled: SparQ on (True here, since a config is usually made to turn it on; llama.cpp's default is off).
        False: dense attention everywhere and no derived state kept (the other values are still stored).
    k1: query components used for the approximate scores (r in the paper); None: by the index, about 1/8 of
        dense attention's bytes: head_dim / 4 with the f16 index, head_dim / 2 with the q8 index; head_dim with
        the q4 index, which scores every component and takes no other k1 (None only: `check` refuses any k1).
    k2: cells kept per KV head and query row (k in the paper).
    window: most recent visible cells always kept; None: k2 / 4.
    sinks: first visible cells always kept.
    mean: mean-value reallocation, "on", "off" or "auto" (on for MHA layers, off for GQA ones).
    policy: "sparq" (approximate scores from k1 components), "exact" (top-k2 of the true scores: reads all
        of K, an oracle baseline) or "window" (sinks + most recent cells only).
    sparse_v_thresh: drop final attention weights below this and renormalise (Sparse-V); 0: off.
    default_layout: keep no transposed copy of K (the approximate scores gather from row-major K instead;
        no extra memory, slower).
    prefill: multi-token batches select too (each row causally), not only one-token-per-sequence decodes;
        teacher-forced evaluation then equals step-by-step decoding.
    swa: also sparsify sliding-window layers (dense by default: their read is already bounded).
    min_n_kv: dense attention while the cache view holds fewer cells; None: llama.cpp's measured default.
    index: the transposed key copy the approximate scores read: "f16" (2 bytes a component, whatever the cache
        type), "q8" (int8 with one f16 scale per 32 cells: 1.0625 bytes a component) or "q4" (every component in
        4 bits, ggml's q4_0 of each component's 32-cell blocks stored cell by cell: 0.5625 bytes a component,
        scored as integer dot products with int8 query coefficients; k1 is then None, for head_dim).
        None: `DEFAULT_INDEX`, or "f16" with default_layout, which keeps no copy to quantize. Read back as the
        name held.
    select: how the k1 components are chosen: "q" (largest |q|, the paper) or "qsigma" (largest |q| times the
        spread of the keys' component).
    """

    enabled: bool = True
    k1: int | None = None
    k2: int = 128
    window: int | None = None
    sinks: int = 0
    mean: MeanMode = "auto"
    policy: Policy = "sparq"
    sparse_v_thresh: float = 0.0
    default_layout: bool = False
    prefill: bool = False
    swa: bool = False
    min_n_kv: int | None = None
    index: Index | None = None
    select: Select = DEFAULT_SELECT

    def __post_init__(self) -> None:
        for name in ("enabled", "default_layout", "prefill", "swa"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
        set_ = object.__setattr__  # frozen: normalise in place once (numpy ints -> int, ints -> float)
        set_(self, "k1", _opt_int("k1", self.k1, minimum=1, none_means="the index's default"))
        set_(self, "k2", _int32("k2", self.k2))
        set_(self, "window", _opt_int("window", self.window, minimum=0, none_means="k2/4"))
        set_(self, "sinks", _int32("sinks", self.sinks))
        set_(self, "min_n_kv", _opt_int("min_n_kv", self.min_n_kv, minimum=0,
                                        none_means="llama.cpp's measured default"))
        if self.mean not in MEAN_MODES:
            raise ValueError(f"mean must be one of {', '.join(map(repr, MEAN_MODES))}, got {self.mean!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(map(repr, POLICIES))}, got {self.policy!r}")
        set_(self, "sparse_v_thresh", _finite_float("sparse_v_thresh", self.sparse_v_thresh))
        if self.index is None:
            set_(self, "index", "f16" if self.default_layout else DEFAULT_INDEX)
        if self.index not in INDEXES:
            raise ValueError(f"index must be one of {', '.join(map(repr, INDEXES))} (or None for the default), "
                             f"got {self.index!r}")
        if self.select not in SELECTS:
            raise ValueError(f"select must be one of {', '.join(map(repr, SELECTS))}, got {self.select!r}")

    def to_c(self) -> LlamaSparqParams:
        """The C struct (None -> 0 for k1, -1 for window and min_n_kv; enums -> their values)."""
        return LlamaSparqParams(
            enabled=self.enabled, k1=0 if self.k1 is None else self.k1, k2=self.k2,
            window=-1 if self.window is None else self.window, sinks=self.sinks,
            mean=MEAN_MODES.index(self.mean), policy=POLICIES.index(self.policy),
            sparse_v_thresh=self.sparse_v_thresh, default_layout=self.default_layout, prefill=self.prefill,
            swa=self.swa, min_n_kv=-1 if self.min_n_kv is None else self.min_n_kv,
            index=INDEXES.index(self.index), select=SELECTS.index(self.select))  # type: ignore[arg-type]

    @classmethod
    def from_c(cls, p: LlamaSparqParams) -> SparqConfig:
        """The config a C struct holds (0 / negative "auto" encodings -> None)."""
        for name, names in (("mean", MEAN_MODES), ("policy", POLICIES), ("index", INDEXES), ("select", SELECTS)):
            if not 0 <= getattr(p, name) < len(names):
                raise ValueError(f"llama_sparq_params.{name} = {getattr(p, name)} is not a known value")
        return cls(enabled=bool(p.enabled), k1=None if p.k1 == 0 else int(p.k1), k2=int(p.k2),
                   window=None if p.window < 0 else int(p.window), sinks=int(p.sinks),
                   mean=MEAN_MODES[p.mean], policy=POLICIES[p.policy],  # type: ignore[arg-type]
                   sparse_v_thresh=_shortest_f32(p.sparse_v_thresh), default_layout=bool(p.default_layout),
                   prefill=bool(p.prefill), swa=bool(p.swa), min_n_kv=None if p.min_n_kv < 0 else int(p.min_n_kv),
                   index=INDEXES[p.index], select=SELECTS[p.select])  # type: ignore[arg-type]


def _as_int(name: str, value: Any) -> int:
    """`value` as a Python int (numpy ints too, not bools or floats), or ValueError naming the parameter."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


def _int32(name: str, value: Any) -> int:
    out = _as_int(name, value)
    if not _INT32_MIN <= out <= _INT32_MAX:
        raise ValueError(f"{name} = {out} does not fit the C int32_t it is passed as")
    return out


def _opt_int(name: str, value: Any, *, minimum: int, none_means: str) -> int | None:
    """None, or an int32 >= minimum (the smaller values are C's encodings of None)."""
    if value is None:
        return None
    out = _int32(name, value)
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, or None for {none_means}; got {out}")
    return out


def _finite_float(name: str, value: Any) -> float:
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})") from None
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def _shortest_f32(x: float) -> float:
    """The shortest decimal that rounds to the same float32 as x (so 0.1 reads back as 0.1, not 0.100000001)."""
    target = ctypes.c_float(x).value
    for digits in range(1, 10):
        y = float(f"{target:.{digits}g}")
        if ctypes.c_float(y).value == target:
            return y
    return target


# ---------------------------------------------------------------------------------------------------
# Keyword arguments (Llama(...) and Llama.set_sparq(...))

# constructor keyword -> SparqConfig field. set_sparq also takes the field names themselves.
KWARG_FIELDS: dict[str, str] = {
    "sparq": "enabled", "k1": "k1", "k2": "k2", "sparq_window": "window", "sparq_sinks": "sinks",
    "sparq_mean": "mean", "sparq_policy": "policy", "sparse_v_thresh": "sparse_v_thresh",
    "sparq_default_layout": "default_layout", "sparq_prefill": "prefill", "sparq_swa": "swa",
    "sparq_min_n_kv": "min_n_kv", "index": "index", "select": "select",
}
_FIELDS = tuple(f.name for f in fields(SparqConfig))


def unknown_kwarg_message(owner: str, unknown: list[str], known: set[str] | frozenset[str]) -> str:
    """`owner() got unexpected keyword argument(s): 'x' (did you mean 'y'?)`."""
    hints = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"{owner}() got unexpected keyword argument(s): {', '.join(hints)}"


def config_from_kwargs(kwargs: Mapping[str, Any], base: SparqConfig, *, owner: str = "set_sparq",
                       field_names: bool = True) -> SparqConfig:
    """`base` with the settings named in kwargs (constructor names, and field names if field_names).

    TypeError for an unknown name or one field named twice; ValueError for a bad value. Turning default_layout
    on without naming the index takes the f16 index (that layout keeps no key copy to quantize); choosing the q4
    index without naming k1 takes k1 None (it scores every component: no other k1 goes with it).
    """
    known = set(KWARG_FIELDS) | (set(_FIELDS) if field_names else set())
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise TypeError(unknown_kwarg_message(owner, unknown, known))
    changes: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in kwargs.items():
        field = KWARG_FIELDS.get(key, key)
        if field in changes:
            raise TypeError(f"{owner}() got {given_as[field]!r} and {key!r}, which both set {field!r}")
        changes[field], given_as[field] = value, key
    if changes.get("default_layout") is True and "index" not in changes:
        changes["index"] = "f16"
    if changes.get("index") == "q4" and "k1" not in changes:
        changes["k1"] = None
    return replace(base, **changes)


def to_kwargs(config: SparqConfig) -> dict[str, Any]:
    """The constructor keyword arguments that make `config` (Llama(path, **to_kwargs(cfg)))."""
    by_field = {f: k for k, f in KWARG_FIELDS.items()}
    return {by_field[name]: value for name, value in asdict(config).items()}


# ---------------------------------------------------------------------------------------------------
# The C API (sparq-llama.h)


_C_FUNCTIONS = (C.llama_sparq_default_params, C.llama_sparq_check, C.llama_set_sparq, C.llama_get_sparq,
                C.llama_sparq_last_error, C.llama_sparq_summary, C.llama_sparq_log_summary, C.llama_sparq_last_run)


def available() -> bool:
    """Whether the loaded libllama has SparQ's decode-path API (a build from before it has not)."""
    return not C.missing(_C_FUNCTIONS)


@lru_cache(maxsize=1)
def _api() -> Any:
    """The bound C functions (`_bindings`), once this libllama is known to have SparQ's."""
    missing = C.missing(_C_FUNCTIONS)
    if missing:
        raise RuntimeError(f"this build of sparq-llama's libllama has no SparQ decode path ({', '.join(missing)} "
                           f"missing); rebuild and reinstall the package (`make install` or `pip install .`)")
    return C


def _ctx_ptr(ctx: Any) -> int | None:
    """A llama_context pointer as ctypes takes it (an int, a c_void_p, or None for NULL)."""
    if ctx is None:
        return None
    value = ctx.value if isinstance(ctx, ctypes.c_void_p) else ctx
    if not value:
        raise ValueError("the llama_context is NULL (was the Llama closed?)")
    return int(value)


def c_defaults() -> SparqConfig:
    """llama_sparq_default_params() as a SparqConfig."""
    return SparqConfig.from_c(_api().llama_sparq_default_params())


def check(config: SparqConfig, ctx: Any = None) -> None:
    """ValueError with llama_sparq_check's message if C rejects `config` (for `ctx`'s model when given)."""
    p = config.to_c()
    msg = _api().llama_sparq_check(_ctx_ptr(ctx), ctypes.byref(p))
    if msg is not None:
        raise ValueError(f"invalid SparQ settings: {msg.decode(errors='replace')}")


def apply(ctx: Any, config: SparqConfig) -> None:
    """Check `config` for `ctx`, then llama_set_sparq (effective at the next decode); ValueError on failure."""
    if ctx is None:
        raise ValueError("apply() needs a llama_context")
    check(config, ctx)
    p = config.to_c()
    lib = _api()
    if lib.llama_set_sparq(_ctx_ptr(ctx), ctypes.byref(p)) != 0:
        reason = (lib.llama_sparq_last_error() or b"").decode(errors="replace") or "no reason given"
        raise ValueError(f"llama_set_sparq failed: {reason}")


def summary(ctx: Any) -> str:
    """One line saying what `ctx` runs: SparQ on or off, in how many layers, why the others stay dense, and below how
    many cached cells layers stay dense (llama_sparq_summary)."""
    if ctx is None:
        raise ValueError("summary() needs a llama_context")
    lib = _api()
    n = lib.llama_sparq_summary(_ctx_ptr(ctx), None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.llama_sparq_summary(_ctx_ptr(ctx), buf, n + 1)
    return buf.value.decode(errors="replace")


def log_summary(ctx: Any) -> None:
    """Log that line through llama.cpp's log (shown where llama.cpp's INFO lines are: `Llama(verbose=True)`)."""
    _api().llama_sparq_log_summary(_ctx_ptr(ctx))


@dataclass(frozen=True)
class SparqRun:
    """What the attention layers of one computed ubatch ran (llama_sparq_last_run): n_tokens is 0 when no ubatch was
    recorded; the layer counts split the layers that attend over the KV cache."""

    n_tokens: int
    n_layers_sparq: int
    n_layers_centroid: int
    n_layers_dense: int

    @property
    def ran_sparq(self) -> bool:
        """SparQ ran in at least one layer."""
        return self.n_layers_sparq > 0


def last_run(ctx: Any, seq_id: int = -1) -> SparqRun:
    """What the last ubatch computed that held a token of `seq_id` ran (-1: the last ubatch computed)."""
    if ctx is None:
        raise ValueError("last_run() needs a llama_context")
    r = _api().llama_sparq_last_run(_ctx_ptr(ctx), _int32("seq_id", seq_id))
    return SparqRun(r.n_tokens, r.n_layers_sparq, r.n_layers_centroid, r.n_layers_dense)


def read(ctx: Any) -> SparqConfig:
    """The settings `ctx` holds (llama_get_sparq)."""
    if ctx is None:
        raise ValueError("read() needs a llama_context")
    return SparqConfig.from_c(_api().llama_get_sparq(_ctx_ptr(ctx)))


# ---------------------------------------------------------------------------------------------------
# Transfer model


def transfer_elements(n_kv: int, head_dim: int, k1: int, k2: int, mean: bool = True) -> tuple[int, int]:
    """(dense, SparQ) elements moved per KV head and decode step (the transfer model of docs/design.md, "SparQ: op
    semantics").

    dense = 2*S*d + 2*d (read K and V, write the new k and v);
    sparq = S*r + 2*k*d + 4*d (r rows of K^T, k rows of K and V, write k and v, read/write v_bar),
    or S*r + 2*k*d + 2*d without mean reallocation. S = n_kv, d = head_dim, r = k1, k = k2.
    """
    s, d, r, kk = (_as_int(n, v) for n, v in (("n_kv", n_kv), ("head_dim", head_dim), ("k1", k1), ("k2", k2)))
    if s < 1 or d < 1 or r < 1 or kk < 1:
        raise ValueError(f"n_kv, head_dim, k1, k2 must all be >= 1, got {s}, {d}, {r}, {kk}")
    if mean not in (True, False):
        raise ValueError(f"mean must be True or False (mean-value reallocation on or off), got {mean!r}")
    dense = 2 * s * d + 2 * d
    sparq = s * r + 2 * kk * d + (4 * d if mean else 2 * d)
    return dense, sparq


# Bytes a cache element takes, by llama.cpp's cache type name (-ctk / -ctv); a block type's block bytes over its 32
# values.
KV_TYPE_BYTES: dict[str, Fraction] = {
    "f32": Fraction(4), "f16": Fraction(2), "bf16": Fraction(2), "q8_0": Fraction(34, 32), "q5_1": Fraction(24, 32),
    "q5_0": Fraction(22, 32), "q4_1": Fraction(20, 32), "q4_0": Fraction(18, 32), "iq4_nl": Fraction(18, 32),
}
Q8_BLOCK = 32                      # cells of a component row that share one scale in the q8 index
Q8_BLOCK_BYTES = 34                # their f16 scale and 32 int8 values
Q8_INDEX_BYTES = Fraction(Q8_BLOCK_BYTES, Q8_BLOCK)
Q4_BLOCK = 32                      # cells of a q4 index block (per KV head): each component's 32 values share a scale
Q4_DIM_BYTES = 18                  # a q4 block's bytes per key component: 32 nibbles (16 bytes) and an f16 scale
Q4_INDEX_BYTES = Fraction(Q4_DIM_BYTES, Q4_BLOCK)


def default_k1(head_dim: int, index: str = DEFAULT_INDEX) -> int:
    """k1 when it is left at 0 / None (llama_sparq_params.k1 = 0), as llama.cpp resolves it: about 1/8 of dense
    attention's bytes, head_dim / 2 components of the q8 index or head_dim / 4 of the f16 one (at least 1); every
    component (head_dim) with the q4 index, the only k1 it takes."""
    if index not in INDEXES:
        raise ValueError(f"index must be one of {', '.join(map(repr, INDEXES))}, got {index!r}")
    d = _as_int("head_dim", head_dim)
    if index == "q4":
        return d
    return max(1, d // (2 if index == "q8" else 4))


def check_q4_k1(k1: int, head_dim: int) -> None:
    """ValueError unless k1 is head_dim: the q4 index scores every component (no choice of components)."""
    if k1 != head_dim:
        raise ValueError(f"the q4 index scores every key component: k1 must be head_dim = {head_dim}, got {k1}")


def index_bytes(index: str, kv_type: str = "f16") -> Fraction:
    """Bytes an index element (one key component of one cell) takes: 2 for the f16 index (whatever the cache
    type), 34/32 for the q8 index, 18/32 for the q4 index. kv_type is checked only."""
    if index not in INDEXES:
        raise ValueError(f"index must be one of {', '.join(map(repr, INDEXES))}, got {index!r}")
    if kv_type not in KV_TYPE_BYTES:
        raise ValueError(f"kv_type must be one of {', '.join(map(repr, KV_TYPE_BYTES))}, got {kv_type!r}")
    return {"q8": Q8_INDEX_BYTES, "q4": Q4_INDEX_BYTES}.get(index, Fraction(2))


def _transfer_bytes(n_kv: int, head_dim: int, k1: int, k2: int, mean: bool, kv_type: str,
                    index: str) -> tuple[Fraction, Fraction]:
    dense, sparq = transfer_elements(n_kv, head_dim, k1, k2, mean)
    b_idx = index_bytes(index, kv_type)  # checks both names
    b_kv = KV_TYPE_BYTES[kv_type]
    s, r = _as_int("n_kv", n_kv), _as_int("k1", k1)
    if index == "q4":
        check_q4_k1(r, _as_int("head_dim", head_dim))
    return dense * b_kv, s * r * b_idx + (sparq - s * r) * b_kv


def transfer_bytes(n_kv: int, head_dim: int, k1: int, k2: int, mean: bool = True, *, kv_type: str = "f16",
                   index: str = DEFAULT_INDEX) -> tuple[float, float]:
    """(dense, SparQ) bytes moved per KV head and decode step: `transfer_elements` with the k1 rows of K^T at the
    index's width (`index_bytes`) and every other element (K and V rows, the new k and v, the running V sum) at
    the cache type's (`KV_TYPE_BYTES`). The q4 index reads all of its S*d*18/32 bytes: k1 must be head_dim.

    dense = (2*S*d + 2*d) * b_kv; sparq = S*r*b_index + (2*k*d + 4*d) * b_kv (2*d without mean reallocation).
    """
    dense, sparq = _transfer_bytes(n_kv, head_dim, k1, k2, mean, kv_type, index)
    return float(dense), float(sparq)


def transfer_ratio(n_kv: int, head_dim: int, k1: int, k2: int, mean: bool = True, *, kv_type: str = "f16",
                   index: str = DEFAULT_INDEX) -> float:
    """Dense / SparQ bytes moved per KV head and decode step (`transfer_bytes`). With the f16 index on an f16
    cache this is the paper's ratio of elements."""
    dense, sparq = _transfer_bytes(n_kv, head_dim, k1, k2, mean, kv_type, index)
    return float(dense / sparq)
