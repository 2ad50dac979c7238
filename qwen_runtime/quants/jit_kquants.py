"""Compiled K-quant kernels (numba): Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, the blocks of :mod:`.kquants` read in
place.

Bit layouts are those of :mod:`.kquants`' docstring.  Per super-block of 256 values the sub-block scales are
decoded (a few integer operations) and folded into the activations: lane ``l`` of a row adds
``f32(q) * (x * (d * sc_j))`` for each sub-block ``j`` that feeds it.

* Q4_K: 4 chunks of 32 bytes; lane ``l`` of chunk ``c`` takes the low nibble (value ``64c + l``, sub-block
  ``2c``) and the high nibble (value ``64c + 32 + l``, sub-block ``2c + 1``); Q5_K adds bits ``2c`` and
  ``2c + 1`` of ``qh[l]`` as bit 4 (one generic body, :func:`k45_gemv`, inlined with each type's size).
  The ``dmin * m_j`` terms are ``(dmin * m_j) * sum(x over sub-block j)``, from per-32 activation sums
  computed once per product (:meth:`Q4_KJitKernel.activations`) and kept in one scalar per row.
* Q6_K: 2 halves of 128 values; in half ``h``, step ``s`` (0..3), lane ``l`` is value ``128h + 32s + l``:
  nibble ``s // 2`` of ``ql[64h + 32(s % 2) + l]`` and bits ``2s, 2s+1`` of ``qh[32h + l]`` as bits 4-5,
  minus 32; lanes 0-15 and 16-31 belong to sub-blocks ``8h + 2s`` and ``8h + 2s + 1``.
* Q2_K and Q3_K: the same steps over 2-bit fields (Q3_K minus 4 where its hmask bit is clear), 16 sub-block
  scales per block; Q2_K's ``dmin * m_j`` terms from per-16 activation sums, as Q4_K's.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import carray, types

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

QK_K = 256
Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES = 144, 176, 210
# uint8 constants keep the bit arithmetic in 8-bit lanes (numba widens uint8 op int64 to int64, which does not
# vectorize); f32(q) - 32 equals f32(q - 32) exactly for 6-bit q.
M6, M4, M2, S6, S4, ONE = np.uint8(63), np.uint8(15), np.uint8(3), np.uint8(6), np.uint8(4), np.uint8(1)
Q6_BIAS = np.float32(32)


@compiled(types.void(types.Array(types.uint8, 1, "C", readonly=True), F32_1D, F32_1D, F32_1D))
def q4_k_scales(blk, table, ds, dm):
    """``ds[j] = d * sc_j`` and ``dm[j] = dmin * m_j`` (j < 8) of one Q4_K/Q5_K block (6-bit values packed in
    bytes 4..15, float16 d and dmin in bytes 0..3), as the reference computes them."""
    d = table[np.int64(blk[0]) | (np.int64(blk[1]) << 8)]
    dmin = table[np.int64(blk[2]) | (np.int64(blk[3]) << 8)]
    for j in range(4):
        ds[j] = d * np.float32(blk[4 + j] & M6)
        dm[j] = dmin * np.float32(blk[8 + j] & M6)
        ds[j + 4] = d * np.float32((blk[12 + j] & M4) | ((blk[4 + j] >> S6) << S4))
        dm[j + 4] = dmin * np.float32((blk[12 + j] >> S4) | ((blk[8 + j] >> S6) << S4))


@numba.njit(inline="always")
def k45_value(blk, qs, k, c, high, size):
    """Values ``64c + k`` (``high`` 0) or ``64c + 32 + k`` (1) of a Q4_K (size 144) or Q5_K (176) block, as
    float32: a nibble of ``qs[k]``, plus for Q5_K bit ``2c + high`` of ``qh[k]`` (bytes 16..47) as bit 4."""
    q = np.uint8(qs[k] >> S4) if high else np.uint8(qs[k] & M4)
    if size == Q5_K_BYTES:
        q |= np.uint8(((blk[16 + k] >> np.uint8(2 * c + high)) & ONE) << S4)
    return np.float32(q)


@numba.njit(inline="always")
def k45_gemv(raw, x, xsum, table, out, size, one_row):
    """``out[i, r] = x[i] @ W[r]`` for Q4_K/Q5_K rows ``raw`` [R, nb * size]; ``xsum`` [N, nb * 8] sums x per 32;
    ``one_row``: a single activation row, lanes in registers."""
    n, nb = x.shape[0], x.shape[1] // 256
    qs_at = size - 128
    acc = carray(stack_f32(ACC_FLOATS), (GEMV_ROWS, LANES))
    lanes = carray(stack_f32(LANES), (LANES,))
    mins = carray(stack_f32(GEMV_ROWS), (GEMV_ROWS,))
    ds, dm = carray(stack_f32(8), (8,)), carray(stack_f32(8), (8,))
    rows = 1 if one_row else n
    for r in range(raw.shape[0]):
        for i in range(rows):
            mins[i] = 0
            for k in range(32):
                acc[i, k] = 0
        for k in range(32):
            lanes[k] = 0
        for b in range(nb):
            blk = raw[r, b * size: b * size + size]
            prefetch(blk, 0)
            q4_k_scales(blk, table, ds, dm)
            for c in range(4):
                d0, d1 = ds[2 * c], ds[2 * c + 1]
                qs = blk[qs_at + 32 * c: qs_at + 32 * c + 32]
                for i in range(rows):
                    mins[i] += dm[2 * c] * xsum[i, b * 8 + 2 * c] + dm[2 * c + 1] * xsum[i, b * 8 + 2 * c + 1]
                    x0 = x[i, b * 256 + 64 * c: b * 256 + 64 * c + 32]
                    x1 = x[i, b * 256 + 64 * c + 32: b * 256 + 64 * c + 64]
                    a = lanes if one_row else acc[i]
                    for k in range(32):
                        a[k] += k45_value(blk, qs, k, c, 0, size) * (x0[k] * d0) + \
                            k45_value(blk, qs, k, c, 1, size) * (x1[k] * d1)
        for i in range(rows):
            a = lanes if one_row else acc[i]
            s = np.float32(0)
            for k in range(32):
                s += a[k]
            out[i, r] = s - mins[i]


@numba.njit(inline="always")
def k45_decode(raw, table, tile, size):
    """``tile`` [R, nb * 256] = Q4_K/Q5_K rows decoded (``(d * sc) * q - dmin * m``, as the reference)."""
    nb = tile.shape[1] // 256
    qs_at = size - 128
    ds, dm = carray(stack_f32(8), (8,)), carray(stack_f32(8), (8,))
    for r in range(raw.shape[0]):
        row = tile[r]
        for b in range(nb):
            blk = raw[r, b * size: b * size + size]
            q4_k_scales(blk, table, ds, dm)
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
    k45_gemv(raw, x, xsum, table, out, Q4_K_BYTES, True)


@compiled(K45_GEMV)
def q4_k_gemv(raw, x, xsum, table, out):
    k45_gemv(raw, x, xsum, table, out, Q4_K_BYTES, False)


@compiled(K_DECODE, contract=False)
def q4_k_decode(raw, table, tile):
    k45_decode(raw, table, tile, Q4_K_BYTES)


@compiled(K45_GEMV)
def q5_k_gemv1(raw, x, xsum, table, out):
    k45_gemv(raw, x, xsum, table, out, Q5_K_BYTES, True)


@compiled(K45_GEMV)
def q5_k_gemv(raw, x, xsum, table, out):
    k45_gemv(raw, x, xsum, table, out, Q5_K_BYTES, False)


@compiled(K_DECODE, contract=False)
def q5_k_decode(raw, table, tile):
    k45_decode(raw, table, tile, Q5_K_BYTES)


@compiled(types.void(U8_2D, F32_2D_C, F32_1D, F32_2D))
def q6_k_gemv1(raw, x, table, out):
    """``out[0, r] = x[0] @ W[r]`` for Q6_K rows ``raw`` [R, nb * 210]."""
    nb = x.shape[1] // 256
    acc = carray(stack_f32(LANES), (LANES,))
    xr = x[0]
    for r in range(raw.shape[0]):
        for k in range(32):
            acc[k] = 0
        for b in range(nb):
            blk = raw[r, b * 210: b * 210 + 210]
            prefetch(blk, 0)
            d = table[np.int64(blk[208]) | (np.int64(blk[209]) << 8)]
            for h in range(2):
                qh = blk[128 + 32 * h: 160 + 32 * h]
                for s in range(4):
                    ql = blk[64 * h + 32 * (s % 2): 64 * h + 32 * (s % 2) + 32]
                    shift, high = np.uint8(4 * (s // 2)), np.uint8(2 * s)
                    j = 8 * h + 2 * s
                    d0 = d * np.float32(np.int8(blk[192 + j]))
                    d1 = d * np.float32(np.int8(blk[193 + j]))
                    xs = xr[b * 256 + 128 * h + 32 * s: b * 256 + 128 * h + 32 * s + 32]
                    for k in range(32):
                        q = np.uint8(((ql[k] >> shift) & M4) | (((qh[k] >> high) & M2) << S4))
                        acc[k] += (np.float32(q) - Q6_BIAS) * (xs[k] * (d0 if k < 16 else d1))
        s = np.float32(0)
        for k in range(32):
            s += acc[k]
        out[0, r] = s


@compiled(types.void(U8_2D, F32_2D_C, F32_1D, F32_2D))
def q6_k_gemv(raw, x, table, out):
    """:func:`q6_k_gemv1` for 1..GEMV_ROWS rows, each by the same operations; blocks read once for all rows."""
    n, nb = x.shape[0], x.shape[1] // 256
    acc = carray(stack_f32(ACC_FLOATS), (GEMV_ROWS, LANES))
    for r in range(raw.shape[0]):
        for i in range(n):
            for k in range(32):
                acc[i, k] = 0
        for b in range(nb):
            blk = raw[r, b * 210: b * 210 + 210]
            prefetch(blk, 0)
            d = table[np.int64(blk[208]) | (np.int64(blk[209]) << 8)]
            for h in range(2):
                qh = blk[128 + 32 * h: 160 + 32 * h]
                for s in range(4):
                    ql = blk[64 * h + 32 * (s % 2): 64 * h + 32 * (s % 2) + 32]
                    shift, high = np.uint8(4 * (s // 2)), np.uint8(2 * s)
                    j = 8 * h + 2 * s
                    d0 = d * np.float32(np.int8(blk[192 + j]))
                    d1 = d * np.float32(np.int8(blk[193 + j]))
                    for i in range(n):
                        xs = x[i, b * 256 + 128 * h + 32 * s: b * 256 + 128 * h + 32 * s + 32]
                        a = acc[i]
                        for k in range(32):
                            q = np.uint8(((ql[k] >> shift) & M4) | (((qh[k] >> high) & M2) << S4))
                            a[k] += (np.float32(q) - Q6_BIAS) * (xs[k] * (d0 if k < 16 else d1))
        for i in range(n):
            s = np.float32(0)
            for k in range(32):
                s += acc[i, k]
            out[i, r] = s


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
def k23_scales(blk, table, ds, dm, q3):
    """The 16 sub-block scales ``ds[j]`` (and Q2_K's minimums ``dm[j]``) of a Q2_K or (``q3``) Q3_K block, as the
    reference computes them: Q2_K ``d * (scales[j] & 15)``, ``dmin * (scales[j] >> 4)``; Q3_K
    ``d * (s_j - 32)`` with the 6-bit ``s_j`` of :mod:`.kquants`' docstring."""
    if q3:
        d = table[np.int64(blk[108]) | (np.int64(blk[109]) << 8)]
        for j in range(16):
            low = (blk[96 + j % 8] >> np.uint8(4 * (j // 8))) & M4
            high = (blk[104 + j % 4] >> np.uint8(2 * (j // 4))) & M2
            ds[j] = d * np.float32(np.int32(low | (high << S4)) - 32)
        return
    d = table[np.int64(blk[80]) | (np.int64(blk[81]) << 8)]
    dmin = table[np.int64(blk[82]) | (np.int64(blk[83]) << 8)]
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


@numba.njit(inline="always")
def k23_gemv(raw, x, xsum, table, out, q3, one_row):
    """``out[i, r] = x[i] @ W[r]`` for Q2_K/Q3_K rows; ``xsum`` [N, nb * 16] sums x per 16 (Q2_K's minimums);
    ``one_row``: a single activation row, lanes in registers.  Lanes 0-15 and 16-31 of step (h, s) belong to
    sub-blocks ``8h + 2s`` and ``8h + 2s + 1``."""
    size = 110 if q3 else 84
    n, nb = x.shape[0], x.shape[1] // 256
    acc = carray(stack_f32(ACC_FLOATS), (GEMV_ROWS, LANES))
    lanes = carray(stack_f32(LANES), (LANES,))
    mins = carray(stack_f32(GEMV_ROWS), (GEMV_ROWS,))
    ds, dm = carray(stack_f32(16), (16,)), carray(stack_f32(16), (16,))
    rows = 1 if one_row else n
    for r in range(raw.shape[0]):
        for i in range(rows):
            mins[i] = 0
            for k in range(32):
                acc[i, k] = 0
        for k in range(32):
            lanes[k] = 0
        for b in range(nb):
            blk = raw[r, b * size: b * size + size]
            prefetch(blk, 0)
            k23_scales(blk, table, ds, dm, q3)
            for h in range(2):
                for s in range(4):
                    j = 8 * h + 2 * s
                    d0, d1 = ds[j], ds[j + 1]
                    for i in range(rows):
                        if not q3:
                            mins[i] += dm[j] * xsum[i, b * 16 + j] + dm[j + 1] * xsum[i, b * 16 + j + 1]
                        xs = x[i, b * 256 + 128 * h + 32 * s: b * 256 + 128 * h + 32 * s + 32]
                        a = lanes if one_row else acc[i]
                        for k in range(32):
                            a[k] += k23_value(blk, k, h, s, q3) * (xs[k] * (d0 if k < 16 else d1))
        for i in range(rows):
            a = lanes if one_row else acc[i]
            total = np.float32(0)
            for k in range(32):
                total += a[k]
            out[i, r] = total - mins[i]


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
    k23_gemv(raw, x, xsum, table, out, False, True)


@compiled(K45_GEMV)
def q2_k_gemv(raw, x, xsum, table, out):
    k23_gemv(raw, x, xsum, table, out, False, False)


@compiled(K_DECODE, contract=False)
def q2_k_decode(raw, table, tile):
    k23_decode(raw, table, tile, False)


@compiled(K45_GEMV)
def q3_k_gemv1(raw, x, xsum, table, out):
    k23_gemv(raw, x, xsum, table, out, True, True)


@compiled(K45_GEMV)
def q3_k_gemv(raw, x, xsum, table, out):
    k23_gemv(raw, x, xsum, table, out, True, False)


@compiled(K_DECODE, contract=False)
def q3_k_decode(raw, table, tile):
    k23_decode(raw, table, tile, True)


def sums_per_32(x: np.ndarray) -> np.ndarray:
    """Each row's sums over consecutive groups of 32 values (the sub-blocks of minimums).  # [N, n] -> [N, n/32]"""
    return x.reshape(len(x), -1, 32).sum(axis=2, dtype=np.float32)


def sums_per_16(x: np.ndarray) -> np.ndarray:
    """Each row's sums over consecutive groups of 16 values (Q2_K's sub-blocks).  # [N, n] -> [N, n/16]"""
    return x.reshape(len(x), -1, 16).sum(axis=2, dtype=np.float32)


class Q4_KJitKernel(JitKernel):
    block, type_size = QK_K, Q4_K_BYTES
    constants = (F16_TABLE,)
    gemv1 = staticmethod(q4_k_gemv1)
    gemv = staticmethod(q4_k_gemv)
    decode = staticmethod(q4_k_decode)

    def activations(self, x: np.ndarray) -> tuple:
        return (sums_per_32(x),)


class Q5_KJitKernel(Q4_KJitKernel):
    type_size = Q5_K_BYTES
    gemv1 = staticmethod(q5_k_gemv1)
    gemv = staticmethod(q5_k_gemv)
    decode = staticmethod(q5_k_decode)


class Q2_KJitKernel(JitKernel):
    block, type_size = QK_K, 84
    constants = (F16_TABLE,)
    gemv1, gemv, decode = staticmethod(q2_k_gemv1), staticmethod(q2_k_gemv), staticmethod(q2_k_decode)

    def activations(self, x: np.ndarray) -> tuple:
        return (sums_per_16(x),)


class Q3_KJitKernel(Q2_KJitKernel):
    type_size = 110
    gemv1, gemv, decode = staticmethod(q3_k_gemv1), staticmethod(q3_k_gemv), staticmethod(q3_k_decode)

    def activations(self, x: np.ndarray) -> tuple:
        return (np.zeros((len(x), 1), np.float32),)  # no minimums: the shared signature's unused sums


class Q6_KJitKernel(JitKernel):
    block, type_size = QK_K, Q6_K_BYTES
    constants = (F16_TABLE,)
    gemv1 = staticmethod(q6_k_gemv1)
    gemv = staticmethod(q6_k_gemv)
    decode = staticmethod(q6_k_decode)
