"""Compiled kernels of the dense 16-bit types F16 and BF16 (numba): the stored rows read in place as uint16.

Row ``r`` of the product keeps 32 float32 lanes ``acc[k] += f32(w[c + k]) * x[c + k]`` over the row's chunks of
32 columns ``c`` (a last partial chunk in the first lanes), summed once at the end (see :mod:`.jit_base`).
The widening is exact: BF16 bits shifted into the high half of a uint32 and reinterpreted, F16 bits
reinterpreted as LLVM ``half`` and extended (the hardware conversion; a signalling NaN comes out quiet, its
payload otherwise kept, where numpy keeps it signalling — still a NaN).

Assembly (numba 0.68, this Xeon with AVX-512 and F16C): in the column loop F16 widens with packed
``vcvtph2ps`` on ymm, BF16 with packed ``vpmovzxwd`` + ``vpslld``; both accumulate with packed
``vfmadd231ps`` on ymm.  The multi-row kernel converts a chunk once for all rows (hoisted out of the row loop).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from .base import QType
from .jit_base import (
    ACC_FLOATS,
    F32_2D,
    F32_2D_C,
    GEMV_ROWS,
    LANES,
    U16_2D,
    JitKernel,
    compiled,
    prefetch,
    stack_f32,
)

inline = numba.njit(inline="always", cache=True, fastmath={"contract"})  # steps inlined into the kernels


@intrinsic
def f16_to_f32(typingctx, bits):  # noqa: ARG001 (numba's intrinsic protocol)
    """The float16 whose bits are the uint16 ``bits``, as float32 (exact)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def bf16_to_f32(typingctx, bits):  # noqa: ARG001
    """The bfloat16 whose bits are the uint16 ``bits``, as float32 (exact: the high half of its bits)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.IntType(32)(16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(types.uint16), codegen


@inline
def gemv1_loop(widen, raw, x, out):
    """``out[0, r] = x[0] @ W[r]``: one activation row, the lanes in registers."""
    n = x.shape[1]
    full = n - n % LANES
    acc = carray(stack_f32(LANES), (LANES,))
    xr = x[0]
    for r in range(raw.shape[0]):
        w = raw[r]
        for k in range(LANES):
            acc[k] = 0
        for c in range(0, full, LANES):
            prefetch(w, c)
            for k in range(LANES):
                acc[k] += widen(w[c + k]) * xr[c + k]
        for k in range(n - full):
            acc[k] += widen(w[full + k]) * xr[full + k]
        s = np.float32(0)
        for k in range(LANES):
            s += acc[k]
        out[0, r] = s


@inline
def gemv_loop(widen, raw, x, out):
    """``out[i, r] = x[i] @ W[r]`` for 1..GEMV_ROWS rows, each by :func:`gemv1_loop`'s operations."""
    m, n = x.shape
    full = n - n % LANES
    acc = carray(stack_f32(ACC_FLOATS), (GEMV_ROWS, LANES))
    for r in range(raw.shape[0]):
        w = raw[r]
        for i in range(m):
            for k in range(LANES):
                acc[i, k] = 0
        for c in range(0, full, LANES):
            prefetch(w, c)
            for i in range(m):
                a, xs = acc[i], x[i]
                for k in range(LANES):
                    a[k] += widen(w[c + k]) * xs[c + k]
        for i in range(m):
            a, xs = acc[i], x[i]
            for k in range(n - full):
                a[k] += widen(w[full + k]) * xs[full + k]
            s = np.float32(0)
            for k in range(LANES):
                s += a[k]
            out[i, r] = s


@inline
def decode_loop(widen, raw, tile):
    """``tile`` [R, n] = the rows widened to float32."""
    for r in range(raw.shape[0]):
        w, row = raw[r], tile[r]
        for k in range(raw.shape[1]):
            row[k] = widen(w[k])


GEMV = types.void(U16_2D, F32_2D_C, F32_2D)
DECODE = types.void(U16_2D, F32_2D_C)


@compiled(GEMV)
def f16_gemv1(raw, x, out):
    gemv1_loop(f16_to_f32, raw, x, out)


@compiled(GEMV)
def f16_gemv(raw, x, out):
    gemv_loop(f16_to_f32, raw, x, out)


@compiled(DECODE)
def f16_decode(raw, tile):
    decode_loop(f16_to_f32, raw, tile)


@compiled(GEMV)
def bf16_gemv1(raw, x, out):
    gemv1_loop(bf16_to_f32, raw, x, out)


@compiled(GEMV)
def bf16_gemv(raw, x, out):
    gemv_loop(bf16_to_f32, raw, x, out)


@compiled(DECODE)
def bf16_decode(raw, tile):
    decode_loop(bf16_to_f32, raw, tile)


class Dense16JitKernel(JitKernel):
    """A 16-bit dense matrix, stored rows viewed as uint16 (one element per "block")."""

    block = 1

    def stored_unit(self) -> int:
        return 1

    def stored(self, raw: np.ndarray) -> np.ndarray:
        return raw.view(np.uint16)


class F16JitKernel(Dense16JitKernel):
    qtype, type_size = QType.F16, 2
    gemv1, gemv, decode = staticmethod(f16_gemv1), staticmethod(f16_gemv), staticmethod(f16_decode)


class BF16JitKernel(Dense16JitKernel):
    qtype, type_size = QType.BF16, 2
    gemv1, gemv, decode = staticmethod(bf16_gemv1), staticmethod(bf16_gemv), staticmethod(bf16_decode)


KERNELS = (F16JitKernel, BF16JitKernel)
