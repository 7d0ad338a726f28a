"""The capture context of the selection-agreement studies (`eval.agreement.QKCapture`): a prompt longer than its
ubatch is captured in pieces, and the pieces make the same roped Q and K as one ubatch holding it all."""
from __future__ import annotations

import numpy as np
from sparq_llama.eval import agreement
from sparq_llama.eval.agreement import QKCapture
from sparq_llama.eval.engine import Engine, EngineConfig

N_TOK, KEEP_Q_FROM = 300, 260


def _capture(engine: Engine, tokens: list[int]) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    cap = QKCapture(engine, n_ctx=len(tokens), keep_q_from=KEEP_Q_FROM)
    try:
        cap.prefill(tokens)
        return ({il: np.concatenate(parts) for il, parts in cap.k.items()},
                {il: np.concatenate(parts) for il, parts in cap.q.items()})
    finally:
        cap.close()


def test_a_prompt_in_several_ubatches_captures_what_one_ubatch_does(smollm2_path, monkeypatch):
    engine = Engine(EngineConfig(str(smollm2_path), n_ctx=N_TOK + 64, n_threads=2))
    try:
        text = " ".join(f"Item {i} of the list is the word {w}." for i, w in enumerate(["alpha", "beta", "gamma"] * 12))
        tokens = engine.tokenize(text)[:N_TOK]
        assert len(tokens) == N_TOK
        monkeypatch.setattr(agreement, "CAPTURE_UBATCH", N_TOK)
        k_one, q_one = _capture(engine, tokens)
        monkeypatch.setattr(agreement, "CAPTURE_UBATCH", 64)  # 5 ubatches, the last partial
        k_many, q_many = _capture(engine, tokens)
    finally:
        engine.close()
    assert sorted(k_many) == sorted(k_one) == list(range(30))
    for il in k_one:
        assert k_many[il].shape == k_one[il].shape == (N_TOK, 3, 64)
        assert q_many[il].shape == q_one[il].shape == (N_TOK - KEEP_Q_FROM, 9, 64)
        np.testing.assert_allclose(k_many[il], k_one[il], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(q_many[il], q_one[il], rtol=1e-4, atol=1e-4)
