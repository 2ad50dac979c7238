"""The pool's waits without the GIL: compiled loops that poll a shared counter for a bounded time.

Imported by :mod:`qwen_runtime.backend.pool` only for workspaces of the compiled kernels (``kernels="numba"``), so the
numpy path never loads numba.  A pool thread waiting for the next product polls the posted-batch counter here,
a caller waiting for its helpers polls their finished-task counters: both hold no GIL while they poll (the
other threads run Python meanwhile) and give up after a bounded time, after which the caller sleeps on a
condition variable as the numpy path always does.  See the pool's docstring for what was measured.
"""

from __future__ import annotations

import functools
import platform
import time

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .jit_setup import prepare_numba

prepare_numba()  # before this module's first compile or cache load

# The CPU's spin-wait hint (an LLVM intrinsic: numba's code emitter parses no inline assembly): it lowers the power
# drawn and frees the pipeline for a hyper-threaded sibling.  Elsewhere the loops poll without it.
_RELAX = "llvm.x86.sse2.pause" if platform.machine().lower() in ("x86_64", "amd64", "i686", "i386") else None


@intrinsic
def cpu_relax(typingctx):  # noqa: ARG001 (numba's intrinsic protocol)
    """The CPU's spin-wait hint (nothing on CPUs without one)."""
    def codegen(context, builder, signature, args):
        if _RELAX is not None:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), _RELAX)
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def load_fresh(typingctx, array, index):  # noqa: ARG001
    """``array[index]`` of an int64 array read from memory every time (an atomic acquire load, never hoisted out
    of a polling loop)."""
    if not isinstance(array, types.Array) or array.dtype != types.int64 or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.load_atomic(builder.gep(data, [args[1]]), "acquire", 8)

    return array.dtype(array, index), codegen


@intrinsic
def fetch_add(typingctx, array, index, value):  # noqa: ARG001
    """``array[index] += value`` on an int64 array, atomically (acquire-release); returns the value before."""
    if not isinstance(array, types.Array) or array.dtype != types.int64 or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", builder.gep(data, [args[1]]), value, "acq_rel")

    return types.int64(array, index, value), codegen


@intrinsic
def store_fresh(typingctx, array, index, value):  # noqa: ARG001
    """``array[index] = value`` on an int64 array, a release store: whatever the thread wrote before is visible to a
    thread whose :func:`load_fresh` reads the value."""
    if not isinstance(array, types.Array) or array.dtype != types.int64 or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(value, builder.gep(data, [args[1]]), "release", 8)
        return context.get_dummy_value()

    return types.void(array, index, value), codegen


@intrinsic
def cycles(typingctx):  # noqa: ARG001
    """The CPU's cycle counter (``llvm.readcyclecounter``: the time-stamp counter on x86, constant-rate)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


COUNTERS = types.int64[::1]
LOST_US = 50  # a gap this long between two polls means the poller was descheduled (a poll is far shorter)
# What a poll returns: the awaited change came, the time ran out, or the poller lost its CPU meanwhile.
CHANGED, TIMED_OUT, PREEMPTED = 1, 0, -1


@numba.njit(types.int64(), nogil=True, cache=True)
def read_cycles():  # pragma: no cover (compiled)
    return cycles()


@numba.njit(types.int64(COUNTERS), nogil=True, cache=True)
def fresh_sum(counters):  # pragma: no cover (compiled)
    """The sum of ``counters``, each read from memory."""
    total = 0
    for i in range(len(counters)):
        total += load_fresh(counters, i)
    return total


@numba.njit(types.int64(COUNTERS, types.int64, types.int64, types.int64, types.int64), nogil=True, cache=True)
def poll(counters, target, at_least, ticks, lost):  # pragma: no cover (compiled)
    """Poll ``counters`` until their sum reaches ``target`` (``at_least``) or differs from it (else), for at most
    ``ticks`` cycles: CHANGED, TIMED_OUT, or PREEMPTED when two consecutive polls lie ``lost`` cycles apart (the
    thread lost its CPU to another: the machine is busy, and polling only burns the time slices it gets)."""
    now = cycles()
    deadline = now + ticks
    while True:
        total = fresh_sum(counters)
        if (total >= target) if at_least else (total != target):
            return CHANGED
        cpu_relax()
        before, now = now, cycles()
        if now - before > lost:
            return PREEMPTED
        if now > deadline:
            return TIMED_OUT


@functools.lru_cache(maxsize=1)
def cycles_per_us() -> float:
    """The cycle counter's rate, measured once per process against the wall clock over a millisecond."""
    t0, c0 = time.perf_counter(), read_cycles()
    while time.perf_counter() - t0 < 1e-3:
        pass
    t1, c1 = time.perf_counter(), read_cycles()
    return max((c1 - c0) / ((t1 - t0) * 1e6), 1.0)


def wait_changed(counters: np.ndarray, seen: int, us: float) -> int:
    """Poll without the GIL, for up to ``us`` microseconds, until ``counters.sum() != seen`` (:func:`poll`)."""
    rate = cycles_per_us()
    return poll(counters, seen, False, int(us * rate), int(LOST_US * rate))


def wait_total(counters: np.ndarray, total: int, us: float) -> int:
    """Poll without the GIL, for up to ``us`` microseconds, until ``counters.sum() >= total`` (:func:`poll`)."""
    rate = cycles_per_us()
    return poll(counters, total, True, int(us * rate), int(LOST_US * rate))
