"""SparQ in llama.cpp's decode path, end to end on the real default model (SmolLM2-135M: 30 layers, 9 query /
3 KV heads, d = 64), every result against an oracle:

* dense attention, where SparQ must equal it (k2 covering the context, min_n_kv above the view, rows with at
  most k2 visible cells) and where it must not (a small k2: proof that SparQ is really used);
* the same tokens computed another way, where SparQ's derived state (the transposed K copy, the
  per-sequence V sums) must have followed the cache: after seq_rm, seq_cp, a context shift, state save /
  load, with two sequences in one batch, with --sparq-prefill teacher forcing.

The SparQ settings are small (k2 = 32, k1 = 8, min_n_kv = 0) so selection happens at these short contexts,
and mean reallocation is on so the V sums matter too (auto would turn it off for this GQA model).
Two logits rows "agree" when max |a - b| <= tol * max |b|. This Q4_1 model quantises its activations to
8 bits before every matmul, which turns any rounding difference into quantisation-step jumps: two dense
kernels, or one kernel summing the same cells in another order, give logits ~0.04 of their scale apart.
So a recomputation of the same cells in the same order must agree to TOL (it is bit-for-bit in practice),
one in another kernel or cell order to TOL_DENSE / TOL_LAYOUT; SparQ's selection moves logits by 0.2-0.4
(test_small_k2_really_selects), and a stale cell in the derived state by as much.
"""
from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
from sparq_llama import Llama, SparqConfig
from sparq_llama import sparq as sparq_api

from llama_cpp import llama_cpp as lc  # isort: skip  (after sparq_llama, which points it at our libllama)

N_CTX = 1024
N_THREADS = 1
N_PROMPT = 300     # the prompt of the dense comparisons
N_SHORT = 160      # the prompt of the cache tests (k2 = 32 selects from 160+ cells)
# The f16 index and select q, whose derived state is exact: a q8 block's scale is shared by the 32 cells written
# into it (later tokens of a batch, other sequences of a unified stream), and qsigma's key statistics are running
# f32 sums that a rebuild adds in another order, so those agree to TOL_DENSE, not TOL (measured up to 0.08 here,
# with the mean on); tests/test_sparq_kv_index.py checks both against the cache.
SPARSE = SparqConfig(k1=8, k2=32, min_n_kv=0, mean="on", index="f16", select="q")
TOL = 1e-3         # same computation and cache content, other rounding
# Another attention kernel over the same cells: this small Q4_1 model amplifies rounding, so llama.cpp's own
# two dense paths (flash attention with its f16 V accumulation, and the plain soft_max path) already differ
# by up to 0.046 of the logit scale at these contexts (measured); SparQ's exact path sits as close to both.
TOL_DENSE = 0.1
# The same for one attention kernel over the same cells in another cell order (the summation order changes;
# dense flash attention itself moves by 0.039 then, measured).
TOL_LAYOUT = 0.1

TEXT = """\
The lighthouse on the northern cape was built in the spring of a year that nobody in the village can now
name with confidence. The oldest fisherman says it was the year the herring came late; the schoolteacher,
who keeps a ledger of everything, insists it was two winters after the great storm that carried away the
harbour wall. Whatever the year, the tower rose quickly. Masons came from the city with carts of grey stone,
and for eleven weeks the village children sat on the dunes to watch the walls climb, course by course,
until the lantern room was lifted into place with ropes, pulleys and a great deal of shouting.

The first keeper was a quiet man called Tobias Wren. He had served on merchant ships for twenty years and
knew the coast by its smells as much as by its shapes. Every evening at dusk he climbed the one hundred and
twelve steps, trimmed the wicks, polished the brass and wound the clockwork that turned the lens. Every
morning he wrote three lines in the log: the weather, the ships he had seen, and anything unusual. Most
days there was nothing unusual. Once there was a whale in the bay; once a balloon drifted over from the
south and came down in the marsh; once a rowing boat arrived with a doctor who had lost his way in fog.

Wren kept bees behind the cottage and grew beans, onions and a stubborn row of potatoes in the sandy soil.
On Sundays he walked to the village for bread and news, and the baker's wife always gave him the loaf
with the darkest crust because she knew he liked it. He did not talk much, but he listened well, and people
told him things they told nobody else. When the miller's son wanted to leave for the city, it was Wren who
persuaded the miller to let him go. When two families quarrelled over a strip of grazing land, it was Wren
who walked the boundary with them and found the old marker stones buried under thirty years of turf.

In his eighth year at the light a winter came that was harder than any before it. The sea froze in the
shallows, the road to the village vanished under drifts, and for nineteen days no ship passed the cape.
Wren rationed his oil by burning only half the wicks on clear nights, and he kept the full light for the
nights of snow, when a captain would need it most. On the twentieth day a schooner appeared, battered and
listing, her sails torn to ribbons. She had been driven north by the gales and her crew had not seen land
for a week. They saw the light, they steered for it, and they came into the bay on the last of the tide.

The village remembers that night because every household took in a sailor. The baker fed six of them. The
schoolteacher wrote down their names, their home ports and the cargo they carried, which turned out to be
oranges, crates and crates of oranges, so that for the rest of that winter every child in the village had
orange peel drying on the windowsill and the whole street smelled of summer. The captain stayed until the
thaw and then sailed south again, and every year after that a crate of oranges arrived at the lighthouse
with no letter, only a painted mark on the lid: a small schooner and a star.

Wren kept the light for thirty-one years. When his eyes began to fail, a young woman from the village,
Marta Hale, climbed the steps with him each evening and learned the work: the wicks, the brass, the clock,
the log. She was patient and exact, and she asked questions that made him think about things he had done
for decades without thinking. Why three lines in the log and not four? Why trim the wicks before polishing
and not after? He did not always have answers, but he enjoyed the questions, and he said later that those
evenings were the happiest of his long life on the cape.
"""


