"""The tile thread pool: per-thread scratch buffers, one :meth:`Workspace.run` for parallel work, and the
threading policy of a model.

Interface (all a kernel needs)::

    ws = Workspace(threads=None)           # one per model; threads default to BLAS's own thread count
    ws.run([task, task, ...])              # each task(scratch) runs once, spread over ws.threads threads
    ws.run_grid(task, (B, H), (1, 8))      # task(rows, heads, scratch) per block of a grid, spread the same way
    scratch.array("tile", (r, c), dtype)   # inside a task: a kept buffer of that thread, grown on demand
    scratch.arrays("work", [(r, c), (c,)])  # several arrays end to end in one such buffer
    ws.scratch[0]                          # the calling thread's scratch (for work outside run())
    with single_threaded_blas(): ...       # many tiny BLAS calls (the delta rule)
    with ws.keep_scratch(): ...            # passes of several tokens keep their scratch until the block ends

A task is any ``Callable[[Scratch], None]``; tasks of one run must be independent (they write disjoint
outputs).  Kernels name their scratch buffers after what they hold, so a new stored type brings its own
buffers without touching this module.

**Threading policy**, chosen once per model (``Workspace(blas_products=...)``) and never switched per call:
OpenBLAS's worker threads keep spinning for a while after every multi-threaded call, even once their count is
set to one, so handing the cores back and forth between BLAS and the pool leaves a spinning thread on the core
the pool needs (docs/performance.md has the measurement).

* ``blas_products=True`` (every matrix is float32, nothing to widen, and the numpy kernels): every product is
  one BLAS call on the whole matrix with BLAS's own threads, :meth:`Workspace.run` runs its tasks in turn on the
  calling thread, and no pool thread is ever started.  This is how plain numpy multiplies: an fp32 decode step is GEMVs
  bound by memory bandwidth, which OpenBLAS splits over its threads with no Python in between.
* ``blas_products=False`` (a stored type must be widened before BLAS can read it, or the compiled kernels, whose
  decode step runs fp32 models too): the pool's threads widen and multiply tiles in parallel, with BLAS held to
  one thread.

The compiled kernels (``kernels="numba"``, :func:`resolve_kernels`) follow the same policy: they are
single-threaded ``nogil`` functions that the pool's threads call, so numba's own thread pool never starts and
no third set of threads competes for the cores.

**Hand-off with the compiled kernels.**  A decode step is about a hundred pool runs (q/k/v, o, gate/up and
down per layer, then the lm_head), most of them a few hundred microseconds of work or less per thread, so the
hand-off decides whether a second thread helps: a helper asleep on a condition variable wakes too late to take
part in many of them, and the calling thread does the rest alone.  With ``kernels="numba"`` a helper therefore
polls for the next batch without the GIL for :data:`SPIN_US` after its last task (:mod:`.pool_jit`: a compiled
loop reading a counter), then sleeps as before; the caller likewise polls for its helpers' last tasks before it
sleeps.  Idle threads stop polling after that time, so between tokens and requests nothing spins (the OpenBLAS
lesson above).

Polling only pays while every thread has a core.  On a machine busy with other processes a polling helper uses
up its time slices polling and is descheduled when work comes (``sched_yield()`` in the loop makes it worse),
where a sleeping one is run by the scheduler as soon as it is woken.  So a poller that finds itself descheduled
(two polls more than ``pool_jit.LOST_US`` apart) stops all polling for :data:`BACKOFF_RUNS` runs: under load the
pool behaves as the sleeping one, on idle cores it polls.  What was measured to choose this (helpers' share of
the runs, the two pools' times, decode A/B under load) is in docs/performance.md.

Decode products of the compiled row kernels (which read any row range straight from the blocks, with no
scratch tile) are cut into exactly one task per thread, the matrices of a fused product (q/k/v) end to end
(:func:`qwen_runtime.backend.weights.direct_split`): a run claims two tasks on two threads, not six to a hundred and
thirty, so the per-task Python (claim, call chain, numba's dispatch) is paid twice per product.  Products of
several activation rows (short prompts) are cut into up to four tasks per thread, so that a thread that runs
slower leaves part of its share to the other.

**Kernels.**  ``Workspace.kernels`` is ``"numba"`` (compiled kernels, numba imported only then) or ``"numpy"``
(the reference path); :func:`resolve_kernels` turns the user's choice (``auto``, ``numba``, ``numpy``; default:
the ``QWEN_KERNELS`` environment variable, else ``auto``) into one of them.  ``Workspace.activations`` is
``"float"`` (exact float32 products), ``"q8-prompts"`` or ``"q8"``, all but the first with the compiled kernels
only.  ``"q8"`` quantizes the activation rows of every product of a type with an integer-dot kernel
(:func:`qwen_runtime.backend.kernels.kernel_table`, form ``"q8"``) to 8 bits first, as llama.cpp does
(:mod:`qwen_runtime.quants.q8_act`).  ``"q8-prompts"`` does so only in the prompt products that run on AMX tiles
(the table's form ``"q8-prompts"``); decode steps, speculative verify passes and every
``rowwise`` product keep the exact float kernels, so a row's decoded numbers, batch invariance and exact
verification are those of ``"float"``.  :func:`resolve_activations` turns ``"auto"`` into ``"float"`` with numpy and,
with the compiled kernels, into ``"q8-prompts"`` (a prompt's cost is what a user waits for) or, where only AVX2
multiplies, ``"q8"``: there the exact float kernels decode well below the memory's rate and the integer ones do not
(:data:`.kernels.base.MADDUBS`).  In ``"q8"`` a row's activations are quantized alone and its integer sums are exact,
so batch invariance and exact verification hold there too, at the 8-bit activations' numbers.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from threadpoolctl import ThreadpoolController

from ..errors import KernelsError
from ..quants.scratch import Scratch
from .ops import resolve as resolve_ops

KERNEL_CHOICES = ("auto", "numba", "numpy")
# What the products multiply: float32 activations, 8-bit ones in prompt products only, or in every product (the
# last two with the compiled kernels only); "auto" is resolved at load (resolve_activations).
ACTIVATION_FORMS = ("float", "q8-prompts", "q8")
ACTIVATION_CHOICES = ("auto", *ACTIVATION_FORMS)
KERNELS_VARIABLE = "QWEN_KERNELS"  # the default choice (the one environment setting of the runtime)
# New tokens per row up to which a pass inside Workspace.rowwise() runs the decode step's compiled kernels
# (speculative decoding's verify pass: each token then gets exactly the numbers of a one-token step).
STEP_TOKENS = 16
# With the compiled kernels, how long a pool thread polls for the next product (and the caller for its helpers'
# tasks) without the GIL before it sleeps: longer than the gaps between the products of a decode step (tens of
# microseconds), shorter than a token's sampling and output (see the module docstring).
SPIN_US = 100.0
# Runs without polling after a poller lost its CPU to another process (about 5 decode steps of Qwen2.5-0.5B).
BACKOFF_RUNS = 500


def balanced_rows(rows: int, max_rows: int, threads: int) -> int:
    """Rows per tile: at most ``max_rows`` (at least 1), in a number of tiles that is a multiple of ``threads``
    when there are enough rows, so the pool's threads get equal work."""
    tiles = -(-rows // max(1, max_rows))
    tiles = min(rows, -(-tiles // threads) * threads)
    return -(-rows // tiles)


class Workspace:
    """Scratch buffers, the tile thread pool and the BLAS thread count of one model.

    ``threads`` workers (default: BLAS's own thread count, i.e. ``OPENBLAS_NUM_THREADS`` or the CPUs) each own
    a :class:`Scratch` and claim tasks one by one until none is left, so uneven tasks balance themselves (and
    a worker descheduled on a busy machine simply claims fewer).  Under the pool BLAS runs on one thread:
    numpy releases the GIL in casts, ufuncs and BLAS, so the workers really run in parallel, and BLAS threads
    of their own would oversubscribe the cores (prefill ran at half speed while BLAS got its threads back
    between projections).  With ``blas_products`` the pool is never used and BLAS keeps ``threads`` threads
    (see the module docstring).  Each :meth:`run` re-asserts this model's BLAS thread count (a cheap call), so
    two models with different policies can live in one process.  Without a BLAS that threadpoolctl controls, tasks
    run in turn.
    """

    def __init__(self, threads: int | None = None, blas_products: bool = False, kernels: str = "numpy",
                 activations: str = "float") -> None:
        if kernels not in ("numba", "numpy"):
            raise KernelsError(f"kernels must be 'numba' or 'numpy' (resolve_kernels), got {kernels!r}")
        if activations not in ACTIVATION_FORMS:
            raise KernelsError(f"activations: expected one of {', '.join(ACTIVATION_FORMS)}, got {activations!r}")
        if activations != "float" and kernels != "numba":
            raise KernelsError(f"activations={activations!r} needs the compiled kernels (kernels='numba')")
        self.kernels = kernels  # which kernels this model's products and decode-step ops use
        self.ops = resolve_ops(kernels)  # the norms its blocks call
        self.activations = activations  # which products quantize their activations (the module docstring)
        blas = blas_controller()
        self._libs = [] if blas is None else list(blas.lib_controllers)
        self.threads = max(1, threads or default_threads())
        self.blas_products = blas_products
        self.blas_threads = self.threads if blas_products else 1  # what BLAS runs with for this model
        self.pooled = self.threads > 1 and not blas_products and bool(self._libs)  # run() spreads tasks
        self.scratch = [Scratch() for _ in range(self.threads)]
        self._helpers: _Helpers | None = None
        self._polls = None  # the compiled polling loops of the helpers (pool_jit), loaded with the model's kernels
        self.spin_us = SPIN_US  # how long the pool polls before it sleeps (read when the first run starts helpers)
        if self.pooled and kernels == "numba":
            from . import pool_jit

            pool_jit.cycles_per_us()
            self._polls = pool_jit
        self.row_invariant = False  # inside rowwise(): see there
        self.dry = False  # inside dry_run(): see there
        self._keeping = 0  # open keep_scratch() blocks
        self.active_rows: np.ndarray | None = None  # inside rowwise(rows): the activation rows multiplied
        self.segments: tuple[int, ...] | None = None  # inside segmented(): see there
        self.tile_segments: tuple[int, ...] | None = None  # the segments of a tile product (weights.by_segments)

    @contextlib.contextmanager
    def rowwise(self, rows: np.ndarray | None = None) -> Iterator[None]:
        """Inside the block, weights multiply each activation row on its own, so that a row's result does not
        depend on the other rows of the batch (see :mod:`qwen_runtime.backend.weights`); for serving, and for passes
        whose tokens must each get a one-token step's numbers (:meth:`compiled_step`).  ``rows`` (bool [N]):
        the products of the block take N activation rows and multiply only these (the others come out 0): the
        padding of a pass whose rows bring different numbers of tokens costs no product."""
        previous = self.row_invariant, self.active_rows
        self.row_invariant, self.active_rows = True, rows
        try:
            yield
        finally:
            self.row_invariant, self.active_rows = previous

    @contextlib.contextmanager
    def segmented(self, lengths: Sequence[int]) -> Iterator[None]:
        """Inside the block, the activation rows of a product are consecutive segments of ``lengths`` rows (the
        chunks of several prompts prefilled together), and each segment's rows get the numbers a product of that
        segment alone gives (:func:`qwen_runtime.backend.weights.by_segments`), while the weights are read once
        for all."""
        previous, self.segments = self.segments, tuple(int(n) for n in lengths)
        try:
            yield
        finally:
            self.segments = previous

    @contextlib.contextmanager
    def dry_run(self) -> Iterator[None]:
        """Inside the block, weight products give zeros without reading the weights (everything else runs): a model's
        warm-up loads its compiled code before the first prompt reads the weights (``models.warm_up``)."""
        self.dry = True
        try:
            yield
        finally:
            self.dry = False

    def compiled_step(self, tokens: int, limit: int) -> bool:
        """Whether a pass of ``tokens`` new tokens per row runs the decode step's compiled kernels: with
        ``kernels="numba"``, up to ``limit`` tokens (where the caller measured them faster than its batched numpy
        code) and, inside :meth:`rowwise`, up to :data:`STEP_TOKENS`: those kernels treat the tokens one after
        the other by the operations of a one-token step, so each token's numbers are a lone step's."""
        return self.kernels == "numba" and (tokens <= limit or (self.row_invariant and tokens <= STEP_TOKENS))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.scratch)

    def release_scratch(self) -> None:
        """Drop every thread's scratch buffers, between runs (a prefill's are several times a decode step's)."""
        for scratch in self.scratch:
            scratch.clear()

    def pass_done(self, tokens: int) -> None:
        """The scratch policy, told by the model after each forward pass of ``tokens`` new tokens per row: a pass
        of several tokens (a prefill) drops the scratch buffers, so that the decode steps after it hold only
        their own, unless a :meth:`keep_scratch` block is open."""
        if tokens > 1 and not self._keeping:
            self.release_scratch()

    @contextlib.contextmanager
    def keep_scratch(self) -> Iterator[None]:
        """Inside the block, passes of several tokens keep their scratch buffers; the outermost block drops them
        as it ends.  For callers that run such passes again and again (the chunks of a long prompt, a server's
        prefill steps between its decode steps): regrowing the buffers costs page faults, a few per cent of a
        decode step."""
        self._keeping += 1
        try:
            yield
        finally:
            self._keeping -= 1
            if not self._keeping:
                self.release_scratch()

    def run(self, tasks: Sequence[Callable[[Scratch], None]]) -> None:
        """Run every task with a scratch of its thread, spread over the pool (see the class docstring)."""
        self.hold_blas_threads()
        if not self.pooled or len(tasks) < 2:
            for task in tasks:
                task(self.scratch[0])
            return
        if self._helpers is None:
            self._helpers = _Helpers(self.scratch[1:], self._polls, self.spin_us)
            weakref.finalize(self, self._helpers.close)
        self._helpers.run(_Batch(tasks, self.threads - 1), self.scratch[0])

    def run_grid(self, task: Callable[..., None], extents: Sequence[int], blocks: Sequence[int],
                 share: bool = True) -> None:
        """``task(*slices, scratch)`` for every block of a grid: axis ``i`` of ``extents[i]`` cut into slices of
        ``blocks[i]``, one :meth:`run` task per block (in row-major order).  Without ``share`` (work too small
        to hand around, e.g. a decode step) one call on the calling thread covers the whole grid."""
        if not share:
            task(*(slice(0, n) for n in extents), self.scratch[0])
            return
        axes = [[slice(i, min(i + size, n)) for i in range(0, n, size)]
                for n, size in zip(extents, blocks, strict=True)]
        self.run([functools.partial(task, *block) for block in itertools.product(*axes)])

    def balanced(self, rows: int, max_rows: int) -> int:
        """:func:`balanced_rows` for this workspace's threads."""
        return balanced_rows(rows, max_rows, self.threads)

    def hold_blas_threads(self) -> None:
        """Give BLAS this model's thread count if something changed it (another model, a ``with`` block)."""
        for lib in self._libs:
            if lib.get_num_threads() != self.blas_threads:
                lib.set_num_threads(self.blas_threads)


class _Batch:
    """The tasks of one :meth:`Workspace.run`, claimed one at a time by the calling thread and the helpers.

    The caller never waits for a helper that has not claimed a task: a sleeping thread takes longer to wake
    than a small projection's tiles take to multiply, so a run ends as soon as every task is claimed and every
    claimed one is finished.  A helper that wakes after that finds nothing left to claim.  Claims are ``next()``
    of one counter (atomic under the GIL, no lock).
    """

    def __init__(self, tasks: Sequence[Callable[[Scratch], None]], helpers: int) -> None:
        self.tasks = tasks
        self.claims = itertools.count()  # the index of the next unclaimed task
        self.error: BaseException | None = None
        self.finished = np.zeros(helpers, np.int64)  # tasks finished by each helper (one writer each)

    def work(self, scratch: Scratch, helper: int | None = None, settled: threading.Condition | None = None) -> int:
        """Run unclaimed tasks until none is left (the first error cancels the rest, which are still counted); a
        ``helper`` counts each in ``finished[helper]`` and notifies ``settled``.  The number of tasks claimed."""
        claimed = 0
        while (i := next(self.claims)) < len(self.tasks):
            claimed += 1
            try:
                if self.error is None:
                    self.tasks[i](scratch)
            except BaseException as e:
                if self.error is None:
                    self.error = e
            finally:
                if settled is not None:
                    with settled:
                        self.finished[helper] += 1
                        settled.notify()
        return claimed


class _Helpers:
    """The pool threads of one workspace (daemons, one per extra scratch), each waiting for the next batch.

    With ``polls`` (:mod:`.pool_jit`, compiled kernels only) a helper polls for the next batch for ``spin_us``
    (:data:`SPIN_US`; 0: never) without the GIL before it sleeps, and the caller polls as long for the helpers' tasks to
    finish before it sleeps.  They hold no reference to the workspace: :meth:`close` (called when the workspace
    is collected) ends them.
    """

    def __init__(self, scratches: Sequence[Scratch], polls: types.ModuleType | None = None,
                 spin_us: float = SPIN_US) -> None:
        self.posted = threading.Condition()  # helpers sleep on it for the next batch
        self.settled = threading.Condition()  # the caller sleeps on it for the helpers' tasks
        self.batch: _Batch | None = None
        self.generation = 0  # batches posted so far; a helper that slept through several takes the latest
        self.closed = False
        self.sleeping = 0  # helpers asleep on `posted` (post notifies only then)
        self.polls = polls if spin_us > 0 else None
        self.backoff = 0  # runs left without polling (a poller was descheduled: the machine is busy)
        self.spin_us = spin_us
        self.signal = np.zeros(1, np.int64)  # the generation, for helpers polling without the GIL
        self.threads = [threading.Thread(target=self._serve, args=(i, scratch), name=f"qwen-tiles-{i + 1}", daemon=True)
                        for i, scratch in enumerate(scratches)]
        for thread in self.threads:
            thread.start()
        LIVE_HELPERS.add(self)

    def run(self, batch: _Batch, scratch: Scratch) -> None:
        """Post ``batch``, work on it with ``scratch`` and wait for the tasks the helpers claimed."""
        with self.posted:
            self.batch, self.generation = batch, self.generation + 1
            self.signal[0] = self.generation
            if self.sleeping:
                self.posted.notify_all()
        target = len(batch.tasks) - batch.work(scratch)  # the tasks helpers claimed
        if self.backoff:
            self.backoff -= 1
        if not self.polled(self.polls and self.polls.wait_total, batch.finished, target):
            with self.settled:
                while batch.finished.sum() < target:
                    self.settled.wait()
        if batch.error is not None:
            raise batch.error

    def polled(self, wait: Callable[[np.ndarray, int, float], int] | None, counters: np.ndarray, value: int) -> bool:
        """Whether polling ``wait(counters, value, spin_us)`` saw its change (False: sleep on a condition); a
        poller that lost its CPU meanwhile stops everyone's polling for the next :data:`BACKOFF_RUNS` runs."""
        if wait is None or self.backoff:
            return False
        result = wait(counters, value, self.spin_us)
        if result == self.polls.PREEMPTED:
            self.backoff = BACKOFF_RUNS
        return result == self.polls.CHANGED

    def close(self) -> None:
        with self.posted:
            self.closed, self.batch = True, None
            self.signal[0] = -1
            self.posted.notify_all()

    def join(self, timeout: float) -> None:
        """:meth:`close`, then wait up to ``timeout`` seconds for each helper to end."""
        self.close()
        for thread in self.threads:
            thread.join(timeout)

    def _serve(self, index: int, scratch: Scratch) -> None:
        seen = 0
        while True:
            if not self.polled(self.polls and self.polls.wait_changed, self.signal, seen):
                with self.posted:
                    self.sleeping += 1
                    while self.generation == seen and not self.closed:
                        self.posted.wait()
                    self.sleeping -= 1
            with self.posted:
                if self.closed:
                    return
                seen, batch = self.generation, self.batch
            batch.work(scratch, index, self.settled)


# Every pool's helpers not yet collected, ended at interpreter exit (:func:`end_helpers`).
LIVE_HELPERS: weakref.WeakSet[_Helpers] = weakref.WeakSet()
EXIT_JOIN_S = 1.0  # how long exit waits for each helper (one is at most a task away from its next poll)


@atexit.register
def end_helpers() -> None:
    """End the pool threads still alive before the interpreter finalizes.  A daemon thread that is still inside
    compiled code then (polling for a batch without the GIL) is ended by the interpreter when it next takes the
    GIL, by unwinding its stack through numba's frames: a CI run's pytest process, all tests passed, died with a
    segmentation fault at exit."""
    for helpers in list(LIVE_HELPERS):
        helpers.join(EXIT_JOIN_S)


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """BLAS on one thread inside the block, restored after (a no-op without a controllable BLAS).

    For thousands of small products (the delta rule): a multi-threaded BLAS synchronises its threads on each
    one, which costs far more than the products themselves.  Reads and sets the thread count directly instead of
    through threadpoolctl's ``limit``, which costs more than many of the products it would wrap.
    """
    blas = blas_controller()
    libs = [] if blas is None else [lib for lib in blas.lib_controllers if lib.get_num_threads() != 1]
    saved = [lib.get_num_threads() for lib in libs]
    for lib in libs:
        lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, n in zip(libs, saved, strict=True):
            lib.set_num_threads(n)


def resolve_kernels(choice: str | None = None) -> str:
    """``"numba"`` or ``"numpy"`` for a user's ``choice`` of kernels (None: ``$QWEN_KERNELS``, else ``auto``).

    ``auto`` is numba when it imports, else numpy; ``numba`` when numba does not import is a
    :class:`KernelsError` (as is an unknown choice).  ``numpy`` never imports numba.
    """
    where = "kernels"
    if choice is None:
        choice, where = os.environ.get(KERNELS_VARIABLE) or "auto", KERNELS_VARIABLE
    if choice not in KERNEL_CHOICES:
        raise KernelsError(f"{where}: expected one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    if choice == "numpy":
        return "numpy"
    problem = numba_problem()
    if problem is None:
        return "numba"
    if choice == "numba":
        raise KernelsError(f"{where}=numba: numba does not import ({problem}); use --kernels numpy")
    return "numpy"


def resolve_activations(choice: str, kernels: str) -> str:
    """The activation form (:data:`ACTIVATION_FORMS`) of a user's ``choice`` for a model on ``kernels``:
    ``auto`` is the compiled kernels' choice for this CPU (:func:`.kernels.base.auto_activations`: ``q8`` where
    only AVX2 multiplies, else ``q8-prompts``), ``float`` with numpy (which has no integer kernels)."""
    if choice not in ACTIVATION_CHOICES:
        raise KernelsError(f"activations: expected one of {', '.join(ACTIVATION_CHOICES)}, got {choice!r}")
    if choice != "auto":
        return choice
    if kernels != "numba":
        return "float"
    from .kernels.base import auto_activations  # numba: imported only for the compiled kernels

    return auto_activations()


@functools.lru_cache(maxsize=1)
def numba_problem() -> str | None:
    """Why numba cannot be used (None when it imports)."""
    try:
        import numba  # noqa: F401
    except Exception as exc:  # an ImportError, or a numba built for another numpy
        return f"{type(exc).__name__}: {exc}"
    return None


@functools.lru_cache(maxsize=1)
def default_threads() -> int:
    """BLAS's own thread count when first asked (``OPENBLAS_NUM_THREADS`` or the CPUs; 1 without a controllable BLAS),
    remembered because pooled workspaces hold BLAS to one thread afterwards."""
    blas = blas_controller()
    return max(1, blas.lib_controllers[0].get_num_threads()) if blas is not None else 1


@functools.lru_cache(maxsize=1)
def blas_controller() -> ThreadpoolController | None:
    """The BLAS libraries loaded by numpy, or None when numpy's BLAS is not one threadpoolctl can control (the
    pool then stays unused)."""
    blas = ThreadpoolController().select(user_api="blas")
    return blas if blas.lib_controllers else None
