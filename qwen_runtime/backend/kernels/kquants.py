"""Compiled K-quant kernels (numba): Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, the blocks of :mod:`.kquants` read in
place.

Bit layouts are those of :mod:`.kquants`' docstring.  Per super-block of 256 values the sub-block scales are
decoded (a few integer operations, as the reference), and every 32 values of a block are unpacked by one
intrinsic (:func:`fields_rows`: two 32-byte loads, shifts and masks in int8 vectors, minus a bias) into the
weights ``w = (d * sc_j) * q``, exact in float32 (the float16 significand's 11 bits times a scale of at most 8
bits and a quant of at most 6, the two as integers below 2**12: the products stay below 2**23), shared by the
rows of a group, each doing ``acc = fma(w, x, acc)`` into zmm registers (see :mod:`.base`).

* Q4_K: 4 chunks of 32 bytes; lane ``l`` of chunk ``c`` takes the low nibble (value ``64c + l``, sub-block
  ``2c``) and the high nibble (value ``64c + 32 + l``, sub-block ``2c + 1``); Q5_K adds bits ``2c`` and
  ``2c + 1`` of ``qh[l]`` as bit 4 (one generic body, :func:`k45_group`, inlined with each type's size).
  The ``dmin * m_j`` terms are ``(dmin * m_j) * sum(x over sub-block j)``, from per-32 activation sums
  computed once per product (:meth:`Q4_KJitKernel.activations`) and kept in 8 lanes per row (:func:`minimums_fma`).
  With AVX-512F, groups of up to ``TABLE_ROWS`` rows look a chunk's weights up in tables of ``d * j``
  (:func:`k45_table_rows`) instead of converting and scaling them: the same products.
* Q6_K: 2 halves of 128 values; in half ``h``, step ``s`` (0..3), lane ``l`` is value ``128h + 32s + l``:
  nibble ``s // 2`` of ``ql[64h + 32(s % 2) + l]`` and bits ``2s, 2s+1`` of ``qh[32h + l]`` as bits 4-5,
  minus 32; lanes 0-15 and 16-31 belong to sub-blocks ``8h + 2s`` and ``8h + 2s + 1``.
* Q2_K and Q3_K: the same steps over 2-bit fields (Q3_K's value ``(low | hmask bit << 2) - 4``), 16 sub-block
  scales per block; Q2_K's ``dmin * m_j`` terms from per-16 activation sums, as Q4_K's.

These loops replaced ones that kept each row's lanes in a stack array indexed by the row
(``acc += f32(q) * (x * (d * sc))``), faster for every type and row count (docs/performance.md).  The scale
decoders are inlined: a call in the block loop made LLVM keep the accumulators on the stack.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...quants.base import QType
from .base import (
    CHUNK_COLS,
    F16_TABLE,
    F32_1D,
    F32_2D,
    F32_2D_C,
    GROUP_ROWS,
    HALF,
    I8,
    I32,
    LANES,
    PERMUTE,
    TABLE_ROWS,
    U8_2D,
    V4_I8,
    V8_F32,
    V8_I32,
    V16_F32,
    V16_I8,
    V16_I32,
    V32_I8,
    JitKernel,
    compiled,
    deposit,
    gemv1_rows,
    gemv_groups,
    inline,
    lanes_sum,
    level_table,
    levels_of,
    look_up,
    nibble_indices,
    prefetch,
    row_cfunc,
    rows_fma,
    splat,
    stack_f32,
    sums_of,
    sums_product,
    table_product,
    zero_lanes,
)

QK_K = 256
Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = 144, 176, 210
# uint8 constants keep the bit arithmetic in 8-bit lanes (numba widens uint8 op int64 to int64, which does not
# vectorize); f32(q) - 32 equals f32(q - 32) exactly for 6-bit q.
M6, M4, M2, S6, S4, ONE = np.uint8(63), np.uint8(15), np.uint8(3), np.uint8(6), np.uint8(4), np.uint8(1)
Q6_BIAS = np.float32(32)




@intrinsic
def fields_rows(typingctx, blk, lo_at, lo_shift, lo_mask, hi_at, hi_shift, hi_mask, hi_up, bias, d0, d1, x, i0, col,
                rows, acc):  # noqa: ARG001 (numba's intrinsic protocol)
    """``acc[i, k] = fma(d * w[k], x[i0 + i, col + k], acc[i, k])`` for ``i < rows`` (a literal) and 32 values
    ``w[k] = ((lo[k] >> lo_shift) & lo_mask | ((hi[k] >> hi_shift) & hi_mask) << hi_up) - bias`` of the 32 bytes
    ``lo`` at ``blk[lo_at]`` and ``hi`` at ``blk[hi_at]`` (int8 vector arithmetic), ``d`` = ``d0`` for lanes 0-15 and
    ``d1`` for 16-31: the bit fields of every K-quant (``d * w`` is exact in float32)."""
    if not isinstance(rows, types.IntegerLiteral):
        return None
    count = rows.literal_value

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data

        def field(at, shift, mask):
            v = builder.load(builder.bitcast(builder.gep(data, [at]), V32_I8.as_pointer()), align=1)
            v = builder.lshr(v, splat(builder, builder.trunc(shift, I8), V32_I8))
            return builder.and_(v, splat(builder, builder.trunc(mask, I8), V32_I8))

        high = builder.shl(field(args[4], args[5], args[6]), splat(builder, builder.trunc(args[7], I8), V32_I8))
        bias = splat(builder, builder.trunc(args[8], I8), V32_I8)
        q = builder.sub(builder.or_(field(args[1], args[2], args[3]), high), bias)
        w = []
        for h in range(2):
            lanes = ir.Constant(ir.VectorType(I32, HALF), list(range(HALF * h, HALF * h + HALF)))
            half = builder.shuffle_vector(q, q, lanes)
            w.append(builder.fmul(builder.sitofp(half, V16_F32), splat(builder, args[9 + h], V16_F32)))
        rows_fma(context, builder, signature.args[11], args[11], args[12], args[13], count, args[15], w)
        return context.get_dummy_value()

    return types.void(blk, lo_at, lo_shift, lo_mask, hi_at, hi_shift, hi_mask, hi_up, bias, d0, d1, x, i0, col, rows,
                      acc), codegen




@intrinsic
def k45_scales_at(typingctx, blk, d, dmin, ds, dm):  # noqa: ARG001
    """``ds[j] = d * sc_j`` and ``dm[j] = dmin * m_j`` (j < 8, float32 pointers) of a Q4_K/Q5_K block's 6-bit
    values packed in bytes 4..15, unpacked in ``<4 x i8>`` vectors and multiplied as ``<8 x float>``: the
    reference's operations, a few vector instructions instead of some sixty scalar ones per block."""
    if not (isinstance(ds, types.CPointer) and isinstance(dm, types.CPointer)):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data

        def four(at):
            return builder.load(builder.bitcast(builder.gep(data, [ir.IntType(64)(at)]), V4_I8.as_pointer()), align=1)

        def const(v):
            return ir.Constant(V4_I8, [v] * 4)

        a, b, c = four(4), four(8), four(12)  # sc_0..3 | hi bits, m_0..3 | hi bits, low nibbles sc_4..7 | m_4..7
        low_sc, low_m = builder.and_(a, const(int(M6))), builder.and_(b, const(int(M6)))
        high_sc = builder.or_(builder.and_(c, const(int(M4))),
                              builder.shl(builder.lshr(a, const(int(S6))), const(int(S4))))
        high_m = builder.or_(builder.lshr(c, const(int(S4))),
                             builder.shl(builder.lshr(b, const(int(S6))), const(int(S4))))
        for low, high, scale, out in ((low_sc, high_sc, args[1], args[3]), (low_m, high_m, args[2], args[4])):
            values = builder.uitofp(builder.shuffle_vector(low, high, ir.Constant(V8_I32, list(range(8)))), V8_F32)
            one = builder.insert_element(ir.Constant(V8_F32, ir.Undefined), scale, I32(0))
            scales = builder.shuffle_vector(one, ir.Constant(V8_F32, ir.Undefined), ir.Constant(V8_I32, [0] * 8))
            builder.store(builder.fmul(scales, values), builder.bitcast(out, V8_F32.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(blk, d, dmin, ds, dm), codegen


@intrinsic
def k45_table_rows(typingctx, size, blk, at, qh_bit, d_low, d_high, x, i0, col, rows, acc):  # noqa: ARG001
    """``acc[i, k] = fma(w[k], x[i0 + i, col + k], acc[i, k])`` for ``i < rows`` (a literal) and the 64 values of a
    Q4_K (``size`` 144, a literal) or Q5_K (176) chunk: the 32 bytes at ``blk[at]``, low nibbles (values 0-31,
    scale ``d_low``) then high ones (32-63, ``d_high``); for Q5_K bits ``qh_bit`` and ``qh_bit + 1`` of the 32
    ``qh`` bytes (16..47) are the halves' bit 4.  The weights ``d * q`` are looked up (:func:`.base.look_up`)
    in tables of ``d * j`` (:func:`.base.level_table`): the bytes zero-extended to int32 straight from memory,
    the high nibbles by one shift, no conversion or scaling per weight; the same products, rounded the same
    way, as :func:`fields_rows`."""
    if not (isinstance(rows, types.IntegerLiteral) and isinstance(size, types.IntegerLiteral)):
        return None
    count, five = rows.literal_value, size.literal_value == Q5_K_BYTES

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[1])(context, builder, args[1]).data

        def pointer(at, vector):
            return builder.bitcast(builder.gep(data, [at]), vector.as_pointer())

        halves = [nibble_indices(builder, pointer(builder.add(args[2], args[2].type(16 * h)), V16_I8))
                  for h in range(2)]
        qh = builder.load(pointer(ir.IntType(64)(16), V32_I8), align=1) if five else None
        for h in range(2):
            tables = [level_table(builder, args[4 + h], levels_of(range(16 * t, 16 * t + 16)))
                      for t in range(2 if five else 1)]
            bit = None
            if five:
                shift = splat(builder, builder.trunc(builder.add(args[3], args[3].type(h)), I8), V32_I8)
                bit = builder.icmp_unsigned("!=", builder.and_(builder.lshr(qh, shift), splat(builder, I8(1), V32_I8)),
                                            ir.Constant(V32_I8, [0] * LANES))
            w = []
            for half in range(2):
                lanes = ir.Constant(V16_I32, list(range(HALF * half, HALF * half + HALF)))
                high = builder.shuffle_vector(bit, bit, lanes) if five else None
                w.append(look_up(builder, halves[half][h], tables, high))
            column = builder.add(args[8], args[8].type(32 * h))
            rows_fma(context, builder, signature.args[6], args[6], args[7], column, count, args[10], w)
        return context.get_dummy_value()

    return types.void(size, blk, at, qh_bit, d_low, d_high, x, i0, col, rows, acc), codegen


@inline
def k45_chunk(size, blk, at, c, d0, d1, x, i0, col, rows, acc):
    """The 64 values of chunk ``c`` (its 32 bytes at ``blk[at]``) of a Q4_K (``size`` 144) or Q5_K (176) block into
    the rows' lanes: looked up for small groups of rows where the CPU can (:func:`k45_table_rows`), else converted
    and scaled (:func:`fields_rows`, Q5_K's bits ``2c`` and ``2c + 1`` of ``qh`` as bit 4); the same products."""
    if PERMUTE and rows <= TABLE_ROWS:
        k45_table_rows(size, blk, at, 2 * c, d0, d1, x, i0, col, rows, acc)
    else:
        high = 1 if size == Q5_K_BYTES else 0  # Q5_K's bit 4 from qh (bytes 16..47); Q4_K: none
        fields_rows(blk, at, 0, 15, 16, 2 * c, high, 4, 0, d0, d0, x, i0, col, rows, acc)
        fields_rows(blk, at, 4, 15, 16, 2 * c + 1, high, 4, 0, d1, d1, x, i0, col + 32, rows, acc)


MIN_LANES = 8 * GROUP_ROWS  # a group's minimum lanes (8 per activation row)


@intrinsic
def minimums_fma(typingctx, dm, xsum, at, stride, mins, rows):  # noqa: ARG001
    """``mins[8i + j] = fma(dm[j], xsum[at + i stride + j], mins[8i + j])`` for ``i < rows`` (a literal) and j < 8:
    a Q4_K/Q5_K block's minimums (``dm``, a float32 pointer) against each activation row's sums per 32 (``xsum``,
    flat index), one ``<8 x float>`` per row."""
    if not isinstance(rows, types.IntegerLiteral):
        return None
    count = rows.literal_value

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        minimums = builder.load(builder.bitcast(args[0], V8_F32.as_pointer()), align=4)
        sums = context.make_array(signature.args[1])(context, builder, args[1]).data
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8_F32, [V8_F32] * 3), "llvm.fma.v8f32")
        for i in range(count):
            at = builder.add(args[2], builder.mul(args[3], i64(i)))
            row = builder.load(builder.bitcast(builder.gep(sums, [at]), V8_F32.as_pointer()), align=4)
            lanes = builder.bitcast(builder.gep(args[4], [i64(8 * i)]), V8_F32.as_pointer())
            builder.store(builder.call(fma, [minimums, row, builder.load(lanes, align=4)]), lanes, align=4)
        return context.get_dummy_value()

    return types.void(dm, xsum, at, stride, mins, rows), codegen


