"""Compiled kernels of the legacy types Q4_0, Q4_1, Q5_0 and Q5_1 (numba): the blocks of :mod:`.legacy` read in
place, no widened copy of anything.

A block of 32 values holds a float16 scale ``d`` (the ``_1`` types then a float16 minimum ``m``), for the
5-bit types a little-endian 32-bit ``qh`` with each value's bit 4, and 16 bytes ``qs``: value ``k < 16`` is
the low nibble of ``qs[k]``, value ``16 + k`` the high one.  Row ``i`` of the product keeps 32 float32 lanes
``acc[k] = fma(d[b] * w[k], x[i, b*32 + k], acc[k])`` over the blocks ``b`` (see :mod:`.base`), where
``w[k]`` is the value's integer part, ``q - 8`` or ``q - 16`` for the ``_0`` types: ``d * w`` is exact (an
11-bit significand times at most 5 bits); the ``_1`` types add ``m[b] * sum(x over block b)`` to one scalar
per row, the block sums computed once per product (:meth:`.base.BlockSumsKernel.activations`) and shared by every
weight row.

Each kernel is the shared loop :func:`.base.group_loop` (one group of rows, run by :func:`.base.gemv1_rows` and
:func:`.base.gemv_groups`) or :func:`decode_loop` around a per-block step passed as an argument (numba
compiles one specialization per step, inlined).  The steps are small LLVM intrinsics on explicit
``<16 x ...>`` vectors (:func:`nibbles_rows`, :func:`nibbles_decode`): the 16 quant bytes loaded once, nibbles
and Q5's bit 4 unpacked in int8/int32 vector arithmetic (numba's own ``&``/``>>`` widen scalars to 64 bits
and did not vectorize), converted to float32, multiplied by ``d`` once for the group and fused into each
row's lanes with ``llvm.fma``.  A row gives the same bits alone and in a batch of up to GEMV_ROWS; the
decoders round ``d * w`` and ``+ m`` separately, as the reference.

Assembly (numba 0.68, this Xeon with AVX-512; ``inspect_asm``): per block one 16-byte load, ``vpand`` and
``vgf2p8affineqb`` (the nibbles), ``vpaddb`` (the ``_0`` types' bias in int8), ``vpmovsxbd``/``vpmovzxbd``,
``vcvtdq2ps``, two ``vmulps`` (d * w), then per row of the group two ``vfmadd231ps`` with the activations as
memory operands into zmm accumulators held in registers (the ``_1`` types' per-row offsets in xmm registers,
``vfmadd231ss``); Q5 adds two ``kmovw`` from ``qh`` and two masked byte moves for bit 4 (:func:`bit4_bytes`).
The decoders are packed likewise (``vcvtdq2ps``, ``vmulps``, ``vaddps``).  With AVX-512F, groups of up to
``TABLE_ROWS`` rows look the weights up instead (:func:`_looked_up`): per block two ``vmulps`` make the tables of
``d * (j - bias)``, then ``vpmovzxbd`` from memory, one ``vpsrld`` and ``vpermps`` per 16 weights (Q5's bit 4 a
masked second ``vpermps`` from ``kmovw``): the same products, the same bits.  These loops replaced ones that kept
each row's lanes in a stack array indexed by the row (``acc += w * (x * d)``), faster for every type and row
count (docs/performance.md).
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...quants.base import QType
from ...quants.iq4 import IQ4_LEVELS
from ...quants.legacy import Q4_0, Q4_1, Q5_0, Q5_1
from .base import (
    HALF,
    I8,
    I32,
    LANES,
    PAIR,
    PERMUTE,
    SUMS_GEMV,
    TABLE_DECODE,
    TABLE_ROWS,
    V16_F32,
    V16_I8,
    V16_I32,
    BlockSumsKernel,
    block_at,
    compiled,
    gemv1_rows,
    gemv_groups,
    group_loop,
    inline,
    level_table,
    levels_of,
    look_up,
    nibble_indices,
    row_cfunc,
    rows_fma,
    splat,
    sums_product,
)

NEGATIVE_ZERO = np.float32(-0.0)
X86 = llvm.get_process_triple().startswith(("x86_64", "i386", "i686"))  # pshufb for the IQ4 levels



def _data(context: object, builder: ir.IRBuilder, array_type: types.Array, array: ir.Value) -> ir.Value:
    return context.make_array(array_type)(context, builder, array).data


def bit4_bytes(builder: ir.IRBuilder, qh: ir.Value, first: int, count: int) -> ir.Value:
    """Bit 4 of values ``first .. first + count - 1`` of a 5-bit block (``<count x i8>``, 16 or 0) from those bits
    of ``qh`` (an integer): the bits taken as an ``<i1>`` mask, so that AVX-512 selects the bytes by a mask register
    (``kmovw``/``kmovd`` straight from the block, a masked byte operation) instead of shifting 32 int32 lanes and
    narrowing them (``vpsrlvd``/``vpmovdb``), which made the Q5 kernels faster, float and 8-bit alike
    (docs/performance.md)."""
    width = first + count
    bits = builder.trunc(qh, ir.IntType(width)) if qh.type.width > width else \
        builder.zext(qh, ir.IntType(width)) if qh.type.width < width else qh
    if first:
        bits = builder.trunc(builder.lshr(bits, ir.Constant(bits.type, first)), ir.IntType(count))
    vector = ir.VectorType(I8, count)
    return builder.select(builder.bitcast(bits, ir.VectorType(ir.IntType(1), count)),
                          ir.Constant(vector, [16] * count), ir.Constant(vector, [0] * count))


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
        halves = [builder.or_(h, bit4_bytes(builder, qh, k, HALF)) for h, k in zip(halves, (0, HALF), strict=True)]
    if levels:
        halves = [_levels(builder, h) for h in halves]
    else:
        offset = splat(builder, builder.trunc(bias, I8), V16_I8)
        halves = [builder.sub(h, offset) for h in halves]
    return [builder.sitofp(h, V16_F32) for h in halves]


def _looked_up(context: object, builder: ir.IRBuilder, signature: object, args: list, levels: bool) -> list:
    """:func:`_values` times the block's scale ``args[4]``, looked up (:func:`.base.look_up`) in a table of
    ``d * (j - bias)`` (``d * IQ4_LEVELS[j]``; ``j`` 16..31 in a second table for bit 4) by the 16 bytes
    zero-extended to int32 straight from memory, the high nibbles by one shift: the same products, each rounded
    once, without a conversion and a multiplication per 16 weights."""
    blocks, at, qh, bias = args[:4]
    source = builder.bitcast(builder.gep(_data(context, builder, signature.args[0], blocks), [at]),
                             V16_I8.as_pointer())
    five = signature.args[2] != types.none
    if levels:
        tables = [level_table(builder, args[4], levels_of(IQ4_LEVELS))]
    else:
        offset = splat(builder, builder.trunc(bias, I32), V16_I32)
        first = [ir.Constant(V16_I32, list(range(16 * t, 16 * t + HALF))) for t in range(2 if five else 1)]
        tables = [level_table(builder, args[4], builder.sitofp(builder.sub(j, offset), V16_F32)) for j in first]
    w = []
    for h, index in enumerate(nibble_indices(builder, source)):
        high = None
        if five:
            bits = builder.trunc(builder.lshr(qh, ir.Constant(qh.type, HALF * h)), ir.IntType(HALF))
            high = builder.bitcast(bits, ir.VectorType(ir.IntType(1), HALF))
        w.append(look_up(builder, index, tables, high))
    return w


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


def _lanes_rows(levels: bool) -> object:
    """An intrinsic ``(blocks, at, qh, bias, d, x, i0, col, rows, acc)``: ``acc[i, k] = fma(d * w[k], x[i0 + i,
    col + k], acc[i, k])`` for ``i < rows`` (a literal) and the 32 values ``w`` of the block whose 16 quant bytes
    start at ``blocks[at]`` (see :func:`_values`; ``d * w`` is exact)."""

    @intrinsic
    def lanes_rows(typingctx, blocks, at, qh, bias, d, x, i0, col, rows, acc):  # noqa: ARG001 (numba's protocol)
        if not isinstance(rows, types.IntegerLiteral):
            return None
        count = rows.literal_value

        def codegen(context, builder, signature, args):
            if PERMUTE and count <= TABLE_ROWS:
                w = _looked_up(context, builder, signature, args, levels)
            else:
                scale = splat(builder, args[4], V16_F32)
                w = [builder.fmul(v, scale) for v in _values(context, builder, signature, args, levels)]
            rows_fma(context, builder, signature.args[5], args[5], args[6], args[7], count, args[9], w)
            return context.get_dummy_value()

        return types.void(blocks, at, qh, bias, d, x, i0, col, rows, acc), codegen

    return lanes_rows


def _lanes_decode(levels: bool) -> object:
    """An intrinsic ``(blocks, at, qh, bias, d, start, out)``: ``out[k] = w[k] * d + start``, rounded after the
    product and after the sum as the reference (``start``: the minimum, or -0.0: -0.0 + y is y)."""

    @intrinsic
    def lanes_decode(typingctx, blocks, at, qh, bias, d, start, out):  # noqa: ARG001
        def codegen(context, builder, signature, args):
            out_at = builder.bitcast(_data(context, builder, signature.args[6], args[6]), V16_F32.as_pointer())
            scale, first = splat(builder, args[4], V16_F32), splat(builder, args[5], V16_F32)
            for h, w in enumerate(_values(context, builder, signature, args, levels)):
                builder.store(builder.fadd(builder.fmul(w, scale), first), builder.gep(out_at, [I32(h)]), align=4)
            return context.get_dummy_value()

        return types.void(blocks, at, qh, bias, d, start, out), codegen

    return lanes_decode


nibbles_rows, nibbles_decode = _lanes_rows(levels=False), _lanes_decode(levels=False)
levels_rows, levels_decode = _lanes_rows(levels=True), _lanes_decode(levels=True)


@inline
def _u32(blocks, at):
    """The little-endian 32 bits at byte ``at``."""
    return (np.uint32(blocks[at]) | (np.uint32(blocks[at + 1]) << np.uint32(8))
            | (np.uint32(blocks[at + 2]) << np.uint32(16)) | (np.uint32(blocks[at + 3]) << np.uint32(24)))


@inline
def _q4(blocks, o, geo, d, x, i0, col, rows, acc):
    """``acc[i, k] = fma(d * w[k], x[i0 + i, col + k], acc[i, k])`` for the 32 values ``w`` (``q - bias``) of the
    4-bit block at byte ``o``."""
    nibbles_rows(blocks, o + geo[1], None, geo[2], d, x, i0, col, rows, acc)


@inline
def _q5(blocks, o, geo, d, x, i0, col, rows, acc):
    """As :func:`_q4`, bit 4 of value ``k`` from bit ``k`` of the block's little-endian ``qh`` (before ``qs``)."""
    nibbles_rows(blocks, o + geo[1], _u32(blocks, o + geo[1] - 4), geo[2], d, x, i0, col, rows, acc)


