"""Compiled F16 and BF16 kernels (numba): the stored 16-bit values widened in registers, never in memory.

Lane ``k`` of a row adds ``w[32g + k] * x[32g + k]`` for every group ``g`` of 32 columns (the last, partial
group into the first lanes).  BF16 is the high half of a float32; float16 is widened exactly by bit
manipulation (:func:`f16_to_f32`: numba has no float16 type, and a table lookup per weight would be a gather).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import carray, types

from .jit_base import (
    ACC_FLOATS,
    F32_2D,
    F32_2D_C,
    GEMV_ROWS,
    LANES,
    U16_2D,
    JitKernel,
    bits_to_f32,
    compiled,
    stack_f32,
)

F16_MAGNITUDE, F16_EXPONENT, F16_SIGN = np.uint32(0x7FFF), np.uint32(0x7C00), np.uint32(0x8000)
F32_EXPONENT = np.uint32(0x7F800000)
F16_REBIAS = np.float32(2.0**112)  # fp16's exponent bias (15) to float32's (127)


@numba.njit(inline="always")
def f16_to_f32(h):
    """The float16 with bits ``h`` (uint16) as float32, exactly: the magnitude bits shifted into place form a
    float32 biased by 15 instead of 127, which ``* 2**112`` fixes for normal and subnormal values alike;
    inf/NaN (exponent 31) get float32's all-ones exponent; the sign is applied last (-0 stays -0)."""
    bits = np.uint32(h)
    magnitude = (bits & F16_MAGNITUDE) << np.uint32(13)
    value = bits_to_f32(magnitude) * F16_REBIAS
    if bits & F16_EXPONENT == F16_EXPONENT:
        value = bits_to_f32(magnitude | F32_EXPONENT)
    return -value if bits & F16_SIGN else value


@numba.njit(inline="always")
def widen(h, bf16):
    """A stored 16-bit value as float32: BF16 (``bf16``) or F16."""
    if bf16:
        return bits_to_f32(np.uint32(h) << np.uint32(16))
    return f16_to_f32(h)


@numba.njit(inline="always")
def dense_gemv(raw, x, out, bf16, one_row):
    """``out[i, r] = x[i] @ W[r]`` for 16-bit rows ``raw`` [R, n]; ``one_row``: a single activation row."""
    n, cols = x.shape[0], x.shape[1]
    full = cols - cols % 32
    acc = carray(stack_f32(ACC_FLOATS), (GEMV_ROWS, LANES))
    lanes = carray(stack_f32(LANES), (LANES,))
    rows = 1 if one_row else n
    for r in range(raw.shape[0]):
        w = raw[r]
        for k in range(32):
            lanes[k] = 0
        for i in range(rows):
            for k in range(32):
                acc[i, k] = 0
        for g in range(0, full, 32):
            ws = w[g: g + 32]
            if one_row:
                xs = x[0, g: g + 32]
                for k in range(32):
                    lanes[k] += widen(ws[k], bf16) * xs[k]
                continue
            for i in range(rows):
                xs = x[i, g: g + 32]
                a = acc[i]
                for k in range(32):
                    a[k] += widen(ws[k], bf16) * xs[k]
        for i in range(rows):
            a = lanes if one_row else acc[i]
            for k in range(cols - full):
                a[k] += widen(w[full + k], bf16) * x[i, full + k]
            s = np.float32(0)
            for k in range(32):
                s += a[k]
            out[i, r] = s


@numba.njit(inline="always")
def dense_decode(raw, tile, bf16):
    for r in range(raw.shape[0]):
        w, row = raw[r], tile[r]
        for k in range(tile.shape[1]):
            row[k] = widen(w[k], bf16)


GEMV = types.void(U16_2D, F32_2D_C, F32_2D)
DECODE = types.void(U16_2D, F32_2D_C)


@compiled(GEMV)
def f16_gemv(raw, x, out):
    dense_gemv(raw, x, out, False, False)


@compiled(GEMV)
def f16_gemv1(raw, x, out):
    dense_gemv(raw, x, out, False, True)


@compiled(DECODE)
def f16_decode(raw, tile):
    dense_decode(raw, tile, False)


@compiled(GEMV)
def bf16_gemv(raw, x, out):
    dense_gemv(raw, x, out, True, False)


@compiled(GEMV)
def bf16_gemv1(raw, x, out):
    dense_gemv(raw, x, out, True, True)


@compiled(DECODE)
def bf16_decode(raw, tile):
    dense_decode(raw, tile, True)


class DenseJitKernel(JitKernel):
    """A 16-bit matrix: stored rows ``[R, n]`` (float16 or uint16), taken as uint16."""

    block, type_size = 1, 2

    def stored_unit(self) -> int:
        return 1

    def stored(self, raw: np.ndarray) -> np.ndarray:
        return raw.view(np.uint16)


class F16JitKernel(DenseJitKernel):
    gemv1, gemv, decode = staticmethod(f16_gemv1), staticmethod(f16_gemv), staticmethod(f16_decode)


class BF16JitKernel(DenseJitKernel):
    gemv1, gemv, decode = staticmethod(bf16_gemv1), staticmethod(bf16_gemv), staticmethod(bf16_decode)