@inline
def minimums_sum(mins, i):
    """Row ``i``'s 8 minimum lanes (:func:`minimums_fma`) summed pairwise: ``((0+1)+(2+3))+((4+5)+(6+7))``."""
    m = 8 * i
    return ((mins[m] + mins[m + 1]) + (mins[m + 2] + mins[m + 3])) + ((mins[m + 4] + mins[m + 5])
                                                                     + (mins[m + 6] + mins[m + 7]))


@inline
def q4_k_scales(blk, table, ds, dm):
    """:func:`k45_scales_at` of one Q4_K/Q5_K block (float16 d and dmin in bytes 0..3 through ``table``) into the
    stack buffers ``ds`` and ``dm`` (:func:`.base.stack_f32` pointers of 8 floats).  Inlined: a call in the
    block loop made LLVM keep the row kernels' zmm accumulators on the stack around it (caller-saved).  Faster
    than the scalar unpacking it replaces, with the same bits (docs/performance.md)."""
    k45_scales_at(blk, table[np.int64(blk[0]) | (np.int64(blk[1]) << 8)],
                  table[np.int64(blk[2]) | (np.int64(blk[3]) << 8)], ds, dm)


@numba.njit(inline="always")
def k45_value(blk, qs, k, c, high, size):
    """Values ``64c + k`` (``high`` 0) or ``64c + 32 + k`` (1) of a Q4_K (size 144) or Q5_K (176) block, as
    float32: a nibble of ``qs[k]``, plus for Q5_K bit ``2c + high`` of ``qh[k]`` (bytes 16..47) as bit 4."""
    q = np.uint8(qs[k] >> S4) if high else np.uint8(qs[k] & M4)
    if size == Q5_K_BYTES:
        q |= np.uint8(((blk[16 + k] >> np.uint8(2 * c + high)) & ONE) << S4)
    return np.float32(q)


