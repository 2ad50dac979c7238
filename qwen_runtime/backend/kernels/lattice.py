"""Compiled kernels of the 1- to 3-bit i-quants and TQ2_0 (numba): the blocks of :mod:`qwen_runtime.quants.lattice`
and :mod:`qwen_runtime.quants.ternary` read in place.

The loops are those of the 32-value types (:func:`.base.group_loop`, :func:`.legacy.decode_loop`): a
super-block of 256 values is taken as 8 sub-blocks of 32, ``locate`` giving sub-block ``b``'s byte ``o =
256-block start + j`` (``j = b % 8``: ``o % type_size`` recovers it, the prefetch hint is off by at most 7
bytes) and the super-block's float32 ``d``.  Each type's step turns its 32 values into four 64-bit words of int8
values (value ``8l + k`` in byte ``k`` of word ``l``) and the float32 scales of lanes 0-15 and 16-31, computed in
the reference's float32 operations; one intrinsic (:func:`words_rows`) widens the words (``vpmovsxbd``,
``vcvtdq2ps``), multiplies by the scales (exact: an 11-bit float16 significand times at most 5 bits of scale and
6 of grid value) and adds ``fma(w, x, acc)`` into the group's lanes; :func:`words_decode` stores the weights.

* a step reads the row with :func:`load_le` (one unaligned load of 1-8 bytes) and its tables with :func:`entry`,
  neither with numba's test for a negative index, and takes its sub-block ``j`` and super-block byte ``base``
  apart (the integer-dot kernels of :mod:`.lattice_int8` loop over both; the loops here divide ``o``), so a
  sub-block costs no compare and conditional move per access and no division (docs/performance.md);
* grid points come from tables of words (:mod:`qwen_runtime.quants.grids`, compile-time constants); signs
  are applied to a word at once: ``(g ^ m) + (m & 0x01..01)`` with ``m`` the byte mask of the sign byte
  (``SIGN_MASKS``), which negates the bytes of ``m`` without carries (grid values are 1..62);
* IQ1's values ``8g ± 1`` come from one table (``g * 8 + 1``, then ``g * 8 - 1``): IQ1_M's delta sign is bit 11 of
  the index (no branch per word), IQ1_S's picks a half once per sub-block; the scale times 1/8;
* TQ2_0's 2-bit ``q`` are masked from 64-bit loads, and ``q - 1`` taken per byte as ``((q | 0x80) - 1) ^ 0x80``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ...quants.base import QType
from ...quants.grids import GRID_IQ1, GRID_IQ2_S, GRID_IQ2_XS, GRID_IQ2_XXS, GRID_IQ3_S, GRID_IQ3_XXS, SIGNS_EVEN, words
from ...quants.lattice import IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS
from ...quants.ternary import TQ2_0
from .base import (
    HALF,
    I32,
    I64,
    PAIR,
    SUMS_GEMV,
    TABLE_DECODE,
    V4_I64,
    V16_F32,
    V32_I8,
    BlockSumsKernel,
    compiled,
    f16_at,
    gemv1_rows,
    gemv_groups,
    group_loop,
    inline,
    row_cfunc,
    rows_fma,
    splat,
    sums_product,
)
from .legacy import decode_loop

W_IQ2_XXS, W_IQ2_XS, W_IQ2_S = words(GRID_IQ2_XXS), words(GRID_IQ2_XS), words(GRID_IQ2_S)
W_IQ3_XXS, W_IQ3_S = words(GRID_IQ3_XXS).astype(np.uint64), words(GRID_IQ3_S).astype(np.uint64)
# IQ1's values 8g + 1 at index i, 8g - 1 at i + 2048: the sign of the delta is bit 11 of the index.
W_IQ1 = np.concatenate([words(GRID_IQ1 * np.int8(8) + np.int8(1)), words(GRID_IQ1 * np.int8(8) - np.int8(1))])
# The halves, for IQ1_S, whose sign holds for a whole sub-block (LLVM picks the table once for its four words).
W_IQ1_PLUS, W_IQ1_MINUS = W_IQ1[:len(GRID_IQ1)], W_IQ1[len(GRID_IQ1):]
# Byte k of SIGN_MASKS[s] is 0xFF where bit k of s is set.
SIGN_MASKS = words(np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, -1, 0).astype(np.int8))
ONES = np.uint64(0x0101010101010101)
TOPS = np.uint64(0x8080808080808080)
TWO_BITS = np.uint64(0x0303030303030303)
U64_8, U64_32 = np.uint64(8), np.uint64(32)
U32_1, U32_4, U32_7, U32_8, U32_15, U32_127, U32_F0 = (np.uint32(v) for v in (1, 4, 7, 8, 15, 127, 0xF0))
F_HALF, F_QUARTER, F_EIGHTH = np.float32(0.5), np.float32(0.25), np.float32(0.125)


def _weights(builder: ir.IRBuilder, words_: list, s0: ir.Value, s1: ir.Value) -> list:
    """The two ``<16 x float>`` halves of the 32 int8 values held by four i64 words, times ``s0`` and ``s1``."""
    vector = ir.Constant(V4_I64, ir.Undefined)
    for k, word in enumerate(words_):
        vector = builder.insert_element(vector, word, I32(k))
    values = builder.bitcast(vector, V32_I8)
    halves = [builder.shuffle_vector(values, ir.Constant(V32_I8, ir.Undefined),
                                     ir.Constant(ir.VectorType(I32, HALF), list(range(HALF * h, HALF * h + HALF))))
              for h in range(2)]
    return [builder.fmul(builder.sitofp(h, V16_F32), splat(builder, s, V16_F32)) for h, s in zip(halves, (s0, s1),
                                                                                                    strict=True)]


@intrinsic
def words_rows(typingctx, w0, w1, w2, w3, s0, s1, x, i0, col, rows, acc):  # noqa: ARG001 (numba's protocol)
    """``acc[i, k] = fma(s * v[k], x[i0 + i, col + k], acc[i, k])`` for ``i < rows`` (a literal) and the 32 int8
    values ``v`` of the words ``w0..w3`` (byte ``k % 8`` of word ``k // 8``), ``s`` = ``s0`` for k < 16, else ``s1``."""
    if not isinstance(rows, types.IntegerLiteral):
        return None
    count = rows.literal_value

    def codegen(context, builder, signature, args):
        w = _weights(builder, list(args[0:4]), args[4], args[5])
        rows_fma(context, builder, signature.args[6], args[6], args[7], args[8], count, args[10], w)
        return context.get_dummy_value()

    return types.void(w0, w1, w2, w3, s0, s1, x, i0, col, rows, acc), codegen


@intrinsic
def words_decode(typingctx, w0, w1, w2, w3, s0, s1, out):  # noqa: ARG001
    """``out[k] = s * v[k]`` for the values and scales of :func:`words_rows` (``out``: 32 contiguous float32)."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[6])(context, builder, args[6]).data
        at = builder.bitcast(data, V16_F32.as_pointer())
        for h, w in enumerate(_weights(builder, list(args[0:4]), args[4], args[5])):
            builder.store(w, builder.gep(at, [I32(h)]), align=4)
        return context.get_dummy_value()

    return types.void(w0, w1, w2, w3, s0, s1, out), codegen


@intrinsic
def load_le(typingctx, blocks, at, width):  # noqa: ARG001
    """The ``width``-byte (a literal: 1, 2, 4 or 8) little-endian unsigned integer at byte ``at`` of a stored row
    (``at >= 0``), in one unaligned load and without the test numba adds to a signed index for a negative one:
    uint32, or uint64 for 8 bytes."""
    if not isinstance(width, types.IntegerLiteral) or width.literal_value not in (1, 2, 4, 8):
        return None
    bits = 8 * width.literal_value
    result = types.uint64 if bits == 64 else types.uint32

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        value = builder.load(builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(bits).as_pointer()), align=1)
        return builder.zext(value, I32) if bits < 32 else value

    return result(blocks, at, width), codegen


@intrinsic
def entry(typingctx, table, i):  # noqa: ARG001
    """``table[i]`` of a one-dimensional constant table for an index ``0 <= i < len(table)``, without numba's
    negative-index test (the index fields of these types cannot leave their tables: tests/quants/test_lowbit_quants)."""
    if not isinstance(table, types.Array) or table.ndim != 1 or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        index = args[1] if i.bitwidth == 64 else (builder.zext if not i.signed else builder.sext)(args[1], I64)
        return builder.load(builder.gep(data, [index]))

    return table.dtype(table, i), codegen


@inline
def _signed(point, signs):
    """The int8 bytes of the word ``point`` negated where bit k of the sign byte ``signs`` is set."""
    mask = entry(SIGN_MASKS, signs)
    return (point ^ mask) + (mask & ONES)


@inline
def _half_scale(d, ls, times):
    """``d * (0.5 + ls) * times`` in float32, as the reference."""
    return d * (F_HALF + np.float32(ls)) * times


@inline
def _d_at(table, blocks, base, geo):
    """The float16 ``d`` at byte ``geo[1]`` of the super-block at byte ``base``."""
    return f16_at(table, blocks, base + geo[1])


@inline
def _iq1_m_d(table, blocks, base, geo):  # noqa: ARG001
    """IQ1_M's ``d``: the top nibbles of its four scale words."""
    bits = ((load_le(blocks, base + 49, 1) >> U32_4) | (load_le(blocks, base + 51, 1) & U32_F0)
            | ((load_le(blocks, base + 53, 1) >> U32_4) << U32_8) | ((load_le(blocks, base + 55, 1) & U32_F0) << U32_8))
    return entry(table, bits)


@inline
def _sub_block_at(table, blocks, b, geo):
    """(super-block byte + sub-block ``j``, float16 ``d`` at ``geo[1]``, 0) of the 32-value sub-block ``b``."""
    base = (b // 8) * geo[0]
    return base + b % 8, _d_at(table, blocks, base, geo), np.float32(0)


@inline
def _iq1_m_at(table, blocks, b, geo):
    """:func:`_sub_block_at` for IQ1_M (:func:`_iq1_m_d`)."""
    base = (b // 8) * geo[0]
    return base + b % 8, _iq1_m_d(table, blocks, base, geo), np.float32(0)


# Each type's step: the words and scales of sub-block j of the super-block at byte ``base`` (ggml-common.h's layouts).

@inline
def _iq2_xxs(blocks, base, j, d):
    at = base + 2 + 8 * j
    aux = load_le(blocks, at + 4, 4)
    s = _half_scale(d, aux >> np.uint32(28), F_QUARTER)
    w0 = _signed(entry(W_IQ2_XXS, load_le(blocks, at, 1)), entry(SIGNS_EVEN, aux & U32_127))
    w1 = _signed(entry(W_IQ2_XXS, load_le(blocks, at + 1, 1)), entry(SIGNS_EVEN, (aux >> np.uint32(7)) & U32_127))
    w2 = _signed(entry(W_IQ2_XXS, load_le(blocks, at + 2, 1)), entry(SIGNS_EVEN, (aux >> np.uint32(14)) & U32_127))
    w3 = _signed(entry(W_IQ2_XXS, load_le(blocks, at + 3, 1)), entry(SIGNS_EVEN, (aux >> np.uint32(21)) & U32_127))
    return w0, w1, w2, w3, s, s


@inline
def _iq2_xs_word(blocks, at):
    q = load_le(blocks, at, 2)
    return _signed(entry(W_IQ2_XS, q & np.uint32(511)), entry(SIGNS_EVEN, q >> np.uint32(9)))


@inline
def _iq2_xs(blocks, base, j, d):
    at = base + 2 + 8 * j
    sc = load_le(blocks, base + 66 + j, 1)
    return (_iq2_xs_word(blocks, at), _iq2_xs_word(blocks, at + 2), _iq2_xs_word(blocks, at + 4),
            _iq2_xs_word(blocks, at + 6), _half_scale(d, sc & U32_15, F_QUARTER),
            _half_scale(d, sc >> U32_4, F_QUARTER))


@inline
def _iq2_s_word(blocks, base, j, p, qh):
    index = load_le(blocks, base + 2 + 4 * j + p, 1) | ((qh >> np.uint32(2 * p)) & np.uint32(3)) << U32_8
    return _signed(entry(W_IQ2_S, index), load_le(blocks, base + 34 + 4 * j + p, 1))


@inline
def _iq2_s(blocks, base, j, d):
    qh, sc = load_le(blocks, base + 66 + j, 1), load_le(blocks, base + 74 + j, 1)
    return (_iq2_s_word(blocks, base, j, 0, qh), _iq2_s_word(blocks, base, j, 1, qh),
            _iq2_s_word(blocks, base, j, 2, qh), _iq2_s_word(blocks, base, j, 3, qh),
            _half_scale(d, sc & U32_15, F_QUARTER), _half_scale(d, sc >> U32_4, F_QUARTER))


@inline
def _iq3_xxs_word(blocks, at, aux, p):
    point = (entry(W_IQ3_XXS, load_le(blocks, at + 2 * p, 1))
             | (entry(W_IQ3_XXS, load_le(blocks, at + 2 * p + 1, 1)) << U64_32))
    return _signed(point, entry(SIGNS_EVEN, (aux >> np.uint32(7 * p)) & U32_127))


@inline
def _iq3_xxs(blocks, base, j, d):
    at = base + 2 + 8 * j
    aux = load_le(blocks, base + 66 + 4 * j, 4)
    s = _half_scale(d, aux >> np.uint32(28), F_HALF)
    return (_iq3_xxs_word(blocks, at, aux, 0), _iq3_xxs_word(blocks, at, aux, 1), _iq3_xxs_word(blocks, at, aux, 2),
            _iq3_xxs_word(blocks, at, aux, 3), s, s)


@inline
def _iq3_s_word(blocks, base, j, p, qh):
    at = base + 2 + 8 * j + 2 * p
    low = load_le(blocks, at, 1) | ((qh >> np.uint32(2 * p)) & U32_1) << U32_8
    high = load_le(blocks, at + 1, 1) | ((qh >> np.uint32(2 * p + 1)) & U32_1) << U32_8
    return _signed(entry(W_IQ3_S, low) | (entry(W_IQ3_S, high) << U64_32), load_le(blocks, base + 74 + 4 * j + p, 1))


@inline
def _iq3_s(blocks, base, j, d):
    qh = load_le(blocks, base + 66 + j, 1)
    s = d * np.float32(1 + 2 * ((load_le(blocks, base + 106 + j // 2, 1) >> np.uint32(4 * (j % 2))) & U32_15))
    return (_iq3_s_word(blocks, base, j, 0, qh), _iq3_s_word(blocks, base, j, 1, qh),
            _iq3_s_word(blocks, base, j, 2, qh), _iq3_s_word(blocks, base, j, 3, qh), s, s)


@inline
def _iq1_word(index, minus):
    return entry(W_IQ1_MINUS, index) if minus else entry(W_IQ1_PLUS, index)


@inline
def _iq1_s(blocks, base, j, d):
    qh = load_le(blocks, base + 34 + 2 * j, 2)
    at, minus = base + 2 + 4 * j, qh >> np.uint32(15)
    s = d * np.float32(2 * ((qh >> np.uint32(12)) & U32_7) + 1) * F_EIGHTH
    return (_iq1_word(load_le(blocks, at, 1) | (qh & U32_7) << U32_8, minus),
            _iq1_word(load_le(blocks, at + 1, 1) | ((qh >> np.uint32(3)) & U32_7) << U32_8, minus),
            _iq1_word(load_le(blocks, at + 2, 1) | ((qh >> np.uint32(6)) & U32_7) << U32_8, minus),
            _iq1_word(load_le(blocks, at + 3, 1) | ((qh >> np.uint32(9)) & U32_7) << U32_8, minus), s, s)


@inline
def _iq1_m_word(blocks, base, j, p):
    nib = (load_le(blocks, base + 32 + 2 * j + p // 2, 1) >> np.uint32(4 * (p % 2))) & U32_15
    return entry(W_IQ1, load_le(blocks, base + 4 * j + p, 1) | nib << U32_8)  # nib's bit 3: the delta's sign


@inline
def _iq1_m(blocks, base, j, d):
    word = load_le(blocks, base + 48 + 2 * (j // 2), 2)  # sub-blocks 2j, 2j + 1: bits 6(j % 2) .. + 5
    low = (word >> np.uint32(6 * (j % 2))) & U32_7
    high = (word >> np.uint32(6 * (j % 2) + 3)) & U32_7
    return (_iq1_m_word(blocks, base, j, 0), _iq1_m_word(blocks, base, j, 1), _iq1_m_word(blocks, base, j, 2),
            _iq1_m_word(blocks, base, j, 3), d * np.float32(2 * low + 1) * F_EIGHTH,
            d * np.float32(2 * high + 1) * F_EIGHTH)


@inline
def _tq2_word(blocks, at, shift):
    q = (load_le(blocks, at, 8) >> shift) & TWO_BITS
    return ((q | TOPS) - ONES) ^ TOPS


@inline
def _tq2_0(blocks, base, j, d):
    at = base + 32 * (j // 4)
    shift = np.uint64(2 * (j % 4))
    return (_tq2_word(blocks, at, shift), _tq2_word(blocks, at + 8, shift), _tq2_word(blocks, at + 16, shift),
            _tq2_word(blocks, at + 24, shift), d, d)


@inline
def _rows(sub, blocks, o, geo, d, x, i0, col, rows, acc):
    """The products of the sub-block at ``o`` (``sub``: the type's words and scales of it)."""
    j = o % geo[0]
    w0, w1, w2, w3, s0, s1 = sub(blocks, o - j, j, d)
    words_rows(w0, w1, w2, w3, s0, s1, x, i0, col, rows, acc)


@inline
def _decode(sub, blocks, o, geo, d, out):
    """The weights of the sub-block at ``o`` into ``out`` (exact products: nothing to add for these types)."""
    j = o % geo[0]
    w0, w1, w2, w3, s0, s1 = sub(blocks, o - j, j, d)
    words_decode(w0, w1, w2, w3, s0, s1, out)


# The loops of each type, as those of kernels/iq4.py: a group step, the one-row and multi-row products, the tile
# decoder, the row product called by address, the kernel class.

IQ2_XXS_GEO = (IQ2_XXS().type_size, 0, 0, False)


@inline
def _iq2_xxs_rows(blocks, o, geo, d, x, i0, col, rows, acc):
    _rows(_iq2_xxs, blocks, o, geo, d, x, i0, col, rows, acc)


@inline
def _iq2_xxs_values(blocks, o, geo, d, start, out):
    _decode(_iq2_xxs, blocks, o, geo, d, out)


@inline
def iq2_xxs_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_iq2_xxs_rows, _sub_block_at, IQ2_XXS_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def iq2_xxs_gemv1(raw, x, sums, table, out):
    gemv1_rows(iq2_xxs_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def iq2_xxs_gemv(raw, x, sums, table, out):
    gemv_groups(iq2_xxs_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def iq2_xxs_decode(raw, table, tile):
    decode_loop(_iq2_xxs_values, _sub_block_at, IQ2_XXS_GEO, raw, table, tile)


@row_cfunc
def iq2_xxs_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(iq2_xxs_gemv1, iq2_xxs_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


class IQ2_XXSJitKernel(BlockSumsKernel):
    qtype = QType.IQ2_XXS
    qtype, block, type_size = QType.IQ2_XXS, IQ2_XXS().block_size, IQ2_XXS_GEO[0]
    gemv1, gemv, decode = staticmethod(iq2_xxs_gemv1), staticmethod(iq2_xxs_gemv), staticmethod(iq2_xxs_decode)
    row_product = iq2_xxs_rows

IQ2_XS_GEO = (IQ2_XS().type_size, 0, 0, False)


@inline
def _iq2_xs_rows(blocks, o, geo, d, x, i0, col, rows, acc):
    _rows(_iq2_xs, blocks, o, geo, d, x, i0, col, rows, acc)


@inline
def _iq2_xs_values(blocks, o, geo, d, start, out):
    _decode(_iq2_xs, blocks, o, geo, d, out)


@inline
def iq2_xs_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_iq2_xs_rows, _sub_block_at, IQ2_XS_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def iq2_xs_gemv1(raw, x, sums, table, out):
    gemv1_rows(iq2_xs_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def iq2_xs_gemv(raw, x, sums, table, out):
    gemv_groups(iq2_xs_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def iq2_xs_decode(raw, table, tile):
    decode_loop(_iq2_xs_values, _sub_block_at, IQ2_XS_GEO, raw, table, tile)


@row_cfunc
def iq2_xs_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(iq2_xs_gemv1, iq2_xs_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


class IQ2_XSJitKernel(BlockSumsKernel):
    qtype = QType.IQ2_XS
    qtype, block, type_size = QType.IQ2_XS, IQ2_XS().block_size, IQ2_XS_GEO[0]
    gemv1, gemv, decode = staticmethod(iq2_xs_gemv1), staticmethod(iq2_xs_gemv), staticmethod(iq2_xs_decode)
    row_product = iq2_xs_rows

IQ2_S_GEO = (IQ2_S().type_size, 0, 0, False)


@inline
def _iq2_s_rows(blocks, o, geo, d, x, i0, col, rows, acc):
    _rows(_iq2_s, blocks, o, geo, d, x, i0, col, rows, acc)


@inline
def _iq2_s_values(blocks, o, geo, d, start, out):
    _decode(_iq2_s, blocks, o, geo, d, out)


@inline
def iq2_s_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_iq2_s_rows, _sub_block_at, IQ2_S_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def iq2_s_gemv1(raw, x, sums, table, out):
    gemv1_rows(iq2_s_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def iq2_s_gemv(raw, x, sums, table, out):
    gemv_groups(iq2_s_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def iq2_s_decode(raw, table, tile):
    decode_loop(_iq2_s_values, _sub_block_at, IQ2_S_GEO, raw, table, tile)


@row_cfunc
def iq2_s_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(iq2_s_gemv1, iq2_s_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


class IQ2_SJitKernel(BlockSumsKernel):
    qtype = QType.IQ2_S
    qtype, block, type_size = QType.IQ2_S, IQ2_S().block_size, IQ2_S_GEO[0]
    gemv1, gemv, decode = staticmethod(iq2_s_gemv1), staticmethod(iq2_s_gemv), staticmethod(iq2_s_decode)
    row_product = iq2_s_rows

IQ3_XXS_GEO = (IQ3_XXS().type_size, 0, 0, False)


@inline
def _iq3_xxs_rows(blocks, o, geo, d, x, i0, col, rows, acc):
    _rows(_iq3_xxs, blocks, o, geo, d, x, i0, col, rows, acc)


@inline
def _iq3_xxs_values(blocks, o, geo, d, start, out):
    _decode(_iq3_xxs, blocks, o, geo, d, out)


@inline
def iq3_xxs_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_iq3_xxs_rows, _sub_block_at, IQ3_XXS_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def iq3_xxs_gemv1(raw, x, sums, table, out):
    gemv1_rows(iq3_xxs_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def iq3_xxs_gemv(raw, x, sums, table, out):
    gemv_groups(iq3_xxs_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def iq3_xxs_decode(raw, table, tile):
    decode_loop(_iq3_xxs_values, _sub_block_at, IQ3_XXS_GEO, raw, table, tile)


@row_cfunc
def iq3_xxs_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(iq3_xxs_gemv1, iq3_xxs_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


class IQ3_XXSJitKernel(BlockSumsKernel):
    qtype = QType.IQ3_XXS
    qtype, block, type_size = QType.IQ3_XXS, IQ3_XXS().block_size, IQ3_XXS_GEO[0]
    gemv1, gemv, decode = staticmethod(iq3_xxs_gemv1), staticmethod(iq3_xxs_gemv), staticmethod(iq3_xxs_decode)
    row_product = iq3_xxs_rows

IQ3_S_GEO = (IQ3_S().type_size, 0, 0, False)


@inline
def _iq3_s_rows(blocks, o, geo, d, x, i0, col, rows, acc):
    _rows(_iq3_s, blocks, o, geo, d, x, i0, col, rows, acc)


@inline
def _iq3_s_values(blocks, o, geo, d, start, out):
    _decode(_iq3_s, blocks, o, geo, d, out)


@inline
def iq3_s_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_iq3_s_rows, _sub_block_at, IQ3_S_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def iq3_s_gemv1(raw, x, sums, table, out):
    gemv1_rows(iq3_s_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def iq3_s_gemv(raw, x, sums, table, out):
    gemv_groups(iq3_s_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def iq3_s_decode(raw, table, tile):
    decode_loop(_iq3_s_values, _sub_block_at, IQ3_S_GEO, raw, table, tile)


@row_cfunc
def iq3_s_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(iq3_s_gemv1, iq3_s_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


class IQ3_SJitKernel(BlockSumsKernel):
    qtype = QType.IQ3_S
    qtype, block, type_size = QType.IQ3_S, IQ3_S().block_size, IQ3_S_GEO[0]
    gemv1, gemv, decode = staticmethod(iq3_s_gemv1), staticmethod(iq3_s_gemv), staticmethod(iq3_s_decode)
    row_product = iq3_s_rows

IQ1_S_GEO = (IQ1_S().type_size, 0, 0, False)


@inline
def _iq1_s_rows(blocks, o, geo, d, x, i0, col, rows, acc):
    _rows(_iq1_s, blocks, o, geo, d, x, i0, col, rows, acc)


@inline
def _iq1_s_values(blocks, o, geo, d, start, out):
    _decode(_iq1_s, blocks, o, geo, d, out)


@inline
def iq1_s_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_iq1_s_rows, _sub_block_at, IQ1_S_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def iq1_s_gemv1(raw, x, sums, table, out):
    gemv1_rows(iq1_s_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def iq1_s_gemv(raw, x, sums, table, out):
    gemv_groups(iq1_s_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def iq1_s_decode(raw, table, tile):
    decode_loop(_iq1_s_values, _sub_block_at, IQ1_S_GEO, raw, table, tile)


@row_cfunc
def iq1_s_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(iq1_s_gemv1, iq1_s_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


class IQ1_SJitKernel(BlockSumsKernel):
    qtype = QType.IQ1_S
    qtype, block, type_size = QType.IQ1_S, IQ1_S().block_size, IQ1_S_GEO[0]
    gemv1, gemv, decode = staticmethod(iq1_s_gemv1), staticmethod(iq1_s_gemv), staticmethod(iq1_s_decode)
    row_product = iq1_s_rows

IQ1_M_GEO = (IQ1_M().type_size, 0, 0, False)


@inline
def _iq1_m_rows(blocks, o, geo, d, x, i0, col, rows, acc):
    _rows(_iq1_m, blocks, o, geo, d, x, i0, col, rows, acc)


@inline
def _iq1_m_values(blocks, o, geo, d, start, out):
    _decode(_iq1_m, blocks, o, geo, d, out)


@inline
def iq1_m_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_iq1_m_rows, _iq1_m_at, IQ1_M_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def iq1_m_gemv1(raw, x, sums, table, out):
    gemv1_rows(iq1_m_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def iq1_m_gemv(raw, x, sums, table, out):
    gemv_groups(iq1_m_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def iq1_m_decode(raw, table, tile):
    decode_loop(_iq1_m_values, _iq1_m_at, IQ1_M_GEO, raw, table, tile)


@row_cfunc
def iq1_m_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(iq1_m_gemv1, iq1_m_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


class IQ1_MJitKernel(BlockSumsKernel):
    qtype = QType.IQ1_M
    qtype, block, type_size = QType.IQ1_M, IQ1_M().block_size, IQ1_M_GEO[0]
    gemv1, gemv, decode = staticmethod(iq1_m_gemv1), staticmethod(iq1_m_gemv), staticmethod(iq1_m_decode)
    row_product = iq1_m_rows

TQ2_0_GEO = (TQ2_0().type_size, 64, 0, False)


@inline
def _tq2_0_rows(blocks, o, geo, d, x, i0, col, rows, acc):
    _rows(_tq2_0, blocks, o, geo, d, x, i0, col, rows, acc)


@inline
def _tq2_0_values(blocks, o, geo, d, start, out):
    _decode(_tq2_0, blocks, o, geo, d, out)


@inline
def tq2_0_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_tq2_0_rows, _sub_block_at, TQ2_0_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def tq2_0_gemv1(raw, x, sums, table, out):
    gemv1_rows(tq2_0_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def tq2_0_gemv(raw, x, sums, table, out):
    gemv_groups(tq2_0_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def tq2_0_decode(raw, table, tile):
    decode_loop(_tq2_0_values, _sub_block_at, TQ2_0_GEO, raw, table, tile)


@row_cfunc
def tq2_0_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(tq2_0_gemv1, tq2_0_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


class TQ2_0JitKernel(BlockSumsKernel):
    qtype = QType.TQ2_0
    qtype, block, type_size = QType.TQ2_0, TQ2_0().block_size, TQ2_0_GEO[0]
    gemv1, gemv, decode = staticmethod(tq2_0_gemv1), staticmethod(tq2_0_gemv), staticmethod(tq2_0_decode)
    row_product = tq2_0_rows


# This family's float kernels (:func:`.kernel_table`).
KERNELS = (IQ2_XXSJitKernel, IQ2_XSJitKernel, IQ2_SJitKernel, IQ3_XXSJitKernel, IQ3_SJitKernel, IQ1_SJitKernel,
           IQ1_MJitKernel, TQ2_0JitKernel)
