"""One sequence's generation step, shared by :class:`~qwen_runtime.generation.generate.Generation` and the server's
engine.

A :class:`RowStepper` turns a row's logits into its next token and the text that token completes: the
sampling parameters and the row's random generator pick the token (within what a :class:`Constraint`
allows, if the row has one), the stream decoder turns tokens into whole UTF-8 characters, text that may be
the start of a stop string is held back, and the row finishes on a stop token, a stop string or its token
budget.  The loops around it only schedule: which rows run, with which cache, in which batch.

**Speculative decoding by prompt lookup.**  A greedy row with ``draft_tokens`` > 0 proposes up to that many
tokens (:meth:`RowStepper.drafts`): the continuation of the latest earlier occurrence of its last n-gram
(n = 3, 2, 1) in its prompt and output (:class:`PromptLookup`); no draft model.  The loop feeds the row's last
token and the drafts in one verify pass (:meth:`~qwen_runtime.models.Model.verify`, whose logits are bit for bit
one-token steps'), and :meth:`RowStepper.accept` steps through the logits as plain decoding would, taking
each pick while it is the next draft: the drafts the row's own greedy picks agree with, plus one more token.
How many it proposes adapts as in transformers' assisted generation: two more after a pass that took every
draft, one fewer (at least one) after a pass that refused some, so a row whose drafts keep failing verifies
short passes.  Stops, stop strings, the token budget and constraints act on each token as in plain decoding,
so the tokens and text are plain decoding's; the loop cuts the cache back to the tokens taken.  Sampled rows
never draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import numpy as np

from ..text.tokenizer import StreamDecoder, Tokenizer
from .sampling import NEG_INF, SamplingParams, sample

NO_TOKENS = np.zeros(0, np.int64)  # an empty history: the penalties that read it do nothing


class FinishReason(StrEnum):
    """Why a row ended, spelled as OpenAI's ``finish_reason`` (a ``str``: it compares and serialises as its text)."""

    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # the token budget (or the context) is used up
    TOOL_CALLS = "tool_calls"  # stopped, and the text held tool calls (the server's chat completions)
    CANCELLED = "cancelled"  # the request went away or failed (the server)


class Constraint(Protocol):
    """Which tokens a row may take next (structured output); advanced with every token the row takes."""

    def allowed(self, remaining: int) -> np.ndarray | None:
        """Token ids allowed now, given ``remaining`` tokens of budget (this one included); None: any."""

    def advance(self, token: int) -> None:
        """The row took ``token``."""


class StopStrings:
    """Text that is released only once it cannot be the start of a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add generated text; return the text safe to release and whether a stop string was reached."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class PromptLookup:
    """Draft tokens from a sequence's own history: after the latest earlier occurrence of its last n-gram.

    ``index[n]`` maps every n-gram that has a token after it to the start of its latest such occurrence, kept
    up to date as tokens are appended (n-grams of ``min_ngram`` .. ``max_ngram`` tokens).
    """

    def __init__(self, tokens: Sequence[int], max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.tokens: list[int] = []
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        end = len(self.tokens)  # the n-grams ending just before the new token now have a continuation
        self.tokens.append(int(token))
        for n, index in self.index.items():
            if end >= n:
                index[tuple(self.tokens[end - n:end])] = end - n

    def propose(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the last n-gram before, longest n-gram first; [] when none."""
        for n in self.sizes:
            if len(self.tokens) < n:
                continue
            start = self.index[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start + n:start + n + limit]
        return []


@dataclass(frozen=True)
class Step:
    """What one token did: the token, the text it released (stop strings removed) and, at the end, why."""

    token: int
    text: str
    finish: FinishReason | None


