"""Where independent jobs run: in this process (``local``) or as Ray tasks (``ray``), one task per job.

The executor only decides *where* a job runs; what a job does is the caller's function, the same for both.
:func:`run_on_ray` is the one place that imports :mod:`ray`, lazily, so the runtime stays numpy-only unless
the ``ray`` extra is installed and asked for.

Each job becomes a Ray task that declares the memory it needs (``memory=``, in bytes: Ray's scheduler then
places no more tasks on a node than its memory holds) and ``num_cpus``.  A task whose worker process dies
(killed, out of memory, node lost) is retried up to ``max_retries`` times; an exception raised by the job
itself is not retried (jobs report their own failures as results).  Progress travels from the tasks to the
driver through a small relay actor that the driver polls, so the driver keeps its progress bars.  Ctrl-C in
the driver cancels every outstanding task (a running one gets a ``KeyboardInterrupt``, so its ``finally``
blocks clean up) and re-raises.

Paths given to jobs must name the same files on every node (one machine, or a shared filesystem).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import QwenError

LOCAL, RAY = "local", "ray"
EXECUTORS = (LOCAL, RAY)
MAX_RETRIES = 3  # attempts after a worker dies (Ray's own default for tasks)
POLL_SECONDS = 0.1  # how often the driver drains progress events while it waits
FLUSH_SECONDS = 0.25  # how often a task sends its accumulated progress
CANCEL_GRACE_SECONDS = 10.0  # after Ctrl-C, how long running tasks get to clean up before they are killed
INSTALL_HINT = "pip install 'qwen-numpy[ray]'"


class ExecutorError(QwenError):
    """The ray executor cannot run (ray is not installed, the cluster cannot be reached, a job fits no node)."""


def import_ray() -> Any:
    """The :mod:`ray` module, or :class:`ExecutorError` saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ExecutorError(f"--executor ray needs the ray extra ({INSTALL_HINT}): {exc}") from None
    return ray


