"""Q8_0: blocks of 32 values, a float16 scale ``d`` then 32 int8 ``q``; value = d * q.

The kernel casts every byte of a tile, scale bytes included, to float32 in one contiguous pass and lets the
scale bytes meet zeros in the activations; the block scales are widened to float32 once per tile and kept
(``[nb, out]``, 2/17 of the stored bytes: widening them on every call cost a fifth of the decode time).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import Codec, QType, f16_field, f16_scales
from .scratch import Scratch

Q8_0_BLOCK = 32
Q8_0_BYTES = 34
# Activation rows up to which Q8_0 tiles are multiplied per block column (decode, small batches); above it the
# tile is scaled in place and multiplied once: block sums win up to 4 rows, and the batched K=34 GEMMs fall behind
# at 8 (docs/performance.md).
Q8_0_BLOCK_SUM_ROWS = 4


class Q8_0(Codec):
    qtype = QType.Q8_0

    def __init__(self) -> None:
        self.npy_dtype = np.dtype([("d", "<f2"), ("qs", "i1", (self.block_size,))])

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)  # [n_blocks, 34]
        d = f16_field(blocks[:, 0:2])  # [n_blocks]
        q = blocks[:, 2:].view(np.int8).astype(np.float32)  # [n_blocks, 32]
        return (d[:, None] * q).reshape(*raw.shape[:-1], -1)

    def decode(self, raw: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        blocks = raw.view(self.npy_dtype)  # [R, nb] of (d: f16, qs: 32 x i8)
        scale = blocks["d"].astype(np.float32)[..., None]  # [R, nb, 1] (1/32 of the elements: a plain cast is fine)
        np.multiply(blocks["qs"], scale, out=out.reshape(*blocks.shape, self.block_size))
        return out

    def kernel(self, raw: np.ndarray) -> Q8_0Kernel:
        return Q8_0Kernel(raw)

    def kept_bytes(self, stored_nbytes: int) -> int:
        """The block scales :class:`Q8_0Kernel` keeps widened to float32 (4 bytes per 34-byte block)."""
        return stored_nbytes // Q8_0_BYTES * np.dtype(np.float32).itemsize


def q8_0_activations(x: np.ndarray) -> np.ndarray:
    """Activations laid out like Q8_0 bytes: ``[N, nb * 32] -> [N, nb, 34]``, zeros where the scale bytes sit."""
    n, width = x.shape
    out = np.zeros((n, width // Q8_0_BLOCK, Q8_0_BYTES), np.float32)
    out[:, :, Q8_0_BYTES - Q8_0_BLOCK:] = x.reshape(n, -1, Q8_0_BLOCK)
    return out


def q8_0_row_scales(raw: np.ndarray) -> np.ndarray:
    """The float32 block scales of Q8_0 rows.  # [R, nb * 34] uint8 -> [R, nb]"""
    rows = raw.shape[0]
    return f16_scales(raw.reshape(rows, -1, Q8_0_BYTES)[:, :, :2].view(np.uint16)[..., 0])


def q8_0_product(raw: np.ndarray, scales: np.ndarray, xq: np.ndarray, scratch: Scratch,
                 out: np.ndarray) -> np.ndarray:
    """``out = x @ dequantize(raw).T`` for Q8_0 rows ``raw`` [R, nb * 34], their float32 ``scales`` [nb, R]
    (any strides) and ``xq = q8_0_activations(x)`` [N, nb, 34].

    Every byte of the rows, scales included, is cast to float32 in one contiguous pass (the fast cast; the
    strided 32-of-34 view is several times slower); the scale bytes meet the zeros of ``xq``.  For up to
    :data:`Q8_0_BLOCK_SUM_ROWS` activation rows (decode) one batched BLAS call gives the per-block dot
    products ``[nb, N, R]``, which are scaled and summed over the blocks with R innermost; for more rows the
    tile is scaled in place and multiplied once.  Equal to the reference up to float32 rounding (the scale
    is applied to block sums).  ``out`` is ``[N, R]`` (a column block of the output, any leading stride).  # -> out
    """
    return q8_0_tile_product(q8_0_cast(raw, scratch), scales, xq, scratch, out)


def q8_0_cast(raw: np.ndarray, scratch: Scratch) -> np.ndarray:
    """Every byte of Q8_0 rows ``raw`` [R, nb * 34], scale bytes included, as float32 ``[R, nb, 34]``."""
    tile = scratch.array("tile", (len(raw), raw.shape[1] // Q8_0_BYTES, Q8_0_BYTES))
    np.copyto(tile.reshape(raw.shape), raw.view(np.int8), casting="unsafe")
    return tile


def q8_0_tile_product(tile: np.ndarray, scales: np.ndarray, xq: np.ndarray, scratch: Scratch,
                      out: np.ndarray) -> np.ndarray:
    """The product of :func:`q8_0_product` from the cast tile ``[R, nb, 34]`` (scaled in place for many rows)."""
    rows, n, nb = len(tile), xq.shape[0], xq.shape[1]
    if n <= Q8_0_BLOCK_SUM_ROWS:
        sums = scratch.array("block sums", (nb, n, rows))
        np.matmul(xq.transpose(1, 0, 2), tile.transpose(1, 2, 0), out=sums)  # [nb, N, 34] @ [nb, 34, R]
        np.multiply(sums, scales[:, None, :], out=sums)
        return np.add.reduce(sums, axis=0, out=out)
    tile *= scales.T[:, :, None]
    return np.matmul(xq.reshape(n, -1), tile.reshape(rows, -1).T, out=out)


class Q8_0Kernel:
    """Q8_0 tiles through :func:`q8_0_product`, their scales widened on each tile's first use and kept."""

    def __init__(self, raw: np.ndarray) -> None:
        self.raw = raw  # [out, nb * 34]
        self._scaled: set[int] = set()  # tile starts whose scales are in _scales
        self._scales = np.empty((raw.shape[1] // Q8_0_BYTES, raw.shape[0]), np.float32)  # [nb, out]

    def prepare(self, x: np.ndarray) -> np.ndarray:
        return q8_0_activations(x)

    def product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        q8_0_product(self.raw[r0:r1], self.tile_scales(r0, r1), xk, scratch, out)

    def product_rows(self, r0: int, r1: int, xks: Sequence[object], out: np.ndarray, scratch: Scratch) -> None:
        """Each row by one matrix-vector product with the scaled tile (per-row block sums cost ~2x more)."""
        tile = q8_0_cast(self.raw[r0:r1], scratch)
        tile *= self.tile_scales(r0, r1).T[:, :, None]
        flat = tile.reshape(len(tile), -1)  # [R, nb * 34]
        for i, xq in enumerate(xks):
            np.matmul(xq.reshape(1, -1), flat.T, out=out[i:i + 1])

    def tile_scales(self, r0: int, r1: int) -> np.ndarray:
        """Scales of rows ``r0:r1`` as float32, widened on the tile's first use.  # -> [nb, R]"""
        scales = self._scales[:, r0:r1]
        if r0 not in self._scaled:
            scales[...] = q8_0_row_scales(self.raw[r0:r1]).T
            self._scaled.add(r0)
        return scales