@inline
def _q4_values(blocks, o, geo, d, start, out):
    """``out[k]`` = value ``k`` of the 4-bit block at byte ``o`` plus ``start``, as the reference rounds it."""
    nibbles_decode(blocks, o + geo[1], None, geo[2], d, start, out)


@inline
def _q5_values(blocks, o, geo, d, start, out):
    """As :func:`_q4_values` for a 5-bit block."""
    nibbles_decode(blocks, o + geo[1], _u32(blocks, o + geo[1] - 4), geo[2], d, start, out)


@inline
def decode_loop(values, locate, geo, raw, table, tile):
    """``tile`` [R, nb * 32] = the rows decoded as the reference computes them: ``d * w`` or ``d * w + m``."""
    nb = tile.shape[1] // LANES
    for r in range(raw.shape[0]):
        blocks, row = raw[r], tile[r]
        for b in range(nb):
            o, d, m = locate(table, blocks, b, geo)
            values(blocks, o, geo, d, m if geo[3] else NEGATIVE_ZERO, row[b * LANES: b * LANES + LANES])


# Block geometry as compile-time constants: bytes per block, first byte of qs, bias subtracted from q, minimum.
Q4_0_GEO = (Q4_0().type_size, Q4_0.qs_at, Q4_0.bias, False)
Q4_1_GEO = (Q4_1().type_size, Q4_1.qs_at, Q4_1.bias, True)
Q5_0_GEO = (Q5_0().type_size, Q5_0.qs_at, Q5_0.bias, False)
Q5_1_GEO = (Q5_1().type_size, Q5_1.qs_at, Q5_1.bias, True)

