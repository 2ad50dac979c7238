"""What every stored type provides, and the exact float16 helpers its decoders share.

A :class:`Codec` is one GGML type: its block geometry (from ``gguf.GGML_QUANT_SIZES``), a plain
:meth:`~Codec.reference` decoder written to be read, a fast exact :meth:`~Codec.decode` of whole rows, and a
:class:`TileKernel` that multiplies float32 activations by a tile of stored rows without widening the matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import FormatError
from .scratch import Scratch

QType = GGMLQuantizationType

# Activation rows up to which quantized tiles are multiplied per block (decode, batch decode): the block dot
# products come from one batched BLAS call and are scaled afterwards; above it the tile is decoded in place
# and multiplied once (prefill).
BLOCK_SUM_ROWS = 8

F16_EXP_MASK = np.uint16(0x7C00)
_F16_ABS_MASK = np.uint16(0x7FFF)
_F16_SIGN_MASK = np.uint16(0x8000)
_F32_EXP_MASK = np.uint32(0x7F800000)
F16_TO_F32_SCALE = np.float32(2.0**112)  # rebias the fp16 exponent (15) to float32's (127)
_F16_OVERFLOW = np.float32(65536.0)  # only fp16 inf/nan land at or above this after rebiasing
_F32_SIGN_AND_LOW = np.int32(-0x70000001)  # 0x8FFFFFFF: clears bits 28-30 that sign extension filled


class TileKernel(Protocol):
    """How one stored matrix multiplies activations, a tile of rows at a time (the interface of weights.py)."""

    def prepare(self, x: np.ndarray) -> object:
        """``x`` [N, in] in the layout :meth:`product` multiplies; shared by all weights of one type."""

    def product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        """``out = x @ W[r0:r1].T`` for ``xk = prepare(x)``; ``out`` is [N, r1 - r0], any leading stride."""


@runtime_checkable
class RowTileKernel(TileKernel, Protocol):
    """A kernel that can also multiply a tile by activation rows one at a time, decoding the tile once."""

    def product_rows(self, r0: int, r1: int, xks: Sequence[object], out: np.ndarray, scratch: Scratch) -> None:
        """``out[i] = x[i] @ W[r0:r1].T`` for ``xks[i] = prepare(x[i:i+1])``, each row by the same operations
        whatever the other rows (a row's numbers may differ from :meth:`product`'s in the last bits)."""


class Codec:
    """One stored GGML type.  Subclasses set :attr:`qtype` and implement the three decoders.

    ``raw`` arguments are the stored views of :class:`~qwen_runtime.formats.tensors.StoredTensor` rows: for quantized
    types ``uint8 [R, nb * type_size]``, for F32/F16 the float array, for BF16 ``uint16`` (logical shape).
    """

    qtype: QType
    npy_dtype: np.dtype | None = None  # the block dtype an npy directory stores this type as (None: not in npy)

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def quantized(self) -> bool:
        return self.block_size > 1

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the array view holding a tensor of logical ``shape`` (bytes per row for quantized types)."""
        if not self.quantized:
            return shape
        if not shape or shape[-1] % self.block_size:
            raise FormatError(f"{self.name} needs a row length divisible by {self.block_size}, got shape {shape}")
        return (*shape[:-1], shape[-1] // self.block_size * self.type_size)

    def stored_nbytes(self, shape: tuple[int, ...]) -> int:
        itemsize = 1 if self.quantized else self.type_size
        return int(np.prod(self.stored_shape(shape), dtype=np.int64)) * itemsize

    def reference(self, raw: np.ndarray) -> np.ndarray:
        """The plain decoder: stored rows to float32 ``[R, n]``, written to follow the format, not to be fast."""
        raise NotImplementedError

    def decode(self, raw: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
        """The fast decoder: stored rows into ``out`` float32 ``[R, n]``, equal to :meth:`reference` bit for bit."""
        raise NotImplementedError

    def kernel(self, raw: np.ndarray) -> TileKernel:
        """The tile kernel of one matrix stored as ``raw`` ``[out, stored row length]``."""
        raise NotImplementedError

    def kept_bytes(self, stored_nbytes: int) -> int:
        """Anonymous memory :meth:`kernel` keeps for the life of a matrix of ``stored_nbytes`` stored bytes,
        beside the memory-mapped rows it reads (most keep nothing: their scratch is per thread)."""
        return 0

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


def f16_bits_to_f32(bits: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
    """Exact float16 -> float32 by bit manipulation (numpy's own f16 cast is not vectorised here).

    The 15 magnitude bits shifted left by 13 form a float32 whose exponent is biased by 15 instead of 127;
    multiplying by 2**112 fixes the bias for normal and subnormal values alike.  Inf/NaN (exponent 31)
    come out >= 65536 and get the float32 all-ones exponent; then the sign bit is copied over.
    """
    tmp16, tmp32 = scratch.array("f16 bits", bits.shape, np.uint16), scratch.array("f16 sign", bits.shape, np.uint32)
    out32 = out.view(np.uint32)
    np.bitwise_and(bits, _F16_ABS_MASK, out=tmp16)
    np.left_shift(tmp16, 13, out=out32, dtype=np.uint32)
    np.multiply(out, F16_TO_F32_SCALE, out=out)
    special = out >= _F16_OVERFLOW
    if special.any():
        np.bitwise_or(out32, _F32_EXP_MASK, out=out32, where=special)
    np.bitwise_and(bits, _F16_SIGN_MASK, out=tmp16)
    np.left_shift(tmp16, 16, out=tmp32, dtype=np.uint32)
    np.bitwise_or(out32, tmp32, out=out32)
    return out


def f16_bits_to_prescaled(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Finite float16 -> float32 divided by 2**112, exactly, in three plain passes (no multiply).

    Sign-extending the int16 bits to int32 and shifting left by 13 puts the sign at bit 31, the exponent
    (still biased by 15) and mantissa in place, and copies of the sign in bits 28-30, which the mask clears.
    Multiplying the activations by 2**112 instead of the weights gives exactly the same products.  Only
    for tiles without inf/NaN (exponent 31), which would come out finite here.  The widening copy, then an
    in-place shift, cost 13% less than one shift that casts as it goes (numpy buffers a casting ufunc).
    """
    out32 = out.view(np.int32)
    np.copyto(out32, bits.view(np.int16))
    np.left_shift(out32, 13, out=out32)
    np.bitwise_and(out32, _F32_SIGN_AND_LOW, out=out32)
    return out


def f16_scales(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Float16 block scales (as bits) to float32, exactly; 3 vector passes instead of numpy's scalar cast."""
    bits = np.ascontiguousarray(bits)
    out = np.empty(bits.shape, np.float32) if out is None else out
    if np.any(np.bitwise_and(bits, F16_EXP_MASK) == F16_EXP_MASK):  # inf/NaN scale: a broken tensor
        np.copyto(out, bits.view(np.float16), casting="same_kind")
        return out
    f16_bits_to_prescaled(bits, out)
    return np.multiply(out, F16_TO_F32_SCALE, out=out)


def f16_field(raw: np.ndarray) -> np.ndarray:
    """A float16 field of plain blocks as float32: ``[..., 2]`` uint8 -> ``[...]`` (for references)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)