class RowStepper:
    """The generation state of one sequence.

    ``max_tokens`` bounds the tokens generated; ``stop_ids`` end the row (their text is never shown);
    ``hidden_ids`` produce no text (default: the tokenizer's special tokens); ``stop`` strings end the row
    before them.  Without a ``tokenizer`` no text is produced.  ``rng`` may be shared by several rows (they
    then draw in the order they are stepped).  ``draft_tokens`` > 0: a greedy row proposes that many drafts at
    most (see the module docstring).
    """

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, rng: np.random.Generator,
                 max_tokens: int, stop_ids: frozenset[int], tokenizer: Tokenizer | None = None,
                 stop: Sequence[str] = (), hidden_ids: frozenset[int] | None = None,
                 constraint: Constraint | None = None, draft_tokens: int = 0) -> None:
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params, self.rng, self.max_tokens = params, rng, max_tokens
        self.stop_ids = stop_ids
        self.decoder = StreamDecoder(tokenizer, skip_special=False) if tokenizer is not None else None
        self.hidden_ids = hidden_ids if hidden_ids is not None else \
            (tokenizer.special_ids if tokenizer is not None else frozenset())
        self.stops = StopStrings(stop)
        self.constraint = constraint
        self.tokens: list[int] = []
        self.finish: FinishReason | None = None
        self.draft_tokens = draft_tokens if params.greedy else 0
        self.draft_length = self.draft_tokens  # drafts of the next pass (adapted to the row's acceptance)
        self.lookup = PromptLookup(self.prompt_ids) if self.draft_tokens > 0 else None
        self.proposed = self.accepted = 0  # draft tokens proposed and taken so far

    @property
    def last(self) -> int:
        return self.tokens[-1]

    def sample(self, logits: np.ndarray) -> int:
        """The next token from the row's logits [V] (penalties over its own prompt and output)."""
        if self.constraint is not None:
            ids = self.constraint.allowed(self.max_tokens - len(self.tokens))
            if ids is not None:
                masked = np.full(logits.shape, NEG_INF, np.float32)
                masked[ids] = logits[ids]
                logits = masked
        p = self.params
        # the histories only for the penalties that read them: the prompt's copy grew with every step of every row
        seen = np.asarray(self.prompt_ids + self.tokens, np.int64) if p.repetition_penalty != 1.0 else NO_TOKENS
        output = np.asarray(self.tokens, np.int64) if p.presence_penalty or p.frequency_penalty else NO_TOKENS
        return int(sample(logits[None], [p], [seen], [self.rng], [output])[0])

    def record(self, token: int) -> Step:
        """Take ``token``: the text it completes and whether the row ends."""
        self.tokens.append(token)
        if self.lookup is not None:
            self.lookup.append(token)
        if self.constraint is not None:
            self.constraint.advance(token)
        stopped = token in self.stop_ids
        full = len(self.tokens) >= self.max_tokens
        text = "" if stopped or token in self.hidden_ids or self.decoder is None else self.decoder.push(token)
        if (stopped or full) and self.decoder is not None:
            text += self.decoder.flush()
        out, hit = self.stops.push(text)
        if hit:
            self.finish = FinishReason.STOP
        elif stopped or full:
            out += self.stops.flush()
            self.finish = FinishReason.STOP if stopped else FinishReason.LENGTH
        return Step(token, out, self.finish)

    def step(self, logits: np.ndarray) -> Step:
        """:meth:`sample` then :meth:`record`."""
        return self.record(self.sample(logits))

    def drafts(self, limit: int | None = None) -> list[int]:
        """Tokens to verify after :attr:`last` (none for a sampled or finished row): at most ``draft_length``
        and ``limit``, and one fewer than the budget left (the token after the drafts completes it)."""
        if self.lookup is None or self.finish is not None:
            return []
        room = min(self.draft_length, self.max_tokens - len(self.tokens) - 1)
        if limit is not None:
            room = min(room, limit)
        return self.lookup.propose(room) if room > 0 else []

    def accept(self, logits: np.ndarray, drafts: Sequence[int]) -> list[Step]:
        """Step through a verify pass's logits [T, V] (of :attr:`last` and then each of ``drafts``) as plain
        decoding would, while each pick is the next draft: the steps taken (the drafts agreed with, plus one),
        fewer when the row finishes on the way.  The cache keeps the first ``len(steps)`` tokens of the pass."""
        steps = [self.step(logits[0])]
        for i, draft in enumerate(drafts):
            if steps[-1].finish is not None or steps[-1].token != draft:
                break
            steps.append(self.step(logits[i + 1]))
        self.proposed += len(drafts)
        self.accepted += len(steps) - 1
        if drafts:
            taken_all = len(steps) > len(drafts)
            self.draft_length = min(self.draft_tokens, self.draft_length + 2) if taken_all else \
                max(1, self.draft_length - 1)
        return steps


__all__ = ["Constraint", "FinishReason", "PromptLookup", "RowStepper", "Step", "StopStrings"]
