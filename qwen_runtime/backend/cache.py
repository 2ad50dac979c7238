"""Per-layer caches and the batch bookkeeping that every mixer sees.

A model's cache is a :class:`Cache`: one object per layer (made by the layer's mixer, so Qwen3.5's
linear-attention layers hold a recurrent state where full-attention layers hold a :class:`KVCache`), plus
per-row bookkeeping shared by all layers.  What a layer's cache holds is reported, before anything is
allocated, as a :class:`CacheSize` (bytes per row and per token of a row) by the mixer that makes it; every
memory estimate (``Model.make_cache``'s check, the generation limits, the server's admission) adds those.

Batches are left-padded and *slot-aligned*: column ``s`` of every row's KV buffer holds the token fed at
step ``s`` of the batch, padding included.  ``valid[b, s]`` says whether slot ``s`` of row ``b`` is a real
token; rotary positions count real tokens only, so each row starts at position 0 at its first real token
and gives the same result as running it alone.

Keys and values are stored in their *cache type* (:data:`CACHE_TYPES`, llama.cpp's ``--cache-type-k/-v`` names),
each chosen separately (:class:`CacheType`): ``f32`` (exact), ``f16`` (each value rounded to nearest float16: a
relative error of at most 2^-11, or 2^-25 absolute below float16's normal range), ``bf16`` (rounded to nearest
bfloat16: relative 2^-8), and llama.cpp's block types along ``head_dim``: ``q8_0`` (blocks of 32 values, a float16
scale d = max|x|/127 and 32 int8) and ``q4_0`` (a float16 scale d = x_max/-8, x_max the value of largest magnitude,
and 32 4-bit q with value d·(q-8)), quantized exactly as ggml's ``quantize_row_q8_0_ref``/``quantize_row_q4_0_ref``
(gguf's numpy quantizer, which gives their bytes).  A block value is within d/2 of the original (plus the scale's
own float16 rounding).  Attention widens what it reads to float32 and accumulates there.

A *ragged* batch (``BatchState.lengths`` set, used by servers that let rows join and leave a running batch)
has no padding at all: each row keeps its own slots from 0, writes its new tokens after its own
``lengths[b]`` tokens and attends over exactly those slots, computed as if the row were alone
(:attr:`BatchState.rows`), so its results do not depend on the other rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np
from gguf import GGMLQuantizationType, quants

from ..errors import UsageError
from ..formats.rope import RopeScaling
from .ops import rope_cos_sin


@dataclass(frozen=True)
class CacheType:
    """How keys or values are stored: an array of ``dtype`` with ``head_dim // block`` elements per head and slot.

    Block types are numpy records (float16 scale ``d`` as its bits, then ``qs``), so an array says its type by
    its dtype alone: the compiled kernels specialise on it and the prefix store checks it on disk.
    """

    name: str
    dtype: np.dtype
    qtype: GGMLQuantizationType  # gguf's encoder and decoder of the type (one place for the formats' bytes)
    block: int = 1  # values per stored element along head_dim

    def width(self, head_dim: int) -> int:
        """Stored elements per ``head_dim`` values; :class:`UsageError` when blocks do not divide the head."""
        if head_dim % self.block:
            raise UsageError(f"cache type {self.name}: head_dim {head_dim} is not a multiple of its "
                             f"{self.block}-value blocks (use f32, f16 or bf16)")
        return head_dim // self.block

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Float32 ``[..., hd]`` in this type ``[..., hd // block]`` (rounded as ggml rounds)."""
        if self.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return x.astype(self.dtype)
        return quants.quantize(np.ascontiguousarray(x, np.float32), self.qtype).view(self.dtype)

    def decode(self, stored: np.ndarray) -> np.ndarray:
        """What ``stored`` ``[..., hd // block]`` holds, as float32 ``[..., hd]``."""
        if stored.dtype == np.float32:
            return stored
        if stored.dtype == np.float16:
            return stored.astype(np.float32)
        return quants.dequantize(np.ascontiguousarray(stored).view(np.uint8), self.qtype)


