"""The engine's cache: a fixed number of rows ("slots"), each holding one sequence of its own length.

Every layer's cache is made once for ``slots`` rows of ``capacity`` tokens (full-attention layers' keys and
values are allocated with ``np.zeros``, so pages are only backed by memory once a row has written them), in pages
of 4 KiB: numpy asks the kernel for transparent huge pages for large arrays, and then a fresh row's first tokens
faulted in (and zeroed) 2 MiB per layer, head, keys and values, which made a fresh engine's first passes and row
moves several times slower than later ones (docs/performance.md).
A forward pass runs on a contiguous range of rows (:meth:`SlotCache.rows`): the running batch is always
rows ``0 .. n-1`` and a prompt is prefilled in a row of its own.  The batch is *ragged*: each row writes its
new tokens after its own tokens and attends over exactly those (see :mod:`qwen_runtime.backend.cache`), so a row
computes the same numbers whichever rows run beside it.  Rows leave by having the last row moved into their
place (:meth:`SlotCache.move`), which keeps the running rows contiguous.
"""

from __future__ import annotations

import numpy as np

from qwen_runtime.backend.cache import BatchState, LayerCache, LayeredCache
from qwen_runtime.backend.memory import MADV_NOHUGEPAGE, advise
from qwen_runtime.models import Model


class RowRange(LayeredCache):
    """Rows ``start .. stop-1`` of a :class:`SlotCache`, in the form ``Model.forward`` takes as a cache."""

    def __init__(self, slots: SlotCache, start: int, stop: int) -> None:
        self.slots, self.start, self.stop = slots, start, stop
        self.last_length = 0  # new tokens per row of the last pass
        self.layers: list[LayerCache] = [layer.view(slice(start, stop)) for layer in slots.layers]

    def begin(self, valid: np.ndarray) -> BatchState:
        """The ragged :class:`BatchState` of ``T`` new tokens per row.  ``valid`` is all True but for a verify
        pass (``Model.verify``), whose rows may end in padding: it is written after the row's own new tokens,
        which never see it, and the pass is then cut back (:meth:`rollback`) to at most the row's own tokens."""
        valid = np.asarray(valid, bool)
        b, t = valid.shape
        own = valid.sum(axis=1)  # [B]
        if b != self.stop - self.start or not (valid == (np.arange(t) < own[:, None])).all():
            raise ValueError(f"a ragged batch of rows {self.start}..{self.stop - 1} takes {self.stop - self.start} "
                             f"rows, padded at the end only, got valid of shape {valid.shape}")
        lengths = self.slots.lengths[self.start:self.stop].copy()  # [B]
        if (lengths + t).max(initial=0) > self.slots.capacity:
            raise ValueError(f"cache overflow: a row would exceed its {self.slots.capacity} slots")
        positions = lengths[:, None] + np.arange(t)[None, :]  # [B, T]
        return BatchState(positions, valid, 0, valid, lengths)

    def commit(self, state: BatchState) -> None:
        self.slots.lengths[self.start:self.stop] += state.length
        self.last_length = state.length

    def rollback(self, keep: np.ndarray) -> None:
        """Keep only the first ``keep[b]`` tokens of the last pass (after :meth:`checkpoint`) in each row.  # int [B]"""
        keep = np.asarray(keep, np.int64)
        self.slots.lengths[self.start:self.stop] -= self.last_length - keep
        for layer in self.layers:
            layer.rollback(keep)


class SlotCache:
    """``slots`` rows of up to ``capacity`` tokens for every layer of ``model``, and each row's length."""

    def __init__(self, model: Model, slots: int, capacity: int) -> None:
        self.capacity = capacity
        self.layers: list[LayerCache] = [blk.mixer.make_cache(slots, capacity) for blk in model.blocks]
        for layer in self.layers:  # before any row writes them (see the module docstring)
            for array in vars(layer).values():
                if isinstance(array, np.ndarray) and array.nbytes:
                    advise(array.ctypes.data, array.nbytes, MADV_NOHUGEPAGE)
        self.lengths = np.zeros(slots, np.int64)  # [slots] tokens held per row

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def rows(self, start: int, stop: int) -> RowRange:
        return RowRange(self, start, stop)

    def reset(self, row: int) -> None:
        """Empty a row for a new sequence (recurrent states start from zero)."""
        self.lengths[row] = 0
        for layer in self.layers:
            layer.clear_row(row)

    def copy(self, src: int, dst: int) -> None:
        """Make row ``dst`` a copy of row ``src`` (several choices of one prompt share its prefill)."""
        length = int(self.lengths[src])
        for layer in self.layers:
            layer.copy_row(src, dst, length)
        self.lengths[dst] = length

    def move(self, src: int, dst: int) -> None:
        """Move row ``src`` into row ``dst`` (``src`` is free afterwards)."""
        if src != dst:
            self.copy(src, dst)
            self.lengths[src] = 0
