"""Compiled Q8_0 kernels (numba): the blocks of :mod:`.q8_0` read in place, no widened copy of anything.

A block is a float16 scale ``d`` (2 bytes, little-endian) then 32 int8 ``q``: value = d * q, exact in float32
(an 11-bit significand times an 8-bit integer).  Row ``i`` of the product keeps 32 lanes
``acc[k] = fma(d[b] * f32(q[b, k]), x[i, b*32 + k], acc[k])`` over the blocks ``b`` (see :mod:`.jit_base`);
``d`` comes from :data:`~.jit_base.F16_TABLE`.

Assembly (numba 0.68, this Xeon with AVX-512; ``inspect_asm``): per block a ``vbroadcastss`` of the scale, two
``vpmovsxbd`` (16 int8 each), ``vcvtdq2ps`` and ``vmulps`` on zmm, then per row of the group two
``vfmadd231ps`` with the activations as memory operands into accumulators held in zmm registers.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .jit_base import (
    F16_TABLE,
    F32_1D,
    F32_2D,
    F32_2D_C,
    FETCH_PAIR,
    HALF,
    I8_2D,
    LANES,
    PAIR,
    V16_F32,
    JitKernel,
    compiled,
    deposit,
    fetch_block,
    first_fetch,
    gemv1_rows,
    gemv_groups,
    inline,
    lanes_at,
    lanes_sum,
    pair_rows,
    prefetch,
    row_cfunc,
    rows_fma,
    splat,
    stored_row,
    table_product,
    zero_lanes,
)
from .q8_0 import Q8_0_BLOCK, Q8_0_BYTES

V16_I8 = ir.VectorType(ir.IntType(8), HALF)


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


@inline
def q8_0_block(table, blocks, b, x, i0, rows, acc, how):
    """Block ``b`` of a stored row times ``rows`` activation rows into their lanes at ``acc`` (``how``: its
    :func:`.jit_base.fetch_block`)."""
    o = b * Q8_0_BYTES
    fetch_block(prefetch, blocks, o, Q8_0_BYTES, how)
    d = table[np.int64(np.uint8(blocks[o])) | (np.int64(np.uint8(blocks[o + 1])) << 8)]
    q8_block_fma(blocks, o + 2, d, x, i0, b * LANES, rows, acc)


@inline
def q8_0_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    """``out[i0 + i, r + s] (+)= x[i0 + i, c0:c1] @ W[r + s, c0:c1]`` for ``i < rows`` (a literal) and the ``s <
    stored`` rows of :func:`.jit_base.pair_rows`: the lanes of the group in registers."""
    (table,) = args
    zero_lanes(acc, rows * stored)
    first, second = pair_rows(raw, r, stored)
    for b in range(c0 // LANES, c1 // LANES):
        q8_0_block(table, first, b, x, i0, rows, acc, first_fetch(stored))
        if stored == 2:
            q8_0_block(table, second, b, x, i0, rows, lanes_at(acc, rows), FETCH_PAIR)
    for s in range(stored):
        if stored_row(raw, r, s):
            for i in range(rows):
                deposit(out, i0 + i, r + s, lanes_sum(acc, s * rows + i), c0)


@compiled(types.void(I8_2D, F32_2D_C, F32_1D, F32_2D))
def q8_0_gemv1(raw, x, table, out):
    """``out[0, r] = x[0] @ W[r]`` for Q8_0 rows ``raw`` (int8 view) [R, nb * 34], ``x`` [1, nb * 32]."""
    gemv1_rows(q8_0_group, PAIR, raw, x, (table,), out, 0)


@compiled(types.void(I8_2D, F32_2D_C, F32_1D, F32_2D))
def q8_0_gemv(raw, x, table, out):
    """``out[i, r] = x[i] @ W[r]`` for 1..GEMV_ROWS rows of ``x``, each by :func:`q8_0_gemv1`'s operations."""
    gemv_groups(q8_0_group, raw, x, (table,), out, 0)


@compiled(types.void(I8_2D, F32_1D, F32_2D_C))
def q8_0_decode(raw, table, tile):
    """``tile`` [R, nb * 32] = the Q8_0 rows decoded (``d * q`` in float32, as the reference)."""
    nb = tile.shape[1] // 32
    width = tile.shape[1] // nb  # 32, hidden from the compiler: a constant trip count compiled to scalar code
    for r in range(raw.shape[0]):
        blocks, row = raw[r], tile[r]
        for b in range(nb):
            q = blocks[b * 34: b * 34 + 34]
            d = table[np.int64(np.uint8(q[0])) | (np.int64(np.uint8(q[1])) << 8)]
            for k in range(width):
                row[b * 32 + k] = d * np.float32(q[2 + k])


@row_cfunc
def q8_0_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    """The :data:`~.jit_base.ROW_PRODUCT` of Q8_0 (the stored rows as int8)."""
    table_product(q8_0_gemv1, q8_0_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride,
                  np.int8)


class Q8_0JitKernel(JitKernel):
    block, type_size = Q8_0_BLOCK, Q8_0_BYTES
    constants = (F16_TABLE,)
    gemv1 = staticmethod(q8_0_gemv1)
    gemv = staticmethod(q8_0_gemv)
    decode = staticmethod(q8_0_decode)
    row_product = q8_0_rows

    def stored(self, raw: np.ndarray) -> np.ndarray:
        return raw.view(np.int8)