@inline
def k45_group(size, rows, raw, r, x, i0, c0, c1, args, out, acc):
    """``out[i0 + i, r] (+)= x[i0 + i, c0:c1] @ W[r, c0:c1]`` (:func:`.base.deposit`) for ``i < rows`` (a literal)
    of Q4_K (``size`` 144) or Q5_K (176) rows ``raw`` [R, nb * size], each 64-value chunk by :func:`k45_chunk`; ``args``
    = (``xsum`` [N, nb * 8], sums of x per 32; the float16 table).  Each row's minimums go into 8 lanes, one fused
    ``<8 x float>`` per block (:func:`minimums_fma`), summed pairwise at the end: faster than one scalar sum per row
    (docs/performance.md)."""
    xsum, table = args
    qs_at = size - 128
    minp = stack_f32(MIN_LANES)
    mins = carray(minp, (MIN_LANES,))
    dsp, dmp = stack_f32(8), stack_f32(8)
    ds = carray(dsp, (8,))
    nd = xsum.shape[1]
    for k in range(8 * rows):
        mins[k] = 0
    zero_lanes(acc, rows)
    for b in range(c0 // QK_K, c1 // QK_K):
        blk = raw[r, b * size: b * size + size]
        prefetch(blk, 0)
        q4_k_scales(blk, table, dsp, dmp)
        minimums_fma(dmp, xsum, i0 * nd + b * 8, nd, minp, rows)
        for c in range(4):
            k45_chunk(size, blk, qs_at + 32 * c, c, ds[2 * c], ds[2 * c + 1], x, i0, b * QK_K + 64 * c, rows, acc)
    for i in range(rows):
        deposit(out, i0 + i, r, lanes_sum(acc, i) - minimums_sum(mins, i), c0)


@inline
def q4_k_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):  # noqa: ARG001
    k45_group(Q4_K_BYTES, rows, raw, r, x, i0, c0, c1, args, out, acc)


