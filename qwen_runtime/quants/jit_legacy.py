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
per-block step passed as an argument (numba compiles one specialization per step, inlined).  The steps are
small LLVM intrinsics on explicit ``<16 x ...>`` vectors (:func:`nibbles_fma`, :func:`nibbles_decode`): the
16 quant bytes loaded once, nibbles and Q5's bit 4 unpacked in int8/int32 vector arithmetic (numba's own
``&``/``>>`` widen scalars to 64 bits and did not vectorize), converted to float32 and fused into the lanes
with ``llvm.fma``; Q4_0's row kernels keep an equivalent scalar-lane step (:func:`_q4_lanes`, see there).
Both row loops run the same float32 operations on every row, so a row gives the same bits alone and in a
batch of up to GEMV_ROWS; the decoders round ``d * w`` and ``+ m`` separately, as the reference.

Assembly (numba 0.68, this Xeon with AVX-512; ``inspect_asm``): per block one 16-byte load, ``vpand`` and
``vgf2p8affineqb`` (the nibbles), ``vpaddb`` (Q4_0's ``- 8`` in int8), ``vpmovsxbd``/``vpmovzxbd``,
``vcvtdq2ps``, ``vmulps`` (x * d) and ``vfmadd...ps`` on zmm (Q4_0's row kernels: the same on 4 ymm), Q5 adds
``vpsrlvd``/``vpmovdb``/``vpternlogq`` for bit 4; the 1-row loop keeps the lanes in registers, the multi-row
loop unpacks a block once (hoisted out of the loop over rows) and per row does ``vmulps`` and
``vfmadd213ps``.  The decoders are packed likewise (``vcvtdq2ps``, ``vmulps``, ``vaddps``).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from .base import QType
from .iq4 import IQ4_LEVELS
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
    prefetch,
    stack_f32,
)
from .legacy import Q4_0, Q4_1, Q5_0, Q5_1

HALF = LANES // 2
NEGATIVE_ZERO = np.float32(-0.0)
X86 = llvm.get_process_triple().startswith(("x86_64", "i386", "i686"))  # pshufb for the IQ4 levels

inline = numba.njit(inline="always", cache=True, fastmath={"contract"})
I8, I32, F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
V16_I8, V16_I32, V16_F32 = ir.VectorType(I8, HALF), ir.VectorType(I32, HALF), ir.VectorType(F32, HALF)


def _splat(builder: ir.IRBuilder, value: ir.Value, vector: ir.VectorType) -> ir.Value:
    """``value`` in every element of ``vector``."""
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, I32(0))
    return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined), ir.Constant(V16_I32, [0] * HALF))


def _data(context: object, builder: ir.IRBuilder, array_type: types.Array, array: ir.Value) -> ir.Value:
    return context.make_array(array_type)(context, builder, array).data


def _values(context: object, builder: ir.IRBuilder, signature: object, args: list, levels: bool) -> list:
    """The two halves (values 0-15, 16-31) of a block as ``<16 x float>``: from the 16 bytes at ``args[1]`` of
    the row ``args[0]``, low then high nibbles, bit 4 from ``args[2]`` (a uint32, or None), then ``- bias``
    (``args[3]``) in int8 or the IQ4 level of the index (pshufb on x86, a select chain elsewhere)."""
    blocks, at, qh, bias = args[:4]
    source = builder.bitcast(builder.gep(_data(context, builder, signature.args[0], blocks), [at]),
                             V16_I8.as_pointer())
    q = builder.load(source, align=1)
    halves = [builder.and_(q, ir.Constant(V16_I8, [15] * HALF)), builder.lshr(q, ir.Constant(V16_I8, [4] * HALF))]
    if signature.args[2] != types.none:
        bits = _splat(builder, builder.trunc(qh, I32) if qh.type.width > 32 else builder.zext(qh, I32)
                      if qh.type.width < 32 else qh, V16_I32)
        for h in range(2):
            bit = builder.lshr(bits, ir.Constant(V16_I32, list(range(HALF * h, HALF * h + HALF))))
            bit = builder.shl(builder.and_(bit, ir.Constant(V16_I32, [1] * HALF)), ir.Constant(V16_I32, [4] * HALF))
            halves[h] = builder.or_(halves[h], builder.trunc(bit, V16_I8))
    if levels:
        halves = [_levels(builder, h) for h in halves]
    else:
        offset = _splat(builder, builder.trunc(bias, I8), V16_I8)
        halves = [builder.sub(h, offset) for h in halves]
    return [builder.sitofp(h, V16_F32) for h in halves]