def connect(address: str | None = None) -> Any:
    """Connect to the Ray cluster at ``address`` (``auto``, ``ray://host:10001``, ``host:6379``), or start a
    local instance when ``address`` is None and none is running; an already initialised Ray is reused."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    try:
        ray.init(address=address, include_dashboard=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = address or "a local Ray instance"
        raise ExecutorError(f"cannot connect to {where}: {exc}") from None
    return ray


@dataclass(frozen=True)
class RemoteJob:
    """One call of the job function as a Ray task: its arguments and the resources it declares."""

    args: tuple[Any, ...]
    memory: int  # bytes the job needs at its peak (scheduling resource)
    num_cpus: float = 1.0
    name: str = ""  # shown in Ray's task list


def largest_node(ray: Any) -> tuple[int, float] | None:
    """The largest ``memory`` (bytes) and ``CPU`` resources of any live node, or None when Ray reports none."""
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    if not nodes:
        return None
    return int(max(n.get("memory", 0) for n in nodes)), float(max(n.get("CPU", 0) for n in nodes))


def unplaceable(job: RemoteJob, largest: tuple[int, float] | None) -> ExecutorError | None:
    """Why no node of the cluster could ever run ``job`` (Ray would wait for such a node forever), or None."""
    if largest is None:
        return None
    memory, cpus = largest
    if job.memory > memory:
        return ExecutorError(f"needs {job.memory / 2**30:.2f} GiB of memory; the largest node of the Ray cluster "
                             f"offers {memory / 2**30:.2f} GiB")
    if job.num_cpus > cpus:
        return ExecutorError(f"needs {job.num_cpus:g} CPUs; the largest node of the Ray cluster has {cpus:g}")
    return None


class Reporter:
    """What a task calls with progress events; they reach the driver's ``on_event(index, event)``.

    Picklable: it holds the relay actor's handle and the job's index.  Events are sent without waiting.
    """

    def __init__(self, relay: Any, index: int) -> None:
        self._relay, self._index = relay, index

    def __call__(self, event: Any) -> None:
        self._relay.put.remote(self._index, event)


class Throttle:
    """Accumulates a count and hands it to ``send`` at most every ``FLUSH_SECONDS`` (and on :meth:`flush`)."""

    def __init__(self, send: Callable[[int], None], seconds: float = FLUSH_SECONDS) -> None:
        self._send, self._seconds = send, seconds
        self._pending, self._last = 0, time.monotonic()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self._pending += n
            if time.monotonic() - self._last < self._seconds:
                return
            n, self._pending, self._last = self._pending, 0, time.monotonic()
        self._send(n)

    def flush(self) -> None:
        with self._lock:
            n, self._pending, self._last = self._pending, 0, time.monotonic()
        if n:
            self._send(n)


class _Relay:
    """Actor body: holds ``(index, event)`` pairs until the driver drains them."""

    def __init__(self) -> None:
        self._events: list[tuple[int, Any]] = []

    def put(self, index: int, event: Any) -> None:
        self._events.append((index, event))

    def drain(self) -> list[tuple[int, Any]]:
        events, self._events = self._events, []
        return events


def _call(fn: Callable[..., Any], args: tuple[Any, ...], reporter: Reporter) -> Any:
    """Task body: the job function with its arguments and the reporter."""
    return fn(*args, reporter)


def run_on_ray(fn: Callable[..., Any], jobs: Sequence[RemoteJob], *,
               on_done: Callable[[int, Any], None] | None = None,
               on_event: Callable[[int, Any], None] | None = None,
               on_lost: Callable[[int, BaseException], Any] | None = None,
               max_retries: int = MAX_RETRIES) -> list[Any]:
    """Run ``fn(*job.args, reporter)`` for every job as a Ray task on the connected cluster (:func:`connect`).

    Returns the results in job order.  ``on_done(index, result)`` is called as each job finishes (in
    completion order), ``on_event(index, event)`` for each progress event a task reports.  A task that
    fails for good (its worker died more than ``max_retries`` times, it fits no node, or ``fn`` raised) gives
    ``on_lost(index, error)`` as its result; without ``on_lost`` the error propagates.  A job needing more
    memory or CPUs than the largest node offers is lost at once (Ray would wait forever for such a node).
    """
    run = _RayRun(import_ray(), on_done, on_event, on_lost, len(jobs))
    try:
        run.submit(fn, jobs, max_retries)
        run.collect()
    except BaseException:
        _cancel(run.ray, run.pending)
        raise
    finally:
        run.ray.kill(run.relay)
    return run.results


class _RayRun:
    """The bookkeeping of one :func:`run_on_ray`: tasks in flight, results in job order, the callbacks."""

    def __init__(self, ray: Any, on_done: Callable[[int, Any], None] | None,
                 on_event: Callable[[int, Any], None] | None, on_lost: Callable[[int, BaseException], Any] | None,
                 count: int) -> None:
        self.ray, self.on_done, self.on_event, self.on_lost = ray, on_done, on_event, on_lost
        self.relay = ray.remote(_Relay).options(num_cpus=0).remote()
        self.results: list[Any] = [None] * count
        self.index: dict[Any, int] = {}
        self.pending: list[Any] = []

    def submit(self, fn: Callable[..., Any], jobs: Sequence[RemoteJob], max_retries: int) -> None:
        """One Ray task per job that some node can hold; a job none can is lost at once."""
        task, largest = self.ray.remote(_call), largest_node(self.ray)
        for i, job in enumerate(jobs):
            problem = unplaceable(job, largest)
            if problem is not None:
                self.lose(i, problem)
                continue
            ref = task.options(memory=max(int(job.memory), 1), num_cpus=job.num_cpus, max_retries=max_retries,
                               retry_exceptions=False, name=job.name or fn.__name__).remote(fn, job.args,
                                                                                            Reporter(self.relay, i))
            self.index[ref] = i
            self.pending.append(ref)

    def collect(self) -> None:
        """Wait for the tasks one by one, relaying their progress events as they come."""
        while self.pending:
            ready, self.pending = self.ray.wait(self.pending, num_returns=1, timeout=POLL_SECONDS)
            self.drain()
            for ref in ready:
                try:
                    value = self.ray.get(ref)
                except self.ray.exceptions.RayError as exc:
                    self.lose(self.index[ref], exc)
                    continue
                self.finish(self.index[ref], value)
        self.drain()

    def finish(self, i: int, value: Any) -> None:
        self.results[i] = value
        if self.on_done is not None:
            self.on_done(i, value)

    def lose(self, i: int, exc: BaseException) -> None:
        if self.on_lost is None:
            raise exc
        self.finish(i, self.on_lost(i, exc))

    def drain(self) -> None:
        for i, event in self.ray.get(self.relay.drain.remote()):
            if self.on_event is not None:
                self.on_event(i, event)


def _cancel(ray: Any, refs: list[Any]) -> None:
    """Cancel ``refs``: a KeyboardInterrupt in running tasks first (their cleanup runs), then a kill."""
    if not refs:
        return
    for ref in refs:
        ray.cancel(ref, force=False)
    _, still = ray.wait(refs, num_returns=len(refs), timeout=CANCEL_GRACE_SECONDS)
    for ref in still:
        ray.cancel(ref, force=True)
