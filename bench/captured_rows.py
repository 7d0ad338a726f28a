"""Real decode rows for the numpy studies of bench/ (carry_threshold.py, int8_tiles.py): the last `rows` positions of
retrieval examples (the quality harness's haystack with needles, `sparq_llama.eval.tasks`), prefilled densely on a
capture context (`eval.agreement.QKCapture`: each layer's roped Q and K), every earlier cell visible."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from sparq_llama.eval import tasks
from sparq_llama.eval.agreement import QKCapture
from sparq_llama.eval.engine import Engine, EngineConfig
from sparq_llama.models import fetch
from tqdm import tqdm


def captured_rows(model: str, length: int, rows: int, n: int, seed: int, threads: int
                  ) -> Iterator[tuple[int, np.ndarray, np.ndarray, int]]:
    """Per example, SparQ layer (every layer where the graph has none) and KV head: (layer, q [rows, G, d] of the
    head's query group from row `first`, k [n_kv, d] of the head, first)."""
    engine = Engine(EngineConfig(str(fetch(model)), n_ctx=length + 64, n_threads=threads))
    depths = tuple(round(0.2 + 0.6 * i / max(1, n - 1), 3) for i in range(n))
    examples = tasks.retrieval_examples(engine, lengths=(length,), depths=depths, n_per_cell=1, n_distractors=2,
                                        seed=seed)
    for ex in tqdm(examples, desc="examples"):
        yield from prefill_rows(engine, ex.context + ex.tail, rows)


def prefill_rows(engine: Engine, tokens: list[int], rows: int) -> Iterator[tuple[int, np.ndarray, np.ndarray, int]]:
    """The rows of one prefill of `tokens`, as captured_rows yields them (from row first = len(tokens) - rows)."""
    first = len(tokens) - rows
    cap = QKCapture(engine, n_ctx=len(tokens), keep_q_from=first)
    try:
        cap.prefill(tokens)
        layers = sorted(cap.sparq_layers) or sorted(cap.k)
        G = cap.n_head // cap.n_head_kv
        for il in tqdm(layers, desc="layers", leave=False):
            q = np.concatenate(cap.q[il])  # [rows, n_head, d]
            k = np.concatenate(cap.k[il])  # [n, n_head_kv, d]
            for h in range(cap.n_head_kv):
                yield il, q[:, h * G:(h + 1) * G], k[:, h], first
    finally:
        cap.close()
