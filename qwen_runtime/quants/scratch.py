"""Per-thread scratch buffers: kept from task to task so hot loops allocate nothing.

The numpy codecs decode tiles into these buffers; the thread pool (:mod:`qwen_runtime.backend.pool`) gives each of
its threads one :class:`Scratch`.  They live here, below the pool, so that a file format never depends on threads.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Sequence

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
        size = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.size < size:
            buf = self._buffers[name] = buffer(size, dtype)
        return buf[:size].reshape(shape)

    def arrays(self, name: str, shapes: Sequence[tuple[int, ...]], dtype: np.dtype | type = np.float32,
               ) -> list[np.ndarray]:
        """Uninitialised arrays of ``shapes`` laid end to end in the buffer ``name`` (valid until its next request):
        work that needs several buffers at once, and different work that never runs in the same task, share one."""
        sizes = [math.prod(shape) for shape in shapes]
        buf = self.array(name, sum(sizes), dtype)
        offsets = np.cumsum([0, *sizes]).tolist()
        return [buf[a:b].reshape(shape) for a, b, shape in zip(offsets[:-1], offsets[1:], shapes, strict=True)]

    def clear(self) -> None:
        """Drop every buffer (the next requests allocate afresh)."""
        self._buffers.clear()

    def sizes(self) -> dict[str, int]:
        """Elements held per buffer name."""
        return {name: buf.size for name, buf in self._buffers.items()}

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for buf in self._buffers.values())


# Buffers from this size on get a mapping of their own (see buffer()).
OWN_MAPPING_BYTES = 1 << 20


def buffer(size: int, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """An uninitialised 1-D array of ``size`` elements; from :data:`OWN_MAPPING_BYTES` on, in an anonymous
    mapping of its own (transparent huge pages asked for), unmapped as soon as the array is dropped.

    Through malloc, a freed scratch buffer of a few MiB often stayed resident: glibc raises its mmap threshold
    to the size of the first such buffer freed, so later ones come from a (per-thread) arena that is rarely
    trimmed.  Measured on the Qwen3.5 shape after a prefill released its scratch: 168 or 180 MiB anonymous
    from run to run; with own mappings it is returned every time.
    """
    dtype = np.dtype(dtype)
    nbytes = size * dtype.itemsize
    if nbytes < OWN_MAPPING_BYTES:
        return np.empty(size, dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: counted in RssAnon
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages refuses the advice
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapping, dtype, count=size)
