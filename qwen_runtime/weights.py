"""Weight kinds: how to multiply float32 activations by a matrix kept in its stored type.

A :class:`Weight` is a ``[out, in]`` matrix as stored in the model file (memory-mapped, never copied whole):

* :class:`F32Weight` multiplies straight from the memory map (BLAS reads the mapped pages).
* :class:`TiledWeight` (BF16, F16, Q8_0) widens ``tile_rows`` rows at a time into one float32 buffer
  shared by every weight of a model (a :class:`Workspace`) and BLAS-multiplies the tile.  No float32 copy
  of a whole matrix ever exists, so anonymous memory stays at one tile per model.

``rows(ids)`` is the embedding lookup: it decodes only the rows asked for.  A tied ``lm_head`` is the very
same object as the token embedding.  Every kind keeps ``to_float32()`` as the plain reference that the
tests compare the fast paths against.
"""

from __future__ import annotations

import numpy as np

from .errors import FormatError
from .tensors import Q8_0_BLOCK, Q8_0_DTYPE, QType, StoredTensor

# Elements per widened tile: 1 MiB of float32 stays in a core's L2 cache between widening and BLAS.
TILE_ELEMENTS = 1 << 18

_F16_EXP_MASK = np.uint16(0x7C00)
_F16_ABS_MASK = np.uint16(0x7FFF)
_F16_SIGN_MASK = np.uint16(0x8000)
_F32_EXP_MASK = np.uint32(0x7F800000)
_F16_TO_F32_SCALE = np.float32(2.0**112)  # rebias the fp16 exponent (15) to float32's (127)
_F16_OVERFLOW = np.float32(65536.0)  # only fp16 inf/nan land at or above this after rebiasing


class Workspace:
    """Reusable scratch buffers for widening tiles (one per model; not shared between threads)."""

    def __init__(self, elements: int = TILE_ELEMENTS) -> None:
        self.f32 = np.empty(elements, np.float32)
        self.u16 = np.empty(elements, np.uint16)
        self.u32 = np.empty(elements, np.uint32)

    def ensure(self, elements: int) -> None:
        if elements > self.f32.size:
            self.__init__(elements)  # type: ignore[misc]


def f16_bits_to_f32(bits: np.ndarray, out: np.ndarray, ws: Workspace) -> np.ndarray:
    """Exact float16 -> float32 by bit manipulation (numpy's own f16 cast is not vectorised here).

    The 15 magnitude bits shifted left by 13 form a float32 whose exponent is biased by 15 instead of 127;
    multiplying by 2**112 fixes the bias for normal and subnormal values alike.  Inf/NaN (exponent 31)
    come out >= 65536 and get the float32 all-ones exponent; then the sign bit is copied over.
    """
    n = bits.size
    tmp16, tmp32 = ws.u16[:n].reshape(bits.shape), ws.u32[:n].reshape(bits.shape)
    out32 = out.view(np.uint32)
    np.bitwise_and(bits, _F16_ABS_MASK, out=tmp16)
    np.left_shift(tmp16, 13, out=out32, dtype=np.uint32)
    np.multiply(out, _F16_TO_F32_SCALE, out=out)
    special = out >= _F16_OVERFLOW
    if special.any():
        np.bitwise_or(out32, _F32_EXP_MASK, out=out32, where=special)
    np.bitwise_and(bits, _F16_SIGN_MASK, out=tmp16)
    np.left_shift(tmp16, 16, out=tmp32, dtype=np.uint32)
    np.bitwise_or(out32, tmp32, out=out32)
    return out