@inline
def q5_k_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):  # noqa: ARG001
    k45_group(Q5_K_BYTES, rows, raw, r, x, i0, c0, c1, args, out, acc)


@numba.njit(inline="always")
def k45_decode(raw, table, tile, size):
    """``tile`` [R, nb * 256] = Q4_K/Q5_K rows decoded (``(d * sc) * q - dmin * m``, as the reference)."""
    nb = tile.shape[1] // 256
    qs_at = size - 128
    dsp, dmp = stack_f32(8), stack_f32(8)
    ds, dm = carray(dsp, (8,)), carray(dmp, (8,))
    for r in range(raw.shape[0]):
        row = tile[r]
        for b in range(nb):
            blk = raw[r, b * size: b * size + size]
            q4_k_scales(blk, table, dsp, dmp)
            for c in range(4):
                qs = blk[qs_at + 32 * c: qs_at + 32 * c + 32]
                base = b * 256 + 64 * c
                for k in range(32):
                    row[base + k] = ds[2 * c] * k45_value(blk, qs, k, c, 0, size) - dm[2 * c]
                    row[base + 32 + k] = ds[2 * c + 1] * k45_value(blk, qs, k, c, 1, size) - dm[2 * c + 1]


K45_GEMV = types.void(U8_2D, F32_2D_C, F32_2D_C, F32_1D, F32_2D)
K_DECODE = types.void(U8_2D, F32_1D, F32_2D_C)


