"""The fast path shared by the 4-, 5- and 6-bit types: decode a tile "field-major", then scale block sums.

A tile of ``R`` stored rows holds ``R * nb`` blocks of ``type_size`` bytes.  Two copies turn it field-major,
``fields[byte, block, row]``, so that every later step is a few numpy passes over long contiguous rows
whatever the block layout: groups of ``G`` neighbouring blocks that fill whole 8-byte words (G = 4 for the
18-byte Q4_0) are transposed as words (a byte-wise transpose costs several times more), then the bytes of each
word are spread into rows.  The block axis is ordered group-member-major (block ``b = G * b4 + g`` sits at
``g * nb / G + b4``; :meth:`BlockCodec.layout`), which activations and decoded rows follow:

1. :meth:`BlockCodec.ints` writes each value's integer part to ``ints[element, block, row]``
   (``[block_size, nb, R]`` int8), and one cast makes the float32 tile;
2. :meth:`BlockCodec.scales` gives each sub-block of ``sub`` values its float32 ``scale`` and, for types with a
   minimum, ``offset`` (``[J, nb, R]``, J = block_size / sub), so that value = scale * int + offset, computed in
   the same float32 operations as ``gguf.quants`` (the decode is bit-exact);
3. for a few activation rows (decode) one batched BLAS call gives every sub-block's dot product
   ``[J, nb, N, R]`` (R contiguous: BLAS's fast layout), which is scaled and summed, plus
   ``sum(x over the sub-block) @ offset``; for many rows the tile is scaled in place and multiplied once.

Nothing outlives a call but the thread's scratch buffers: no per-matrix cache, so the anonymous memory of
these types is a tile per thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import BLOCK_SUM_ROWS, Codec, f16_bits_to_f32
from .scratch import Scratch

UINTS = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}
SHIFTS_2BIT = np.array([0, 2, 4, 6], np.uint8)
SHIFTS_1BIT = np.arange(8, dtype=np.uint8)


@dataclass(frozen=True)
class BlockActivations:
    """Activations ``x`` [N, n] laid out for one block type (only what N needs is computed).

    ``sums_x`` [J, nb, N, W] (sub-block major, for block sums) and ``sub_sums`` [N, J * nb] (each sub-block's
    sum, for offsets) when N <= BLOCK_SUM_ROWS, else ``field_x`` [N, block * nb] (element-major, ``x`` permuted
    like the tile's rows)."""

    sums_x: np.ndarray | None
    sub_sums: np.ndarray | None
    field_x: np.ndarray | None


class BlockCodec(Codec):
    """A block type decoded field-major (module docstring).  Subclasses set ``sub``, ``has_offset`` and
    ``subtracts`` and implement :meth:`reference`, :meth:`ints` and :meth:`scales`."""

    sub: int  # values per scale (sub-block)
    int_range: tuple[int, int]  # the integer parts a value can have (IQ4: its levels)
    max_gap = 1  # largest distance between neighbouring integer parts (IQ4's levels are uneven)
    has_offset = False
    subtracts = False  # value = scale * int - offset (K-quant minimums) instead of + offset

    @property
    def n_sub(self) -> int:
        return self.block_size // self.sub

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        """Integer parts ``out`` int8 [block_size, *B] from ``fields`` uint8 [type_size, *B], where ``B`` are
        the block axes of :meth:`field_major` (any number: work along the first axis only)."""
        raise NotImplementedError

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        """(scale, offset or None), contiguous float32 [J, *B] each, from ``fields`` [type_size, *B]."""
        raise NotImplementedError

    # -- shared machinery -------------------------------------------------------------------------------

    def layout(self, nb: int) -> tuple[int, int]:
        """(G, word bytes) of a row of ``nb`` blocks: the smallest group of blocks that fills whole 8-byte
        words, else single blocks moved as the widest word dividing the block."""
        for group in (1, 2, 4, 8):
            if nb % group == 0 and group * self.type_size % 8 == 0:
                return group, 8
        return 1, next(w for w in (4, 2, 1) if self.type_size % w == 0)

    def field_major(self, raw: np.ndarray, scratch: Scratch) -> np.ndarray:
        """``raw`` [R, nb * type_size] -> ``fields`` [type_size, G, nb / G, R] (module docstring)."""
        rows, size = raw.shape[0], self.type_size
        nb = raw.shape[1] // size
        group, word = self.layout(nb)
        per_group = group * size // word  # words in a group of blocks
        words = scratch.array("field words", (per_group, nb // group, rows), UINTS[word])
        np.copyto(words, raw.view(UINTS[word]).reshape(rows, nb // group, per_group).transpose(2, 1, 0))
        if word == 1:
            return words.reshape(1, size, nb, rows).transpose(1, 0, 2, 3)
        fields = scratch.array("fields", (group, size, nb // group, rows), np.uint8)
        spread = words.view(np.uint8).reshape(per_group, nb // group, rows, word).transpose(0, 3, 1, 2)
        np.copyto(fields.reshape(per_group, word, nb // group, rows), spread)
        return fields.transpose(1, 0, 2, 3)

    def int_tile(self, fields: np.ndarray, scratch: Scratch) -> np.ndarray:
        """The float32 tile of integer parts ``[block_size, nb, R]``."""
        shape = (self.block_size, *fields.shape[1:])
        ints = scratch.array("ints", shape, np.int8)
        self.ints(fields, ints, scratch)
        tile = scratch.array("tile", shape)
        np.copyto(tile, ints, casting="unsafe")
        return tile.reshape(self.block_size, -1, shape[-1])

    def sub_scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`scales` as ``[J, nb, R]``."""
        shape = (self.n_sub, -1, fields.shape[-1])
        scale, offset = self.scales(fields, scratch)
        return scale.reshape(shape), None if offset is None else offset.reshape(shape)

    def scaled_tile(self, raw: np.ndarray, scratch: Scratch) -> np.ndarray:
        """The decoded tile, field-major: float32 ``[block_size, nb, R]``."""
        fields = self.field_major(raw, scratch)
        tile = self.int_tile(fields, scratch)
        scale, offset = self.sub_scales(fields, scratch)
        by_sub = tile.reshape(self.n_sub, self.sub, *tile.shape[1:])  # [J, W, nb, R]
        np.multiply(by_sub, scale[:, None], out=by_sub)
        if offset is not None:
            (np.subtract if self.subtracts else np.add)(by_sub, offset[:, None], out=by_sub)
        return tile

    def decode(self, raw: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        tile = self.scaled_tile(raw, scratch)  # [block, nb, R], blocks group-member-major
        nb = tile.shape[1]
        group = self.layout(nb)[0]
        by_group = tile.reshape(self.block_size, group, nb // group, len(raw)).transpose(3, 2, 1, 0)
        np.copyto(out.reshape(len(raw), nb // group, group, self.block_size), by_group)
        return out

    def f16_row(self, fields: np.ndarray, byte: int, name: str, scratch: Scratch) -> np.ndarray:
        """The float16 field at ``byte`` of every block as float32 (``fields.shape[1:]``), exactly."""
        bits = scratch.array(name + " bits", fields.shape[1:], np.uint16)
        np.left_shift(fields[byte + 1], 8, out=bits, dtype=np.uint16)
        np.bitwise_or(bits, fields[byte], out=bits)
        return f16_bits_to_f32(bits, scratch.array(name, fields.shape[1:]), scratch)

    def grouped(self, x: np.ndarray) -> np.ndarray:
        """Activations ``[N, n]`` as blocks in the tile's block order: ``[N, nb, block]``."""
        n, nb = x.shape[0], x.shape[1] // self.block_size
        group = self.layout(nb)[0]
        return x.reshape(n, nb // group, group, self.block_size).transpose(0, 2, 1, 3).reshape(n, nb, -1)

    def prepare(self, x: np.ndarray) -> BlockActivations:
        n = x.shape[0]
        blocks = self.grouped(x).reshape(n, -1, self.n_sub, self.sub)  # [N, nb, J, W]
        if n <= BLOCK_SUM_ROWS:
            sums_x = np.ascontiguousarray(blocks.transpose(2, 1, 0, 3))  # [J, nb, N, W]
            sub_sums = None
            if self.has_offset:
                sub_sums = np.ascontiguousarray(blocks.sum(axis=3, dtype=np.float32).transpose(0, 2, 1)).reshape(n, -1)
            return BlockActivations(sums_x, sub_sums, None)
        field_x = np.ascontiguousarray(self.grouped(x).transpose(0, 2, 1)).reshape(n, -1)
        return BlockActivations(None, None, field_x)

    def product(self, raw: np.ndarray, xk: BlockActivations, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        """``out = x @ dequantize(raw).T`` for ``raw`` [R, nb * type_size]; ``out`` [N, R], any leading stride."""
        if xk.sums_x is None:
            tile = self.scaled_tile(raw, scratch)
            return np.matmul(xk.field_x, tile.reshape(-1, len(raw)), out=out)  # [N, block*nb] @ [block*nb, R]
        fields = self.field_major(raw, scratch)
        tile = self.int_tile(fields, scratch)
        scale, offset = self.sub_scales(fields, scratch)
        n_sub, nb, n, rows = self.n_sub, tile.shape[1], xk.sums_x.shape[2], len(raw)
        sums = scratch.array("block sums", (n_sub, nb, n, rows))
        by_sub = tile.reshape(n_sub, self.sub, nb, rows).transpose(0, 2, 1, 3)  # [J, nb, W, R]
        np.matmul(xk.sums_x, by_sub, out=sums)  # [J, nb, N, W] @ [J, nb, W, R]
        np.multiply(sums, scale[:, :, None, :], out=sums)
        np.add.reduce(sums.reshape(n_sub * nb, n, rows), axis=0, out=out)
        if offset is not None:
            correction = xk.sub_sums @ offset.reshape(n_sub * nb, rows)  # [N, R]
            (np.subtract if self.subtracts else np.add)(out, correction, out=out)
        return out

    def kernel(self, raw: np.ndarray) -> BlockKernel:
        return BlockKernel(self, raw)

    def rounding_bound(self, raw: np.ndarray, source: np.ndarray, slack: float) -> np.ndarray:
        """Per-element bound on ``|decode(raw) - source|`` for a quantizer that rounds every value to the
        nearest point of its sub-block's grid: half the largest grid step (plus ``slack`` steps), plus how
        far ``source`` lies outside the grid's range (values clamped to its ends).  float64 ``[R, n]``."""
        scratch = Scratch()
        fields = self.field_major(raw, scratch)
        scale, offset = (a.astype(np.float64) if a is not None else None for a in self.sub_scales(fields, scratch))
        sign = -1.0 if self.subtracts else 1.0
        ends = [scale * q + (sign * offset if offset is not None else 0.0) for q in self.int_range]  # [J, nb, R]
        lo, hi = np.minimum(*ends), np.maximum(*ends)
        step = np.abs(scale) * self.max_gap * (0.5 + slack)

        group = self.layout(scale.shape[1])[0]

        def per_element(a: np.ndarray) -> np.ndarray:  # [J, nb, R] (grouped blocks) -> [R, nb * block]
            natural = a.reshape(self.n_sub, group, -1, len(raw)).transpose(3, 2, 1, 0)  # [R, nb / G, G, J]
            return np.repeat(natural, self.sub, axis=3).reshape(len(raw), -1)

        x = source.astype(np.float64)
        outside = np.maximum(np.maximum(per_element(lo) - x, x - per_element(hi)), 0.0)
        return per_element(step) + outside


class BlockKernel:
    """A matrix of one :class:`BlockCodec` type: stateless, everything is decoded per tile."""

    def __init__(self, codec: BlockCodec, raw: np.ndarray) -> None:
        self.codec, self.raw = codec, raw

    def prepare(self, x: np.ndarray) -> BlockActivations:
        return self.codec.prepare(x)

    def product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        self.codec.product(self.raw[r0:r1], xk, out, scratch)


def nibbles(packed: np.ndarray, low: np.ndarray, high: np.ndarray) -> None:
    """Split bytes into their low and high 4 bits (uint8 arrays of one shape)."""
    np.bitwise_and(packed, 15, out=low)
    np.right_shift(packed, 4, out=high)


def signed_6bit_scales(low: np.ndarray, high: np.ndarray, d: np.ndarray, scratch: Scratch) -> np.ndarray:
    """Scales of Q3_K and IQ4_XS: ``d * ((low | (high & 3) << 4) - 32)`` as float32 [S, ...].

    ``low`` (uint8 [S, ...], the 4 low bits) is overwritten; ``high`` holds the 2 high bits in its low bits
    (any shape of ``low``'s size, overwritten too); ``d`` is the super-block scale broadcast against ``low``.
    """
    np.bitwise_and(high, 3, out=high)
    np.multiply(high, 16, out=high)  # = << 4 (numpy has no fast uint8 shift left)
    np.bitwise_or(low, high.reshape(low.shape), out=low)
    np.subtract(low, 32, out=low)
    scale = scratch.array("scale", low.shape)
    np.multiply(d, low.view(np.int8), out=scale)
    return scale


def bit_planes(packed: np.ndarray, out: np.ndarray) -> None:
    """Bit ``i`` of each byte of ``packed`` [K, ...] into ``out`` [K, 8, ...] (0 or 1)."""
    np.right_shift(packed[:, None], along(SHIFTS_1BIT, 1, packed.ndim + 1), out=out)
    np.bitwise_and(out, 1, out=out)


def along(values: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """``values`` (1-D) shaped to broadcast along ``axis`` of an ``ndim``-dimensional array."""
    return values.reshape([-1 if i == axis else 1 for i in range(ndim)])