F16_BITS = np.dtype("<u2")  # a float16 scale stored as its bits (numba reads records of integers only)
_TYPES = (
    CacheType("f32", np.dtype(np.float32), GGMLQuantizationType.F32),
    CacheType("f16", np.dtype(np.float16), GGMLQuantizationType.F16),
    CacheType("bf16", np.dtype([("bits", F16_BITS)]), GGMLQuantizationType.BF16),
    CacheType("q8_0", np.dtype([("d", F16_BITS), ("qs", np.int8, (32,))]), GGMLQuantizationType.Q8_0, 32),
    CacheType("q4_0", np.dtype([("d", F16_BITS), ("qs", np.uint8, (16,))]), GGMLQuantizationType.Q4_0, 32),
)
CACHE_TYPE = {t.name: t for t in _TYPES}
CACHE_TYPES = tuple(CACHE_TYPE)
# load(), create_app() and the commands: llama.cpp's default, half the memory of float32 (its effect on the bundled
# model's predictions: docs/performance.md); ``-ctk f32 -ctv f32`` or ``cache_type_k/v="f32"`` give exact numbers
DEFAULT_CACHE_TYPE = "f16"
# build_model() and a bare KVCache: the numbers of float32 arithmetic, what conversion checks and tests compare
EXACT_CACHE_TYPE = "f32"


def cache_type(name: str) -> CacheType:
    """Cache type ``name``; :class:`UsageError` for an unknown one."""
    if name not in CACHE_TYPE:
        raise UsageError(f"cache type: expected one of {', '.join(CACHE_TYPES)}, got {name!r}")
    return CACHE_TYPE[name]


def stored_type(array: np.ndarray) -> CacheType:
    """The cache type of a stored keys or values array (its dtype says it)."""
    return next(t for t in _TYPES if t.dtype == array.dtype)


@dataclass(frozen=True)
class CacheSize:
    """Bytes a cache holds for one batch row: ``row`` whatever its length (a recurrent state) plus ``token``
    for each slot (keys and values)."""

    row: int = 0
    token: int = 0

    def __add__(self, other: CacheSize) -> CacheSize:
        return CacheSize(self.row + other.row, self.token + other.token)

    def nbytes(self, batch: int, max_len: int) -> int:
        """Bytes for ``batch`` rows of ``max_len`` slots."""
        return batch * (self.row + self.token * max_len)

    @staticmethod
    def total(sizes: Iterable[CacheSize]) -> CacheSize:
        return sum(sizes, CacheSize())


