"""llama_sparq_last_run (sparq_llama.sparq.last_run, Llama.sparq_last_run): what the attention layers of the last
ubatch computed for a sequence ran, SparQ, centroid-sparse or dense, counted while its graph was built and kept when
llama.cpp reuses the graph. SmolLM2-135M: 30 attention layers."""
from __future__ import annotations

import pytest
from sparq_llama import Llama, SparqConfig
from sparq_llama import sparq as sparq_api
from sparq_llama.sparq import SparqRun
from test_sparq_decode import N_CTX, N_THREADS, Ctx, llm, toks  # noqa: F401 (fixtures)

N_LAYER = 30
DENSE = lambda n: SparqRun(n, 0, 0, N_LAYER)   # noqa: E731
SPARQ = lambda n: SparqRun(n, N_LAYER, 0, 0)   # noqa: E731
NONE = SparqRun(0, 0, 0, 0)


def last(ctx: Ctx, seq_id: int = -1) -> SparqRun:
    return sparq_api.last_run(ctx.ctx, seq_id)


def test_nothing_recorded_before_a_decode(llm):
    with Ctx(llm.model, SparqConfig(min_n_kv=0), n_seq_max=2) as c:
        assert [last(c, s) for s in (-1, 0, 1)] == [NONE] * 3
        # out of range: nothing, not a crash
        assert last(c, 2) == NONE and last(c, -2) == NONE


def test_prompts_run_dense_and_decodes_run_sparq(llm, toks):
    with Ctx(llm.model, SparqConfig(min_n_kv=0)) as c:
        c.prefill(toks[:40])
        assert last(c) == DENSE(40) and last(c, 0) == DENSE(40)
        for i in range(3):  # the later steps reuse the first step's graph: the record is the graph's
            c.decode([(toks[40 + i], 40 + i, 0, True)])
            assert last(c) == SPARQ(1) and last(c).ran_sparq
        c.set_sparq(SparqConfig(enabled=False))
        c.decode([(toks[43], 43, 0, True)])
        assert last(c) == DENSE(1) and not last(c).ran_sparq
        c.set_sparq(SparqConfig(min_n_kv=0, prefill=True))  # --sparq-prefill: prompt batches select too
        c.prefill(toks[44:60], pos0=44)
        assert last(c) == SparqRun(16, N_LAYER, 0, 0)


def test_the_view_under_min_n_kv_runs_dense(llm, toks):
    # llama.cpp's view of the cache grows in steps of 256 cells: 256 while fewer cells are used, then 512
    with Ctx(llm.model, SparqConfig(min_n_kv=512)) as c:
        c.prefill(toks[:200])
        c.decode([(toks[200], 200, 0, True)])
        assert last(c) == DENSE(1)
        c.prefill(toks[201:300], pos0=201)
        c.decode([(toks[300], 300, 0, True)])
        assert last(c) == SPARQ(1)


def test_each_sequence_keeps_its_own_record(llm, toks):
    with Ctx(llm.model, SparqConfig(min_n_kv=0), n_seq_max=2, kv_unified=True) as c:
        c.prefill(toks[:30], seq=0)
        c.decode([(toks[30], 30, 0, True)])
        assert last(c, 0) == SPARQ(1) and last(c, 1) == NONE
        c.prefill(toks[100:120], seq=1)  # a prompt of sequence 1 after sequence 0's decode
        assert last(c, 0) == SPARQ(1) and last(c, 1) == DENSE(20) and last(c) == DENSE(20)
        c.decode([(toks[31], 31, 0, True), (toks[120], 20, 1, True)])  # one decode step of both
        assert last(c, 0) == last(c, 1) == last(c) == SPARQ(2)


def test_a_prepared_prefix_counts_as_centroid_attention(smollm2_path, toks):
    llm = Llama(str(smollm2_path), n_ctx=N_CTX, flash_attn=True, n_threads=N_THREADS, n_threads_batch=N_THREADS,
                verbose=False)
    try:
        llm.prepare_fixed_context(toks[:300], centroids=0.1, keep=0.5, progress=False)
        llm.eval([toks[300]])
        assert llm.sparq_last_run == SparqRun(1, 0, N_LAYER, 0)
        llm.set_sparq(min_n_kv=0)  # the prefix takes precedence over SparQ in its layers
        llm.eval([toks[301]])
        assert llm.sparq_last_run == SparqRun(1, 0, N_LAYER, 0)
        llm.clear_fixed_context()
        llm.eval([toks[302]])
        assert llm.sparq_last_run == SparqRun(1, N_LAYER, 0, 0)
    finally:
        llm.close()


def test_llama_property_and_bad_arguments(smollm2_path):
    llm = Llama(str(smollm2_path), n_ctx=256, sparq=True, sparq_min_n_kv=0, n_threads=N_THREADS, verbose=False)
    try:
        assert llm.sparq_last_run == NONE
        llm.eval(llm.tokenize(b"The capital of France is"))
        assert llm.sparq_last_run.n_layers_dense == N_LAYER and not llm.sparq_last_run.ran_sparq
        llm.eval([llm.token_eos()])
        assert llm.sparq_last_run == SPARQ(1)
        with pytest.raises(ValueError, match="seq_id"):
            sparq_api.last_run(llm.ctx, 2**31)
    finally:
        llm.close()