# ---------------------------------------------------------------------------------------------------
# Decoding through llama.cpp's C API (llama-cpp-python's ctypes bindings)


class Ctx:
    """A llama_context: decode (token, pos, seq, wants_logits) rows and read the logits back.

    Made on `model` with flash attention (SparQ needs it) and N_THREADS for decodes and batches alike, or
    wrapping the context of a Llama (`Ctx.of(llm)`, not owned).
    """

    def __init__(self, model, sparq: SparqConfig | None = None, *, n_seq_max: int = 1, kv_unified: bool = False,
                 n_batch: int = 512, kv_f32: bool = False, n_ctx: int = N_CTX, swa_full: bool = True) -> None:
        p = lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, n_batch, n_batch
        p.swa_full = swa_full  # sliding-window models: a full-size windowed cache (llama.cpp's default), or the window
        if kv_f32:
            p.type_k = p.type_v = lc.GGML_TYPE_F32
        p.n_seq_max, p.kv_unified = n_seq_max, kv_unified
        p.n_threads = p.n_threads_batch = N_THREADS
        p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        p.no_perf = True
        self.ctx = lc.llama_init_from_model(model, p)
        assert self.ctx, "llama_init_from_model failed"
        self._owned = True
        self.n_batch = n_batch
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        if sparq is not None:
            sparq_api.apply(self.ctx, sparq)

    @classmethod
    def of(cls, llm: Llama) -> Ctx:
        self = cls.__new__(cls)
        self.ctx, self._owned, self.n_batch = llm.ctx, False, llm.n_batch
        self.n_vocab = llm.n_vocab()
        return self

    def close(self) -> None:
        if self._owned and self.ctx:
            lc.llama_free(self.ctx)
        self.ctx = None

    def __enter__(self) -> Ctx:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def mem(self):
        return lc.llama_get_memory(self.ctx)

    def set_sparq(self, config: SparqConfig) -> None:
        sparq_api.apply(self.ctx, config)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode of (token, pos, seq_id, wants_logits) rows; the logits [n_out, n_vocab]."""
        batch = lc.llama_batch_init(len(rows), 0, 1)
        try:
            batch.n_tokens = len(rows)
            for i, (tok, pos, seq, out) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
                batch.seq_id[i][0] = seq
            rc = lc.llama_decode(self.ctx, batch)
            assert rc == 0, f"llama_decode returned {rc}"
            return np.array([np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                             for i, row in enumerate(rows) if row[3]], dtype=np.float32).reshape(-1, self.n_vocab)
        finally:
            lc.llama_batch_free(batch)

    def prefill(self, tokens: list[int], *, pos0: int = 0, seq: int = 0, all_logits: bool = False) -> np.ndarray:
        """Tokens in batches of n_batch; the logits of every row (all_logits) or of the last one [1, n_vocab]."""
        out = []
        for i in range(0, len(tokens), self.n_batch):
            chunk = tokens[i:i + self.n_batch]
            last = i + len(chunk) == len(tokens)
            out.append(self.decode([(t, pos0 + i + j, seq, all_logits or (last and j == len(chunk) - 1))
                                    for j, t in enumerate(chunk)]))
        return np.concatenate(out)

    def steps(self, tokens: list[int], pos0: int, *, seq: int = 0) -> np.ndarray:
        """One decode per token (the decode path), teacher-forced; logits [len(tokens), n_vocab]."""
        return np.concatenate([self.decode([(t, pos0 + i, seq, True)]) for i, t in enumerate(tokens)])

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
        """Prefill the prompt, then n greedy tokens decoded one by one; (tokens, the logits each came from)."""
        logits = [self.prefill(prompt)[0]]
        tokens = [int(np.argmax(logits[0]))]
        for i in range(n - 1):
            logits.append(self.decode([(tokens[-1], len(prompt) + i, 0, True)])[0])
            tokens.append(int(np.argmax(logits[-1])))
        return tokens, np.array(logits)


def rel_err(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per row: max |got - want| / max |want|."""
    got, want = np.atleast_2d(got), np.atleast_2d(want)
    return np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)