class LayerCache(Protocol):
    """What the generation loop needs from any per-layer cache."""

    def select(self, rows: np.ndarray) -> None:
        """Keep only batch rows ``rows`` (in that order), e.g. to drop finished sequences."""

    def view(self, rows: slice) -> LayerCache:
        """A cache of the same kind over rows ``rows`` that shares this one's memory (writes go through)."""

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Make row ``dst`` hold what row ``src`` holds after ``length`` tokens."""

    def clear_row(self, row: int) -> None:
        """Make row ``row`` ready for a new sequence (slots past a row's length are never read)."""

    def checkpoint(self, rows: np.ndarray | None = None) -> None:
        """Keep what :meth:`rollback` needs to undo the next pass in ``rows`` (bool [B], default all: the rows it
        may cut back before their last token; a recurrent state, as keys and values need nothing: the
        bookkeeping's lengths cut them back)."""

    def rollback(self, keep: np.ndarray) -> None:
        """Undo the pass after :meth:`checkpoint` but for its first ``keep[b]`` tokens of each row b (int [B])."""

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache arrays."""


@dataclass(frozen=True)
class BatchState:
    """What a mixer needs to know about the tokens it is given.

    ``start`` is the cache slot of the first new token (the same for every row); the new tokens occupy slots
    ``start .. start + T - 1``.  ``key_valid`` covers every slot up to and including the new ones.

    One state serves every layer of a forward pass, so what all layers need of it (rotary angles, the slots
    hidden from the new tokens, the rows of a ragged batch) is computed on first use and kept.
    """

    positions: np.ndarray  # int64 [B, T] rotary position of each new token (0 at a row's first real token)
    valid: np.ndarray  # bool [B, T] False on padding
    start: int  # slot of the first new token
    key_valid: np.ndarray  # bool [B, start + T] which cached + new slots hold real tokens
    lengths: np.ndarray | None = None  # ragged batch: int [B] tokens each row holds before the new ones
    _memo: dict[object, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    @property
    def end(self) -> int:
        return self.start + self.length

    def rotary(self, rotary_dim: int, theta: float,
               scaling: RopeScaling | None = None) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of the new tokens' rotary angles (:func:`~qwen_runtime.backend.ops.rope_cos_sin`), once per
        pass.  # 2 x [B, T, r/2] float32"""
        key = ("rotary", rotary_dim, theta, scaling)
        if key not in self._memo:
            self._memo[key] = rope_cos_sin(self.positions, rotary_dim, theta, scaling)
        return self._memo[key]

    def hidden(self, q0: int = 0, q1: int | None = None, s0: int = 0, s1: int | None = None) -> np.ndarray | None:
        """Which of the slots ``s0:s1`` new tokens ``q0:q1`` may not attend to, or None when they see every one of
        them (a decode step without padding; a block of a prefill's tile below the diagonal).
        # bool [B, 1, 1, q1 - q0, s1 - s0] (default: every new token and every slot up to ``end``)

        A token sees the slots up to its own that hold real tokens; it always sees its own slot, so a padding
        query has one finite score (its output is ignored) instead of a row of ``-inf``.  The answer for all
        new tokens and slots at once is kept for the other layers (a decode step asks for it; a long prefill asks
        tile by tile and block by block and keeps nothing).
        """
        q1 = self.length if q1 is None else q1
        s1 = self.end if s1 is None else s1
        whole = (q0, q1, s0, s1) == (0, self.length, 0, self.end)
        if whole and "hidden" in self._memo:
            return self._memo["hidden"]
        slots = np.arange(s0, s1)  # [n]
        query_slots = np.arange(self.start + q0, self.start + q1)  # [Tq]
        causal = slots[None, :] <= query_slots[:, None]  # [Tq, n]
        own = slots[None, :] == query_slots[:, None]
        hidden = ~((causal[None] & self.key_valid[:, None, s0:s1]) | own[None])  # [B, Tq, n]
        result = hidden[:, None, None] if hidden.any() else None
        if whole:
            self._memo["hidden"] = result
        return result

    def slots(self) -> tuple[np.ndarray, np.ndarray]:
        """The cache slot of each new token and which slots hold real tokens, for kernels that index the cache
        themselves; once per pass.  # int64 [B, T], bool [B, S]

        A token sees the real slots before its own and its own; a ragged batch's row ``b`` writes after its own
        ``lengths[b]`` tokens, all real.
        """
        if "slots" not in self._memo:
            steps = np.arange(self.length)  # [T]
            if self.lengths is None:
                own, real = np.broadcast_to(self.start + steps, self.positions.shape), self.key_valid
            else:
                own = self.lengths[:, None] + steps  # [B, T]
                real = np.ones((self.batch, int(own.max(initial=0)) + 1), bool)
            self._memo["slots"] = (np.array(own, np.int64), np.array(real, bool))  # fresh, C-ordered and writable:
            # one type whatever the batch, so the compiled kernels warmed up at load are the ones used
        return self._memo["slots"]

    @cached_property
    def rows(self) -> list[BatchState]:
        """Each row of a ragged batch as a one-row state: its new tokens after its own slots, all real."""
        if self.lengths is None:
            raise ValueError("only a ragged batch (lengths set) is split into rows")
        return [BatchState(self.positions[b:b + 1], self.valid[b:b + 1], start, np.ones((1, start + self.length), bool))
                for b, start in enumerate(self.lengths.tolist())]


class KVCache:
    """Preallocated keys and values of one full-attention layer, each in its cache type (:data:`CACHE_TYPES`).
    # 2 x [B, kv_heads, max_len, head_dim / block]"""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, key_type: str = EXACT_CACHE_TYPE,
                 value_type: str = EXACT_CACHE_TYPE) -> None:
        kt, vt = cache_type(key_type), cache_type(value_type)
        self.keys = np.zeros((batch, kv_heads, max_len, kt.width(head_dim)), kt.dtype)
        self.values = np.zeros((batch, kv_heads, max_len, vt.width(head_dim)), vt.dtype)

    @staticmethod
    def size(kv_heads: int, head_dim: int, key_type: str = EXACT_CACHE_TYPE,
             value_type: str = EXACT_CACHE_TYPE) -> CacheSize:
        """What such a cache holds: the keys and values of every token in their types."""
        kt, vt = cache_type(key_type), cache_type(value_type)
        return CacheSize(token=kv_heads * (kt.width(head_dim) * kt.dtype.itemsize
                                           + vt.width(head_dim) * vt.dtype.itemsize))

    @property
    def types(self) -> tuple[CacheType, CacheType]:
        """The cache types of the keys and of the values."""
        return stored_type(self.keys), stored_type(self.values)

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    def update(self, k: np.ndarray, v: np.ndarray, state: BatchState) -> tuple[np.ndarray, np.ndarray]:
        """Write the new keys/values at their slots (encoded in the cache types); return views of every slot so far.

        ``k``, ``v``: [B, kv_heads, T, hd] -> 2 x [B, kv_heads, start + T, hd / block] (ragged batches: each row after
        its own tokens, and the whole buffers are returned: row ``b`` is valid up to ``state.rows[b].end``)
        """
        kt, vt = self.types
        if state.lengths is not None:
            rows = np.arange(state.batch)[:, None]  # [B, 1]
            slots = state.lengths[:, None] + np.arange(state.length)  # [B, T]
            self.keys[rows, :, slots] = kt.encode(k.transpose(0, 2, 1, 3))  # [B, T, kv_heads, hd / block]
            self.values[rows, :, slots] = vt.encode(v.transpose(0, 2, 1, 3))
            return self.keys, self.values
        self.keys[:, :, state.start:state.end] = kt.encode(k)
        self.values[:, :, state.start:state.end] = vt.encode(v)
        return self.keys[:, :, : state.end], self.values[:, :, : state.end]

    def select(self, rows: np.ndarray) -> None:
        self.keys = self.keys[rows]
        self.values = self.values[rows]

    def view(self, rows: slice) -> KVCache:
        out = KVCache.__new__(KVCache)
        out.keys, out.values = self.keys[rows], self.values[rows]
        return out

    def copy_row(self, src: int, dst: int, length: int) -> None:
        self.keys[dst, :, :length] = self.keys[src, :, :length]
        self.values[dst, :, :length] = self.values[src, :, :length]

    def clear_row(self, row: int) -> None:
        pass  # keys and values are only read up to the tokens a row holds

    def checkpoint(self, rows: np.ndarray | None = None) -> None:
        pass  # slots past a row's length are never read and are written again

    def rollback(self, keep: np.ndarray) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class LayeredCache:
    """Per-layer caches under one bookkeeping (:class:`Cache`, and the server's row ranges): what a model's pass
    takes as a cache."""

    layers: list[LayerCache]

    def checkpoint(self, rows: np.ndarray | None = None) -> None:
        """Make the next pass undoable by ``rollback`` in ``rows`` (bool [B], default all; speculative
        decoding's verify pass)."""
        for layer in self.layers:
            layer.checkpoint(rows)


