"""Unquantized types: F32, F16 and BF16 (one value per "block").

Stored views: F32 and F16 as float arrays of the logical shape, BF16 as ``uint16`` (numpy has no bfloat16).
F16 tiles are widened from their bits (numpy's own float16 cast is not vectorised); when the activations
are small enough, the widening skips its multiply by scaling the activations by 2**112 instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import F16_EXP_MASK, F16_TO_F32_SCALE, Codec, QType, f16_bits_to_f32, f16_bits_to_prescaled
from .scratch import Scratch

_F16_PRESCALE_LIMIT = np.float32(2.0**15)  # |x| * 2**112 stays finite below this


class F32(Codec):
    qtype = QType.F32
    npy_dtype = np.dtype("<f4")

    def reference(self, raw: np.ndarray) -> np.ndarray:
        return np.array(raw, dtype=np.float32)

    def decode(self, raw: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        np.copyto(out, raw)
        return out

    def kernel(self, raw: np.ndarray) -> DenseKernel:
        return DenseKernel(self, raw)


class F16(Codec):
    qtype = QType.F16
    npy_dtype = np.dtype("<f2")

    def reference(self, raw: np.ndarray) -> np.ndarray:
        return np.asarray(raw, dtype=np.float16).astype(np.float32)

    def decode(self, raw: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        return f16_bits_to_f32(np.asarray(raw).view(np.uint16), out, scratch)

    def kernel(self, raw: np.ndarray) -> F16Kernel:
        return F16Kernel(self, raw)


class BF16(Codec):
    qtype = QType.BF16
    npy_dtype = np.dtype("<u2")

    def reference(self, raw: np.ndarray) -> np.ndarray:
        """BF16 is the high half of a float32."""
        return (np.asarray(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)

    def decode(self, raw: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        np.left_shift(raw, 16, out=out.view(np.uint32), dtype=np.uint32)
        return out

    def kernel(self, raw: np.ndarray) -> DenseKernel:
        return DenseKernel(self, raw)


class DenseKernel:
    """Widen a tile of rows into the thread's float32 scratch tile and multiply it with BLAS."""

    def __init__(self, codec: Codec, raw: np.ndarray) -> None:
        self.codec, self.raw = codec, raw

    def prepare(self, x: np.ndarray) -> np.ndarray:
        return x

    def product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        raw = self.raw[r0:r1]
        tile = scratch.array("tile", raw.shape)
        np.matmul(xk, self.codec.decode(raw, tile, scratch).T, out=out)

    def product_rows(self, r0: int, r1: int, xks: Sequence[object], out: np.ndarray, scratch: Scratch) -> None:
        raw = self.raw[r0:r1]
        tile = self.codec.decode(raw, scratch.array("tile", raw.shape), scratch)
        for i, x in enumerate(xks):
            np.matmul(x, tile.T, out=out[i:i + 1])


class F16Kernel(DenseKernel):
    """F16 tiles, checked for inf/NaN once each; finite tiles are widened in two passes (prescaled activations)."""

    def __init__(self, codec: Codec, raw: np.ndarray) -> None:
        super().__init__(codec, np.asarray(raw).view(np.uint16))
        self._finite: dict[int, bool] = {}  # tile start -> no inf/NaN in it (checked on first use)

    def prepare(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(x, x * 2**112 when every |x| is small enough, else None)."""
        if x.size and np.abs(x).max() < _F16_PRESCALE_LIMIT:
            return x, x * F16_TO_F32_SCALE
        return x, None

    def product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        raw, (x, prescaled) = self.raw[r0:r1], xk
        tile = scratch.array("tile", raw.shape)
        if prescaled is not None and self._tile_is_finite(r0, raw):
            np.matmul(prescaled, f16_bits_to_prescaled(raw, tile).T, out=out)
        else:
            np.matmul(x, f16_bits_to_f32(raw, tile, scratch).T, out=out)

    def product_rows(self, r0: int, r1: int, xks: Sequence[object], out: np.ndarray, scratch: Scratch) -> None:
        raw = self.raw[r0:r1]
        finite = self._tile_is_finite(r0, raw)
        prescaled = f16_bits_to_prescaled(raw, scratch.array("tile", raw.shape)) \
            if finite and any(p is not None for _, p in xks) else None
        wide = f16_bits_to_f32(raw, scratch.array("wide tile", raw.shape), scratch) \
            if prescaled is None or any(p is None for _, p in xks) else None
        for i, (x, p) in enumerate(xks):
            if p is not None and prescaled is not None:
                np.matmul(p, prescaled.T, out=out[i:i + 1])
            else:
                np.matmul(x, wide.T, out=out[i:i + 1])

    def _tile_is_finite(self, r0: int, raw: np.ndarray) -> bool:
        if r0 not in self._finite:
            self._finite[r0] = not np.any(np.bitwise_and(raw, F16_EXP_MASK) == F16_EXP_MASK)
        return self._finite[r0]
