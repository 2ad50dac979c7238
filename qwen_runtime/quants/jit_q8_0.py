"""Compiled Q8_0 kernels (numba): the blocks of :mod:`.q8_0` read in place, no widened copy of anything.

A block is a float16 scale ``d`` (2 bytes, little-endian) then 32 int8 ``q``: value = d * q.  Row ``r`` of the
product is ``sum over blocks b, lanes k of f32(q[b, k]) * (x[b*32 + k] * d[b])`` in 32 lanes (see
:mod:`.jit_base`); ``d`` comes from :data:`~.jit_base.F16_TABLE`.
"""

from __future__ import annotations

import numpy as np
from numba import carray, types

from .jit_base import (
    ACC_FLOATS,
    F16_TABLE,
    F32_1D,
    F32_2D,
    F32_2D_C,
    GEMV_ROWS,
    I8_2D,
    LANES,
    JitKernel,
    compiled,
    prefetch,
    stack_f32,
)
from .q8_0 import Q8_0_BLOCK, Q8_0_BYTES


@compiled(types.void(I8_2D, F32_2D_C, F32_1D, F32_2D))
def q8_0_gemv1(raw, x, table, out):
    """``out[0, r] = x[0] @ W[r]`` for Q8_0 rows ``raw`` (int8 view) [R, nb * 34], ``x`` [1, nb * 32]."""
    nb = x.shape[1] // 32
    acc = carray(stack_f32(32), (32,))
    xr = x[0]
    for r in range(raw.shape[0]):
        blocks = raw[r]
        for k in range(32):
            acc[k] = 0
        for b in range(nb):
            q = blocks[b * 34: b * 34 + 34]
            xs = xr[b * 32: b * 32 + 32]
            prefetch(blocks, b * 34)
            d = table[np.int64(np.uint8(q[0])) | (np.int64(np.uint8(q[1])) << 8)]
            for k in range(32):
                acc[k] += np.float32(q[2 + k]) * (xs[k] * d)
        s = np.float32(0)
        for k in range(32):
            s += acc[k]
        out[0, r] = s


@compiled(types.void(I8_2D, F32_2D_C, F32_1D, F32_2D))
def q8_0_gemv(raw, x, table, out):
    """``out[i, r] = x[i] @ W[r]`` for 1..GEMV_ROWS rows of ``x``, each by :func:`q8_0_gemv1`'s operations; every block
    is read once for all rows."""
    n, nb = x.shape[0], x.shape[1] // 32
    acc = carray(stack_f32(ACC_FLOATS), (GEMV_ROWS, LANES))
    for r in range(raw.shape[0]):
        blocks = raw[r]
        for i in range(n):
            for k in range(32):
                acc[i, k] = 0
        for b in range(nb):
            q = blocks[b * 34: b * 34 + 34]
            prefetch(blocks, b * 34)
            d = table[np.int64(np.uint8(q[0])) | (np.int64(np.uint8(q[1])) << 8)]
            for i in range(n):
                xs = x[i, b * 32: b * 32 + 32]
                a = acc[i]
                for k in range(32):
                    a[k] += np.float32(q[2 + k]) * (xs[k] * d)
        for i in range(n):
            s = np.float32(0)
            for k in range(32):
                s += acc[i, k]
            out[i, r] = s


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


class Q8_0JitKernel(JitKernel):
    block, type_size = Q8_0_BLOCK, Q8_0_BYTES
    constants = (F16_TABLE,)
    gemv1 = staticmethod(q8_0_gemv1)
    gemv = staticmethod(q8_0_gemv)
    decode = staticmethod(q8_0_decode)

    def stored(self, raw: np.ndarray) -> np.ndarray:
        return raw.view(np.int8)