@inline
def q4_0_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_q4, block_at, Q4_0_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def q4_0_gemv1(raw, x, sums, table, out):
    gemv1_rows(q4_0_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def q4_0_gemv(raw, x, sums, table, out):
    gemv_groups(q4_0_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def q4_0_decode(raw, table, tile):
    decode_loop(_q4_values, block_at, Q4_0_GEO, raw, table, tile)


@inline
def q4_1_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_q4, block_at, Q4_1_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def q4_1_gemv1(raw, x, sums, table, out):
    gemv1_rows(q4_1_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def q4_1_gemv(raw, x, sums, table, out):
    gemv_groups(q4_1_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def q4_1_decode(raw, table, tile):
    decode_loop(_q4_values, block_at, Q4_1_GEO, raw, table, tile)


@inline
def q5_0_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_q5, block_at, Q5_0_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def q5_0_gemv1(raw, x, sums, table, out):
    gemv1_rows(q5_0_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def q5_0_gemv(raw, x, sums, table, out):
    gemv_groups(q5_0_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def q5_0_decode(raw, table, tile):
    decode_loop(_q5_values, block_at, Q5_0_GEO, raw, table, tile)


@inline
def q5_1_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_q5, block_at, Q5_1_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def q5_1_gemv1(raw, x, sums, table, out):
    gemv1_rows(q5_1_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def q5_1_gemv(raw, x, sums, table, out):
    gemv_groups(q5_1_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def q5_1_decode(raw, table, tile):
    decode_loop(_q5_values, block_at, Q5_1_GEO, raw, table, tile)


@row_cfunc
def q4_0_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(q4_0_gemv1, q4_0_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


@row_cfunc
def q4_1_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(q4_1_gemv1, q4_1_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


@row_cfunc
def q5_0_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(q5_0_gemv1, q5_0_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


@row_cfunc
def q5_1_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(q5_1_gemv1, q5_1_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


class Q4_0JitKernel(BlockSumsKernel):
    qtype = QType.Q4_0
    qtype, type_size = QType.Q4_0, Q4_0_GEO[0]
    gemv1, gemv, decode = staticmethod(q4_0_gemv1), staticmethod(q4_0_gemv), staticmethod(q4_0_decode)
    row_product = q4_0_rows


class Q4_1JitKernel(BlockSumsKernel):
    qtype = QType.Q4_1
    qtype, type_size, sums_width = QType.Q4_1, Q4_1_GEO[0], LANES
    gemv1, gemv, decode = staticmethod(q4_1_gemv1), staticmethod(q4_1_gemv), staticmethod(q4_1_decode)
    row_product = q4_1_rows


class Q5_0JitKernel(BlockSumsKernel):
    qtype = QType.Q5_0
    qtype, type_size = QType.Q5_0, Q5_0_GEO[0]
    gemv1, gemv, decode = staticmethod(q5_0_gemv1), staticmethod(q5_0_gemv), staticmethod(q5_0_decode)
    row_product = q5_0_rows


class Q5_1JitKernel(BlockSumsKernel):
    qtype = QType.Q5_1
    qtype, type_size, sums_width = QType.Q5_1, Q5_1_GEO[0], LANES
    gemv1, gemv, decode = staticmethod(q5_1_gemv1), staticmethod(q5_1_gemv), staticmethod(q5_1_decode)
    row_product = q5_1_rows


# This family's float kernels (:func:`.kernel_table`).
KERNELS = (Q4_0JitKernel, Q4_1JitKernel, Q5_0JitKernel, Q5_1JitKernel)
