"""A request as the engine sees it (:class:`Job`), the events it emits, and one of its choices while it runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from qwen_runtime.generation.sampling import SamplingParams
from qwen_runtime.generation.stepper import Constraint, FinishReason, RowStepper


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (raw logits) and the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class Delta:
    """New output of one choice: its tokens this step and the text they completed (stop strings removed)."""

    choice: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """A choice ended (``reason``: ``stop`` or ``length``)."""

    choice: int
    reason: FinishReason


@dataclass(frozen=True)
class Done:
    """Every choice of the job ended: the usage numbers."""

    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    """The job failed inside the engine (a bug, never a client error): the message says why."""

    message: str


Event = Delta | Finished | Done | Failed


@dataclass
class Job:
    """One request: a prompt, ``n`` choices, and where its events go (called on the engine thread)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    emit: Callable[[Event], None]
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; k: the sampled token's logprob plus the k most likely
    constraint: Callable[[], Constraint] | None = None  # makes each choice's constraint (structured output)
    cancelled: bool = False
    completion_tokens: int = 0  # sampled so far over all choices
    submitted: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        """Stop the job: its rows leave the batch at the next step (safe from any thread)."""
        self.cancelled = True


class Row:
    """One choice of a job while it runs: its job, its number and its :class:`RowStepper`."""

    def __init__(self, job: Job, choice: int, stepper: RowStepper) -> None:
        self.job, self.choice, self.stepper = job, choice, stepper
        self.finish: FinishReason | None = None  # the stepper's, or CANCELLED

    @property
    def last(self) -> int:
        return self.stepper.last


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """Log-probabilities of the raw logits [V] (float64): the sampled token's and the ``top`` best."""
    x = logits.astype(np.float64)
    m = x.max()
    logz = m + np.log(np.exp(x - m).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, x.size)
        ids = np.argpartition(-x, k - 1)[:k]
        ids = ids[np.argsort(-x[ids], kind="stable")]
        best = tuple((int(i), float(x[i] - logz)) for i in ids)
    return TokenLogprob(int(token), float(x[token] - logz), best)
