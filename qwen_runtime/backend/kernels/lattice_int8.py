"""Compiled integer-dot kernels of the 1- to 3-bit i-quants and TQ2_0 with 8-bit activations (``activations="q8"``,
numba; see :mod:`.int8`).

Each 32-value sub-block comes as the float kernels read it (:mod:`.lattice`): the type's step gives four 64-bit
words holding its 32 signed integer values (grid points with their signs, IQ1's ``8g ± 1``, TQ2_0's ``q - 1``)
and the float32 scales of values 0-15 and 16-31.  Here the words go into one ``<32 x i8>`` and meet the row's
activations quantized per 32 (:func:`.q8_act.quantize_rows`) in integer products, :func:`.int8._fma_group` with
two scales: with :data:`.base.MADDUBS` (AVX2 without AVX-512) ``|v|`` against the activations signed by ``v`` in
``pmaddubsw``, then ``pmaddwd`` by ones, 8 exact sums of 4 (no saturation: ``|v| <= 62`` and ``|q| <= 127``),
elsewhere ``pmaddwd`` pairs; each block's sums are scaled by ``s * d_x`` into float32 lanes.  llama.cpp too
multiplies these types against 8-bit activations, quantized per 256 values (q8_K) where ours are per 32.
The float kernels' per-value ``cvt``, scale and FMA per row become one integer product and one FMA per 8 lanes.

One and several activation rows run the same loops (groups of 1, or :func:`.int8.row_groups`), so a row's numbers
do not depend on the rows beside it.  Prompts (more than :attr:`.int8.Int8Kernel.direct_rows` rows) take the
type's float kernel.  A module of its own so that models without these types do not load these kernels.
"""

from __future__ import annotations

from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from ...quants.lattice import IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS
from ...quants.q8_act import Q8_ACT_BLOCK
from ...quants.ternary import TQ2_0
from .base import ACC_FLOATS, GEMV_ROWS, compiled, stack_f32
from .int8 import (
    LEGACY_GEMV,
    LEGACY_GEMV_ROWS,
    Int8Kernel,
    _fma_group,
    _literal,
    inline,
    lanes_sums,
    lanes_zero,
    pairs_product,
    q8_cfunc,
    row_groups,
)
from .lattice import (
    IQ1_M_GEO,
    IQ1_S_GEO,
    IQ2_S_GEO,
    IQ2_XS_GEO,
    IQ2_XXS_GEO,
    IQ3_S_GEO,
    IQ3_XXS_GEO,
    TQ2_0_GEO,
    _d_at,
    _iq1_m,
    _iq1_m_d,
    _iq1_s,
    _iq2_s,
    _iq2_xs,
    _iq2_xxs,
    _iq3_s,
    _iq3_xxs,
    _tq2_0,
)

I32 = ir.IntType(32)
SUPER = IQ2_XXS().block_size  # values of a super-block: 256 for every type here
SUBS = SUPER // Q8_ACT_BLOCK  # its sub-blocks, each one activation block of 32
V4_I64, V32_I8 = ir.VectorType(ir.IntType(64), 4), ir.VectorType(ir.IntType(8), Q8_ACT_BLOCK)


@intrinsic
def group_words_pairs_fma(typingctx, w0, w1, w2, w3, x, x_at, x_stride, xd, d_at, d_stride, s0, s1, acc,
                          group):  # noqa: ARG001 (numba's protocol)
    """The 32 int8 values of the words ``w0..w3`` (value ``8l + k`` in byte ``k`` of word ``l``) times ``group``
    activation rows (:func:`.int8._fma_group`: values 0-15 scaled by ``s0``, 16-31 by ``s1``)."""
    if not _literal(group):
        return None

    def codegen(context, builder, signature, args):
        vector = ir.Constant(V4_I64, ir.Undefined)
        for k in range(4):
            vector = builder.insert_element(vector, args[k], I32(k))
        _fma_group(context, builder, signature, builder.bitcast(vector, V32_I8), args, halves=True)
        return context.get_dummy_value()

    return types.void(w0, w1, w2, w3, x, x_at, x_stride, xd, d_at, d_stride, s0, s1, acc, group), codegen


@inline
def _words_fma(sub, scale, table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group):
    """Super-block ``sb`` of a stored row (``scale``: its ``d``; ``sub``: the words and scales of each of its 8
    sub-blocks) times the activation rows of the group, whose blocks of 32 start at ``x_at`` and ``d_at``."""
    base = sb * geo[0]
    d = scale(table, blocks, base, geo)
    for j in range(SUBS):
        w0, w1, w2, w3, s0, s1 = sub(blocks, base, j, d)
        group_words_pairs_fma(w0, w1, w2, w3, xq, x_at + Q8_ACT_BLOCK * j, cols, xd, d_at + j, nb, s0, s1, acc,
                              group)