class Cache(LayeredCache):
    """All layers' caches of a batch plus per-row bookkeeping (filled slots, real-token counts)."""

    MASK = CacheSize(token=np.dtype(bool).itemsize)  # ``valid``: one flag per row and slot

    def __init__(self, layers: list[LayerCache], batch: int, max_len: int) -> None:
        self.layers = layers
        self.max_len = max_len
        self.offset = 0  # slots filled so far (the same for every row)
        self.valid = np.zeros((batch, max_len), bool)  # [B, max_len]
        self.lengths = np.zeros(batch, np.int64)  # [B] real tokens so far per row
        self.last_length = 0  # new tokens per row of the last pass

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @property
    def remaining(self) -> int:
        return self.max_len - self.offset

    def begin(self, valid: np.ndarray) -> BatchState:
        """The :class:`BatchState` of the next ``T`` tokens, whose validity is ``valid`` [B, T]."""
        valid = np.asarray(valid, bool)
        b, t = valid.shape
        if b != self.batch:
            raise ValueError(f"cache holds {self.batch} rows, got a batch of {b}")
        if t > self.remaining:
            raise ValueError(f"cache overflow: {t} new tokens but only {self.remaining} of {self.max_len} slots left")
        positions = self.lengths[:, None] + np.cumsum(valid, axis=1) - 1  # [B, T]
        start = self.offset
        self.valid[:, start:start + t] = valid
        return BatchState(np.maximum(positions, 0), valid, start, self.valid[:, : start + t])

    def commit(self, state: BatchState) -> None:
        """Advance the bookkeeping once every layer has consumed ``state``."""
        self.offset = state.end
        self.lengths += state.valid.sum(axis=1)
        self.last_length = state.length

    def rollback(self, keep: np.ndarray) -> None:
        """Keep only the first ``keep[b]`` tokens of the last pass (after :meth:`checkpoint`) in row b (int [B]).

        The rows share one slot offset, so every row must drop as many tokens (a one-row generation does); the
        dropped slots become free again (unpadded passes only: each token is one slot).
        """
        dropped = self.last_length - np.asarray(keep, np.int64)  # [B]
        if dropped.min() != dropped.max() or dropped[0] < 0:
            raise ValueError(f"a cache of one slot offset rolls every row back alike, got keep={keep.tolist()} "
                             f"of {self.last_length} tokens")
        drop = int(dropped[0])
        self.offset -= drop
        self.lengths -= drop
        self.valid[:, self.offset:self.offset + drop] = False
        for layer in self.layers:
            layer.rollback(keep)

    def select(self, rows: np.ndarray) -> None:
        """Keep only batch rows ``rows`` in every layer (drops finished sequences)."""
        rows = np.asarray(rows, np.int64)
        for layer in self.layers:
            layer.select(rows)
        self.valid = self.valid[rows]
        self.lengths = self.lengths[rows]

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's cache and of the validity mask."""
        return sum(layer.nbytes for layer in self.layers) + self.valid.nbytes
