"""Run the quality evaluation: tasks x examples x settings, resumable, with progress; then summarise.

    from sparq_llama.eval import EvalConfig, run
    result = run(EvalConfig.preset("smollm2", "quick"), out=Path("quality_smollm2_quick.json"))

Records are written to `out` after every example, keyed by example and setting; running again with the
same config continues where it stopped (a different config refuses to mix with them; `fresh=True` starts
over). Deterministic: the examples come from the seed, decoding is greedy.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tqdm import tqdm

from . import agreement as _agreement
from . import tasks as _tasks
from .engine import Engine, EngineConfig, model_path
from .settings import ABLATIONS, KNOWN_ABLATIONS, settings_for
from .stats import summarize

log = logging.getLogger(__name__)
SCHEMA = 1
ALL_TASKS = (*_tasks.TASKS, "agreement")


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate. `preset(model, mode)` gives the documented quick and full configurations."""

    model: str = "smollm2"
    tasks: tuple[str, ...] = ALL_TASKS
    ppl_lengths: tuple[int, ...] = (2048,)
    ppl_windows: int = 4               # per length
    ppl_score: int = 256               # scored tokens at the end of each window
    retrieval_lengths: tuple[int, ...] = (1024,)
    retrieval_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    retrieval_per_cell: int = 2        # examples per (length, depth)
    retrieval_distractors: int = 0     # 0: passkey; > 0: key-value with other needles
    repetition_lengths: tuple[int, ...] = (2048,)
    repetition_per_length: int = 4
    repetition_prompt: int = 32
    repetition_generate: int = 32
    agreement_lengths: tuple[int, ...] = (2048,)
    agreement_windows: int = 1
    agreement_rows: int = 8            # query rows (the last ones of each window) per window
    ablations: tuple[str, ...] = ABLATIONS
    only: tuple[str, ...] = ()         # run just these settings (and dense); empty: all
    seed: int = 0
    n_threads: int | None = field(default=None, compare=False)   # not part of the fingerprint

    def __post_init__(self) -> None:
        bad = [t for t in self.tasks if t not in ALL_TASKS]
        if bad or not self.tasks:
            raise ValueError(f"tasks must be a non-empty subset of {', '.join(ALL_TASKS)}; got {self.tasks}")
        bad = [a for a in self.ablations if a not in KNOWN_ABLATIONS]
        if bad:
            raise ValueError(f"unknown ablations {bad}; known: {', '.join(KNOWN_ABLATIONS)}")
        for name in ("ppl_windows", "ppl_score", "retrieval_per_cell", "repetition_per_length",
                     "repetition_prompt", "repetition_generate", "agreement_windows", "agreement_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def preset(cls, model: str, mode: str, **overrides: Any) -> EvalConfig:
        if mode not in PRESETS:
            raise ValueError(f"mode must be one of {', '.join(PRESETS)}, got {mode!r}")
        base = dict(PRESETS[mode].get(model, PRESETS[mode]["*"]))
        if mode == "index":  # the full mode's examples
            base = {**PRESETS["full"].get(model, PRESETS["full"]["*"]), **base}
        return cls(model=model, **{**base, **overrides})

    @property
    def n_ctx(self) -> int:
        """Context size that holds the longest prompt plus its generation."""
        longest = max([*self.ppl_lengths, *self.retrieval_lengths, *self.agreement_lengths,
                       *(n + self.repetition_generate for n in self.repetition_lengths)])
        return longest + 64

    def fingerprint(self) -> str:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.compare}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# quick: the test suite's run (minutes on 2 cores); full: the committed results (bench/quality.py).
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "quick": {
        "*": {"ablations": (), "repetition_per_length": 6},
    },
    "full": {
        "smollm2": {"ppl_lengths": (2048, 4096), "ppl_windows": 6, "ppl_score": 256,
                    "retrieval_lengths": (1024, 2048, 4096), "retrieval_depths": (0.0, 0.25, 0.5, 0.75, 1.0),
                    "retrieval_per_cell": 3, "retrieval_distractors": 1,
                    "repetition_lengths": (2048, 4096), "repetition_per_length": 10, "repetition_generate": 48,
                    "agreement_lengths": (2048, 4096), "agreement_windows": 2},
        "gemma3": {"ppl_lengths": (2048, 4096), "ppl_windows": 4, "ppl_score": 256,
                   "retrieval_lengths": (2048, 4096, 8192), "retrieval_depths": (0.0, 0.25, 0.5, 0.75, 1.0),
                   "retrieval_per_cell": 3, "retrieval_distractors": 1,
                   "repetition_lengths": (2048, 4096), "repetition_per_length": 6, "repetition_generate": 48,
                   "agreement_lengths": (2048, 4096), "agreement_windows": 2},
        "*": {},
    },
    # the longest haystacks (Gemma-3 at 16k): retrieval only, the main settings
    "long": {
        "*": {"tasks": ("retrieval",), "retrieval_lengths": (16384,), "retrieval_depths": (0.0, 0.25, 0.5, 0.75, 1.0),
              "retrieval_per_cell": 1, "retrieval_distractors": 1, "ablations": (),
              "only": ("sparq-1/2", "sparq-1/4", "sparq-1/8", "exact", "window")},
    },
    # the index and selection against the paper's (f16 K^T, components of largest |q|) at 1/4 and 1/8 of dense
    # bytes: the full mode's examples, the main settings only
    "index": {
        "*": {"ablations": ("f16-q", "q4"), "only": ("sparq-1/4", "sparq-1/8", "sparq-1/4-f16-q", "sparq-1/8-f16-q",
                                                        "sparq-q4", "exact", "window")},
    },
    # how to spend the 1/8 budget: k2 = 64 / 128 / 256 with k1 by the recipe (perplexity: the low-noise metric)
    "budget": {
        "*": {"tasks": ("ppl",), "ablations": ("k2",), "only": ("sparq-1/8", "sparq-1/8-k2-64", "sparq-1/8-k2-256"),
              "ppl_lengths": (2048, 4096), "ppl_windows": 6},
    },
}


