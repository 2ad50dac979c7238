"""Compiled kernels of the types whose 32-value (sub-)blocks hold 4-bit indices in 16 bytes (numba): Q4_0, Q4_1,
Q5_0, Q5_1, IQ4_NL and IQ4_XS (8 such sub-blocks per 256, with 6-bit scales), the blocks of :mod:`.legacy`
and :mod:`.iq4` read in place.

Lane ``k`` of a block is value ``k``: the low nibble of ``qs[k]`` for k < 16, the high nibble of ``qs[k - 16]``
above, plus bit ``k`` of the little-endian ``qh`` as bit 4 for the 5-bit types; minus the type's bias (Q4_0:
8, Q5_0: 16), or through the level table for IQ4_NL.  Q4_1 and Q5_1 add ``m * sum(x over the block)`` from
per-32 activation sums computed once per product, kept in one scalar per row.

One generic body per function (:func:`legacy_gemv` and friends), inlined by numba into each type's kernel with
the layout as constants, so each type compiles to its own straight-line code.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import carray, types

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
    stack_f32,
)
from .jit_kquants import M4, S4, sums_per_32

ONE = np.uint8(1)
IQ4_LEVELS_F32 = IQ4_LEVELS.astype(np.float32)


@numba.njit(inline="always")
def nibble_values(blk, k, qh, qs_at, qh_at, levels):
    """Values ``k`` and ``k + 16`` of a block before scaling (bias not removed), as float32: the nibbles of
    ``qs[k]`` plus bits ``k`` and ``k + 16`` of ``qh`` (the block's uint32; used when ``qh_at >= 0``) as bit 4,
    or their levels from ``levels`` when ``qs_at`` is negative (IQ4_NL: ``-qs_at`` is where qs is)."""
    byte = blk[(qs_at if qs_at > 0 else -qs_at) + k]
    lo, hi = np.uint32(byte & M4), np.uint32(byte >> S4)
    if qh_at >= 0:
        lo |= ((qh >> np.uint32(k)) & np.uint32(1)) << np.uint32(4)
        hi |= ((qh >> np.uint32(k + 16)) & np.uint32(1)) << np.uint32(4)
    if qs_at < 0:
        return levels[lo], levels[hi]
    return np.float32(lo), np.float32(hi)


@numba.njit(inline="always")
def block_scales(blk, table, qh_at, with_min):
    """(d, m or 0, qh as uint32 or 0) of one block."""
    d = table[np.int64(blk[0]) | (np.int64(blk[1]) << 8)]
    m = table[np.int64(blk[2]) | (np.int64(blk[3]) << 8)] if with_min else np.float32(0)
    qh = np.uint32(0)
    if qh_at >= 0:
        qh = np.uint32(blk[qh_at]) | (np.uint32(blk[qh_at + 1]) << np.uint32(8)) | \
            (np.uint32(blk[qh_at + 2]) << np.uint32(16)) | (np.uint32(blk[qh_at + 3]) << np.uint32(24))
    return d, m, qh


@numba.njit(inline="always")
def legacy_gemv(raw, x, xsum, table, levels, out, size, qs_at, qh_at, bias, with_min, one_row):
    """``out[i, r] = x[i] @ W[r]`` (module docstring); ``one_row``: a single activation row, lanes in registers.
    The lane loop runs over the 16 bytes of qs (two lanes each) with a trip count the compiler cannot see, so
    that it is vectorized instead of unrolled into scalar code."""
    n, nb = x.shape[0], x.shape[1] // 32
    half = x.shape[1] // nb // 2  # 16
    acc = carray(stack_f32(ACC_FLOATS), (GEMV_ROWS, LANES))
    mins = carray(stack_f32(GEMV_ROWS), (GEMV_ROWS,))
    lanes = carray(stack_f32(LANES), (LANES,))
    rows = 1 if one_row else n
    for r in range(raw.shape[0]):
        for i in range(rows):
            mins[i] = 0
            for k in range(32):
                acc[i, k] = 0
        if one_row:
            for k in range(32):
                lanes[k] = 0
        for b in range(nb):
            blk = raw[r, b * size: b * size + size]
            d, m, qh = block_scales(blk, table, qh_at, with_min)
            if one_row:
                xs = x[0, b * 32: b * 32 + 32]
                if with_min:
                    mins[0] += m * xsum[0, b]
                for k in range(half):
                    lo, hi = nibble_values(blk, k, qh, qs_at, qh_at, levels)
                    lanes[k] += (lo - bias) * (xs[k] * d)
                    lanes[k + 16] += (hi - bias) * (xs[k + 16] * d)
                continue
            for i in range(rows):
                xs = x[i, b * 32: b * 32 + 32]
                if with_min:
                    mins[i] += m * xsum[i, b]
                a = acc[i]
                for k in range(half):
                    lo, hi = nibble_values(blk, k, qh, qs_at, qh_at, levels)
                    a[k] += (lo - bias) * (xs[k] * d)
                    a[k + 16] += (hi - bias) * (xs[k + 16] * d)
        for i in range(rows):
            s = np.float32(0)
            for k in range(32):
                s += lanes[k] if one_row else acc[i, k]
            out[i, r] = s + mins[i]


@numba.njit(inline="always")
def legacy_decode(raw, table, levels, tile, size, qs_at, qh_at, bias, with_min):
    """``tile`` [R, nb * 32] = the rows decoded as the reference does (``d * (q - bias)``, ``d * q + m``)."""
    nb = tile.shape[1] // 32
    half = tile.shape[1] // nb // 2
    for r in range(raw.shape[0]):
        row = tile[r]
        for b in range(nb):
            blk = raw[r, b * size: b * size + size]
            d, m, qh = block_scales(blk, table, qh_at, with_min)
            for k in range(half):
                lo, hi = nibble_values(blk, k, qh, qs_at, qh_at, levels)
                v0, v1 = d * (lo - bias), d * (hi - bias)
                row[b * 32 + k] = v0 + m if with_min else v0
                row[b * 32 + k + 16] = v1 + m if with_min else v1


GEMV = types.void(U8_2D, F32_2D_C, F32_2D_C, F32_1D, F32_1D, F32_2D)
DECODE = types.void(U8_2D, F32_1D, F32_1D, F32_2D_C)
NONE = np.float32(0)


# Per type: bytes per block, where qs starts (negative: through the IQ4 levels), where qh starts (-1: none), the
# bias and whether a minimum is added.
@compiled(GEMV)
def q4_0_gemv(raw, x, xsum, table, levels, out):
    legacy_gemv(raw, x, xsum, table, levels, out, 18, 2, -1, np.float32(8), False, False)


@compiled(GEMV)
def q4_0_gemv1(raw, x, xsum, table, levels, out):
    legacy_gemv(raw, x, xsum, table, levels, out, 18, 2, -1, np.float32(8), False, True)


@compiled(DECODE, contract=False)
def q4_0_decode(raw, table, levels, tile):
    legacy_decode(raw, table, levels, tile, 18, 2, -1, np.float32(8), False)


@compiled(GEMV)
def q4_1_gemv(raw, x, xsum, table, levels, out):
    legacy_gemv(raw, x, xsum, table, levels, out, 20, 4, -1, NONE, True, False)


@compiled(GEMV)
def q4_1_gemv1(raw, x, xsum, table, levels, out):
    legacy_gemv(raw, x, xsum, table, levels, out, 20, 4, -1, NONE, True, True)


@compiled(DECODE, contract=False)
def q4_1_decode(raw, table, levels, tile):
    legacy_decode(raw, table, levels, tile, 20, 4, -1, NONE, True)


@compiled(GEMV)
def q5_0_gemv(raw, x, xsum, table, levels, out):
    legacy_gemv(raw, x, xsum, table, levels, out, 22, 6, 2, np.float32(16), False, False)


@compiled(GEMV)
def q5_0_gemv1(raw, x, xsum, table, levels, out):
    legacy_gemv(raw, x, xsum, table, levels, out, 22, 6, 2, np.float32(16), False, True)


@compiled(DECODE, contract=False)
def q5_0_decode(raw, table, levels, tile):
    legacy_decode(raw, table, levels, tile, 22, 6, 2, np.float32(16), False)


@compiled(GEMV)
def q5_1_gemv(raw, x, xsum, table, levels, out):
    legacy_gemv(raw, x, xsum, table, levels, out, 24, 8, 4, NONE, True, False)


@compiled(GEMV)
def q5_1_gemv1(raw, x, xsum, table, levels, out):
    legacy_gemv(raw, x, xsum, table, levels, out, 24, 8, 4, NONE, True, True)


@compiled(DECODE, contract=False)
def q5_1_decode(raw, table, levels, tile):
    legacy_decode(raw, table, levels, tile, 24, 8, 4, NONE, True)


@compiled(GEMV)
def iq4_nl_gemv(raw, x, xsum, table, levels, out):
    legacy_gemv(raw, x, xsum, table, levels, out, 18, -2, -1, NONE, False, False)


@compiled(GEMV)
def iq4_nl_gemv1(raw, x, xsum, table, levels, out):
    legacy_gemv(raw, x, xsum, table, levels, out, 18, -2, -1, NONE, False, True)


@compiled(DECODE, contract=False)
def iq4_nl_decode(raw, table, levels, tile):
    legacy_decode(raw, table, levels, tile, 18, -2, -1, NONE, False)


class LegacyJitKernel(JitKernel):
    """One of the 32-value types: ``x`` sums per block ride along for every type (unused without a minimum)."""

    block = 32
    constants = (F16_TABLE, np.empty(0, np.float32))

    def activations(self, x: np.ndarray) -> tuple:
        return (sums_per_32(x),)


class Q4_0JitKernel(LegacyJitKernel):
    type_size = 18
    gemv1, gemv, decode = staticmethod(q4_0_gemv1), staticmethod(q4_0_gemv), staticmethod(q4_0_decode)


class Q4_1JitKernel(LegacyJitKernel):
    type_size = 20
    gemv1, gemv, decode = staticmethod(q4_1_gemv1), staticmethod(q4_1_gemv), staticmethod(q4_1_decode)


class Q5_0JitKernel(LegacyJitKernel):
    type_size = 22
    gemv1, gemv, decode = staticmethod(q5_0_gemv1), staticmethod(q5_0_gemv), staticmethod(q5_0_decode)


class Q5_1JitKernel(LegacyJitKernel):
    type_size = 24
    gemv1, gemv, decode = staticmethod(q5_1_gemv1), staticmethod(q5_1_gemv), staticmethod(q5_1_decode)


class IQ4_NLJitKernel(LegacyJitKernel):
    type_size = 18
    constants = (F16_TABLE, IQ4_LEVELS_F32)
    gemv1, gemv, decode = staticmethod(iq4_nl_gemv1), staticmethod(iq4_nl_gemv), staticmethod(iq4_nl_decode)


@numba.njit(inline="always")
def iq4_xs_scale(blk, d, j):
    """``d * (ls_j - 32)`` of sub-block ``j`` of an IQ4_XS block: nibble ``j % 2`` of ``scales_l[j // 2]``
    (bytes 4..7) and bits ``2j, 2j + 1`` of the little-endian ``scales_h`` (bytes 2..3) as bits 4-5."""
    high = np.int64(blk[2]) | (np.int64(blk[3]) << 8)
    ls = ((np.int64(blk[4 + j // 2]) >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)
    return d * np.float32(ls - 32)


@numba.njit(inline="always")
def iq4_xs_rows(raw, x, table, levels, out, one_row):
    """``out[i, r] = x[i] @ W[r]`` for IQ4_XS rows [R, nb * 136]: per sub-block j of 32, lanes k and k + 16 take
    the levels of the nibbles of ``qs[16j + k]`` (bytes 8..135), scaled by :func:`iq4_xs_scale`."""
    n, nb = x.shape[0], x.shape[1] // 256
    half = x.shape[1] // (nb * 16)  # 16, hidden from the compiler so that the lane loop is vectorized
    acc = carray(stack_f32(ACC_FLOATS), (GEMV_ROWS, LANES))
    lanes = carray(stack_f32(LANES), (LANES,))
    rows = 1 if one_row else n
    for r in range(raw.shape[0]):
        for i in range(rows):
            for k in range(32):
                acc[i, k] = 0
        for k in range(32):
            lanes[k] = 0
        for b in range(nb):
            blk = raw[r, b * 136: b * 136 + 136]
            d = table[np.int64(blk[0]) | (np.int64(blk[1]) << 8)]
            for j in range(8):
                dl = iq4_xs_scale(blk, d, j)
                qs = blk[8 + 16 * j: 24 + 16 * j]
                for i in range(rows):
                    xs = x[i, b * 256 + 32 * j: b * 256 + 32 * j + 32]
                    a = lanes if one_row else acc[i]
                    for k in range(half):
                        a[k] += levels[qs[k] & M4] * (xs[k] * dl)
                        a[k + 16] += levels[qs[k] >> S4] * (xs[k + 16] * dl)
        for i in range(rows):
            a = lanes if one_row else acc[i]
            s = np.float32(0)
            for k in range(32):
                s += a[k]
            out[i, r] = s


IQ4_XS_GEMV = types.void(U8_2D, F32_2D_C, F32_1D, F32_1D, F32_2D)


@compiled(IQ4_XS_GEMV)
def iq4_xs_gemv1(raw, x, table, levels, out):
    iq4_xs_rows(raw, x, table, levels, out, True)


@compiled(IQ4_XS_GEMV)
def iq4_xs_gemv(raw, x, table, levels, out):
    iq4_xs_rows(raw, x, table, levels, out, False)


@compiled(DECODE, contract=False)
def iq4_xs_decode(raw, table, levels, tile):
    """``tile`` [R, nb * 256] = IQ4_XS rows decoded (``(d * (ls - 32)) * level``, as the reference)."""
    nb = tile.shape[1] // 256
    for r in range(raw.shape[0]):
        row = tile[r]
        for b in range(nb):
            blk = raw[r, b * 136: b * 136 + 136]
            d = table[np.int64(blk[0]) | (np.int64(blk[1]) << 8)]
            for j in range(8):
                dl = iq4_xs_scale(blk, d, j)
                for k in range(16):
                    byte = blk[8 + 16 * j + k]
                    row[b * 256 + 32 * j + k] = dl * levels[byte & M4]
                    row[b * 256 + 32 * j + 16 + k] = dl * levels[byte >> S4]


class IQ4_XSJitKernel(JitKernel):
    block, type_size = 256, 136
    constants = (F16_TABLE, IQ4_LEVELS_F32)
    gemv1, gemv, decode = staticmethod(iq4_xs_gemv1), staticmethod(iq4_xs_gemv), staticmethod(iq4_xs_decode)