@compiled(K45_GEMV)
def q4_k_gemv1(raw, x, xsum, table, out):
    gemv1_rows(q4_k_group, 1, raw, x, (xsum, table), out, CHUNK_COLS)


@compiled(K45_GEMV)
def q4_k_gemv(raw, x, xsum, table, out):
    gemv_groups(q4_k_group, raw, x, (xsum, table), out, CHUNK_COLS)


@compiled(K_DECODE, contract=False)
def q4_k_decode(raw, table, tile):
    k45_decode(raw, table, tile, Q4_K_BYTES)


@compiled(K45_GEMV)
def q5_k_gemv1(raw, x, xsum, table, out):
    gemv1_rows(q5_k_group, 1, raw, x, (xsum, table), out, CHUNK_COLS)


@compiled(K45_GEMV)
def q5_k_gemv(raw, x, xsum, table, out):
    gemv_groups(q5_k_group, raw, x, (xsum, table), out, CHUNK_COLS)


@compiled(K_DECODE, contract=False)
def q5_k_decode(raw, table, tile):
    k45_decode(raw, table, tile, Q5_K_BYTES)




@intrinsic
def q6_k_scales_at(typingctx, blk, d, ds):  # noqa: ARG001
    """``ds[j] = d * sc_j`` (j < 16, a float32 pointer) of a Q6_K block's int8 scales (bytes 192..207), as one
    ``<16 x float>`` product: the reference's operations.  Faster than two scalar products per 32 values, with the
    same bits (docs/performance.md)."""
    if not isinstance(ds, types.CPointer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        at = builder.gep(data, [ir.IntType(64)(192)])
        scales = builder.sitofp(builder.load(builder.bitcast(at, V16_I8.as_pointer()), align=1), V16_F32)
        builder.store(builder.fmul(splat(builder, args[1], V16_F32), scales),
                      builder.bitcast(args[2], V16_F32.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(blk, d, ds), codegen


@inline
def q6_k_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):  # noqa: ARG001
    """``out[i0 + i, r] (+)= x[i0 + i, c0:c1] @ W[r, c0:c1]`` for ``i < rows`` (a literal) of Q6_K rows ``raw`` [R, nb *
    210]: in half ``h``, step ``s`` the 6-bit values from ``ql`` and ``qh`` minus 32, lanes 0-15 and 16-31 scaled by
    their sub-blocks' ``d * sc``."""
    (table,) = args
    dsp = stack_f32(16)
    ds = carray(dsp, (16,))
    zero_lanes(acc, rows)
    for b in range(c0 // QK_K, c1 // QK_K):
        blk = raw[r, b * Q6_K_BYTES: b * Q6_K_BYTES + Q6_K_BYTES]
        prefetch(blk, 0)
        q6_k_scales_at(blk, table[np.int64(blk[208]) | (np.int64(blk[209]) << 8)], dsp)
        for h in range(2):
            for s in range(4):
                j = 8 * h + 2 * s
                fields_rows(blk, 64 * h + 32 * (s % 2), 4 * (s // 2), 15, 128 + 32 * h, 2 * s, 3, 4, 32, ds[j],
                            ds[j + 1], x, i0, b * QK_K + 128 * h + 32 * s, rows, acc)
    for i in range(rows):
        deposit(out, i0 + i, r, lanes_sum(acc, i), c0)


@compiled(types.void(U8_2D, F32_2D_C, F32_1D, F32_2D))
def q6_k_gemv1(raw, x, table, out):
    """``out[0, r] = x[0] @ W[r]`` for Q6_K rows ``raw`` [R, nb * 210]."""
    gemv1_rows(q6_k_group, 1, raw, x, (table,), out, CHUNK_COLS)


@compiled(types.void(U8_2D, F32_2D_C, F32_1D, F32_2D))
def q6_k_gemv(raw, x, table, out):
    """:func:`q6_k_gemv1` for 1..GEMV_ROWS rows, each by the same operations."""
    gemv_groups(q6_k_group, raw, x, (table,), out, CHUNK_COLS)


@compiled(types.void(U8_2D, F32_1D, F32_2D_C), contract=False)
def q6_k_decode(raw, table, tile):
    """``tile`` [R, nb * 256] = the Q6_K rows decoded (``(d * sc) * (q - 32)``, as the reference)."""
    nb = tile.shape[1] // 256
    for r in range(raw.shape[0]):
        row = tile[r]
        for b in range(nb):
            blk = raw[r, b * 210: b * 210 + 210]
            d = table[np.int64(blk[208]) | (np.int64(blk[209]) << 8)]
            for h in range(2):
                qh = blk[128 + 32 * h: 160 + 32 * h]
                for s in range(4):
                    ql = blk[64 * h + 32 * (s % 2): 64 * h + 32 * (s % 2) + 32]
                    shift, high = np.uint8(4 * (s // 2)), np.uint8(2 * s)
                    j = 8 * h + 2 * s
                    d0 = d * np.float32(np.int8(blk[192 + j]))
                    d1 = d * np.float32(np.int8(blk[193 + j]))
                    base = b * 256 + 128 * h + 32 * s
                    for k in range(32):
                        q = np.uint8(((ql[k] >> shift) & M4) | (((qh[k] >> high) & M2) << S4))
                        row[base + k] = (d0 if k < 16 else d1) * (np.float32(q) - Q6_BIAS)


@numba.njit(inline="always")
def k23_d(blk, table, q3):
    """The float16 ``d`` and ``dmin`` (Q3_K: ``d`` and 0) of a Q2_K or (``q3``) Q3_K block, as float32."""
    if q3:
        return table[np.int64(blk[108]) | (np.int64(blk[109]) << 8)], np.float32(0)
    return table[np.int64(blk[80]) | (np.int64(blk[81]) << 8)], table[np.int64(blk[82]) | (np.int64(blk[83]) << 8)]


@numba.njit(inline="always")
def q3_k_scale(blk, j):
    """Q3_K's integer scale ``s_j - 32`` of sub-block ``j`` (the 6-bit ``s_j`` of :mod:`.kquants`' docstring)."""
    low = (blk[96 + j % 8] >> np.uint8(4 * (j // 8))) & M4
    high = (blk[104 + j % 4] >> np.uint8(2 * (j // 4))) & M2
    return np.int32(low | (high << S4)) - 32


@numba.njit(inline="always")
def k23_scales(blk, table, ds, dm, q3):
    """The 16 sub-block scales ``ds[j]`` (and Q2_K's minimums ``dm[j]``) of a Q2_K or (``q3``) Q3_K block, as the
    reference computes them: Q2_K ``d * (scales[j] & 15)``, ``dmin * (scales[j] >> 4)``; Q3_K
    ``d * (s_j - 32)`` (:func:`q3_k_scale`)."""
    d, dmin = k23_d(blk, table, q3)
    if q3:
        for j in range(16):
            ds[j] = d * np.float32(q3_k_scale(blk, j))
        return
    for j in range(16):
        ds[j] = d * np.float32(blk[j] & M4)
        dm[j] = dmin * np.float32(blk[j] >> S4)


@numba.njit(inline="always")
def k23_value(blk, k, h, s, q3):
    """Value ``128h + 32s + k`` of a Q2_K or (``q3``) Q3_K block before scaling, as float32: bits ``2s, 2s+1``
    of ``qs[32h + k]``, for Q3_K minus 4 where bit ``4h + s`` of ``hmask[k]`` is clear."""
    if q3:
        low = (blk[32 + 32 * h + k] >> np.uint8(2 * s)) & M2
        set_bit = (blk[k] >> np.uint8(4 * h + s)) & ONE
        return np.float32(low) - np.float32(4) * np.float32(ONE - set_bit)
    return np.float32((blk[16 + 32 * h + k] >> np.uint8(2 * s)) & M2)


@inline
def k23_group(q3, rows, raw, r, x, i0, c0, c1, args, out, acc):
    """``out[i0 + i, r] (+)= x[i0 + i, c0:c1] @ W[r, c0:c1]`` for ``i < rows`` (a literal) of Q2_K or (``q3``)  Q3_K
    rows; ``args`` = (``xsum`` [N, nb * 16], sums of x per 16 for Q2_K's minimums; the float16 table).  Lanes 0-15 and
    16-31 of step (h, s) belong to sub-blocks ``8h + 2s`` and ``8h + 2s + 1``; Q3_K's value is ``(low | hbit << 2) -
    4``."""
    xsum, table = args
    size = 110 if q3 else 84
    mins = carray(stack_f32(GROUP_ROWS), (GROUP_ROWS,))
    ds, dm = carray(stack_f32(16), (16,)), carray(stack_f32(16), (16,))
    for i in range(rows):
        mins[i] = 0
    zero_lanes(acc, rows)
    for b in range(c0 // QK_K, c1 // QK_K):
        blk = raw[r, b * size: b * size + size]
        prefetch(blk, 0)
        k23_scales(blk, table, ds, dm, q3)
        for h in range(2):
            for s in range(4):
                j = 8 * h + 2 * s
                col = b * QK_K + 128 * h + 32 * s
                if q3:
                    fields_rows(blk, 32 + 32 * h, 2 * s, 3, 0, 4 * h + s, 1, 2, 4, ds[j], ds[j + 1], x, i0, col,
                                rows, acc)
                else:
                    for i in range(rows):
                        mins[i] += dm[j] * xsum[i0 + i, b * 16 + j] + dm[j + 1] * xsum[i0 + i, b * 16 + j + 1]
                    fields_rows(blk, 16 + 32 * h, 2 * s, 3, 0, 0, 0, 0, 0, ds[j], ds[j + 1], x, i0, col, rows, acc)
    for i in range(rows):
        deposit(out, i0 + i, r, lanes_sum(acc, i) - mins[i], c0)


@inline
def q2_k_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):  # noqa: ARG001
    k23_group(False, rows, raw, r, x, i0, c0, c1, args, out, acc)


@inline
def q3_k_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):  # noqa: ARG001
    k23_group(True, rows, raw, r, x, i0, c0, c1, args, out, acc)


@numba.njit(inline="always")
def k23_decode(raw, table, tile, q3):
    """``tile`` [R, nb * 256] = Q2_K/Q3_K rows decoded as the reference does."""
    size = 110 if q3 else 84
    nb = tile.shape[1] // 256
    ds, dm = carray(stack_f32(16), (16,)), carray(stack_f32(16), (16,))
    for r in range(raw.shape[0]):
        row = tile[r]
        for b in range(nb):
            blk = raw[r, b * size: b * size + size]
            k23_scales(blk, table, ds, dm, q3)
            for h in range(2):
                for s in range(4):
                    j = 8 * h + 2 * s
                    base = b * 256 + 128 * h + 32 * s
                    for k in range(32):
                        jk = j if k < 16 else j + 1
                        v = ds[jk] * k23_value(blk, k, h, s, q3)
                        row[base + k] = v if q3 else v - dm[jk]


@compiled(K45_GEMV)
def q2_k_gemv1(raw, x, xsum, table, out):
    gemv1_rows(q2_k_group, 1, raw, x, (xsum, table), out, CHUNK_COLS)


@compiled(K45_GEMV)
def q2_k_gemv(raw, x, xsum, table, out):
    gemv_groups(q2_k_group, raw, x, (xsum, table), out, CHUNK_COLS)


@compiled(K_DECODE, contract=False)
def q2_k_decode(raw, table, tile):
    k23_decode(raw, table, tile, False)


@compiled(K45_GEMV)
def q3_k_gemv1(raw, x, xsum, table, out):
    gemv1_rows(q3_k_group, 1, raw, x, (xsum, table), out, CHUNK_COLS)


@compiled(K45_GEMV)
def q3_k_gemv(raw, x, xsum, table, out):
    gemv_groups(q3_k_group, raw, x, (xsum, table), out, CHUNK_COLS)


@compiled(K_DECODE, contract=False)
def q3_k_decode(raw, table, tile):
    k23_decode(raw, table, tile, True)


@row_cfunc
def q4_k_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(q4_k_gemv1, q4_k_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


@row_cfunc
def q5_k_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(q5_k_gemv1, q5_k_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


@row_cfunc
def q2_k_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(q2_k_gemv1, q2_k_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


@row_cfunc
def q3_k_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(q3_k_gemv1, q3_k_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


@row_cfunc
def q6_k_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    table_product(q6_k_gemv1, q6_k_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride,
                  np.uint8)


class Q4_KJitKernel(JitKernel):
    qtype = QType.Q4_K
    block, type_size = QK_K, Q4_K_BYTES
    constants = (F16_TABLE,)
    gemv1 = staticmethod(q4_k_gemv1)
    gemv = staticmethod(q4_k_gemv)
    row_product = q4_k_rows
    sums_width = LANES
    decode = staticmethod(q4_k_decode)

    def activations(self, x: np.ndarray) -> tuple:
        return (sums_of(x, self.sums_width),)


class Q5_KJitKernel(Q4_KJitKernel):
    qtype = QType.Q5_K
    type_size = Q5_K_BYTES
    gemv1 = staticmethod(q5_k_gemv1)
    gemv = staticmethod(q5_k_gemv)
    row_product = q5_k_rows
    decode = staticmethod(q5_k_decode)


class Q2_KJitKernel(JitKernel):
    qtype = QType.Q2_K
    block, type_size = QK_K, 84
    constants = (F16_TABLE,)
    gemv1, gemv, decode = staticmethod(q2_k_gemv1), staticmethod(q2_k_gemv), staticmethod(q2_k_decode)
    row_product = q2_k_rows
    sums_width = 16

    def activations(self, x: np.ndarray) -> tuple:
        return (sums_of(x, self.sums_width),)


class Q3_KJitKernel(Q2_KJitKernel):
    qtype = QType.Q3_K
    type_size = 110
    gemv1, gemv, decode = staticmethod(q3_k_gemv1), staticmethod(q3_k_gemv), staticmethod(q3_k_decode)
    row_product = q3_k_rows
    sums_width = 0  # no minimums: its kernels never read the sums

    def activations(self, x: np.ndarray) -> tuple:
        return (np.zeros((len(x), 1), np.float32),)  # no minimums: the shared signature's unused sums


class Q6_KJitKernel(JitKernel):
    qtype = QType.Q6_K
    block, type_size = QK_K, Q6_K_BYTES
    constants = (F16_TABLE,)
    gemv1 = staticmethod(q6_k_gemv1)
    gemv = staticmethod(q6_k_gemv)
    row_product = q6_k_rows
    decode = staticmethod(q6_k_decode)


# This family's float kernels (:func:`.kernel_table`).
KERNELS = (Q4_KJitKernel, Q5_KJitKernel, Q2_KJitKernel, Q3_KJitKernel, Q6_KJitKernel)
