"""Compiled Q8_0 kernels (numba): the blocks of :mod:`.q8_0` read in place, no widened copy of anything.

A block is a float16 scale ``d`` (2 bytes, little-endian) then 32 int8 ``q``: value = d * q, exact in float32
(an 11-bit significand times an 8-bit integer).  Row ``i`` of the product keeps 32 lanes
``acc[k] = fma(d[b] * f32(q[b, k]), x[i, b*32 + k], acc[k])`` over the blocks ``b`` (the loop of
the 32-value types, :func:`.base.group_loop`); ``d`` comes from :data:`~.base.F16_TABLE`.

Assembly (numba 0.68, this Xeon with AVX-512; ``inspect_asm``): per block a ``vbroadcastss`` of the scale, two
``vpmovsxbd`` (16 int8 each), ``vcvtdq2ps`` and ``vmulps`` on zmm, then per row of the group two
``vfmadd231ps`` with the activations as memory operands into accumulators held in zmm registers.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ...quants.base import QType
from ...quants.q8_0 import Q8_0_BYTES
from .base import (
    LANES,
    PAIR,
    SUMS_GEMV,
    TABLE_DECODE,
    V16_F32,
    V16_I8,
    BlockSumsKernel,
    block_at,
    compiled,
    gemv1_rows,
    gemv_groups,
    group_loop,
    inline,
    row_cfunc,
    rows_fma,
    splat,
    sums_product,
)


@intrinsic
def q8_block_fma(typingctx, blocks, at, d, x, i0, col, rows, acc):  # noqa: ARG001 (numba's intrinsic protocol)
    """``acc[i, k] = fma(d * f32(q[k]), x[i0 + i, col + k], acc[i, k])`` for ``i < rows`` (a literal), the 32 int8
    ``q`` at ``blocks[at]``."""
    if not isinstance(rows, types.IntegerLiteral):
        return None
    count = rows.literal_value

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        q = builder.bitcast(builder.gep(data, [args[1]]), V16_I8.as_pointer())
        scale = splat(builder, args[2], V16_F32)
        w = [builder.fmul(builder.sitofp(builder.load(builder.gep(q, [ir.IntType(32)(h)]), align=1), V16_F32), scale)
             for h in range(2)]
        rows_fma(context, builder, signature.args[3], args[3], args[4], args[5], count, args[7], w)
        return context.get_dummy_value()

    return types.void(blocks, at, d, x, i0, col, rows, acc), codegen


Q8_0_GEO = (Q8_0_BYTES, 2, 0, False)  # bytes per block, first byte of q (after d), -, no minimum


@inline
def _q8(blocks, o, geo, d, x, i0, col, rows, acc):
    """``acc[i, k] = fma(d * f32(q[k]), x[i0 + i, col + k], acc[i, k])`` for the block at byte ``o``."""
    q8_block_fma(blocks, o + geo[1], d, x, i0, col, rows, acc)


@inline
def q8_0_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    group_loop(_q8, block_at, Q8_0_GEO, rows, stored, raw, r, x, i0, c0, c1, args, out, acc)


@compiled(SUMS_GEMV)
def q8_0_gemv1(raw, x, sums, table, out):
    """``out[0, r] = x[0] @ W[r]`` for Q8_0 rows ``raw`` [R, nb * 34], ``x`` [1, nb * 32] (``sums`` [1, 0])."""
    gemv1_rows(q8_0_group, PAIR, raw, x, (sums, table), out, 0)


@compiled(SUMS_GEMV)
def q8_0_gemv(raw, x, sums, table, out):
    """``out[i, r] = x[i] @ W[r]`` for 1..GEMV_ROWS rows of ``x``, each by :func:`q8_0_gemv1`'s operations."""
    gemv_groups(q8_0_group, raw, x, (sums, table), out, 0)


@compiled(TABLE_DECODE)
def q8_0_decode(raw, table, tile):
    """``tile`` [R, nb * 32] = the Q8_0 rows decoded (``d * q`` in float32, as the reference)."""
    nb = tile.shape[1] // LANES
    width = tile.shape[1] // nb  # 32, hidden from the compiler: a constant trip count compiled to scalar code
    for r in range(raw.shape[0]):
        blocks, row = raw[r], tile[r]
        for b in range(nb):
            o, d, _ = block_at(table, blocks, b, Q8_0_GEO)
            for k in range(width):
                row[b * LANES + k] = d * np.float32(np.int8(blocks[o + Q8_0_GEO[1] + k]))


@row_cfunc
def q8_0_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    """The :data:`~.base.ROW_PRODUCT` of Q8_0."""
    sums_product(q8_0_gemv1, q8_0_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)


class Q8_0JitKernel(BlockSumsKernel):
    qtype = QType.Q8_0
    type_size = Q8_0_BYTES
    gemv1, gemv, decode = staticmethod(q8_0_gemv1), staticmethod(q8_0_gemv), staticmethod(q8_0_decode)
    row_product = q8_0_rows


# This family's float kernels (:func:`.kernel_table`).
KERNELS = (Q8_0JitKernel,)
