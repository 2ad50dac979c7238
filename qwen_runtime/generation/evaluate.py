"""Perplexity of a text, and the divergence of a model from a reference model, streamed window by window.

**Method** (HF's strided perplexity, as in llama.cpp's ``llama-perplexity --kl-divergence`` for the
reference statistics).  The text is tokenized once and cut into windows of ``ctx`` tokens starting every
``stride`` tokens (the last window ends at the end of the text).  Each window is a fresh context (no
cache carried over) and scores only the tokens after the end of the previous window, so every token is
scored at most once: the first window scores tokens ``1 .. ctx-1``; later ones score their last
``stride`` tokens with at least ``ctx - stride`` tokens of context.  With ``stride == ctx`` the windows do
not overlap and the first token of each window has no in-window context, so it is not scored.

For each scored token the log-softmax of the logits is taken in float64; the perplexity is
``exp(mean NLL)``.  Against a reference the per-token ``KL(ref || model) = sum_v p_ref (log p_ref - log
p_model)`` is reported as mean, median, 99th percentile and max, with top-1 agreement (the two argmaxes
are equal) and ``Δppl = ppl(model) - ppl(ref)``.

Memory stays bounded: a window is fed through the cached forward path ``chunk`` tokens at a time, so at
most ``[chunk, V]`` logits exist per model at once; only one float per scored token is kept (its KL).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import QwenError
from ..models import Model
from ..text.chat import chat_format

METHOD = ("sliding window of {ctx} tokens, stride {stride}: each window scores only the tokens after the "
          "previous window's end (HF strided perplexity); log-softmax in float64")
CHUNK_ELEMENTS = 1 << 22  # logits per model per chunk (32 MiB in float64): ~27 tokens of a 152k vocabulary
MAX_CHUNK = 256  # longer chunks amortise per-call work (one 256-token chunk against four of 64)


def default_chunk(vocab_size: int) -> int:
    """Tokens per forward pass inside a window: about CHUNK_ELEMENTS logits, between 8 and MAX_CHUNK tokens."""
    return max(8, min(MAX_CHUNK, CHUNK_ELEMENTS // max(vocab_size, 1)))


class VocabularyMismatchError(QwenError, ValueError):
    """Two models compared token by token do not share a tokenizer and vocabulary."""


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` are fed; targets ``[first_target, end)`` are scored."""

    begin: int
    end: int
    first_target: int


@dataclass(frozen=True)
class ReferenceStats:
    """How a model's next-token distributions differ from a reference's over the scored tokens."""

    reference: str
    reference_perplexity: float
    delta_perplexity: float  # ppl(model) - ppl(reference)
    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_max: float
    top1_agreement: float  # fraction of scored tokens where both argmaxes agree


@dataclass(frozen=True)
class EvalResult:
    """Perplexity of one model on one text (and its divergence from the reference, when one was given)."""

    model: str
    tokens: int  # tokens of the text that were evaluated (after --eval-tokens)
    scored: int  # tokens that were scored
    ctx: int
    stride: int
    method: str
    nll: float  # mean negative log-likelihood, nats per scored token
    perplexity: float
    seconds: float
    vs_reference: ReferenceStats | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def plan_windows(n_tokens: int, ctx: int, stride: int) -> list[Window]:
    """The windows of the strided method (see the module docstring) over ``n_tokens`` tokens."""
    if ctx < 2:
        raise ValueError(f"ctx must be at least 2, got {ctx}")
    if not 1 <= stride <= ctx:
        raise ValueError(f"stride must be between 1 and ctx ({ctx}), got {stride}")
    windows, prev_end = [], 0
    for begin in range(0, max(n_tokens - 1, 0), stride):
        end = min(begin + ctx, n_tokens)
        first = max(prev_end, begin + 1)
        if first < end:
            windows.append(Window(begin, end, first))
        prev_end = end
        if end == n_tokens:
            break
    return windows


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities over the last axis.  # [N, V] -> [N, V]"""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))  # the exp temporary is freed at once
    return x


def kl_divergence(ref_logp: np.ndarray, logp: np.ndarray, ref_probs: np.ndarray | None = None) -> np.ndarray:
    """Per-row KL(ref || model) from float64 log-probabilities.  # [N, V], [N, V] -> [N]"""
    probs = np.exp(ref_logp) if ref_probs is None else ref_probs
    return np.einsum("nv,nv->n", probs, ref_logp - logp)


@dataclass(frozen=True)
class ReferenceChunk:
    """The reference's distributions over one chunk of scored targets, shared by every compared model."""

    logp: np.ndarray  # float64 [N, V]
    probs: np.ndarray  # float64 [N, V]
    top1: np.ndarray  # int [N]

    @classmethod
    def of(cls, logp: np.ndarray) -> ReferenceChunk:
        return cls(logp, np.exp(logp), logp.argmax(-1))


