"""Choosing the next token: penalties, temperature, top-k, top-p, min-p (transformers / OpenAI semantics).

Order follows transformers' logits processors: the penalties on the raw logits, then temperature, top-k,
top-p and min-p.  The repetition penalty (transformers) covers the prompt and the output; the presence and
frequency penalties (OpenAI's API) cover the output only and subtract ``presence`` once and ``frequency``
per occurrence from a token's logit.  ``temperature == 0`` is greedy (argmax after the penalties), and so is
any temperature below :data:`GREEDY_BELOW`: dividing float32 logits by it would overflow to inf and make the
probabilities NaN, and a distribution that sharp is the argmax anyway.
Randomness comes only from the ``np.random.Generator`` passed in, so the same seed gives the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..backend.ops import softmax

NEG_INF = np.float32(-np.inf)
GREEDY_BELOW = 1e-6  # temperatures below this sample greedily (logits / 1e-6 still fit float32 with margin)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens from logits (all filters off by default: greedy decoding)."""

    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) = greedy
    top_k: int = 0  # keep the k most likely tokens (0 = off)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p (1 = off)
    min_p: float = 0.0  # drop tokens less likely than min_p * p(most likely token) (0 = off)
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output (1 = off)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted from a token's logit per occurrence in the output

    def __post_init__(self) -> None:
        checks = (
            ("temperature", self.temperature, math.isfinite(self.temperature) and self.temperature >= 0,
             "a finite number >= 0 (0 = greedy)"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty,
             math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "a finite number > 0"),
            ("presence_penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
        )
        for name, value, ok, expected in checks:
            if not ok:
                raise ValueError(f"sampling: {name} must be {expected}, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """Divide positive / multiply negative logits of every token in ``seen`` by ``penalty``.  # [V] -> [V]"""
    if penalty == 1.0 or seen.size == 0:
        return logits
    out = logits.copy()
    ids = np.unique(seen)
    scores = out[ids]
    out[ids] = np.where(scores > 0, scores / np.float32(penalty), scores * np.float32(penalty))
    return out


def apply_presence_frequency(logits: np.ndarray, output: np.ndarray, presence: float,
                             frequency: float) -> np.ndarray:
    """Subtract ``presence`` once and ``frequency`` per occurrence for every token of ``output``.  # [V] -> [V]"""
    if (presence == 0.0 and frequency == 0.0) or output.size == 0:
        return logits
    ids, counts = np.unique(output, return_counts=True)
    out = logits.copy()
    out[ids] -= (np.float32(presence) + np.float32(frequency) * counts.astype(np.float32))
    return out


def penalized(logits: np.ndarray, params: SamplingParams, seen: np.ndarray | None = None,
              output: np.ndarray | None = None) -> np.ndarray:
    """The logits after the repetition (``seen``: prompt and output) and presence/frequency (``output``)
    penalties.  # [V] -> float32 [V]"""
    logits = np.asarray(logits, np.float32)
    logits = apply_repetition_penalty(logits, np.asarray(seen if seen is not None else [], np.int64),
                                      params.repetition_penalty)
    return apply_presence_frequency(logits, np.asarray(output if output is not None else [], np.int64),
                                    params.presence_penalty, params.frequency_penalty)


def apply_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep logits >= the k-th largest (ties at the boundary are kept, as in transformers).  # [V] -> [V]"""
    if k <= 0 or k >= logits.size:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits >= kth, logits, NEG_INF)


def apply_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the most likely tokens until their probability reaches ``p`` (at least one).  # [V] -> [V]

    A token is kept when the probability of the tokens ranked strictly before it is still below ``p``
    (equivalent to transformers' ascending-cumsum rule).
    """
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")  # most likely first
    probs = softmax(logits[order].astype(np.float64))
    before = np.cumsum(probs) - probs  # probability mass ranked ahead of each token
    keep_sorted = before < p
    keep_sorted[0] = True
    keep = np.empty_like(keep_sorted)
    keep[order] = keep_sorted
    return np.where(keep, logits, NEG_INF)


def apply_min_p(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens whose probability is below ``min_p`` times the top probability.  # [V] -> [V]"""
    if min_p <= 0.0:
        return logits
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
    return np.where(logits >= logits.max() + np.float32(math.log(min_p)), logits, NEG_INF)


def filtered_probs(logits: np.ndarray, params: SamplingParams, seen: np.ndarray | None = None,
                   output: np.ndarray | None = None) -> np.ndarray:
    """The distribution a token is drawn from, after penalties, temperature and filters.  # [V] -> f64 [V]

    For greedy parameters this is one-hot on the argmax.
    """
    logits = penalized(logits, params, seen, output)
    if params.greedy:
        probs = np.zeros(logits.shape, np.float64)
        probs[int(np.argmax(logits))] = 1.0
        return probs
    logits = logits / np.float32(params.temperature)
    logits = apply_min_p(apply_top_p(apply_top_k(logits, params.top_k), params.top_p), params.min_p)
    return softmax(logits.astype(np.float64))


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn from ``probs`` by inverse CDF (one uniform number per draw)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.size - 1))


def sample(logits: np.ndarray, params: Sequence[SamplingParams], seen: Sequence[np.ndarray],
           rng: np.random.Generator | Sequence[np.random.Generator],
           outputs: Sequence[np.ndarray] | None = None) -> np.ndarray:
    """Next token of every row.  # logits [B, V], one params and one history per row -> int64 [B]

    ``seen`` is each row's prompt and output (repetition penalty), ``outputs`` its output alone (presence and
    frequency penalties; default: none).  ``rng`` is shared by the rows or one per row.
    """
    b = logits.shape[0]
    outputs = [None] * b if outputs is None else outputs
    rngs = [rng] * b if isinstance(rng, np.random.Generator) else rng
    if len(params) != b or len(seen) != b or len(outputs) != b or len(rngs) != b:
        raise ValueError("sample: need one SamplingParams, history, output and generator per batch row")
    out = np.empty(b, np.int64)
    for row, (p, history, output, gen) in enumerate(zip(params, seen, outputs, rngs, strict=True)):
        if p.greedy:
            out[row] = int(np.argmax(penalized(logits[row], p, history, output)))
        else:
            out[row] = draw(filtered_probs(logits[row], p, history, output), gen)
    return out