def q8_0_to_f32(raw: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Decode Q8_0 rows ``[R, nb * 34]`` (uint8) into ``out`` float32 ``[R, nb * 32]``."""
    blocks = raw.view(Q8_0_DTYPE)  # [R, nb] of (d: f16, qs: 32 x i8)
    scale = blocks["d"].astype(np.float32)[..., None]  # [R, nb, 1] (1/32 of the elements: a plain cast is fine)
    np.multiply(blocks["qs"], scale, out=out.reshape(*blocks.shape, Q8_0_BLOCK))
    return out


def bf16_bits_to_f32(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """BF16 is the high half of a float32: shift the 16 bits into place."""
    np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


class Weight:
    """A stored ``[out, in]`` matrix that multiplies float32 activations."""

    def __init__(self, tensor: StoredTensor) -> None:
        if len(tensor.shape) != 2:
            raise FormatError(f"{tensor.path}: tensor {tensor.name!r} should be a matrix, got shape {tensor.shape}")
        self.name = tensor.name
        self.tensor = tensor
        self.out_features, self.in_features = tensor.shape

    @property
    def qtype(self) -> QType:
        return self.tensor.qtype

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """``x @ W.T``.  # [N, in] -> [N, out]"""
        raise NotImplementedError

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of W as float32 (embedding lookup).  # [N] -> [N, in]"""
        raise NotImplementedError

    def to_float32(self) -> np.ndarray:
        """The whole matrix as float32: the reference for tests (allocates ``out * in`` floats)."""
        return self.tensor.to_float32()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.qtype.name}, {list(self.tensor.shape)})"


class F32Weight(Weight):
    """Float32 weights used in place: BLAS reads the memory-mapped rows directly."""

    def __init__(self, tensor: StoredTensor) -> None:
        super().__init__(tensor)
        self.w = np.asarray(tensor.data)  # [out, in] view of the memory map

    def matmul(self, x: np.ndarray) -> np.ndarray:
        return np.matmul(x, self.w.T)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(self.w[ids], dtype=np.float32)


class TiledWeight(Weight):
    """BF16 / F16 / Q8_0 weights, widened ``tile_rows`` rows at a time into the shared workspace."""

    def __init__(self, tensor: StoredTensor, ws: Workspace, tile_elements: int = TILE_ELEMENTS) -> None:
        super().__init__(tensor)
        if tensor.qtype not in (QType.BF16, QType.F16, QType.Q8_0):
            raise FormatError(f"{tensor.path}: tensor {tensor.name!r}: no tiled kernel for {tensor.qtype.name}")
        raw = np.asarray(tensor.rows2d())  # [out, stored row length]
        self.raw = raw.view(np.uint16) if tensor.qtype == QType.F16 else raw  # F16 is widened from its bits
        self.ws = ws
        self.tile_rows = max(1, min(self.out_features, tile_elements // self.in_features))
        ws.ensure(self.tile_rows * self.in_features)

    def widen(self, raw_rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Decode stored rows ``[R, stored]`` into ``out`` float32 ``[R, in]``."""
        if self.qtype == QType.Q8_0:
            return q8_0_to_f32(raw_rows, out)
        if self.qtype == QType.BF16:
            return bf16_bits_to_f32(raw_rows, out)
        return f16_bits_to_f32(raw_rows, out, self.ws)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        n = x.shape[0]
        yt = np.empty((self.out_features, n), np.float32)  # [out, N]: each tile writes contiguous rows
        xt = x.T  # [in, N]
        for r0 in range(0, self.out_features, self.tile_rows):
            r1 = min(r0 + self.tile_rows, self.out_features)
            tile = self.ws.f32[: (r1 - r0) * self.in_features].reshape(r1 - r0, self.in_features)
            self.widen(self.raw[r0:r1], tile)
            np.matmul(tile, xt, out=yt[r0:r1])
        return yt.T if n == 1 else np.ascontiguousarray(yt.T)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids).reshape(-1)
        out = np.empty((ids.size, self.in_features), np.float32)
        if self.qtype == QType.F16:
            self.ws.ensure(out.size)
        return self.widen(self.raw[ids], out)


def make_weight(tensor: StoredTensor, ws: Workspace, tile_elements: int = TILE_ELEMENTS) -> Weight:
    """The weight kind for a stored matrix."""
    if tensor.qtype == QType.F32:
        return F32Weight(tensor)
    return TiledWeight(tensor, ws, tile_elements)


def load_vector(tensor: StoredTensor) -> np.ndarray:
    """A small tensor (norm weight, bias) widened once to float32."""
    return np.ascontiguousarray(tensor.to_float32(), dtype=np.float32)