def window_log_probs(model: Model, ids: np.ndarray, window: Window,
                     chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(first target, log-probs [n, V])`` for the window's scored targets, ``chunk`` slots at a time.

    Logits at slot ``s`` predict token ``s + 1``.  The context slots before the first scored target only fill
    the cache (``last_only``: no full-vocabulary logits are computed for them).  Every pass is one of several
    tokens, so the workspace keeps its scratch from chunk to chunk, and drops it after the window.
    """
    cache = model.make_cache(1, window.end - window.begin)
    lo = window.first_target - 1
    with model.workspace.keep_scratch():
        for c0 in range(window.begin, lo, chunk):
            model.forward(ids[None, c0:min(c0 + chunk, lo)], cache, last_only=True)
        for c0 in range(lo, window.end - 1, chunk):
            c1 = min(c0 + chunk, window.end - 1)
            yield c0 + 1, log_softmax(model.forward(ids[None, c0:c1], cache)[0])  # [c1 - c0, V]


class _Scores:
    """Running sums of one model's scored tokens (and its per-token KL against the reference)."""

    def __init__(self) -> None:
        self.nll, self.count, self.agree = 0.0, 0, 0
        self.kl: list[np.ndarray] = []

    def add(self, logp: np.ndarray, targets: np.ndarray, ref: ReferenceChunk | None) -> None:
        self.nll -= float(logp[np.arange(len(targets)), targets].sum())
        self.count += len(targets)
        if ref is not None:
            self.kl.append(kl_divergence(ref.logp, logp, ref.probs))
            self.agree += int((ref.top1 == logp.argmax(-1)).sum())


def check_same_vocabulary(models: Sequence[Model], reference: Model) -> None:
    """Raise :class:`VocabularyMismatchError` unless every model shares the reference's logits and tokens."""
    want = chat_format(reference).tokenizer.backend.get_vocab(with_added_tokens=True)
    for model in models:
        va, vb = model.config.vocab_size, reference.config.vocab_size
        if va != vb:
            raise VocabularyMismatchError(f"{model.path} has {va} logits per token, {reference.path} has {vb}; "
                                          "comparing them token by token needs the same vocabulary")
        got = chat_format(model).tokenizer.backend.get_vocab(with_added_tokens=True)
        if got != want:
            diff = sorted(set(got.items()) ^ set(want.items()))[:3]
            raise VocabularyMismatchError(f"{model.path} and {reference.path} have different tokenizers "
                                          f"({len(got)} vs {len(want)} tokens; e.g. {diff})")


def encode_text(model: Model, text: str, max_tokens: int | None = None) -> np.ndarray:
    """The text's token ids as the model reads a raw prompt (BOS only if the model asks), maybe truncated."""
    ids = chat_format(model).encode_prompt(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s); perplexity needs at least 2")
    return np.asarray(ids, np.int64)


def check_window_fits(models: Sequence[Model], ctx: int) -> None:
    for m in models:
        if ctx > m.config.context_window:
            raise ValueError(f"ctx {ctx} exceeds the context length of {m.path} "
                             f"({m.config.context_window})")


def check_models(models: Sequence[Model], reference: Model | None, ctx: int) -> None:
    """What :func:`evaluate_ids` needs of its models: ``ctx`` within every context length, and one tokenizer
    and vocabulary shared by all of them and the reference."""
    check_window_fits([*models, *([reference] if reference is not None else [])], ctx)
    check_same_vocabulary(models[1:], models[0])
    if reference is not None:
        check_same_vocabulary(models[:1], reference)


def _reference_stats(scores: _Scores, ppl: float, ref: _Scores, reference: Model) -> ReferenceStats:
    kl = np.concatenate(scores.kl) if scores.kl else np.zeros(1)
    ref_ppl = math.exp(ref.nll / ref.count)
    return ReferenceStats(str(reference.path), ref_ppl, ppl - ref_ppl, float(kl.mean()), float(np.median(kl)),
                          float(np.percentile(kl, 99)), float(kl.max()), scores.agree / scores.count)


def _result(model: Model, scores: _Scores, ids: np.ndarray, ctx: int, stride: int, seconds: float,
            ref: _Scores | None, reference: Model | None) -> EvalResult:
    nll = scores.nll / scores.count
    ppl = math.exp(nll)
    vs = _reference_stats(scores, ppl, ref, reference) if ref is not None and reference is not None else None
    return EvalResult(str(model.path), len(ids), scores.count, ctx, stride,
                      METHOD.format(ctx=ctx, stride=stride), nll, ppl, seconds, vs)


def evaluate_ids(models: Sequence[Model], ids: np.ndarray, ctx: int, stride: int,
                 reference: Model | None = None, chunk: int | None = None,
                 progress: Callable[[int], None] | None = None) -> list[EvalResult]:
    """Score ``ids`` with every model (and the reference) in lockstep, one window chunk at a time.

    The reference runs once per chunk however many models are compared; ``progress`` is called with the
    number of targets scored after each chunk.  ``chunk`` defaults to :func:`default_chunk`.
    """
    check_models(models, reference, ctx)
    chunk = chunk or default_chunk(models[0].config.vocab_size)
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    scores = [_Scores() for _ in models]
    ref_scores = _Scores() if reference is not None else None
    seconds = [0.0] * len(models)
    for window in plan_windows(len(ids), ctx, stride):
        streams = [_timed(window_log_probs(m, ids, window, chunk), seconds, i) for i, m in enumerate(models)]
        ref_stream = window_log_probs(reference, ids, window, chunk) if reference is not None else repeat(None)
        for ref_item, *items in zip(ref_stream, *streams, strict=reference is not None):
            ref = None
            if ref_item is not None:
                first, ref_logp = ref_item
                ref_scores.add(ref_logp, ids[first:first + len(ref_logp)], None)
                ref = ReferenceChunk.of(ref_logp)
            for score, (first, logp) in zip(scores, items, strict=True):
                score.add(logp, ids[first:first + len(logp)], ref)
            if progress is not None:
                progress(len(items[0][1]))
    return [_result(m, s, ids, ctx, stride, t, ref_scores, reference)
            for m, s, t in zip(models, scores, seconds, strict=True)]


def _timed(stream: Iterator[tuple[int, np.ndarray]], seconds: list[float],
           slot: int) -> Iterator[tuple[int, np.ndarray]]:
    """Pass ``stream`` through, adding the time spent producing each item to ``seconds[slot]``."""
    while True:
        t0 = time.perf_counter()
        item = next(stream, None)
        seconds[slot] += time.perf_counter() - t0
        if item is None:
            return
        yield item


def evaluate(models: Sequence[Model], text: str, ctx: int = 512, stride: int = 256,
             reference: Model | None = None, max_tokens: int | None = None, chunk: int | None = None,
             progress: Callable[[int], None] | None = None) -> list[EvalResult]:
    """Perplexity of ``text`` under each model, and divergence from ``reference`` when given.

    The text is tokenized with the first model's tokenizer (the reference must share it; see
    :func:`check_same_vocabulary`) and cut to ``max_tokens`` tokens.
    """
    if not models:
        raise ValueError("evaluate needs at least one model")
    ids = encode_text(models[0], text, max_tokens)
    return evaluate_ids(models, ids, ctx, stride, reference, chunk, progress)


def count_targets(n_tokens: int, ctx: int, stride: int) -> int:
    """How many tokens the strided method scores (for progress bars)."""
    return sum(w.end - w.first_target for w in plan_windows(n_tokens, ctx, stride))


def read_text(path: str | Path) -> str:
    """A UTF-8 text file (``OSError``/``UnicodeDecodeError`` propagate with the file name)."""
    return Path(path).read_text(encoding="utf-8")


def _fmt(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec`` (a trailing ``%`` is appended literally), or ``-`` when None."""
    if value is None:
        return "-"
    return format(value, spec.rstrip("%")) + ("%" if spec.endswith("%") else "")


NAME_COLUMN = 40  # widest model column; longer paths keep their end (the file name), after an ellipsis


def short_names(names: Sequence[str], limit: int = NAME_COLUMN) -> list[str]:
    """Each name cut to ``limit`` characters from the left (``…`` + its end), unless that makes two alike."""
    short = [n if len(n) <= limit else "…" + n[len(n) - limit + 1:] for n in names]
    return short if len(set(short)) == len(set(names)) else list(names)


def results_table(results: Sequence[EvalResult]) -> str:
    """Fixed-width table: one row per model (and the reference's perplexity first when there is one); long
    paths are shortened (:func:`short_names`) so the columns stay in place."""
    ref = results[0].vs_reference if results else None
    names = short_names([*([ref.reference] if ref is not None else []), *(r.model for r in results)])
    width = max(len("model"), *(len(n) for n in names))
    lines = [f"{'model':<{width}}  {'ppl':>10}  {'Δppl':>9}  {'KL mean':>9}  {'KL p99':>9}  {'KL max':>9}  "
             f"{'top-1':>7}  {'tok/s':>8}"]
    if ref is not None:
        lines.append(f"{names.pop(0):<{width}}  {ref.reference_perplexity:>10.4f}  {'(ref)':>9}")
    for name, r in zip(names, results, strict=True):
        v = r.vs_reference
        speed = r.scored / r.seconds if r.seconds else 0.0
        lines.append(f"{name:<{width}}  {r.perplexity:>10.4f}  {_fmt(v and v.delta_perplexity, '+9.4f'):>9}  "
                     f"{_fmt(v and v.kl_mean, '9.2e'):>9}  {_fmt(v and v.kl_p99, '9.2e'):>9}  "
                     f"{_fmt(v and v.kl_max, '9.2e'):>9}  {_fmt(v and 100 * v.top1_agreement, '6.2f%'):>7}  "
                     f"{speed:>8.1f}")
    return "\n".join(lines)
