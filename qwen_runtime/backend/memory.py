"""Hints to the kernel about resident memory (``madvise(2)``), for the few places that give them: the compiler's code
pages released once a model's kernels are loaded (:func:`.jit_setup.release_compiler_pages`), a model's weights
mapped in at load (:func:`.weights.populate`) and a server's cache rows kept off huge pages (``qwen_serve.slots``).
No package imports, so that the compiled kernels' cache stamps (:mod:`.jit_setup`) do not depend on anything else."""

from __future__ import annotations

import functools
import mmap
import sys
from collections.abc import Callable
from pathlib import Path

MADV_PAGEOUT, MADV_POPULATE_READ = 21, 22  # Linux 5.4+: reclaim these pages now; 5.14+: map them in now
MADV_NOHUGEPAGE = 15  # no transparent huge pages here: back the pages 4 KiB at a time as they are first written


def advise(address: int, length: int, advice: int) -> bool:
    """``madvise(2)`` over the pages holding bytes ``[address, address + length)``: a hint about resident memory,
    never a change of contents.  Linux only; False elsewhere or when the kernel refuses."""
    madvise = libc_madvise()
    if madvise is None or length <= 0:
        return False
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    return madvise(start, -(-(address + length - start) // mmap.PAGESIZE) * mmap.PAGESIZE, advice) == 0


@functools.cache
def libc_madvise() -> Callable[[int, int, int], int] | None:
    """The C library's ``madvise`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def mapped_ranges(name: str) -> list[tuple[int, int, str]]:
    """The process's mappings of files whose path contains ``name``: (start, end, permissions)."""
    try:
        maps = Path("/proc/self/maps").read_text(encoding="ascii").splitlines()
    except OSError:
        return []
    out = []
    for line in maps:
        fields = line.split()
        if len(fields) > 5 and name in fields[5]:
            start, end = (int(a, 16) for a in fields[0].split("-"))
            out.append((start, end, fields[1]))
    return out