def _levels(builder: ir.IRBuilder, index: ir.Value) -> ir.Value:
    """``IQ4_LEVELS[index]`` for 16 int8 indices (0..15)."""
    if X86:
        pshufb = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16_I8, [V16_I8, V16_I8]),
                                                "llvm.x86.ssse3.pshuf.b.128")
        return builder.call(pshufb, [ir.Constant(V16_I8, [int(v) for v in IQ4_LEVELS]), index])
    out = ir.Constant(V16_I8, [0] * HALF)
    for j, level in enumerate(IQ4_LEVELS):
        hit = builder.icmp_unsigned("==", index, ir.Constant(V16_I8, [j] * HALF))
        out = builder.select(hit, ir.Constant(V16_I8, [int(level)] * HALF), out)
    return out


def _lanes_fma(levels: bool) -> object:
    """An intrinsic ``(blocks, at, qh, bias, xs, d, acc)``: ``acc[k] = fma(w[k], xs[k] * d, acc[k])`` for the
    32 values ``w`` of the block whose 16 quant bytes start at ``blocks[at]`` (see :func:`_values`)."""

    @intrinsic
    def lanes_fma(typingctx, blocks, at, qh, bias, xs, d, acc):  # noqa: ARG001 (numba's intrinsic protocol)
        def codegen(context, builder, signature, args):
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16_F32, [V16_F32] * 3),
                                                 "llvm.fma.v16f32")
            xs_at = builder.bitcast(_data(context, builder, signature.args[4], args[4]), V16_F32.as_pointer())
            acc_at = builder.bitcast(_data(context, builder, signature.args[6], args[6]), V16_F32.as_pointer())
            scale = _splat(builder, args[5], V16_F32)
            for h, w in enumerate(_values(context, builder, signature, args, levels)):
                x = builder.load(builder.gep(xs_at, [I32(h)]), align=4)
                lanes = builder.gep(acc_at, [I32(h)])
                builder.store(builder.call(fma, [w, builder.fmul(x, scale), builder.load(lanes, align=4)]), lanes,
                              align=4)
            return context.get_dummy_value()

        return types.void(blocks, at, qh, bias, xs, d, acc), codegen

    return lanes_fma


def _lanes_decode(levels: bool) -> object:
    """An intrinsic ``(blocks, at, qh, bias, d, start, out)``: ``out[k] = w[k] * d + start``, rounded after the
    product and after the sum as the reference (``start``: the minimum, or -0.0: -0.0 + y is y)."""

    @intrinsic
    def lanes_decode(typingctx, blocks, at, qh, bias, d, start, out):  # noqa: ARG001
        def codegen(context, builder, signature, args):
            out_at = builder.bitcast(_data(context, builder, signature.args[6], args[6]), V16_F32.as_pointer())
            scale, first = _splat(builder, args[4], V16_F32), _splat(builder, args[5], V16_F32)
            for h, w in enumerate(_values(context, builder, signature, args, levels)):
                builder.store(builder.fadd(builder.fmul(w, scale), first), builder.gep(out_at, [I32(h)]), align=4)
            return context.get_dummy_value()

        return types.void(blocks, at, qh, bias, d, start, out), codegen

    return lanes_decode


nibbles_fma, nibbles_decode = _lanes_fma(levels=False), _lanes_decode(levels=False)
levels_fma, levels_decode = _lanes_fma(levels=True), _lanes_decode(levels=True)


@intrinsic
def low_nibble(typingctx, byte):  # noqa: ARG001
    """``byte & 15`` as int8 (numba's own ``&`` widens to 64 bits, which does not vectorize)."""
    if byte != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        return builder.and_(args[0], args[0].type(15))

    return types.int8(types.uint8), codegen