def assert_logits_agree(got: np.ndarray, want: np.ndarray, what: str, tol: float = TOL) -> None:
    assert got.shape == want.shape, f"{what}: shapes {got.shape} vs {want.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite logits"
    err = rel_err(got, want)
    worst = int(np.argmax(err))
    assert err[worst] <= tol, (f"{what}: logits differ by {err[worst]:.3g} of their scale at row {worst} "
                               f"(tolerance {tol:g}); per row: {np.array2string(err, precision=2, max_line_width=200)}")


@pytest.fixture(scope="module")
def llm(smollm2_path):
    """The model (contexts are made per test on llm.model)."""
    llm = Llama(str(smollm2_path), n_ctx=N_CTX, flash_attn=True, n_threads=N_THREADS, n_threads_batch=N_THREADS,
                verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def toks(llm) -> list[int]:
    t = llm.tokenize(TEXT.encode(), add_bos=True)
    assert len(t) >= 800, len(t)
    return t


@pytest.fixture(scope="module")
def parts(toks):
    """P (160 tokens), X (the next 50), Y (12 tokens from elsewhere, decoded after P or after P + X)."""
    return toks[:N_SHORT], toks[N_SHORT:N_SHORT + 50], toks[600:612]


@pytest.fixture(scope="module")
def fresh(llm):
    """fresh(cfg, prompt, steps): logits of `steps` decoded one by one after a one-batch prefill of `prompt`
    in a new context (the oracle of the cache tests; memoised, several tests share results)."""
    memo: dict = {}

    def run(cfg: SparqConfig | None, prompt: list[int], steps: list[int]) -> np.ndarray:
        key = (cfg, tuple(prompt), tuple(steps))
        if key not in memo:
            with Ctx(llm.model, cfg) as ctx:
                ctx.prefill(prompt)
                memo[key] = ctx.steps(steps, len(prompt))
        return memo[key]

    return run


@pytest.fixture(scope="module")
def dense_greedy(llm, toks):
    """Dense greedy continuation of the 300-token prompt: (tokens, logits) for 32 steps."""
    with Ctx(llm.model) as ctx:
        return ctx.greedy(toks[:N_PROMPT], 32)


def test_c_api_is_present():
    assert sparq_api.available(), "libllama has no llama_set_sparq & co.: this build predates SparQ's decode path"


# ---------------------------------------------------------------------------------------------------
# SparQ against dense attention


def test_k2_covering_the_context_is_dense(llm, toks, dense_greedy):
    """k2 >= every row's visible cells: exact attention over all of them, so greedy output is dense's."""
    d_tokens, d_logits = dense_greedy
    with Ctx(llm.model, SparqConfig(k2=N_CTX, min_n_kv=0)) as sparse:
        s_tokens, s_logits = sparse.greedy(toks[:N_PROMPT], 32)
    same = next((i for i, (s, d) in enumerate(zip(s_tokens, d_tokens)) if s != d), len(d_tokens))
    # logits agree as long as both saw the same tokens (all 32 steps when the outputs are identical)
    assert_logits_agree(s_logits[:same + 1], d_logits[:same + 1], "SparQ k2 = n_ctx vs dense", tol=TOL_DENSE)
    row = d_logits[min(same, len(d_tokens) - 1)]
    assert s_tokens == d_tokens, (
        f"SparQ with k2 = n_ctx generated {s_tokens}, dense {d_tokens}: they part at step {same} "
        f"(dense margin {row[d_tokens[same]] - row[s_tokens[same]] if same < len(d_tokens) else 0:.3g})")


def test_small_k2_really_selects(llm, toks, dense_greedy):
    """k2 = 16 of ~300 cells: the logits move well beyond rounding (SparQ is active), stay finite and sane."""
    d_tokens, d_logits = dense_greedy
    with Ctx(llm.model, SparqConfig(k1=8, k2=16, min_n_kv=0)) as sparse:
        sparse.prefill(toks[:N_PROMPT])                       # a multi-token batch: dense (no sparq_prefill)
        s_logits = sparse.steps(d_tokens[:15], N_PROMPT)      # teacher-forced on the dense continuation
    assert np.isfinite(s_logits).all()
    err = rel_err(s_logits, d_logits[1:16])
    assert err.max() > 1.5 * TOL_DENSE, f"SparQ k2=16 logits equal dense to {err.max():.2g}: is SparQ used at all?"
    # still the same language model: dense's choice stays among SparQ's top 5 at most steps
    top5 = np.argsort(-s_logits, axis=1)[:, :5]
    hits = np.mean([d_tokens[i + 1] in top5[i] for i in range(len(top5))])
    assert hits >= 0.75, f"dense's greedy token in SparQ's top 5 at only {hits:.0%} of steps (err {err})"


def test_min_n_kv_keeps_a_small_view_dense(llm, toks, dense_greedy):
    """min_n_kv above the cache view: dense attention, even with k2 = 16. No step there reads SparQ's derived
    state, so none keeps it either: the graphs are dense's and the logits equal dense's bit for bit."""
    d_tokens, d_logits = dense_greedy
    with Ctx(llm.model, SparqConfig(k1=8, k2=16, min_n_kv=N_CTX)) as sparse:
        sparse.prefill(toks[:N_PROMPT])
        s_logits = sparse.steps(d_tokens[:7], N_PROMPT)
    np.testing.assert_array_equal(s_logits, d_logits[1:8])


# ---------------------------------------------------------------------------------------------------
# --sparq-prefill: teacher forcing equals step-by-step decoding


def test_sparq_prefill_equals_step_by_step_decode(llm, parts):
    prompt = parts[0]
    t0 = N_SHORT - 24
    cfg = dataclasses.replace(SPARSE, prefill=True)
    with Ctx(llm.model, cfg) as ctx:
        forced = ctx.prefill(prompt, all_logits=True)        # one batch, every row selects causally
    with Ctx(llm.model, cfg) as ctx:
        ctx.prefill(prompt[:t0])
        stepped = ctx.steps(prompt[t0:], t0)                  # the decode path, one token at a time
    assert_logits_agree(forced[t0:], stepped, "sparq_prefill batch rows vs step-by-step decode")

    with Ctx(llm.model) as ctx:
        dense = ctx.prefill(prompt, all_logits=True)
    with Ctx(llm.model, SPARSE) as ctx:
        no_prefill = ctx.prefill(prompt, all_logits=True)
    # rows with at most k2 = 32 visible cells are exact attention; later rows select
    assert_logits_agree(forced[:32], dense[:32], "sparq_prefill rows 0..31 (<= k2 cells) vs dense", tol=TOL_DENSE)
    err = rel_err(forced[t0:], dense[t0:])
    assert err.max() > 1.5 * TOL_DENSE, f"sparq_prefill rows equal dense to {err.max():.2g}: no selection in the batch?"
    # without sparq_prefill a multi-token batch is dense
    assert_logits_agree(no_prefill, dense, "SparQ without sparq_prefill, prefill batch vs dense")


# ---------------------------------------------------------------------------------------------------
# The derived state follows the cache


def test_enabling_on_a_filled_cache_equals_enabled_from_the_start(llm, parts, fresh):
    """set_sparq on a context holding tokens builds K^T and the V sums from the cache."""
    prompt, _, y = parts
    with Ctx(llm.model) as ctx:
        ctx.prefill(prompt)
        ctx.set_sparq(SPARSE)
        got = ctx.steps(y, len(prompt))
    assert_logits_agree(got, fresh(SPARSE, prompt, y), "SparQ enabled after a dense prefill vs from the start")


def test_seq_rm_then_decode_equals_fresh_context(llm, parts, fresh):
    """Remove the last 50 (decoded) tokens, decode others: as if the 50 had never been there."""
    prompt, x, y = parts
    with Ctx(llm.model, SPARSE) as ctx:
        ctx.prefill(prompt)
        ctx.steps(x, len(prompt))
        assert lc.llama_memory_seq_rm(ctx.mem, 0, len(prompt), -1)
        got = ctx.steps(y, len(prompt))
    assert_logits_agree(got, fresh(SPARSE, prompt, y), "after seq_rm of 50 decoded tokens vs a fresh context")


@pytest.mark.parametrize("kv_unified", [False, True], ids=["streams", "unified"])
def test_seq_cp_then_decode_equals_fresh_context(llm, parts, fresh, kv_unified):
    """Copy sequence 0 to 1 (metadata within one stream, buffers across streams), decode on both."""
    prompt, x, y = parts
    n = len(prompt) + len(x)
    want = fresh(SPARSE, prompt, x + y)[len(x):]
    with Ctx(llm.model, SPARSE, n_seq_max=2, kv_unified=kv_unified) as ctx:
        ctx.prefill(prompt)
        ctx.steps(x, len(prompt))
        lc.llama_memory_seq_cp(ctx.mem, 0, 1, -1, -1)
        got1 = ctx.steps(y, n, seq=1)
        got0 = ctx.steps(y, n, seq=0)
    assert_logits_agree(got1, want, "sequence 1 after seq_cp(0 -> 1) vs a fresh context")
    assert_logits_agree(got0, want, "sequence 0 after seq_cp(0 -> 1) and decodes on 1 vs a fresh context")


def test_context_shift_then_decode(llm, parts):
    """llama-cli's context shift (seq_rm of the older half, seq_add -n_discard): K is re-rotated in place.

    A fresh prefill is no oracle here (the kept tokens' K/V were computed with the discarded ones in view),
    so the oracles are the same shifted cache read (a) after SparQ was switched off and on again, which
    rebuilds K^T and the V sums from it, and (b) with default_layout, which reads no K^T at all.
    """
    prompt, x, y = parts
    n_past, n_keep = len(prompt) + len(x), 4
    n_discard = (n_past - n_keep) // 2

    def shifted(cfg: SparqConfig) -> Ctx:
        ctx = Ctx(llm.model, cfg)
        ctx.prefill(prompt)
        ctx.steps(x, len(prompt))
        assert lc.llama_memory_can_shift(ctx.mem)
        assert lc.llama_memory_seq_rm(ctx.mem, 0, n_keep, n_keep + n_discard)
        lc.llama_memory_seq_add(ctx.mem, 0, n_keep + n_discard, n_past, -n_discard)
        return ctx

    pos = n_past - n_discard
    with shifted(SPARSE) as ctx:
        assert lc.llama_memory_seq_pos_max(ctx.mem, 0) == pos - 1
        got = ctx.steps(y, pos)
    with shifted(SPARSE) as ctx:
        ctx.set_sparq(dataclasses.replace(SPARSE, enabled=False))
        ctx.decode([(y[0], pos, 0, True)])            # a dense decode applies the K shift
        assert lc.llama_memory_seq_rm(ctx.mem, 0, pos, -1)
        ctx.set_sparq(SPARSE)                          # rebuilt from the shifted cache
        rebuilt = ctx.steps(y, pos)
    assert_logits_agree(got, rebuilt, "after a context shift vs SparQ state rebuilt from the shifted cache")
    with shifted(dataclasses.replace(SPARSE, default_layout=True)) as ctx:
        no_kt = ctx.steps(y, pos)
    # another summation order of the approximate scores (K^T rows vs gathered K rows): TOL_LAYOUT
    assert_logits_agree(got, no_kt, "after a context shift, K^T layout vs default layout (no K^T)", tol=TOL_LAYOUT)


def test_state_save_load(llm, smollm2_path, parts, toks, fresh):
    """Llama.save_state / load_state: into the same Llama after other work, into fresh ones, per sequence."""
    prompt, x, y = parts
    kwargs = dict(n_ctx=N_CTX, n_threads=N_THREADS, n_threads_batch=N_THREADS, verbose=False)
    sparse_kwargs = dict(kwargs, **sparq_api.to_kwargs(SPARSE))
    n = len(prompt) + len(x)
    want = fresh(SPARSE, prompt, x + y)[len(x):]
    got: dict[str, np.ndarray] = {}

    def continue_(model: Llama) -> np.ndarray:
        return Ctx.of(model).steps(y, n)

    a = Llama(str(smollm2_path), **sparse_kwargs)
    try:
        a.eval(prompt)
        for t in x:
            a.eval([t])
        state = a.save_state()
        seq_state = (ctypes.c_uint8 * lc.llama_state_seq_get_size(a.ctx, 0))()
        assert lc.llama_state_seq_get_data(a.ctx, seq_state, len(seq_state), 0) == len(seq_state)
        got["the saved Llama itself, decoding on"] = continue_(a)
        a.reset()
        a.eval(toks[440:440 + n + len(y)])             # other tokens over every cell the state holds
        a.load_state(state)
        got["state loaded into the same Llama after other tokens"] = continue_(a)
    finally:
        a.close()

    b = Llama(str(smollm2_path), **sparse_kwargs)
    try:
        b.load_state(state)
        assert b.sparq == SPARSE
        got["state loaded into a fresh SparQ Llama"] = continue_(b)
    finally:
        b.close()

    c = Llama(str(smollm2_path), flash_attn=True, **kwargs)
    try:
        c.load_state(state)
        c.set_sparq(SPARSE)
        got["state loaded into a dense Llama, SparQ enabled after"] = continue_(c)
    finally:
        c.close()

    d = Llama(str(smollm2_path), **sparse_kwargs)      # what llama-bench -d does: one sequence's state
    try:
        assert lc.llama_state_seq_set_data(d.ctx, seq_state, len(seq_state), 0) == len(seq_state)
        got["one sequence's state loaded into a fresh SparQ Llama"] = continue_(d)
    finally:
        d.close()

    errors = {what: float(rel_err(logits, want).max()) for what, logits in got.items()}
    bad = {what: e for what, e in errors.items() if e > TOL}
    assert not bad, f"vs a fresh context that computed the same tokens (tolerance {TOL:g}): {errors}"


def test_recent_window_means_recent_positions(llm, toks):
    """After seq_rm opens a hole, new tokens land in it, in lower cells than older tokens: the recent window
    must still be the most recent positions, wherever the cache put them.

    Oracle: the same cache with the hole filled by another sequence first, so the new tokens land after
    the old ones (cell order = position order). The "window" policy keeps sinks + the k2 most recent only,
    so reading the wrong cells as recent shows at once; dense attention is the control (TOL_LAYOUT).
    """
    prompt, y, filler = toks[:N_SHORT], toks[600:612], toks[700:760]

    def run(cfg: SparqConfig | None, fill: bool) -> np.ndarray:
        with Ctx(llm.model, cfg, n_seq_max=2, kv_unified=True) as ctx:
            ctx.prefill(prompt)
            assert lc.llama_memory_seq_rm(ctx.mem, 0, 60, 120)    # cells 60..119 free
            if fill:
                ctx.prefill(filler, seq=1)                       # now they are sequence 1's
            return ctx.steps(y, len(prompt))

    assert_logits_agree(run(None, False), run(None, True), "dense, new tokens in the hole vs after the old ones",
                        tol=TOL_LAYOUT)
    cfg = dataclasses.replace(SPARSE, policy="window")
    assert_logits_agree(run(cfg, False), run(cfg, True), "SparQ window policy, new tokens in the hole vs after "
                        "the old ones", tol=TOL_LAYOUT)


# ---------------------------------------------------------------------------------------------------
# Several sequences


@pytest.mark.parametrize("kv_unified", [False, True], ids=["streams", "unified"])
def test_two_sequences_in_one_batch_equal_each_alone(llm, toks, fresh, kv_unified):
    p0, p1 = toks[:N_SHORT], toks[300:440]
    y0, y1 = toks[600:612], toks[700:712]
    with Ctx(llm.model, SPARSE, n_seq_max=2, kv_unified=kv_unified) as ctx:
        ctx.prefill(p0, seq=0)
        ctx.prefill(p1, seq=1)
        got = np.array([ctx.decode([(y0[i], len(p0) + i, 0, True), (y1[i], len(p1) + i, 1, True)])
                        for i in range(len(y0))])
    assert_logits_agree(got[:, 0], fresh(SPARSE, p0, y0), "sequence 0 decoded beside sequence 1 vs alone")
    # unified: sequence 1's cells come after sequence 0's (other cells than alone, but the same order)
    assert_logits_agree(got[:, 1], fresh(SPARSE, p1, y1), "sequence 1 decoded beside sequence 0 vs alone",
                        tol=TOL_LAYOUT if kv_unified else TOL)
