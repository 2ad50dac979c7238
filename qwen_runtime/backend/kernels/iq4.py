"""Compiled kernels of the non-linear 4-bit types IQ4_NL and IQ4_XS (numba): the blocks of :mod:`.iq4` read in
place.

Both are read as blocks of 32 values whose 16 bytes hold value ``k``'s level index in the low nibble of byte
``k`` and value ``16 + k``'s in the high one, as Q4_0: the loops of :mod:`.legacy` run them, with the
level ``IQ4_LEVELS[index]`` (exact in float32) in place of ``q - bias`` (:func:`.legacy.levels_rows`).
IQ4_NL's block scale is its float16 ``d``; an IQ4_XS super-block of 256 values gives its 8 sub-blocks the scale
``d * (ls_j - 32)`` (the 6-bit ``ls_j`` from ``scales_l`` and ``scales_h``), computed as the reference does.
The weight ``scale * level`` is exact in float32 (an 11-bit significand times at most 6 and 7 bits).

Assembly (numba 0.68, this Xeon with AVX-512; ``inspect_asm``): per block ``vpand``/``vgf2p8affineqb`` (the
indices), ``vpshufb`` (the 16 levels as int8), ``vpmovsxbd``, ``vcvtdq2ps`` and ``vmulps`` (scale * level) on
zmm, then per row of the group two ``vfmadd231ps`` into accumulators held in registers.  A first version that
gathered float levels from a table (``vgatherqps``) could not hoist the gathers and ran 8 rows in 1.9x the CPU
time of decode + BLAS.
"""

from __future__ import annotations

import numpy as np

from ...quants.base import QType
from ...quants.iq4 import IQ4_NL, IQ4_XS
from .base import (
    LANES,
    PAIR,
    SUMS_GEMV,
    TABLE_DECODE,
    BlockSumsKernel,
    block_at,
    compiled,
    f16_at,
    gemv1_rows,
    gemv_groups,
    group_loop,
    inline,
    row_cfunc,
    sums_product,
)
from .legacy import decode_loop, levels_decode, levels_rows

IQ4_NL_GEO = (IQ4_NL().type_size, 2, 0, False)  # as jit_legacy's: bytes, first byte of qs, -, -
XS_BYTES, XS_SUBS = IQ4_XS().type_size, IQ4_XS().block_size // LANES  # 136 bytes, 8 sub-blocks of 32
IQ4_XS_GEO = (XS_BYTES, 8, 0, False)  # first byte of qs: after d, scales_h and scales_l[4]


@inline
def _levels(blocks, o, geo, d, x, i0, col, rows, acc):
    """``acc[i, k] = fma(d * level[k], x[i0 + i, col + k], acc[i, k])`` for the 32 values of the block whose qs
    start at byte ``o + geo[1]`` (``d * level`` exact)."""
    levels_rows(blocks, o + geo[1], None, 0, d, x, i0, col, rows, acc)


@inline
def _level_values(blocks, o, geo, d, start, out):
    """``out[k]`` = ``d * level[k] + start`` for the block whose qs start at byte ``o + geo[1]``."""
    levels_decode(blocks, o + geo[1], None, 0, d, start, out)


@inline
def _xs_sub_block_at(table, blocks, b, geo):
    """(byte such that its qs start at ``+ geo[1]``, scale ``d * (ls - 32)``, 0) of the 32-value sub-block ``b``
    of an IQ4_XS row."""
    sb, j = b // XS_SUBS, b % XS_SUBS
    o = sb * XS_BYTES
    low = (np.int64(blocks[o + 4 + j // 2]) >> (4 * (j % 2))) & 15
    high = (((np.int64(blocks[o + 2]) | (np.int64(blocks[o + 3]) << 8)) >> (2 * j)) & 3) << 4
    return o + 16 * j, f16_at(table, blocks, o) * np.float32(low + high - 32), np.float32(0)


@inline
def iq4_nl_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_levels, block_at, IQ4_NL_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def iq4_nl_gemv1(raw, x, sums, table, out):
    gemv1_rows(iq4_nl_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def iq4_nl_gemv(raw, x, sums, table, out):
    gemv_groups(iq4_nl_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def iq4_nl_decode(raw, table, tile):
    decode_loop(_level_values, block_at, IQ4_NL_GEO, raw, table, tile)


@inline
def iq4_xs_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_levels, _xs_sub_block_at, IQ4_XS_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def iq4_xs_gemv1(raw, x, sums, table, out):
    gemv1_rows(iq4_xs_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def iq4_xs_gemv(raw, x, sums, table, out):
    gemv_groups(iq4_xs_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE, contract=False)
def iq4_xs_decode(raw, table, tile):
    decode_loop(_level_values, _xs_sub_block_at, IQ4_XS_GEO, raw, table, tile)


@row_cfunc
def iq4_nl_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(iq4_nl_gemv1, iq4_nl_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


@row_cfunc
def iq4_xs_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    sums_product(iq4_xs_gemv1, iq4_xs_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


class IQ4_NLJitKernel(BlockSumsKernel):
    qtype = QType.IQ4_NL
    qtype, type_size = QType.IQ4_NL, IQ4_NL_GEO[0]
    gemv1, gemv, decode = staticmethod(iq4_nl_gemv1), staticmethod(iq4_nl_gemv), staticmethod(iq4_nl_decode)
    row_product = iq4_nl_rows


class IQ4_XSJitKernel(BlockSumsKernel):
    qtype = QType.IQ4_XS
    qtype, block, type_size = QType.IQ4_XS, IQ4_XS().block_size, XS_BYTES
    gemv1, gemv, decode = staticmethod(iq4_xs_gemv1), staticmethod(iq4_xs_gemv), staticmethod(iq4_xs_decode)
    row_product = iq4_xs_rows


# This family's float kernels (:func:`.kernel_table`).
KERNELS = (IQ4_NLJitKernel, IQ4_XSJitKernel)