@intrinsic
def high_nibble(typingctx, byte):  # noqa: ARG001
    """``byte >> 4`` as int8."""
    if byte != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        return builder.lshr(args[0], args[0].type(4))

    return types.int8(types.uint8), codegen


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
def _u32(blocks, at):
    """The little-endian 32 bits at byte ``at``."""
    return (np.uint32(blocks[at]) | (np.uint32(blocks[at + 1]) << np.uint32(8))
            | (np.uint32(blocks[at + 2]) << np.uint32(16)) | (np.uint32(blocks[at + 3]) << np.uint32(24)))


@inline
def _q4(blocks, o, geo, xs, d, a):
    """``a[k] += w[k] * (xs[k] * d)`` for the 32 values ``w`` (``q - bias``) of the 4-bit block at byte ``o``."""
    nibbles_fma(blocks, o + geo[1], None, geo[2], xs, d, a)


@inline
def _q4_lanes(blocks, o, geo, xs, d, a):
    """:func:`_q4` written as 16 steps on float32 scalars (LLVM vectorizes them; the same values and rounding).
    Q4_0's row kernels use it: with :func:`_q4` LLVM unrolls Q4_0's block loop twice and the 1-row product
    took 1.5x the CPU time (0.213 against 0.144 ms per million weights, A/B in one process)."""
    at, bias = o + geo[1], np.float32(geo[2])
    for k in range(HALF):
        byte = blocks[at + k]
        a[k] += (np.float32(low_nibble(byte)) - bias) * (xs[k] * d)
        a[HALF + k] += (np.float32(high_nibble(byte)) - bias) * (xs[HALF + k] * d)


@inline
def _q5(blocks, o, geo, xs, d, a):
    """As :func:`_q4`, bit 4 of value ``k`` from bit ``k`` of the block's little-endian ``qh`` (before ``qs``)."""
    nibbles_fma(blocks, o + geo[1], _u32(blocks, o + geo[1] - 4), geo[2], xs, d, a)


@inline
def _q4_values(blocks, o, geo, d, start, out):
    """``out[k]`` = value ``k`` of the 4-bit block at byte ``o`` plus ``start``, as the reference rounds it."""
    nibbles_decode(blocks, o + geo[1], None, geo[2], d, start, out)


@inline
def _q5_values(blocks, o, geo, d, start, out):
    """As :func:`_q4_values` for a 5-bit block."""
    nibbles_decode(blocks, o + geo[1], _u32(blocks, o + geo[1] - 4), geo[2], d, start, out)


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
            prefetch(blocks, o)
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
            prefetch(blocks, o)
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
    """``tile`` [R, nb * 32] = the rows decoded as the reference computes them: ``d * w`` or ``d * w + m``."""
    nb = tile.shape[1] // LANES
    for r in range(raw.shape[0]):
        blocks, row = raw[r], tile[r]
        for b in range(nb):
            o, d, m = locate(table, blocks, b, geo)
            values(blocks, o, geo, d, m if geo[3] else NEGATIVE_ZERO, row[b * LANES: b * LANES + LANES])


GEMV = types.void(U8_2D, F32_2D_C, F32_2D_C, F32_1D, F32_2D)
DECODE = types.void(U8_2D, F32_1D, F32_2D_C)
# Block geometry as compile-time constants: bytes per block, first byte of qs, bias subtracted from q, minimum.
Q4_0_GEO = (Q4_0().type_size, Q4_0.qs_at, Q4_0.bias, False)
Q4_1_GEO = (Q4_1().type_size, Q4_1.qs_at, Q4_1.bias, True)
Q5_0_GEO = (Q5_0().type_size, Q5_0.qs_at, Q5_0.bias, False)
Q5_1_GEO = (Q5_1().type_size, Q5_1.qs_at, Q5_1.bias, True)

@compiled(GEMV)
def q4_0_gemv1(raw, x, sums, table, out):
    gemv1_loop(_q4_lanes, _block_at, Q4_0_GEO, raw, x, sums, table, out)


@compiled(GEMV)
def q4_0_gemv(raw, x, sums, table, out):
    gemv_loop(_q4_lanes, _block_at, Q4_0_GEO, raw, x, sums, table, out)


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
