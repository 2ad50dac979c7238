"""Continuous batching: one thread owns the model and runs every request's rows in one decode batch.

The loop alternates the admitted prompts' next chunks (up to ``prefill_budget`` tokens in all, oldest first,
several prompts between two steps: :mod:`.prefill`) with one decode step of every running row, so
prompts arriving together start together and a new prompt joins the batch without stalling the others for more
than one budget's pass at a time.
A request's ``n`` choices share its prefill (the row is copied) and then run as ``n`` rows.
Rows leave the batch when they stop (a stop token, a stop string, ``max_tokens``, a cancelled request) and
the last row moves into their place, so the batch stays rows ``0 .. B-1`` of the :class:`SlotCache`.

**Batch invariance.**  A row's numbers never depend on the rows beside it: the cache is ragged (each row
attends over exactly its own tokens, :mod:`qwen_runtime.backend.cache`), decode products are row-invariant
(:meth:`qwen_runtime.backend.weights.Workspace.rowwise`), prompts are prefilled in a row of their own with the same
chunking, and every choice samples from its own random generator (seeded from the request's ``seed``).
So a request's tokens are identical whether it runs alone or among others.

A row's sampling, text, stop strings and finish reason are its :class:`~qwen_runtime.generation.stepper.RowStepper`'s;
the
engine only schedules.  With ``draft_tokens`` > 0 (and the compiled kernels) greedy rows decode speculatively
by prompt lookup (:mod:`qwen_runtime.generation.stepper`): a decode step is then one verify pass
(:meth:`~qwen_runtime.models.Model.verify`) of every row's last token and drafts, padded to the longest row's
drafts (padding costs no product; a sampled row takes its first logits only), and each row's cache is cut back
to the tokens it took.  The tokens, text and events are those of plain decoding, several per step.
A prompt starts from the longest prefix the :mod:`.prefix_cache` holds.  A request whose code raises inside a
step fails alone (a failed batched pass is retried row by row); a loop that dies is restarted, and after
:data:`MAX_RESTARTS` deaths in a row the engine stops and says so.

Admission: a request waits in a bounded queue until there are rows for its ``n`` choices and the memory
for their tokens (prompt + ``max_tokens`` each) fits the limit next to the running ones.  The HTTP layer
talks to the engine only through :meth:`Engine.submit`, :meth:`Job.cancel` and the events a job emits (called
on the engine thread; the HTTP layer hands them to its event loop).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from qwen_runtime.backend.limits import activation_bytes, default_memory_limit, format_bytes
from qwen_runtime.backend.pool import STEP_TOKENS
from qwen_runtime.errors import ResourceLimitError
from qwen_runtime.generation.stepper import FinishReason, RowStepper, Step, verify_pass
from qwen_runtime.models import Model
from qwen_runtime.text.tokenizer import Tokenizer

from .jobs import Delta, Done, Event, Failed, Finished, Job, Row, TokenLogprob, token_logprobs
from .metrics import Metrics
from .prefill import Prefill, Prefills
from .prefix_cache import PrefixCache
from .prefix_store import PrefixStore
from .slots import SlotCache

log = logging.getLogger("qwen_serve")

MAX_TOP_LOGPROBS = 20
PREFILL_BUDGET = 256  # prompt tokens of one prefill pass between two decode steps, by default
MAX_RESTARTS = 3  # loop deaths in a row (no step completing between them) before the engine gives up


class EngineStoppedError(RuntimeError):
    """The engine loop died more than :data:`MAX_RESTARTS` times in a row: nothing will be served."""


class QueueFullError(Exception):
    """Every row is busy and the waiting queue is full: the client should retry later."""


class RequestTooLargeError(ValueError):
    """A request could never run: more choices than rows, or more memory than the limit allows."""


class Engine:
    """Owns a model and serves :class:`Job` s with continuous batching on a thread of its own.

    ``max_batch`` rows run at once, ``max_queue`` jobs wait beyond them; ``max_memory`` bounds the cache
    and activations (default: :func:`qwen_runtime.backend.limits.default_memory_limit`); a row holds at most
    ``max_context`` tokens (default: the model's context, less if the memory limit cannot hold that many for
    one row); prompts are prefilled ``prefill_chunk`` tokens at a time, up to ``prefill_budget`` tokens
    (default: the larger of :data:`PREFILL_BUDGET` and ``prefill_chunk``) of several prompts between two decode
    steps; ``stop_ids`` end a choice; special
    tokens other than ``text_ids`` produce no text; tokens, steps and failures are counted in ``metrics``.
    ``cache_memory`` bounds the prefix cache (:mod:`.prefix_cache`; None: a quarter of the memory limit,
    0: off); its blocks live in the memory limit too and are evicted when a request needs the room.  With
    ``cache_dir`` they are also kept on disk there and restored at start (:mod:`.prefix_store`).
    ``cache_turns``: the prefix cache also keeps where each request stopped, so a chat's next turn prefills only
    its new tokens (not bit-identical with the cache off: see :mod:`.prefix_cache`).
    """

    def __init__(self, model: Model, tokenizer: Tokenizer, stop_ids: frozenset[int], *, max_batch: int = 8,
                 max_queue: int = 64, max_memory: int | None = None, prefill_chunk: int = 128,
                 max_context: int | None = None, text_ids: frozenset[int] = frozenset(),
                 metrics: Metrics | None = None, cache_memory: int | None = None, draft_tokens: int = 0,
                 cache_dir: str | Path | None = None, cache_turns: bool = False,
                 prefill_budget: int | None = None) -> None:
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1 or (max_context is not None and max_context < 2):
            raise ValueError("max_batch and prefill_chunk must be >= 1, max_queue >= 0 and max_context >= 2")
        if not 0 <= draft_tokens < STEP_TOKENS:
            raise ValueError(f"draft_tokens must be from 0 to {STEP_TOKENS - 1}, got {draft_tokens}")
        self.model, self.tokenizer, self.stop_ids = model, tokenizer, frozenset(stop_ids)
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.prefill_budget = max(PREFILL_BUDGET, prefill_chunk) if prefill_budget is None else prefill_budget
        self.hidden_ids = frozenset(tokenizer.special_ids) - frozenset(text_ids)
        cfg = model.config
        context = min(cfg.context_window, max_context or cfg.context_window)
        size = model.cache_size  # what the slots' layers hold, as the mixers report it
        self.row_bytes, self.token_bytes = size.row, size.token  # recurrent state of a row; keys and values of a token
        self.memory_limit = default_memory_limit() if max_memory is None else max_memory
        self.draft_asked = draft_tokens
        self.draft_tokens = draft_tokens if model.exact_steps else 0  # numpy kernels: batched steps not row-invariant
        step_rows = max_batch * (1 + self.draft_tokens)  # a verify pass's tokens, and its recurrent checkpoint
        batched = self.prefill_budget > prefill_chunk  # a pass's tokens beyond one chunk's (their own scores)
        self.activations = (activation_bytes(cfg, step_rows, 1, 1) + activation_bytes(cfg, 1, context, prefill_chunk)
                            + (activation_bytes(cfg, 1, self.prefill_budget, self.prefill_budget) if batched else 0)
                            + (max_batch * self.row_bytes if self.draft_tokens else 0))
        room = (self.memory_limit - self.activations - self.row_bytes) // self.token_bytes
        if max_context is not None and room < context:  # asked for: refused with the numbers, never shrunk
            model.memory_plan(1, context, self.activations, mask=False).check(
                self.memory_limit, f"one request of {context} tokens (--ctx)")
        if room < 2:
            raise ResourceLimitError(f"a memory limit of {format_bytes(self.memory_limit)} leaves no room for the "
                                     f"cache of one request (activations alone need about "
                                     f"{format_bytes(self.activations)}); raise --max-memory or lower --max-batch")
        self.context = min(context, room)  # tokens one row can hold (prompt + completion); the banner says why
        self.plan = model.memory_plan(max_batch, self.context, self.activations, mask=False)  # what the banner prints
        self.slots = SlotCache(model, max_batch, self.context)
        capacity = self.memory_limit // 4 if cache_memory is None else cache_memory
        if cache_turns and capacity <= 0:
            raise ValueError("cache_turns needs the prefix cache (cache_memory > 0)")
        self.prefix = PrefixCache(self.slots, prefill_chunk, capacity, cache_turns) if capacity > 0 else None
        if cache_dir is not None:
            if self.prefix is None:
                raise ValueError("cache_dir needs the prefix cache (cache_memory > 0)")
            self.prefix.persist(PrefixStore(cache_dir, model, self.slots, prefill_chunk, capacity))
        self.ws = model.lm_head.ws
        self.metrics = metrics or Metrics()
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._rows: list[Row] = []
        self.prefills = Prefills(model, self.slots, self.prefix, prefill_chunk, self.prefill_budget, self.metrics,
                                 self.row_bytes > 0)
        self._reserved: dict[int, int] = {}  # id(job) -> bytes reserved for its rows
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # decode steps run so far
        self.peak_rows = 0  # the most rows one decode step ran
        self.restarts = 0  # times the loop died (a bug) and was restarted
        self.last_error: str | None = None  # why it last died
        self.error: str | None = None  # set when it died too often in a row and was not restarted
        self._deaths_in_a_row = 0

    # --- the HTTP side ----------------------------------------------------------------------------------

    def job_bytes(self, prompt_tokens: int, max_tokens: int, n: int) -> int:
        """Memory a job's rows hold at most: recurrent state plus keys and values of every token."""
        return n * (self.row_bytes + self.token_bytes * (prompt_tokens + max_tokens))

    def submit(self, job: Job) -> None:
        """Queue a job (it starts as soon as rows and memory allow).

        Raises :class:`RequestTooLargeError` for a job that could never run and :class:`QueueFullError` when
        the queue is full.
        """
        if job.n > self.max_batch:
            raise RequestTooLargeError(f"n={job.n} is more than the server's {self.max_batch} batch rows")
        need = self.job_bytes(len(job.prompt_ids), job.max_tokens, job.n)
        if need + self.activations > self.memory_limit:
            raise RequestTooLargeError(
                f"the request needs about {format_bytes(need)} of cache, more than the server's memory limit of "
                f"{format_bytes(self.memory_limit)} allows; use a shorter prompt, fewer choices or max_tokens")
        with self._cond:
            if self.error is not None:
                raise EngineStoppedError(f"the engine stopped after repeated internal errors: {self.error}")
            busy = len(self._rows) + self.prefills.rows
            free = max(0, self.max_batch - busy - sum(j.n for j in self._waiting))
            if job.n > free and len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{busy} of {self.max_batch} rows busy and {len(self._waiting)} requests waiting")
            self._waiting.append(job)
            self._cond.notify()
        self.start()

    def status(self) -> dict[str, object]:
        with self._cond:
            return {"running_rows": len(self._rows), "waiting": len(self._waiting),
                    "prefilling": bool(self.prefills.active), "max_batch": self.max_batch,
                    "decode_steps": self.steps, "peak_rows": self.peak_rows,
                    "reserved_bytes": sum(self._reserved.values()), "memory_limit_bytes": self.memory_limit,
                    "restarts": self.restarts, "last_error": self.last_error, "draft_tokens": self.draft_tokens,
                    "prefix_cache": None if self.prefix is None else {
                        "bytes": self.prefix.nbytes, "capacity_bytes": self.prefix.capacity,
                        "blocks": len(self.prefix.blocks), "block_tokens": self.prefix.block,
                        "turns": self.prefix.turns, "tails": len(self.prefix.tails),
                        "lookups": self.prefix.lookups, "hits": self.prefix.hits,
                        "hit_tokens": self.prefix.hit_tokens,
                        "disk": self.prefix.disk.status() if self.prefix.disk else None}}

    def start(self) -> None:
        """Start the engine thread (a no-op while it runs, or once the engine has given up)."""
        with self._cond:
            if self.error is None and (self._thread is None or not self._thread.is_alive()):
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="qwen-serve-engine", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """End the loop (running jobs are cancelled), wait for the thread and the prefix cache's disk writes."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        if self.prefix is not None:
            self.prefix.close()

    # --- the engine thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        """The thread: the loop, restarted when it dies (a bug outside any step).  The jobs in flight fail,
        waiting ones stay queued; after :data:`MAX_RESTARTS` deaths in a row the engine gives up: every job
        fails, :meth:`submit` raises :class:`EngineStoppedError` and ``/health`` reports the error."""
        while True:
            try:
                with self.ws.keep_scratch():  # prefill steps between decode steps: regrowing it costs page faults
                    self._loop()
                self._abandon_all("the server is shutting down")
                return
            except Exception as exc:
                log.exception("engine loop died")
                message = f"{type(exc).__name__}: {exc}"
                with self._cond:
                    self.last_error = message
                    self._deaths_in_a_row += 1
                    if self._deaths_in_a_row > MAX_RESTARTS:
                        self.error = message
                    else:
                        self.restarts += 1
                if self.error is not None:
                    self._abandon_all(f"internal error: {message}")
                    return
                self._abandon_in_flight(f"internal error: {message}")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._rows or self.prefills.active):
                    self._cond.wait()
                if self._stopping:
                    return
            self._drop_cancelled()
            self._prefill_chunks()
            if self._rows:
                self._guarded(self._decode_step, list({id(r.job): r.job for r in self._rows}.values()))
            self._deaths_in_a_row = 0

    def _guarded(self, step: Callable[[], None], jobs: list[Job]) -> None:
        """Run a step; if it raises in a way no single request explains, fail the jobs it touched, keep
        serving (failures a request causes are isolated inside the steps: :meth:`_decode_step`,
        :meth:`_advance`)."""
        try:
            step()
        except Exception as exc:
            log.exception("engine step failed")
            for job in jobs:
                self._fail(job, f"internal error: {type(exc).__name__}: {exc}")

    def _admit(self) -> None:
        """Start prefilling the oldest waiting jobs while rows and memory allow (called under the lock)."""
        if any(job.cancelled for job in self._waiting):
            self._waiting = collections.deque(job for job in self._waiting if not job.cancelled)
        while self._waiting:
            job = self._waiting[0]
            need = self.job_bytes(len(job.prompt_ids), job.max_tokens, job.n)
            slack = 1 if self.prefills.active else 0  # a free row while prompts make room for each other (_start_rows)
            if len(self._rows) + self.prefills.rows + job.n + slack > self.max_batch:
                return
            over = sum(self._reserved.values()) + need + self.activations - self.memory_limit
            if over > 0:
                return
            if self.prefix is not None and over + self.prefix.nbytes > 0:  # cached blocks give way to requests
                self.prefix.evict(over + self.prefix.nbytes)
            self._waiting.popleft()
            self._reserved[id(job)] = need
            self.prefills.start(job, self._free_slot(len(self._rows)))

    def _free_slot(self, low: int, exclude: int = -1) -> int:
        """The highest slot row from ``low`` up that no prompt being prefilled (nor ``exclude``) holds."""
        held = {p.slot for p in self.prefills.active} | {exclude}
        return next(i for i in range(self.max_batch - 1, low - 1, -1) if i not in held)

    def _prefill_chunks(self) -> None:
        """Prefill passes of the admitted prompts' next chunks, up to ``prefill_budget`` tokens in all (at least one
        chunk: :meth:`.Prefills.plan`); prompts arriving together start together."""
        budget, first = self.prefill_budget, True
        while True:
            with self._cond:
                self._admit()
            plan = self.prefills.plan(budget, first)
            if not plan:
                return
            budget -= sum(end - p.done for p, end in plan)
            first = False
            self._guarded(lambda plan=plan: self._prefill_pass(plan), [p.job for p, _ in plan])

    def _prefill_pass(self, plan: list[tuple[Prefill, int]]) -> None:
        """One pass of ``plan``'s chunks; each prompt it finishes starts its rows with its first token."""
        for p, logits in self.prefills.run(plan):
            self._start_rows(p, logits)

    def _start_rows(self, p: Prefill, logits: np.ndarray) -> None:
        """Turn a prefilled prompt into its job's running rows (its slot row and ``n - 1`` copies, right after the
        running rows; a prompt still being prefilled there moves up to a free row, which admission's slack row
        guarantees) and take their first token from ``logits`` [1, V]."""
        job, first = p.job, len(self._rows)
        for other in self.prefills.active:
            if other is not p and first <= other.slot < first + job.n:
                slot = self._free_slot(first + job.n, exclude=p.slot)
                self.slots.move(other.slot, slot)
                other.slot = slot
        self.slots.move(p.slot, first)
        self.prefills.drop(job)
        for i in range(1, job.n):
            self.slots.copy(first, first + i)
        rows = [Row(job, i, self._stepper(job, i)) for i in range(job.n)]
        self._rows.extend(rows)
        self._advance(rows, np.repeat(logits, job.n, axis=0))
        if self.prefix is not None and self.prefix.turns and not self.row_bytes and rows[0].finish is None:
            # where the prompt ends (the row holds just the prompt), once its first token is out
            self.prefix.store_tail(self._rows.index(rows[0]), job.prompt_ids)

    def _stepper(self, job: Job, choice: int) -> RowStepper:
        seed = None if job.seed is None else [job.seed % 2**64, choice]  # SeedSequence takes no negatives
        limit = min(job.max_tokens, self.context - len(job.prompt_ids))  # the row's cache holds no more
        return RowStepper(job.prompt_ids, job.sampling, np.random.default_rng(seed), limit, self.stop_ids,
                          self.tokenizer, job.stop, self.hidden_ids, job.constraint() if job.constraint else None,
                          self.draft_tokens)

    def _decode_step(self) -> None:
        """One token for every running row.  If the batched pass raises, each row is run alone (a row's numbers
        do not depend on its neighbours, so the others get the same logits): the rows that still raise fail
        their request, the others go on.  Models with a recurrent state cannot retry (a failed pass may have
        advanced some layers' state), so there the step's requests fail together."""
        rows = list(self._rows)
        lengths = self.slots.lengths[:len(rows)].copy()  # [B] what the rows held before the pass
        room = int(self.slots.capacity - lengths.max()) - 1  # drafts every row's cache can take
        drafts = [row.stepper.drafts(room) for row in rows]
        if any(drafts) and self._verify_step(rows, drafts, lengths):
            return
        tokens = np.asarray([[row.last] for row in rows], np.int64)  # [B, 1]
        start = time.perf_counter()
        try:
            with self.ws.rowwise():
                logits = self.model.forward(tokens, self.slots.rows(0, len(rows)), last_only=True)  # [B, V]
        except Exception:
            if self.row_bytes:
                raise
            log.exception("a decode step failed; retrying its rows one by one")
            self.slots.lengths[:len(rows)] = lengths  # keys and values past a row's length are rewritten
            logits = self._decode_alone(rows, tokens)
        self.metrics.decode_step.observe(time.perf_counter() - start)
        self.metrics.batch_rows.observe(len(rows))
        self.steps += 1
        self.peak_rows = max(self.peak_rows, len(tokens))
        self._advance(rows, logits)

    def _verify_step(self, rows: list[Row], drafts: list[list[int]], lengths: np.ndarray) -> bool:
        """One verify pass of every running row's last token and drafts
        (:func:`~qwen_runtime.generation.stepper.verify_pass`), each row's steps emitted as it takes them.  If the pass
        raises, a model without recurrent state gets its rows' lengths back and False (the caller steps them plainly,
        row by row if need be); with recurrent state the step's requests fail together."""
        def take(i: int, logits: np.ndarray) -> list[Step]:
            row = rows[i]
            if row.finish is not None:
                return []
            try:
                steps = row.stepper.accept(logits, drafts[i])  # a sampled row: no drafts, one step
            except Exception as exc:
                self._fail_row(row, exc)
                return []
            self.metrics.draft_proposed.inc(len(drafts[i]))
            self.metrics.draft_accepted.inc(len(steps) - 1)
            for j, step in enumerate(steps):
                self._emit(row, step, logits[j])
            return steps

        start = time.perf_counter()
        try:
            verify_pass(self.model, self.slots.rows(0, len(rows)), [row.stepper for row in rows], drafts, take)
        except Exception:
            if self.row_bytes:
                raise
            log.exception("a verify pass failed; stepping its rows plainly")
            self.slots.lengths[:len(rows)] = lengths
            return False
        self.metrics.decode_step.observe(time.perf_counter() - start)
        self.metrics.batch_rows.observe(len(rows))
        self.steps += 1
        self.peak_rows = max(self.peak_rows, len(rows))
        self._retire()
        return True

    def _decode_alone(self, rows: list[Row], tokens: np.ndarray) -> list[np.ndarray | None]:
        """Each row's logits [V] from a pass of its own, None for rows whose pass raised (their job fails)."""
        out: list[np.ndarray | None] = []
        for i, row in enumerate(rows):
            try:
                with self.ws.rowwise():
                    out.append(self.model.forward(tokens[i:i + 1], self.slots.rows(i, i + 1), last_only=True)[0])
            except Exception as exc:
                out.append(None)
                self._fail_row(row, exc)
        return out

    def _advance(self, rows: list[Row], logits: Sequence[np.ndarray | None]) -> None:
        """Sample each row's next token from its logits [V], emit what it adds, retire finished rows.  A row that
        raises fails its own request only."""
        for row, row_logits in zip(rows, logits, strict=True):
            if row.finish is not None or row_logits is None:
                continue
            try:
                self._emit(row, row.stepper.step(row_logits), row_logits)
            except Exception as exc:
                self._fail_row(row, exc)
        self._retire()

    def _fail_row(self, row: Row, exc: Exception) -> None:
        log.error("a request failed inside a step", exc_info=exc)
        self._fail(row.job, f"internal error: {type(exc).__name__}: {exc}", retire=False)

    def _emit(self, row: Row, step: Step, logits: np.ndarray) -> None:
        """Send what a row's step produced (its logprobs from the raw ``logits`` [V] when asked)."""
        job = row.job
        job.completion_tokens += 1
        logprobs = (token_logprobs(logits, step.token, job.logprobs),) if job.logprobs is not None else ()
        if step.text or logprobs or step.finish:
            job.emit(Delta(row.choice, step.text, (step.token,), logprobs))
        if step.finish:
            row.finish = step.finish
            job.emit(Finished(row.choice, step.finish))

    def _retire(self) -> None:
        """Drop finished rows (the last row moves into each hole) and finish jobs with no rows left."""
        i = 0
        while i < len(self._rows):
            row = self._rows[i]
            if row.finish is None:
                i += 1
                continue
            if self.prefix is not None and row.job.n == 1 and row.finish is not FinishReason.CANCELLED:
                held = int(self.slots.lengths[i])  # the prompt and the answer's tokens fed back (not the last)
                self.prefix.store_tail(i, (row.job.prompt_ids + row.stepper.tokens)[:held])
            last = len(self._rows) - 1
            self.slots.move(last, i)
            self._rows[i] = self._rows[last]
            self._rows.pop()
            if not any(r.job is row.job for r in self._rows):
                self._complete(row.job)

    def _release(self, job: Job) -> None:
        with self._cond:  # status() and submit() sum the reservations under the lock
            self._reserved.pop(id(job), None)

    def _complete(self, job: Job) -> None:
        self._release(job)
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        self.metrics.completion_tokens.inc(job.completion_tokens)
        if not job.cancelled:
            job.emit(Done(len(job.prompt_ids), job.completion_tokens))

    def _drop_cancelled(self) -> None:
        for p in list(self.prefills.active):
            if p.job.cancelled:
                self.prefills.drop(p.job)
                self._release(p.job)
        for row in self._rows:
            if row.job.cancelled:
                row.finish = FinishReason.CANCELLED
        self._retire()

    def _fail(self, job: Job, message: str, retire: bool = True) -> None:
        """End ``job`` with :class:`Failed` (its rows leave at the next :meth:`_retire`, at once if ``retire``)."""
        self.prefills.drop(job)
        for row in self._rows:
            if row.job is job:
                row.finish = FinishReason.CANCELLED
        listening = not job.cancelled
        self.metrics.failed_jobs.inc()
        job.cancel()
        if retire:
            self._retire()
        self._release(job)
        if listening:
            job.emit(Failed(message))

    def _abandon_in_flight(self, message: str) -> None:
        """Fail the running and prefilling jobs (after the loop died); waiting jobs stay queued."""
        jobs = [r.job for r in self._rows] + [p.job for p in self.prefills.active]
        self._rows, self.prefills.active = [], []
        for job in {id(j): j for j in jobs}.values():
            self._release(job)
            if not job.cancelled:
                job.cancel()
                job.emit(Failed(message))

    def _abandon_all(self, message: str) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        self._abandon_in_flight(message)
        for job in waiting:
            self._release(job)
            if not job.cancelled:
                job.cancel()
                job.emit(Failed(message))


__all__ = ["Delta", "Done", "Engine", "EngineStoppedError", "Event", "Failed", "Finished", "Job", "QueueFullError",
           "RequestTooLargeError", "TokenLogprob"]
