"""Compiled integer-dot kernels of the 1- to 3-bit i-quants and TQ2_0 with 8-bit activations (``activations="q8"``,
numba; see :mod:`.int8`).

Each 32-value sub-block meets the row's activations quantized per 32 (:func:`.q8_act.quantize_rows`) as llama.cpp
multiplies these types: the grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) give their *unsigned* grid points as
four 64-bit words (value ``8l + k`` in byte ``k`` of word ``l``, from :mod:`qwen_runtime.quants.grids`' tables) and
their 32 sign bits as one integer, which become ±1 bytes (a broadcast, ``vpshufb``, a test per bit) that sign the
activations (``vpsignb``); IQ1's ``8g ± 1`` come as signed words, and TQ2_0's ``q - 1`` unpacked from its 32 bytes
in vector arithmetic (:func:`group_tq2_fma`), their magnitudes against the activations with their signs.
``vpmaddubsw`` then gives 16 exact pair sums (at most ``2 * 62 * 127``: no saturation), and ``vpmaddwd`` by the sub-
block's *integer* scales (``2s + 1``, per 16 or 32 values) 8 exact sums of 4, converted to float32 and fused with
the activations' scale into the super-block's lanes; once per super-block its float ``d`` (times the scales' power-
of-two factor) folds those into the row's lanes (:func:`.int8.lanes_fold`). No float scale is made per sub-block,
and no weight byte is negated (where the words of :mod:`.lattice`'s float kernels carry the signs). llama.cpp's
activations are quantized per 256 values (q8_K), ours per 32. The same integer arithmetic in generic IR where the
CPU has no AVX2.

One and several activation rows run the same loops (groups of 1, or :func:`.int8.row_groups`; int8 activations
for both), so a row's numbers do not depend on the rows beside it.  Prompts (more than
:attr:`.int8.Int8Kernel.direct_rows` rows) take the type's float kernel.  A module of its own so that models
without these types do not load these kernels.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from ...quants.grids import GRID_IQ3_S, GRID_IQ3_XXS, SIGNS_EVEN, words
from ...quants.lattice import IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS
from ...quants.q8_act import Q8_ACT_BLOCK
from ...quants.ternary import TQ2_0
from .base import ACC_FLOATS, GEMV_ROWS, I8, I16, I32, V16_I16, V32_I8, compiled, splat, stack_f32
from .int8 import (
    LEGACY_GEMV,
    Int8Kernel,
    _literal,
    halves16,
    inline,
    lanes_fold,
    lanes_sums,
    lanes_zero,
    magnitudes,
    q8_cfunc,
    row_groups,
    scaled_fma_group,
)
from .lattice import (
    F_EIGHTH,
    F_QUARTER,
    IQ1_M_GEO,
    IQ1_S_GEO,
    IQ2_S_GEO,
    IQ2_XS_GEO,
    IQ2_XXS_GEO,
    IQ3_S_GEO,
    IQ3_XXS_GEO,
    TQ2_0_GEO,
    U32_1,
    U32_4,
    U32_7,
    U32_8,
    U32_15,
    U32_127,
    W_IQ2_S,
    W_IQ2_XS,
    W_IQ2_XXS,
    IQ1_MJitKernel,
    IQ1_SJitKernel,
    IQ2_SJitKernel,
    IQ2_XSJitKernel,
    IQ2_XXSJitKernel,
    IQ3_SJitKernel,
    IQ3_XXSJitKernel,
    TQ2_0JitKernel,
    _d_at,
    _iq1_m_d,
    _iq1_m_word,
    _iq1_word,
    entry,
    load_le,
)
from .q8_act import D, Q, form_arrays, product_arrays, slots

SUPER = IQ2_XXS().block_size  # values of a super-block: 256 for every type here
SUBS = SUPER // Q8_ACT_BLOCK  # its sub-blocks, each one activation block of 32
W4_IQ3_XXS, W4_IQ3_S = words(GRID_IQ3_XXS), words(GRID_IQ3_S)  # uint32: 4 values a point
U32_2, U32_3, U32_9, U32_14, U32_16, U32_21, U32_24, U32_28, U32_511 = (
    np.uint32(v) for v in (2, 3, 9, 14, 16, 21, 24, 28, 511))


# The grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): unsigned grid points, signs on the activations, the
# sub-blocks' integer scales in pmaddwd, one float scale per super-block.

def _sign_bytes(builder: ir.IRBuilder, bits: ir.Value) -> ir.Value:
    """``<32 x i8>``: -1 where bit ``k`` of the low 32 bits of ``bits`` is set, else 1 (byte ``k`` from bit ``k %
    8`` of byte ``k // 8``): the 32-bit word broadcast, each byte spread over 8 (``vpshufb``), tested bit by bit."""
    word = builder.trunc(bits, I32) if bits.type.width > 32 else bits
    four = builder.bitcast(word, ir.VectorType(I8, 4))
    spread = builder.shuffle_vector(four, ir.Constant(four.type, ir.Undefined),
                                    ir.Constant(ir.VectorType(I32, Q8_ACT_BLOCK), [k // 8 for k in range(32)]))
    bit = ir.Constant(V32_I8, [((1 << (k % 8)) + 128) % 256 - 128 for k in range(Q8_ACT_BLOCK)])
    minus = builder.icmp_unsigned("!=", builder.and_(spread, bit), ir.Constant(V32_I8, [0] * Q8_ACT_BLOCK))
    return builder.select(minus, ir.Constant(V32_I8, [-1] * Q8_ACT_BLOCK), ir.Constant(V32_I8, [1] * Q8_ACT_BLOCK))


@intrinsic
def grid_signs_fma(typingctx, points, signs, s0, s1, x, x_at, x_stride, xd, d_at, d_stride, part,
                   group):  # noqa: ARG001 (numba's protocol)
    """A 32-value sub-block times ``group`` activation rows: the unsigned grid values in the words ``points``
    (four uint64 of 8 values, or eight uint32 of 4: value ``k`` in byte ``k % width`` of word ``k // width``),
    their signs in the bits of ``signs`` (bit ``k`` of value ``k``; ``None``: the words hold signed values, at
    most 9 in magnitude, IQ1's) and the integer scales ``s0`` (values 0-15) and ``s1`` (16-31) give row ``g`` 8
    exact sums (:func:`.int8.scaled_quads`), converted to float32 and fused with its scale ``d_x[g] = xd[d_at + g
    * d_stride]`` into its 8 lanes of the super-block at ``part + 16 g``; its activations at ``x[x_at + g *
    x_stride]`` (flat indices).  The weights' vectors are made once for the group; eight 4-byte points go
    straight into the vector (``vpinsrd``), without a shift and an or per pair."""
    if not _literal(group) or not isinstance(points, types.UniTuple) or points.count not in (4, 8):
        return None

    def codegen(context, builder, signature, args):
        count = signature.args[0].count
        vector = ir.Constant(ir.VectorType(ir.IntType(256 // count), count), ir.Undefined)
        for k in range(count):
            word = builder.extract_value(args[0], k)
            vector = builder.insert_element(vector, builder.trunc(word, vector.type.element)
                                            if word.type.width > vector.type.element.width else word, I32(k))
        grid = builder.bitcast(vector, V32_I8)
        if signature.args[1] == types.none:  # signed values: their magnitudes, their signs onto the activations
            grid, sign = magnitudes(builder, grid), grid
        else:
            sign = _sign_bytes(builder, args[1])
        scaled_fma_group(context, builder, signature, grid, sign, halves16(builder, args[2], args[3]), args)
        return context.get_dummy_value()

    return types.void(points, signs, s0, s1, x, x_at, x_stride, xd, d_at, d_stride, part, group), codegen


@inline
def grid_row_group(update, geo, group, r0, r1, i0, raw, xq, xd, xsum, table, out):  # noqa: ARG001 (row_groups')
    """``out[i0 + g, r]`` for ``g < group`` (a literal) and stored rows ``r0 <= r < r1``: each super-block's
    sub-blocks by ``update`` into the rows' super-block lanes, folded with its scale into the rows' lanes (both in
    registers), the lanes summed in order (:func:`.int8.row_group`'s protocol)."""
    nb, cols = xd.shape[1], xq.shape[1]
    acc, part, sums = stack_f32(ACC_FLOATS), stack_f32(ACC_FLOATS), stack_f32(GEMV_ROWS)
    s = carray(sums, (GEMV_ROWS,))
    for r in range(r0, r1):
        blocks = raw[r]
        lanes_zero(acc, group)
        lanes_zero(part, group)
        for sb in range(nb // SUBS):
            scale = update(table, blocks, sb, geo, xq, i0 * cols + sb * SUPER, cols, xd, i0 * nb + sb * SUBS, nb,
                           part, group)
            lanes_fold(part, acc, scale, group)
        lanes_sums(acc, group, sums)
        for g in range(group):
            out[i0 + g, r] = s[g]


@inline
def _grid_fma(sub, blocks, base, xq, x_at, cols, xd, d_at, nb, part, group):
    """The 8 sub-blocks of the super-block at byte ``base`` (``sub``: the grid words, sign bits and integer
    scales of each) into the group's super-block lanes."""
    for j in range(SUBS):
        points, signs, s0, s1 = sub(blocks, base, j)
        grid_signs_fma(points, signs, s0, s1, xq, x_at + Q8_ACT_BLOCK * j, cols, xd, d_at + j, nb, part, group)


@inline
def grid_product(gemv1, gemv, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    """A :data:`.q8_act.Q8_ROW_PRODUCT` of a grid type: ``q`` and ``d`` for one row and for several."""
    w, _, t, o = product_arrays(raw, rows, row_bytes, n, sums, 0, table, out, out_stride)
    q, _, _, d, _, _ = form_arrays(forms, first, n, cols)
    if n == 1:
        gemv1(w, q, d, t, o)
    else:
        gemv(w, q, d, t, o)


class GridKernel(Int8Kernel):
    """A grid type: int8 activations and their scales per 32 for one row and for several."""

    q8_slots = slots(Q, D)

    def forms(self, q: np.ndarray, d: np.ndarray) -> tuple:
        return q, d, q, d


@inline
def _odd_scale(q):
    """``2 q + 1``: a sub-block's integer scale from its 4-bit field."""
    return q * U32_2 + U32_1


@inline
def _even_signs(aux):
    """The 32 sign bits of four 7-bit indices at bits 0, 7, 14 and 21 of ``aux`` (:data:`SIGNS_EVEN`)."""
    return (np.uint32(entry(SIGNS_EVEN, aux & U32_127))
            | (np.uint32(entry(SIGNS_EVEN, (aux >> U32_7) & U32_127)) << U32_8)
            | (np.uint32(entry(SIGNS_EVEN, (aux >> U32_14) & U32_127)) << U32_16)
            | (np.uint32(entry(SIGNS_EVEN, (aux >> U32_21) & U32_127)) << U32_24))


# Each grid type: its sub-block (grid words, sign bits, integer scales: ggml-common.h's layouts), its super-block
# (the sub-blocks, then ``d`` times the factor of its scales), the one-row and multi-row products, the row product
# called by address from the compiled decode step, the kernel class.

@inline
def _iq2_xxs_sub(blocks, base, j):
    at = base + 2 + 8 * j
    aux = load_le(blocks, at + 4, 4)
    ls = _odd_scale(aux >> U32_28)
    return ((entry(W_IQ2_XXS, load_le(blocks, at, 1)), entry(W_IQ2_XXS, load_le(blocks, at + 1, 1)),
             entry(W_IQ2_XXS, load_le(blocks, at + 2, 1)), entry(W_IQ2_XXS, load_le(blocks, at + 3, 1))),
            _even_signs(aux), ls, ls)


@inline
def _iq2_xxs_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, part, group):
    base = sb * geo[0]
    _grid_fma(_iq2_xxs_sub, blocks, base, xq, x_at, cols, xd, d_at, nb, part, group)
    return _d_at(table, blocks, base, geo) * F_EIGHTH


@compiled(LEGACY_GEMV)
def iq2_xxs_gemv1_q8(raw, xq, xd, table, out):
    grid_row_group(_iq2_xxs_q8, IQ2_XXS_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV)
def iq2_xxs_gemv_q8(raw, xq, xd, table, out):
    row_groups(grid_row_group, _iq2_xxs_q8, IQ2_XXS_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq2_xxs_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    grid_product(iq2_xxs_gemv1_q8, iq2_xxs_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                 table, out, out_stride)


class IQ2_XXSInt8Kernel(GridKernel):
    block, type_size, exact = IQ2_XXS().block_size, IQ2_XXS_GEO[0], IQ2_XXSJitKernel
    gemv1_q8, gemv_q8 = staticmethod(iq2_xxs_gemv1_q8), staticmethod(iq2_xxs_gemv_q8)
    q8_row_product = iq2_xxs_q8_rows


@inline
def _iq2_xs_sub(blocks, base, j):
    at = base + 2 + 8 * j
    q0, q1, q2, q3 = load_le(blocks, at, 2), load_le(blocks, at + 2, 2), load_le(blocks, at + 4, 2), load_le(
        blocks, at + 6, 2)
    sc = load_le(blocks, base + 66 + j, 1)
    signs = (np.uint32(entry(SIGNS_EVEN, q0 >> U32_9)) | (np.uint32(entry(SIGNS_EVEN, q1 >> U32_9)) << U32_8)
             | (np.uint32(entry(SIGNS_EVEN, q2 >> U32_9)) << U32_16)
             | (np.uint32(entry(SIGNS_EVEN, q3 >> U32_9)) << U32_24))
    return ((entry(W_IQ2_XS, q0 & U32_511), entry(W_IQ2_XS, q1 & U32_511), entry(W_IQ2_XS, q2 & U32_511),
             entry(W_IQ2_XS, q3 & U32_511)), signs, _odd_scale(sc & U32_15), _odd_scale(sc >> U32_4))


@inline
def _iq2_xs_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, part, group):
    base = sb * geo[0]
    _grid_fma(_iq2_xs_sub, blocks, base, xq, x_at, cols, xd, d_at, nb, part, group)
    return _d_at(table, blocks, base, geo) * F_EIGHTH


@compiled(LEGACY_GEMV)
def iq2_xs_gemv1_q8(raw, xq, xd, table, out):
    grid_row_group(_iq2_xs_q8, IQ2_XS_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV)
def iq2_xs_gemv_q8(raw, xq, xd, table, out):
    row_groups(grid_row_group, _iq2_xs_q8, IQ2_XS_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq2_xs_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    grid_product(iq2_xs_gemv1_q8, iq2_xs_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                 table, out, out_stride)


class IQ2_XSInt8Kernel(GridKernel):
    block, type_size, exact = IQ2_XS().block_size, IQ2_XS_GEO[0], IQ2_XSJitKernel
    gemv1_q8, gemv_q8 = staticmethod(iq2_xs_gemv1_q8), staticmethod(iq2_xs_gemv_q8)
    q8_row_product = iq2_xs_q8_rows


@inline
def _iq2_s_point(blocks, base, j, p, qh):
    return entry(W_IQ2_S, load_le(blocks, base + 2 + 4 * j + p, 1) | ((qh >> np.uint32(2 * p)) & U32_3) << U32_8)


@inline
def _iq2_s_sub(blocks, base, j):
    qh, sc = load_le(blocks, base + 66 + j, 1), load_le(blocks, base + 74 + j, 1)
    return ((_iq2_s_point(blocks, base, j, 0, qh), _iq2_s_point(blocks, base, j, 1, qh),
             _iq2_s_point(blocks, base, j, 2, qh), _iq2_s_point(blocks, base, j, 3, qh)),
            load_le(blocks, base + 34 + 4 * j, 4), _odd_scale(sc & U32_15), _odd_scale(sc >> U32_4))


@inline
def _iq2_s_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, part, group):
    base = sb * geo[0]
    _grid_fma(_iq2_s_sub, blocks, base, xq, x_at, cols, xd, d_at, nb, part, group)
    return _d_at(table, blocks, base, geo) * F_EIGHTH


@compiled(LEGACY_GEMV)
def iq2_s_gemv1_q8(raw, xq, xd, table, out):
    grid_row_group(_iq2_s_q8, IQ2_S_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV)
def iq2_s_gemv_q8(raw, xq, xd, table, out):
    row_groups(grid_row_group, _iq2_s_q8, IQ2_S_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq2_s_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    grid_product(iq2_s_gemv1_q8, iq2_s_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                 table, out, out_stride)


class IQ2_SInt8Kernel(GridKernel):
    block, type_size, exact = IQ2_S().block_size, IQ2_S_GEO[0], IQ2_SJitKernel
    gemv1_q8, gemv_q8 = staticmethod(iq2_s_gemv1_q8), staticmethod(iq2_s_gemv_q8)
    q8_row_product = iq2_s_q8_rows


@inline
def _iq3_xxs_point(blocks, at):
    return entry(W4_IQ3_XXS, load_le(blocks, at, 1))


@inline
def _iq3_xxs_sub(blocks, base, j):
    at = base + 2 + 8 * j
    aux = load_le(blocks, base + 66 + 4 * j, 4)
    ls = _odd_scale(aux >> U32_28)
    return ((_iq3_xxs_point(blocks, at), _iq3_xxs_point(blocks, at + 1), _iq3_xxs_point(blocks, at + 2),
             _iq3_xxs_point(blocks, at + 3), _iq3_xxs_point(blocks, at + 4), _iq3_xxs_point(blocks, at + 5),
             _iq3_xxs_point(blocks, at + 6), _iq3_xxs_point(blocks, at + 7)), _even_signs(aux), ls, ls)


@inline
def _iq3_xxs_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, part, group):
    base = sb * geo[0]
    _grid_fma(_iq3_xxs_sub, blocks, base, xq, x_at, cols, xd, d_at, nb, part, group)
    return _d_at(table, blocks, base, geo) * F_QUARTER


@compiled(LEGACY_GEMV)
def iq3_xxs_gemv1_q8(raw, xq, xd, table, out):
    grid_row_group(_iq3_xxs_q8, IQ3_XXS_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV)
def iq3_xxs_gemv_q8(raw, xq, xd, table, out):
    row_groups(grid_row_group, _iq3_xxs_q8, IQ3_XXS_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq3_xxs_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    grid_product(iq3_xxs_gemv1_q8, iq3_xxs_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                 table, out, out_stride)


class IQ3_XXSInt8Kernel(GridKernel):
    block, type_size, exact = IQ3_XXS().block_size, IQ3_XXS_GEO[0], IQ3_XXSJitKernel
    gemv1_q8, gemv_q8 = staticmethod(iq3_xxs_gemv1_q8), staticmethod(iq3_xxs_gemv_q8)
    q8_row_product = iq3_xxs_q8_rows


@inline
def _iq3_s_point(blocks, at, qh, k):
    return entry(W4_IQ3_S, load_le(blocks, at + k, 1) | ((qh >> np.uint32(k)) & U32_1) << U32_8)


@inline
def _iq3_s_sub(blocks, base, j):
    at = base + 2 + 8 * j
    qh = load_le(blocks, base + 66 + j, 1)
    ls = _odd_scale((load_le(blocks, base + 106 + j // 2, 1) >> np.uint32(4 * (j % 2))) & U32_15)
    return ((_iq3_s_point(blocks, at, qh, 0), _iq3_s_point(blocks, at, qh, 1), _iq3_s_point(blocks, at, qh, 2),
             _iq3_s_point(blocks, at, qh, 3), _iq3_s_point(blocks, at, qh, 4), _iq3_s_point(blocks, at, qh, 5),
             _iq3_s_point(blocks, at, qh, 6), _iq3_s_point(blocks, at, qh, 7)), load_le(blocks, base + 74 + 4 * j, 4),
            ls, ls)


@inline
def _iq3_s_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, part, group):
    base = sb * geo[0]
    _grid_fma(_iq3_s_sub, blocks, base, xq, x_at, cols, xd, d_at, nb, part, group)
    return _d_at(table, blocks, base, geo)


@compiled(LEGACY_GEMV)
def iq3_s_gemv1_q8(raw, xq, xd, table, out):
    grid_row_group(_iq3_s_q8, IQ3_S_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV)
def iq3_s_gemv_q8(raw, xq, xd, table, out):
    row_groups(grid_row_group, _iq3_s_q8, IQ3_S_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq3_s_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    grid_product(iq3_s_gemv1_q8, iq3_s_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                 table, out, out_stride)


class IQ3_SInt8Kernel(GridKernel):
    block, type_size, exact = IQ3_S().block_size, IQ3_S_GEO[0], IQ3_SJitKernel
    gemv1_q8, gemv_q8 = staticmethod(iq3_s_gemv1_q8), staticmethod(iq3_s_gemv_q8)
    q8_row_product = iq3_s_q8_rows


# IQ1_S, IQ1_M and TQ2_0: signed values in the words (IQ1's ``8g ± 1``, TQ2_0's ``q - 1``), no sign bits.

@inline
def _iq1_s_sub(blocks, base, j):
    qh = load_le(blocks, base + 34 + 2 * j, 2)
    at, minus = base + 2 + 4 * j, qh >> np.uint32(15)
    ls = _odd_scale((qh >> np.uint32(12)) & U32_7)
    return ((_iq1_word(load_le(blocks, at, 1) | (qh & U32_7) << U32_8, minus),
             _iq1_word(load_le(blocks, at + 1, 1) | ((qh >> np.uint32(3)) & U32_7) << U32_8, minus),
             _iq1_word(load_le(blocks, at + 2, 1) | ((qh >> np.uint32(6)) & U32_7) << U32_8, minus),
             _iq1_word(load_le(blocks, at + 3, 1) | ((qh >> np.uint32(9)) & U32_7) << U32_8, minus)), None, ls, ls)


@inline
def _iq1_s_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, part, group):
    base = sb * geo[0]
    _grid_fma(_iq1_s_sub, blocks, base, xq, x_at, cols, xd, d_at, nb, part, group)
    return _d_at(table, blocks, base, geo) * F_EIGHTH


@compiled(LEGACY_GEMV)
def iq1_s_gemv1_q8(raw, xq, xd, table, out):
    grid_row_group(_iq1_s_q8, IQ1_S_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV)
def iq1_s_gemv_q8(raw, xq, xd, table, out):
    row_groups(grid_row_group, _iq1_s_q8, IQ1_S_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq1_s_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    grid_product(iq1_s_gemv1_q8, iq1_s_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                 table, out, out_stride)


class IQ1_SInt8Kernel(GridKernel):
    block, type_size, exact = IQ1_S().block_size, IQ1_S_GEO[0], IQ1_SJitKernel
    gemv1_q8, gemv_q8 = staticmethod(iq1_s_gemv1_q8), staticmethod(iq1_s_gemv_q8)
    q8_row_product = iq1_s_q8_rows


@inline
def _iq1_m_sub(blocks, base, j):
    word = load_le(blocks, base + 48 + 2 * (j // 2), 2)  # sub-blocks 2j, 2j + 1: bits 6(j % 2) .. + 5
    return ((_iq1_m_word(blocks, base, j, 0), _iq1_m_word(blocks, base, j, 1), _iq1_m_word(blocks, base, j, 2),
             _iq1_m_word(blocks, base, j, 3)), None, _odd_scale((word >> np.uint32(6 * (j % 2))) & U32_7),
            _odd_scale((word >> np.uint32(6 * (j % 2) + 3)) & U32_7))


@inline
def _iq1_m_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, part, group):
    base = sb * geo[0]
    _grid_fma(_iq1_m_sub, blocks, base, xq, x_at, cols, xd, d_at, nb, part, group)
    return _iq1_m_d(table, blocks, base, geo) * F_EIGHTH


@compiled(LEGACY_GEMV)
def iq1_m_gemv1_q8(raw, xq, xd, table, out):
    grid_row_group(_iq1_m_q8, IQ1_M_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV)
def iq1_m_gemv_q8(raw, xq, xd, table, out):
    row_groups(grid_row_group, _iq1_m_q8, IQ1_M_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq1_m_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    grid_product(iq1_m_gemv1_q8, iq1_m_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                 table, out, out_stride)


class IQ1_MInt8Kernel(GridKernel):
    block, type_size, exact = IQ1_M().block_size, IQ1_M_GEO[0], IQ1_MJitKernel
    gemv1_q8, gemv_q8 = staticmethod(iq1_m_gemv1_q8), staticmethod(iq1_m_gemv_q8)
    q8_row_product = iq1_m_q8_rows


@intrinsic
def group_tq2_fma(typingctx, blocks, at, shift, x, x_at, x_stride, xd, d_at, d_stride, part, group):  # noqa: ARG001
    """A TQ2_0 sub-block times ``group`` activation rows (:func:`.int8.scaled_fma_group`, scale 1): bits ``shift,
    shift + 1`` of the 32 bytes at ``blocks[at]`` are ``q``, the values ``q - 1``, unpacked in vector arithmetic
    (one 16-bit shift by a uniform count, a mask, a subtraction) rather than word by word."""
    if not _literal(group):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        q = builder.load(builder.bitcast(builder.gep(data, [args[1]]), V16_I16.as_pointer()), align=1)
        q = builder.lshr(q, splat(builder, builder.trunc(args[2], I16), V16_I16))
        q = builder.and_(builder.bitcast(q, V32_I8), ir.Constant(V32_I8, [3] * Q8_ACT_BLOCK))
        v = builder.sub(q, ir.Constant(V32_I8, [1] * Q8_ACT_BLOCK))
        one = ir.Constant(I16, 1)
        scaled_fma_group(context, builder, signature, magnitudes(builder, v), v, halves16(builder, one, one), args)
        return context.get_dummy_value()

    return types.void(blocks, at, shift, x, x_at, x_stride, xd, d_at, d_stride, part, group), codegen


@inline
def _tq2_0_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, part, group):
    base = sb * geo[0]
    for j in range(SUBS):
        group_tq2_fma(blocks, base + 32 * (j // 4), 2 * (j % 4), xq, x_at + Q8_ACT_BLOCK * j, cols, xd, d_at + j, nb,
                      part, group)
    return _d_at(table, blocks, base, geo)


@compiled(LEGACY_GEMV)
def tq2_0_gemv1_q8(raw, xq, xd, table, out):
    grid_row_group(_tq2_0_q8, TQ2_0_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV)
def tq2_0_gemv_q8(raw, xq, xd, table, out):
    row_groups(grid_row_group, _tq2_0_q8, TQ2_0_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def tq2_0_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    grid_product(tq2_0_gemv1_q8, tq2_0_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                 table, out, out_stride)


class TQ2_0Int8Kernel(GridKernel):
    block, type_size, exact = TQ2_0().block_size, TQ2_0_GEO[0], TQ2_0JitKernel
    gemv1_q8, gemv_q8 = staticmethod(tq2_0_gemv1_q8), staticmethod(tq2_0_gemv_q8)
    q8_row_product = tq2_0_q8_rows


# This family's 8-bit kernels (:func:`.kernel_table`).
KERNELS = (IQ2_XXSInt8Kernel, IQ2_XSInt8Kernel, IQ2_SInt8Kernel, IQ3_XXSInt8Kernel, IQ3_SInt8Kernel, IQ1_SInt8Kernel,
           IQ1_MInt8Kernel, TQ2_0Int8Kernel)