@inline
def words_row_group(update, geo, group, r0, r1, i0, raw, xq, xd, xsum, table, out):  # noqa: ARG001 (row_groups')
    """``out[i0 + g, r]`` for ``g < group`` (a literal) and stored rows ``r0 <= r < r1``: each super-block by
    ``update`` (each sub-block's words made once for the group), fused into each row's lanes (in registers), the
    lanes summed in order (:func:`.int8.row_group`'s protocol, without minimums)."""
    nb, cols = xd.shape[1], xq.shape[1]
    acc, sums = stack_f32(ACC_FLOATS), stack_f32(GEMV_ROWS)
    s = carray(sums, (GEMV_ROWS,))
    for r in range(r0, r1):
        blocks = raw[r]
        lanes_zero(acc, group)
        for sb in range(nb // SUBS):
            update(table, blocks, sb, geo, xq, i0 * cols + sb * SUPER, cols, xd, i0 * nb + sb * SUBS, nb, acc, group)
        lanes_sums(acc, group, sums)
        for g in range(group):
            out[i0 + g, r] = s[g]


# Each type: its update (step and locator of kernels/lattice.py), the one-row and multi-row products, the row
# product called by address from the compiled decode step, the kernel class.

@inline
def _iq2_xxs_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group):
    _words_fma(_iq2_xxs, _d_at, table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group)


