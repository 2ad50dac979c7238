"""The prompts being prefilled between the engine's decode steps: their rows, their chunks and the prefix cache.

Every admitted prompt is prefilled in a slot row of its own (above the running rows), in chunks that start at
multiples of ``prefill_chunk`` whatever else runs, so that its numbers and its prefix-cache blocks do not depend
on the other prompts.  Between two decode steps the engine spends a budget of ``prefill_budget`` prompt tokens:
:meth:`Prefills.plan` takes the next chunk of each prompt, oldest first, while they fit (the oldest always gets
one, so no prompt waits behind younger ones), and :meth:`Prefills.run` feeds each chunk in a pass of its own
(one forward pass for several chunks, reading the weights once, gave the server other numbers than a prompt's
solo run: see docs/performance.md).  So prompts arriving together start together, and a running stream waits at
most one budget's chunks between two tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from qwen_runtime.models import Model

from .jobs import Job
from .metrics import Metrics
from .prefix_cache import PrefixCache
from .slots import SlotCache


@dataclass
class Prefill:
    """A prompt being prefilled: its job, the slot row it fills, its tokens done so far and whether it started from
    whole blocks of the prefix cache (or nothing), not from a tail (a row resumed from a tail stores no blocks)."""

    job: Job
    slot: int
    done: int
    exact: bool


class Prefills:
    """The prompts being prefilled (oldest first) and what each chunk stores in the prefix cache."""

    def __init__(self, model: Model, slots: SlotCache, prefix: PrefixCache | None, chunk: int, budget: int,
                 metrics: Metrics, recurrent: bool) -> None:
        if budget < chunk:
            raise ValueError(f"prefill_budget ({budget}) must be at least prefill_chunk ({chunk})")
        self.model, self.slots, self.prefix, self.metrics = model, slots, prefix, metrics
        self.chunk, self.budget, self.recurrent = chunk, budget, recurrent
        self.active: list[Prefill] = []

    @property
    def rows(self) -> int:
        """Rows the prompts being prefilled will run in (each job's ``n``)."""
        return sum(p.job.n for p in self.active)

    def start(self, job: Job, slot: int) -> None:
        """Begin prefilling ``job`` in ``slot``, from the longest prefix the prefix cache holds."""
        self.slots.reset(slot)
        hit = self.prefix.lookup(job.prompt_ids) if self.prefix else None
        done = self.prefix.restore(slot, hit) if hit and hit.length else 0
        self.active.append(Prefill(job, slot, done, hit is None or hit.tail is None))

    def drop(self, job: Job) -> None:
        """Forget ``job`` (started, cancelled or failed): its slot row is free again."""
        self.active = [p for p in self.active if p.job is not job]

    def chunk_end(self, p: Prefill) -> int:
        """Where ``p``'s next chunk ends: the next multiple of the chunk size, or the prompt's end."""
        size = len(p.job.prompt_ids)
        end = min(p.done + self.chunk, size)
        if self._turns and self.recurrent and p.exact and end == size and 1 < end - p.done < self.chunk:
            end -= 1  # a new prompt's last token (not a block's) in a pass of its own, for a tail before it (below);
            # a prompt resumed from a tail goes on in one pass (its time to first token) and keeps its answer's tail
        return end

    def plan(self, budget: int, first: bool) -> list[tuple[Prefill, int]]:
        """The chunks of the next pass (each prompt's next, oldest first, while ``budget`` tokens last; the oldest's
        always in the ``first`` pass between two decode steps) as (prompt, end)."""
        out = []
        for p in self.active:
            end = self.chunk_end(p)
            if end - p.done <= budget or (first and not out):
                out.append((p, end))
                budget -= end - p.done
        return out

    def run(self, plan: list[tuple[Prefill, int]]) -> list[tuple[Prefill, np.ndarray]]:
        """One pass of ``plan``'s chunks; the prompts it finished, each with its last logits [1, V] (still
        :attr:`active` until the engine turns them into running rows and :meth:`drop` s them)."""
        start = time.perf_counter()
        logits = self.model.prefill_many([p.job.prompt_ids[p.done:end] for p, end in plan],
                                         [self.slots.rows(p.slot, p.slot + 1) for p, _ in plan])  # [K, V]
        self.metrics.prefill_step.observe(time.perf_counter() - start)
        finished = []
        for (p, end), row in zip(plan, logits, strict=True):
            p.done = end
            size = len(p.job.prompt_ids)
            if self.prefix is not None and p.exact and end % self.chunk == 0:  # a block ends here
                self.prefix.store(p.slot, p.job.prompt_ids, end)
            if end < size:
                if self._turns and self.recurrent and end == size - 1:
                    # a recurrent state restores only whole: a tail before the prompt's last token still serves a
                    # next prompt whose text tokenizes differently where this prompt met its answer
                    self.prefix.store_tail(p.slot, p.job.prompt_ids[:end])
                continue
            finished.append((p, row[None]))
        return finished

    @property
    def _turns(self) -> bool:
        return self.prefix is not None and self.prefix.turns
