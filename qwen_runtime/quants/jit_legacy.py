"""Compiled kernels of the legacy types Q4_0, Q4_1, Q5_0 and Q5_1 (numba): the blocks of :mod:`.legacy` read in
place, no widened copy of anything.

A block of 32 values holds a float16 scale ``d`` (the ``_1`` types then a float16 minimum ``m``), for the
5-bit types a little-endian 32-bit ``qh`` with each value's bit 4, and 16 bytes ``qs``: value ``k < 16`` is
the low nibble of ``qs[k]``, value ``16 + k`` the high one.  Row ``r`` of the product keeps 32 float32 lanes
``acc[k] += w[k] * (x[b*32 + k] * d[b])`` over the blocks ``b`` (see :mod:`.jit_base`), where ``w[k]`` is the
value's integer part as float32, ``q - 8`` or ``q - 16`` for the ``_0`` types (exact); the ``_1`` types add
``m[b] * sum(x over block b)`` to a separate accumulator, the block sums computed once per product
(:meth:`LegacyJitKernel.activations`) and shared by every weight row.

Each kernel is one of the shared loops (:func:`gemv1_loop`, :func:`gemv_loop`, :func:`decode_loop`) around a
per-block step passed as an argument (numba compiles one specialization per step, inlined): ``_q4``/``_q5``
unpack the nibbles with uint8 operations (:func:`low_nibble`, :func:`high_nibble`, :func:`with_bit4`: numba's
own ``&``/``>>`` widen to 64 bits), convert to float32 and update the lanes.  Both row loops run the same
float32 operations on every row, so a row gives the same bits alone and in a batch of up to GEMV_ROWS.

Assembly (numba 0.68, this Xeon with AVX-512; ``inspect_asm``): the 1-row loop keeps the lanes in 4 ymm
registers; per block ``vmovq`` of the bytes, ``vpand``/``vgf2p8affineqb`` (the nibbles), ``vpaddb`` (Q4_0: the
``- 8`` folded into the bytes), ``vpmovsxbd``/``vpmovzxbd``, ``vcvtdq2ps``, ``vmulps`` (x * d) and
``vfmadd231ps``, all packed on ymm; Q5 adds ``vpsrlvd``/``vpmovdb``/``vpternlogq`` for bit 4.  The multi-row
loop unpacks a block once (LLVM hoists it out of the loop over rows) and per row does a packed ``vmulps`` and
``vfmadd213ps`` on lanes kept on the stack.  The Q5 decoders are packed likewise; the Q4 ones (prefill only)
compiled to scalar ``vcvtsi2ss``/``vmulss``: LLVM unrolls their short 16-step loops before it vectorizes.
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
    F16_TABLE,
    F32_1D,
    F32_2D,
    F32_2D_C,
    GEMV_ROWS,
    LANES,
    U8_2D,
    JitKernel,
    compiled,
    stack_f32,
)
from .legacy import Q4_0, Q4_1, Q5_0, Q5_1

HALF = LANES // 2

inline = numba.njit(inline="always", cache=True, fastmath={"contract"})


@intrinsic
def low_nibble(typingctx, byte):  # noqa: ARG001 (numba's intrinsic protocol)
    """``byte & 15`` as uint8 (numba's own ``&`` widens to uint64, which does not vectorize)."""
    if byte != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        return builder.and_(args[0], args[0].type(15))

    return types.uint8(types.uint8), codegen


@intrinsic
def high_nibble(typingctx, byte):  # noqa: ARG001
    """``byte >> 4`` as uint8."""
    if byte != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        return builder.lshr(args[0], args[0].type(4))

    return types.uint8(types.uint8), codegen


@intrinsic
def with_bit4(typingctx, nibble, qh, k):  # noqa: ARG001
    """``nibble | ((qh >> k) & 1) << 4`` as uint8, in 32-bit arithmetic, for the low 32 bits of ``qh`` and a lane
    ``k`` < 32."""
    if nibble != types.uint8 or not isinstance(qh, types.Integer) or not isinstance(k, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        nib, bits, lane = (_as_i32(builder, a) for a in args)
        bit = builder.and_(builder.lshr(bits, lane), bits.type(1))
        return builder.trunc(builder.or_(nib, builder.shl(bit, bits.type(4))), args[0].type)

    return types.uint8(types.uint8, qh, k), codegen


def _as_i32(builder: object, value: object) -> object:
    """An LLVM integer truncated or zero-extended to 32 bits."""
    i32 = ir.IntType(32)
    if value.type.width > 32:
        return builder.trunc(value, i32)
    return builder.zext(value, i32) if value.type.width < 32 else value


@inline
def _f16(table, blocks, at):
    """The float16 field at byte ``at`` of a stored row, exactly as float32."""
    return table[np.int64(blocks[at]) | (np.int64(blocks[at + 1]) << 8)]


@inline
def _block_at(table, blocks, b, geo):
    """(first byte, scale ``d``, minimum ``m`` or 0) of block ``b`` of a stored row; ``geo`` = (bytes per block,
    first byte of qs, bias, has a minimum)."""
    o = b * geo[0]
    return o, _f16(table, blocks, o), _f16(table, blocks, o + 2) if geo[3] else np.float32(0)


@inline
def _q4(blocks, o, geo, xs, d, a):
    """``a[k] += w[k] * (xs[k] * d)`` for the 32 values ``w`` (``q - bias``) of the 4-bit block at byte ``o``."""
    at, bias = o + geo[1], geo[2]
    for k in range(HALF):
        byte = blocks[at + k]
        a[k] += (np.float32(low_nibble(byte)) - bias) * (xs[k] * d)
        a[HALF + k] += (np.float32(high_nibble(byte)) - bias) * (xs[HALF + k] * d)


@inline
def _q5(blocks, o, geo, xs, d, a):
    """As :func:`_q4`, bit 4 of value ``k`` from bit ``k`` of the block's little-endian ``qh`` (before ``qs``)."""
    at, bias = o + geo[1], geo[2]
    qh = _u32(blocks, at - 4)
    for k in range(HALF):
        byte = blocks[at + k]
        a[k] += (np.float32(with_bit4(low_nibble(byte), qh, k)) - bias) * (xs[k] * d)
        a[HALF + k] += (np.float32(with_bit4(high_nibble(byte), qh, HALF + k)) - bias) * (xs[HALF + k] * d)


@inline
def _u32(blocks, at):
    """The little-endian 32 bits at byte ``at``."""
    return (np.uint32(blocks[at]) | (np.uint32(blocks[at + 1]) << np.uint32(8))
            | (np.uint32(blocks[at + 2]) << np.uint32(16)) | (np.uint32(blocks[at + 3]) << np.uint32(24)))


@inline
def _q4_values(blocks, o, geo, d, m, row):
    """``row[k]`` = value ``k`` of the 4-bit block at byte ``o``, as the reference computes it."""
    at, bias = o + geo[1], geo[2]
    for k in range(HALF):
        byte = blocks[at + k]
        lo, hi = np.float32(low_nibble(byte)) - bias, np.float32(high_nibble(byte)) - bias
        row[k] = d * lo + m if geo[3] else d * lo
        row[HALF + k] = d * hi + m if geo[3] else d * hi


@inline
def _q5_values(blocks, o, geo, d, m, row):
    """As :func:`_q4_values` for a 5-bit block."""
    at, bias = o + geo[1], geo[2]
    qh = _u32(blocks, at - 4)
    for k in range(HALF):
        byte = blocks[at + k]
        lo = np.float32(with_bit4(low_nibble(byte), qh, k)) - bias
        hi = np.float32(with_bit4(high_nibble(byte), qh, HALF + k)) - bias
        row[k] = d * lo + m if geo[3] else d * lo
        row[HALF + k] = d * hi + m if geo[3] else d * hi


@inline
def gemv1_loop(update, locate, geo, raw, x, sums, table, out):
    """:func:`gemv_loop` for one row, its accumulators kept in registers (the same operations)."""
    nb = x.shape[1] // LANES
    acc = carray(stack_f32(LANES), (LANES,))
    xr = x[0]
    for r in range(raw.shape[0]):
        blocks = raw[r]
        for k in range(LANES):
            acc[k] = 0
        offset = np.float32(0)
        for b in range(nb):
            o, d, m = locate(table, blocks, b, geo)
            if geo[3]:
                offset += m * sums[0, b]
            update(blocks, o, geo, xr[b * LANES: b * LANES + LANES], d, acc)
        s = np.float32(0)
        for k in range(LANES):
            s += acc[k]
        out[0, r] = s + offset


@inline
def gemv_loop(update, locate, geo, raw, x, sums, table, out):
    """``out[i, r] = x[i] @ W[r]`` for 1..GEMV_ROWS rows of blocks of 32 values, each row by the same operations
    whatever the others: ``locate`` gives a block's byte, scale and minimum, ``update`` adds its products to a
    row's lanes.  LLVM hoists the unpacking out of the loop over rows: a block is unpacked once for all rows."""
    n, nb = x.shape[0], x.shape[1] // LANES
    acc = carray(stack_f32(ACC_FLOATS), (GEMV_ROWS, LANES))
    offset = carray(stack_f32(GEMV_ROWS), (GEMV_ROWS,))
    for r in range(raw.shape[0]):
        blocks = raw[r]
        for i in range(n):
            offset[i] = 0
            for k in range(LANES):
                acc[i, k] = 0
        for b in range(nb):
            o, d, m = locate(table, blocks, b, geo)
            if geo[3]:
                for i in range(n):
                    offset[i] += m * sums[i, b]
            for i in range(n):
                update(blocks, o, geo, x[i, b * LANES: b * LANES + LANES], d, acc[i])
        for i in range(n):
            s = np.float32(0)
            for k in range(LANES):
                s += acc[i, k]
            out[i, r] = s + offset[i]


@inline
def decode_loop(values, locate, geo, raw, table, tile):
    """``tile`` [R, nb * 32] = the rows decoded by ``values`` (as the reference computes them)."""
    nb = tile.shape[1] // LANES
    for r in range(raw.shape[0]):
        blocks, row = raw[r], tile[r]
        for b in range(nb):
            o, d, m = locate(table, blocks, b, geo)
            values(blocks, o, geo, d, m, row[b * LANES: b * LANES + LANES])


GEMV = types.void(U8_2D, F32_2D_C, F32_2D_C, F32_1D, F32_2D)
DECODE = types.void(U8_2D, F32_1D, F32_2D_C)
# Block geometry as compile-time constants: bytes per block, first byte of qs, bias subtracted from q, minimum.
Q4_0_GEO = (Q4_0().type_size, Q4_0.qs_at, np.float32(Q4_0.bias), False)
Q4_1_GEO = (Q4_1().type_size, Q4_1.qs_at, np.float32(Q4_1.bias), True)
Q5_0_GEO = (Q5_0().type_size, Q5_0.qs_at, np.float32(Q5_0.bias), False)
Q5_1_GEO = (Q5_1().type_size, Q5_1.qs_at, np.float32(Q5_1.bias), True)

@compiled(GEMV)
def q4_0_gemv1(raw, x, sums, table, out):
    gemv1_loop(_q4, _block_at, Q4_0_GEO, raw, x, sums, table, out)


@compiled(GEMV)
def q4_0_gemv(raw, x, sums, table, out):
    gemv_loop(_q4, _block_at, Q4_0_GEO, raw, x, sums, table, out)


@compiled(DECODE, contract=False)
def q4_0_decode(raw, table, tile):
    decode_loop(_q4_values, _block_at, Q4_0_GEO, raw, table, tile)


@compiled(GEMV)
def q4_1_gemv1(raw, x, sums, table, out):
    gemv1_loop(_q4, _block_at, Q4_1_GEO, raw, x, sums, table, out)


@compiled(GEMV)
def q4_1_gemv(raw, x, sums, table, out):
    gemv_loop(_q4, _block_at, Q4_1_GEO, raw, x, sums, table, out)


@compiled(DECODE, contract=False)
def q4_1_decode(raw, table, tile):
    decode_loop(_q4_values, _block_at, Q4_1_GEO, raw, table, tile)


@compiled(GEMV)
def q5_0_gemv1(raw, x, sums, table, out):
    gemv1_loop(_q5, _block_at, Q5_0_GEO, raw, x, sums, table, out)


@compiled(GEMV)
def q5_0_gemv(raw, x, sums, table, out):
    gemv_loop(_q5, _block_at, Q5_0_GEO, raw, x, sums, table, out)


@compiled(DECODE, contract=False)
def q5_0_decode(raw, table, tile):
    decode_loop(_q5_values, _block_at, Q5_0_GEO, raw, table, tile)


@compiled(GEMV)
def q5_1_gemv1(raw, x, sums, table, out):
    gemv1_loop(_q5, _block_at, Q5_1_GEO, raw, x, sums, table, out)


@compiled(GEMV)
def q5_1_gemv(raw, x, sums, table, out):
    gemv_loop(_q5, _block_at, Q5_1_GEO, raw, x, sums, table, out)


@compiled(DECODE, contract=False)
def q5_1_decode(raw, table, tile):
    decode_loop(_q5_values, _block_at, Q5_1_GEO, raw, table, tile)


class LegacyJitKernel(JitKernel):
    """A legacy-type matrix: ``gemv(raw, x, sums, table, out)``, ``decode(raw, table, tile)``."""

    block = LANES
    constants = (F16_TABLE,)
    has_min = False

    def activations(self, x: np.ndarray) -> tuple:
        """Each block's sum of ``x`` [N, nb] for the types with a minimum ([N, 0] otherwise): one float32 sum per
        row and block, whatever the other rows."""
        if not self.has_min:
            return (np.empty((len(x), 0), np.float32),)
        return (np.ascontiguousarray(x.reshape(len(x), -1, LANES).sum(axis=2, dtype=np.float32)),)


class Q4_0JitKernel(LegacyJitKernel):
    qtype, type_size = QType.Q4_0, Q4_0_GEO[0]
    gemv1, gemv, decode = staticmethod(q4_0_gemv1), staticmethod(q4_0_gemv), staticmethod(q4_0_decode)


class Q4_1JitKernel(LegacyJitKernel):
    qtype, type_size, has_min = QType.Q4_1, Q4_1_GEO[0], True
    gemv1, gemv, decode = staticmethod(q4_1_gemv1), staticmethod(q4_1_gemv), staticmethod(q4_1_decode)


class Q5_0JitKernel(LegacyJitKernel):
    qtype, type_size = QType.Q5_0, Q5_0_GEO[0]
    gemv1, gemv, decode = staticmethod(q5_0_gemv1), staticmethod(q5_0_gemv), staticmethod(q5_0_decode)


class Q5_1JitKernel(LegacyJitKernel):
    qtype, type_size, has_min = QType.Q5_1, Q5_1_GEO[0], True
    gemv1, gemv, decode = staticmethod(q5_1_gemv1), staticmethod(q5_1_gemv), staticmethod(q5_1_decode)
KERNELS = (Q4_0JitKernel, Q4_1JitKernel, Q5_0JitKernel, Q5_1JitKernel)
