"""Quality evaluation of SparQ against dense attention and baselines, inside the engine users run.

    sparq-llama eval --model smollm2 --mode quick --out quality.json     # minutes on 2 cores
    python bench/quality.py                                              # the full, committed results

Tasks (`tasks`): teacher-forced perplexity / bits per character, needle retrieval, repetition, and
per-layer selection agreement (`agreement`). Settings (`settings`): dense, SparQ at 1/2, 1/4, 1/8 of
dense attention transfers (k2 = 128, k1 by the paper's recipe), the exact top-k oracle, the window
baseline, and ablations of the defaults. Protocol (`engine`): dense context prefill, the tail and every
generated token under the setting. Summaries with standard errors (`stats`), tables and plots (`report`).
"""
from __future__ import annotations

from .runner import ALL_TASKS, PRESETS, EvalConfig, run, summaries
from .settings import ModelShape, Setting, k1_for_ratio, settings_for

__all__ = ["ALL_TASKS", "PRESETS", "EvalConfig", "ModelShape", "Setting", "k1_for_ratio", "run", "settings_for",
           "summaries"]