def build_examples(engine: Engine, cfg: EvalConfig) -> list[_tasks.Example]:
    out: list[_tasks.Example] = []
    if "ppl" in cfg.tasks:
        out += _tasks.ppl_examples(engine, lengths=cfg.ppl_lengths, n_per_length=cfg.ppl_windows,
                                   n_score=cfg.ppl_score, seed=cfg.seed)
    if "retrieval" in cfg.tasks:
        out += _tasks.retrieval_examples(engine, lengths=cfg.retrieval_lengths, depths=cfg.retrieval_depths,
                                         n_per_cell=cfg.retrieval_per_cell,
                                         n_distractors=cfg.retrieval_distractors, seed=cfg.seed)
    if "repetition" in cfg.tasks:
        out += _tasks.repetition_examples(engine, lengths=cfg.repetition_lengths,
                                          n_per_length=cfg.repetition_per_length, n_prompt=cfg.repetition_prompt,
                                          n_generate=cfg.repetition_generate, seed=cfg.seed)
    return out


def _load(out: Path | None, cfg: EvalConfig, fresh: bool) -> dict[str, Any]:
    if out is not None and out.is_file() and not fresh:
        data = json.loads(out.read_text())
        if data.get("schema") != SCHEMA or data.get("fingerprint") != cfg.fingerprint():
            raise ValueError(f"{out} holds results of another configuration (or format); pass fresh=True "
                             f"(--fresh) to start over, or choose another output file")
        return data
    return {"schema": SCHEMA, "fingerprint": cfg.fingerprint(), "config": asdict(cfg), "records": {},
            "agreement": {}}


def _save(out: Path | None, data: dict[str, Any]) -> None:
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, out)


def _run_example(engine: Engine, ex: _tasks.Example, data: dict[str, Any], cfg: EvalConfig,
                 save: Callable[[], None]) -> None:
    settings, skipped = settings_for(ex.n_kv, engine.shape, ablations=cfg.ablations)
    if cfg.only:
        settings = [s for s in settings if s.name == "dense" or s.name in cfg.only]
        skipped = [(name, note) for name, note in skipped if name in cfg.only]
    todo = [s for s in settings if f"{ex.id}|{s.name}" not in data["records"]]
    for name, note in skipped:
        data.setdefault("skipped", {})[f"{ex.id}|{name}"] = f"{name} at {ex.task} length {ex.length}: {note}"
    if not todo:
        return
    engine.clear()
    engine.apply(None)
    engine.prefill(ex.context)            # dense, shared by every setting
    for s in todo:
        engine.truncate(ex.n_kv)
        engine.apply(s.config)
        t0 = time.perf_counter()
        rec = _tasks.score(engine, ex)
        rec.update(task=ex.task, example=ex.id, length=ex.length, n_kv=ex.n_kv, setting=s.name,
                   family=s.family, transfer=s.transfer, seconds=round(time.perf_counter() - t0, 3),
                   k1=s.config.k1 if s.config else None, k2=s.config.k2 if s.config else None,
                   index=s.config.index if s.config else None, select=s.config.select if s.config else None,
                   **{k: v for k, v in ex.meta.items() if k in ("depth", "answer", "work")})
        data["records"][f"{ex.id}|{s.name}"] = rec
    engine.apply(None)
    save()


def summaries(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per task and setting (all lengths together) and per task, length and setting: value +- SE,
    relative to dense on the same examples, the mean transfer ratio."""
    recs = list(data["records"].values())
    dense = {r["example"]: r for r in recs if r["setting"] == "dense"}
    groups: dict[tuple[str, Any, str], list[dict[str, Any]]] = {}
    for r in recs:
        if r["setting"] == "dense" or r["example"] in dense:
            groups.setdefault((r["task"], None, r["setting"]), []).append(r)
            groups.setdefault((r["task"], r["length"], r["setting"]), []).append(r)
    out = []
    for (task, length, setting), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2])):
        rs = sorted(rs, key=lambda r: r["example"])
        s = summarize(task, setting, rs, [dense[r["example"]] for r in rs]).as_dict()
        s.update(length=length, family=rs[0]["family"],
                 transfer=sum(r["transfer"] for r in rs) / len(rs),
                 k1=sorted({r["k1"] for r in rs if r["k1"] is not None}) or None)
        out.append(s)
    return out


def run(cfg: EvalConfig, out: Path | None = None, *, fresh: bool = False, progress: bool = True) -> dict[str, Any]:
    """Evaluate `cfg`; the results dict (also written to `out` as it goes, when given)."""
    data = _load(out, cfg, fresh)
    path = model_path(cfg.model)
    data["model"] = {"name": cfg.model, "file": path.name}
    with Engine(EngineConfig(str(path), n_ctx=cfg.n_ctx, n_threads=cfg.n_threads, seed=cfg.seed)) as engine:
        data["model"]["shape"] = asdict(engine.shape)
        examples = build_examples(engine, cfg)
        for ex in tqdm(examples, desc=f"quality {cfg.model}", unit="example", disable=not progress):
            _run_example(engine, ex, data, cfg, lambda: _save(out, data))
        if "agreement" in cfg.tasks:
            data["agreement"] = _agreement.measure(engine, cfg, data.get("agreement") or {},
                                                   progress=progress, save=lambda: _save(out, data))
    data["summary"] = summaries(data)
    _save(out, data)
    return data
