"""The tile thread pool: per-thread scratch buffers and one :meth:`Workspace.run` for parallel work.

Interface (all a kernel needs)::

    ws = Workspace(threads=None)           # one per model; threads default to BLAS's own thread count
    ws.run([task, task, ...])              # each task(scratch) runs once, spread over ws.threads threads
    scratch.array("tile", (r, c), dtype)   # inside a task: a kept buffer of that thread, grown on demand
    ws.scratch[0]                          # the calling thread's scratch (for work outside run())

A task is any ``Callable[[Scratch], None]``; tasks of one run must be independent (they write disjoint
outputs).  Kernels name their scratch buffers after what they hold, so a new stored type brings its own
buffers without touching this module.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class Scratch:
    """Buffers of one thread, kept from task to task so that hot loops allocate nothing.

    :meth:`array` views the start of the buffer of that name, reallocated (larger) only when a request does
    not fit; two arrays in use at the same time need different names.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def array(self, name: str, shape: int | tuple[int, ...], dtype: np.dtype | type = np.float32) -> np.ndarray:
        """An uninitialised ``shape`` array of ``dtype`` in the buffer ``name`` (valid until its next request)."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        size = int(np.prod(shape, dtype=np.int64))
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.size < size:
            buf = self._buffers[name] = np.empty(size, dtype)
        return buf[:size].reshape(shape)

    def sizes(self) -> dict[str, int]:
        """Elements held per buffer name."""
        return {name: buf.size for name, buf in self._buffers.items()}

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for buf in self._buffers.values())


class Workspace:
    """Scratch buffers and the tile thread pool of one model.

    ``threads`` workers (default: BLAS's own thread count, i.e. ``OPENBLAS_NUM_THREADS`` or the CPUs) each own
    a :class:`Scratch` and claim tasks one by one until none is left, so uneven tasks balance themselves.
    From the first pooled run on, BLAS is held to one thread for good: numpy releases the GIL in casts, ufuncs
    and BLAS, so the workers really run in parallel, and BLAS threads of their own would oversubscribe the
    cores; worse, OpenBLAS's idle threads spin after every multi-threaded call and steal the cores from the
    pool (prefill ran at half speed while BLAS got its threads back between projections).
    BLAS threads are set through threadpoolctl; without it tasks run in turn on the calling thread.
    """

    def __init__(self, threads: int | None = None) -> None:
        self._blas = blas_controller()
        self._blas_single = False
        self.threads = max(1, threads or (self._blas.info()[0]["num_threads"] if self._blas else 1))
        if self.threads == 1:
            self._blas = None
        self.scratch = [Scratch() for _ in range(self.threads)]
        self._pool: ThreadPoolExecutor | None = None
        self.row_invariant = False  # inside rowwise(): see there

    @contextlib.contextmanager
    def rowwise(self) -> Iterator[None]:
        """Inside the block, weights multiply each activation row on its own, so that a row's result does not
        depend on the other rows of the batch (see :mod:`qwen_runtime.weights`); for serving."""
        previous, self.row_invariant = self.row_invariant, True
        try:
            yield
        finally:
            self.row_invariant = previous

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.scratch)

    def run(self, tasks: Sequence[Callable[[Scratch], None]]) -> None:
        """Run every task with a scratch of its thread, spread over the pool (see the class docstring)."""
        if self._blas is None or len(tasks) < 2:
            for task in tasks:
                task(self.scratch[0])
            return
        if not self._blas_single:
            self._blas.limit(limits=1)
            self._blas_single = True
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="qwen-tiles")
        claim = itertools.count().__next__  # shared task index: each worker takes the next unclaimed task
        futures = [self._pool.submit(_run_claimed, tasks, claim, scratch) for scratch in self.scratch[1:]]
        try:
            _run_claimed(tasks, claim, self.scratch[0])
        finally:
            for future in futures:
                future.result()


def _run_claimed(tasks: Sequence[Callable[[Scratch], None]], claim: Callable[[], int], scratch: Scratch) -> None:
    """Run tasks in the order they are claimed until none is left (``claim`` is atomic under the GIL)."""
    while (i := claim()) < len(tasks):
        tasks[i](scratch)


@functools.lru_cache(maxsize=1)
def blas_controller():  # -> threadpoolctl.ThreadpoolController | None
    """The BLAS libraries loaded by numpy, or None without threadpoolctl (the pool then stays unused)."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    blas = ThreadpoolController().select(user_api="blas")
    return blas if blas.lib_controllers else None