@compiled(LEGACY_GEMV)
def iq2_xxs_gemv1_q8(raw, xq, xd, table, out):
    words_row_group(_iq2_xxs_q8, IQ2_XXS_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def iq2_xxs_gemv_q8(raw, xq, xd, table, out):
    row_groups(words_row_group, _iq2_xxs_q8, IQ2_XXS_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq2_xxs_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_product(iq2_xxs_gemv1_q8, iq2_xxs_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                  table, out, out_stride)


class IQ2_XXSInt8Kernel(Int8Kernel):
    block, type_size, exact = IQ2_XXS().block_size, IQ2_XXS_GEO[0], ("lattice", "IQ2_XXSJitKernel")
    gemv1_q8, gemv_q8 = staticmethod(iq2_xxs_gemv1_q8), staticmethod(iq2_xxs_gemv_q8)
    q8_row_product = iq2_xxs_q8_rows


@inline
def _iq2_xs_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group):
    _words_fma(_iq2_xs, _d_at, table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group)


@compiled(LEGACY_GEMV)
def iq2_xs_gemv1_q8(raw, xq, xd, table, out):
    words_row_group(_iq2_xs_q8, IQ2_XS_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def iq2_xs_gemv_q8(raw, xq, xd, table, out):
    row_groups(words_row_group, _iq2_xs_q8, IQ2_XS_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq2_xs_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_product(iq2_xs_gemv1_q8, iq2_xs_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                  table, out, out_stride)


class IQ2_XSInt8Kernel(Int8Kernel):
    block, type_size, exact = IQ2_XS().block_size, IQ2_XS_GEO[0], ("lattice", "IQ2_XSJitKernel")
    gemv1_q8, gemv_q8 = staticmethod(iq2_xs_gemv1_q8), staticmethod(iq2_xs_gemv_q8)
    q8_row_product = iq2_xs_q8_rows


@inline
def _iq2_s_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group):
    _words_fma(_iq2_s, _d_at, table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group)


@compiled(LEGACY_GEMV)
def iq2_s_gemv1_q8(raw, xq, xd, table, out):
    words_row_group(_iq2_s_q8, IQ2_S_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def iq2_s_gemv_q8(raw, xq, xd, table, out):
    row_groups(words_row_group, _iq2_s_q8, IQ2_S_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq2_s_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_product(iq2_s_gemv1_q8, iq2_s_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                  table, out, out_stride)


class IQ2_SInt8Kernel(Int8Kernel):
    block, type_size, exact = IQ2_S().block_size, IQ2_S_GEO[0], ("lattice", "IQ2_SJitKernel")
    gemv1_q8, gemv_q8 = staticmethod(iq2_s_gemv1_q8), staticmethod(iq2_s_gemv_q8)
    q8_row_product = iq2_s_q8_rows


@inline
def _iq3_xxs_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group):
    _words_fma(_iq3_xxs, _d_at, table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group)


@compiled(LEGACY_GEMV)
def iq3_xxs_gemv1_q8(raw, xq, xd, table, out):
    words_row_group(_iq3_xxs_q8, IQ3_XXS_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def iq3_xxs_gemv_q8(raw, xq, xd, table, out):
    row_groups(words_row_group, _iq3_xxs_q8, IQ3_XXS_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq3_xxs_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_product(iq3_xxs_gemv1_q8, iq3_xxs_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                  table, out, out_stride)


class IQ3_XXSInt8Kernel(Int8Kernel):
    block, type_size, exact = IQ3_XXS().block_size, IQ3_XXS_GEO[0], ("lattice", "IQ3_XXSJitKernel")
    gemv1_q8, gemv_q8 = staticmethod(iq3_xxs_gemv1_q8), staticmethod(iq3_xxs_gemv_q8)
    q8_row_product = iq3_xxs_q8_rows


@inline
def _iq3_s_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group):
    _words_fma(_iq3_s, _d_at, table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group)


@compiled(LEGACY_GEMV)
def iq3_s_gemv1_q8(raw, xq, xd, table, out):
    words_row_group(_iq3_s_q8, IQ3_S_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def iq3_s_gemv_q8(raw, xq, xd, table, out):
    row_groups(words_row_group, _iq3_s_q8, IQ3_S_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq3_s_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_product(iq3_s_gemv1_q8, iq3_s_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                  table, out, out_stride)


class IQ3_SInt8Kernel(Int8Kernel):
    block, type_size, exact = IQ3_S().block_size, IQ3_S_GEO[0], ("lattice", "IQ3_SJitKernel")
    gemv1_q8, gemv_q8 = staticmethod(iq3_s_gemv1_q8), staticmethod(iq3_s_gemv_q8)
    q8_row_product = iq3_s_q8_rows


@inline
def _iq1_s_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group):
    _words_fma(_iq1_s, _d_at, table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group)


@compiled(LEGACY_GEMV)
def iq1_s_gemv1_q8(raw, xq, xd, table, out):
    words_row_group(_iq1_s_q8, IQ1_S_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def iq1_s_gemv_q8(raw, xq, xd, table, out):
    row_groups(words_row_group, _iq1_s_q8, IQ1_S_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq1_s_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_product(iq1_s_gemv1_q8, iq1_s_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                  table, out, out_stride)


class IQ1_SInt8Kernel(Int8Kernel):
    block, type_size, exact = IQ1_S().block_size, IQ1_S_GEO[0], ("lattice", "IQ1_SJitKernel")
    gemv1_q8, gemv_q8 = staticmethod(iq1_s_gemv1_q8), staticmethod(iq1_s_gemv_q8)
    q8_row_product = iq1_s_q8_rows


@inline
def _iq1_m_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group):
    _words_fma(_iq1_m, _iq1_m_d, table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group)


@compiled(LEGACY_GEMV)
def iq1_m_gemv1_q8(raw, xq, xd, table, out):
    words_row_group(_iq1_m_q8, IQ1_M_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def iq1_m_gemv_q8(raw, xq, xd, table, out):
    row_groups(words_row_group, _iq1_m_q8, IQ1_M_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def iq1_m_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_product(iq1_m_gemv1_q8, iq1_m_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                  table, out, out_stride)


class IQ1_MInt8Kernel(Int8Kernel):
    block, type_size, exact = IQ1_M().block_size, IQ1_M_GEO[0], ("lattice", "IQ1_MJitKernel")
    gemv1_q8, gemv_q8 = staticmethod(iq1_m_gemv1_q8), staticmethod(iq1_m_gemv_q8)
    q8_row_product = iq1_m_q8_rows


@inline
def _tq2_0_q8(table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group):
    _words_fma(_tq2_0, _d_at, table, blocks, sb, geo, xq, x_at, cols, xd, d_at, nb, acc, group)


@compiled(LEGACY_GEMV)
def tq2_0_gemv1_q8(raw, xq, xd, table, out):
    words_row_group(_tq2_0_q8, TQ2_0_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def tq2_0_gemv_q8(raw, xq, xd, table, out):
    row_groups(words_row_group, _tq2_0_q8, TQ2_0_GEO, raw, xq, xd, xd, table, out)


@q8_cfunc
def tq2_0_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_product(tq2_0_gemv1_q8, tq2_0_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                  table, out, out_stride)


class TQ2_0Int8Kernel(Int8Kernel):
    block, type_size, exact = TQ2_0().block_size, TQ2_0_GEO[0], ("lattice", "TQ2_0JitKernel")
    gemv1_q8, gemv_q8 = staticmethod(tq2_0_gemv1_q8), staticmethod(tq2_0_gemv_q8)
    q8_row_product = tq2_0_q8_rows
