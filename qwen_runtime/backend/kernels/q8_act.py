"""8-bit activations in compiled code (numba): the quantization of :mod:`.q8_act` (:func:`quantize_rows`) and the
*forms* the integer-dot kernels read (:mod:`.int8`, :mod:`.int8_k`), prepared once per product input by the
compiled decode step (:func:`prepare_forms`) and handed to each type's :data:`Q8_ROW_PRODUCT` by address.

A product input ``x`` [N, cols] becomes up to six arrays, each a *slot* of a ``forms`` table (int64 [SLOTS], the
address of each slot's row 0; rows follow each other, so row ``i`` of a slot starts ``i`` times its row size
further):

* :data:`Q`: ``q`` int8 [N, cols] and :data:`D`: ``d`` float32 [N, cols / 32], :func:`quantize_rows`' result;
* :data:`XU`: ``q + 128`` as uint8 [N, cols] (the unsigned operand of ``vpdpbusd``: Q8_0, Q4_0, Q5_0);
* :data:`Q16`: ``q`` as int16 [N, cols] (the pairs kernels for several rows: no widening per row and block);
* :data:`D8`: ``d`` with each value 8 times, float32 [N, cols / 4] (Q8_0's several rows: one 64-byte load);
* :data:`B32`: ``-32`` times each sum of 4 of ``q``, int32 [N, cols / 4] (the start values of ``vpdpbusd``: Q6_K's,
  and shifted to their bias those of one row of Q8_0, Q4_0 and Q5_0);
* :data:`KQ`, :data:`KD`, :data:`KB`: the activations quantized per 256 values instead (llama.cpp's q8_K,
  :func:`quantize_k_rows`): ``q`` int8 [N, cols], ``d`` float32 [N, cols / 256] and the sums of ``q`` per 16 as
  int16 [N, cols / 16] (the K-quants' kernels of :mod:`.q8k_rows`).

These are the integer operations of the kernels' own ``forms`` (numpy, the per-operation path), so the numbers are
the same.  A module of its own, small, so that the compiled decode step loads it without the kernels.
"""

from __future__ import annotations

import numpy as np
from numba import carray, types
from numba.extending import intrinsic

from ...quants.q8_act import Q8_ACT_BLOCK, Q8_ACT_MAX
from ...quants.q8k_act import BSUM, Q8K_MAX, QK_K
from .base import (
    F16_TABLE,
    F32_2D_C,
    I8_2D_W,
    I16_2D_W,
    I32_2D_W,
    address_as,
    call_at,
    compiled,
    f32_at,
    i64_at,
    inline,
    u8_at,
)

Q, XU, Q16, D, D8, B32, KQ, KD, KB = range(9)  # the slots of a forms table
SLOTS = 9
TABLE_SIZE = F16_TABLE.size
# Bytes of a slot's row per column of the input (D: 4 bytes per 32 columns, given as 1/8).
ROW_BYTES = {Q: 1, XU: 1, Q16: 2, D: 1 / 8, D8: 1, B32: 1, KQ: 1, KD: 4 / QK_K, KB: 2 / BSUM}
i8_at, i16_at, i32_at = (address_as(t) for t in (types.int8, types.int16, types.int32))

# The C signature of a type's row product with 8-bit activations (``<type>_q8_rows``), called by address from the
# compiled decode step as :data:`.base.ROW_PRODUCT` is: ``(raw, rows, row_bytes, forms, first, n, cols, sums,
# sums_cols, table, out, out_stride)``, addresses and sizes as int64: activation rows ``first .. first + n - 1`` of
# the forms table at ``forms``; the other arguments as ROW_PRODUCT's (``sums`` already at row ``first``).
Q8_ROW_PRODUCT = types.void(*([types.int64] * 12))


def slots(*names: int) -> int:
    """The bit mask of the given slots (what a kernel reads, what :func:`prepare_forms` fills)."""
    return sum(1 << s for s in set(names))


K_SLOTS = slots(KQ, KD, KB)  # the q8_K slots' mask


@compiled(types.void(F32_2D_C, I8_2D_W, F32_2D_C), contract=False, shared=True)
def quantize_rows(x, q, d):
    """``q``, ``d`` = :func:`.q8_act.quantize_activations` of ``x`` [N, nb * 32] (the same float32 operations)."""
    nb = d.shape[1]
    for i in range(x.shape[0]):
        for b in range(nb):
            xs = x[i, b * 32: b * 32 + 32]
            amax = np.float32(0)
            for k in range(32):
                amax = max(amax, abs(xs[k]))
            scale = amax / Q8_ACT_MAX
            inverse = np.float32(1) / scale if scale > 0 else np.float32(0)
            d[i, b] = scale
            for k in range(32):
                q[i, b * 32 + k] = np.int8(np.rint(xs[k] * inverse))


@compiled(types.void(F32_2D_C, I32_2D_W, I8_2D_W, F32_2D_C), contract=False, shared=True)
def quantize_k_rows(x, bits, q, d):
    """``q``, ``d`` = ``quants.q8k_act.quantize_q8_k`` of ``x`` [N, nb * 256] (the same float32 operations).
    ``bits`` is ``x`` viewed as int32: the largest magnitude is found as the largest of the bits without the sign,
    and its first position as the least index holding them (integer reductions, which the compiler vectorises; a
    float ``max`` is not, for its NaN rules)."""
    nb = d.shape[1]
    for i in range(x.shape[0]):
        for b in range(nb):
            o = b * QK_K
            top_bits = np.int32(0)
            for k in range(QK_K):
                top_bits = max(top_bits, bits[i, o + k] & np.int32(0x7FFFFFFF))
            first = QK_K
            for k in range(QK_K):  # the first of largest magnitude (llama.cpp keeps the first: strict >)
                if bits[i, o + k] & np.int32(0x7FFFFFFF) == top_bits:
                    first = min(first, k)
            iscale = -Q8K_MAX / x[i, o + first] if top_bits else np.float32(0)
            d[i, b] = np.float32(1) / iscale if top_bits else np.float32(0)
            for k in range(QK_K):
                q[i, o + k] = np.int8(min(Q8K_MAX, np.rint(iscale * x[i, o + k])))


@compiled(types.void(I8_2D_W, I16_2D_W), shared=True)
def sums16(q, bs):
    """``bs`` = the sums of ``q`` [N, cols] per 16 values (q8_K's ``bsums``), int16 [N, cols / 16]."""
    for i in range(q.shape[0]):
        for s in range(bs.shape[1]):
            total = np.int32(0)
            for k in range(BSUM):
                total += np.int32(q[i, s * BSUM + k])
            bs[i, s] = total


def quantize_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quants.q8k_act.quantize_q8_k`` of ``x`` [N, cols] compiled, with the sums per 16 as int16: the
    :data:`KQ`, :data:`KD`, :data:`KB` arrays."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, cols = x.shape
    q = np.empty((n, cols), np.int8)
    d = np.empty((n, cols // QK_K), np.float32)
    bs = np.empty((n, cols // BSUM), np.int16)
    quantize_k_rows(x, x.view(np.int32), q, d)
    sums16(q, bs)
    return q, d, bs


@inline
def k_form_arrays(forms, first, n, cols):
    """The q8_K slots of the forms table at address ``forms`` from activation row ``first``: (q, d, bsums)."""
    f = carray(i64_at(forms), (SLOTS,))
    return (carray(i8_at(f[KQ] + first * cols), (n, cols)),
            carray(f32_at(f[KD] + 4 * first * (cols // QK_K)), (n, cols // QK_K)),
            carray(i16_at(f[KB] + 2 * first * (cols // BSUM)), (n, cols // BSUM)))


@inline
def form_arrays(forms, first, n, cols):
    """The slots of the forms table at address ``forms`` from activation row ``first``, ``n`` rows of an input of
    ``cols`` columns: (q, xu, q16, d, d8, b32) as arrays (those a caller does not touch cost nothing)."""
    f = carray(i64_at(forms), (SLOTS,))
    nb = cols // Q8_ACT_BLOCK
    return (carray(i8_at(f[Q] + first * cols), (n, cols)), carray(u8_at(f[XU] + first * cols), (n, cols)),
            carray(i16_at(f[Q16] + 2 * first * cols), (n, cols)), carray(f32_at(f[D] + 4 * first * nb), (n, nb)),
            carray(f32_at(f[D8] + 32 * first * nb), (n, 8 * nb)),
            carray(i32_at(f[B32] + first * cols), (n, cols // 4)))


@compiled(types.void(F32_2D_C, types.int64, types.int64), contract=False)
def prepare_forms(x, mask, forms):
    """Fill the slots in ``mask`` of the forms table at address ``forms`` for the input ``x`` [N, cols]: the
    per-32 ones (and Q, D, from which they come) where it names any, the q8_K ones where it names any."""
    n, cols = x.shape
    if mask & K_SLOTS:
        kq, kd, kb = k_form_arrays(forms, 0, n, cols)
        quantize_k_rows(x, x.view(np.int32), kq, kd)
        sums16(kq, kb)
    if not mask & ~K_SLOTS:
        return
    q, xu, q16, d, d8, b32 = form_arrays(forms, 0, n, cols)
    quantize_rows(x, q, d)
    for i in range(n):
        if mask & (1 << XU):
            for k in range(cols):
                xu[i, k] = np.uint8(q[i, k]) ^ np.uint8(128)
        if mask & (1 << Q16):
            for k in range(cols):
                q16[i, k] = q[i, k]
        if mask & (1 << D8):
            for k in range(cols // 4):
                d8[i, k] = d[i, k // 8]
        if mask & (1 << B32):
            for k in range(cols // 4):
                b32[i, k] = np.int32(-32) * (np.int32(q[i, 4 * k]) + np.int32(q[i, 4 * k + 1])
                                             + np.int32(q[i, 4 * k + 2]) + np.int32(q[i, 4 * k + 3]))


def start_values(q: np.ndarray) -> np.ndarray:
    """:data:`B32` of ``q`` in numpy (the kernels' ``forms``), -32 times each sum of 4.  # [N, n] -> int32 [N, n/4]"""
    return q.reshape(len(q), -1, 4).sum(axis=2, dtype=np.int32) * np.int32(-32)


def forms_bytes(rows: int, cols: int) -> list[int]:
    """Bytes of each slot for ``rows`` activation rows of up to ``cols`` columns (a multiple of 32)."""
    return [int(rows * cols * ROW_BYTES[s]) for s in range(SLOTS)]


@inline
def product_arrays(raw, rows, row_bytes, n, sums, sums_cols, table, out, out_stride):
    """The arrays of a :data:`Q8_ROW_PRODUCT` call but the forms: stored rows uint8 [rows, row_bytes], the float
    sums [n, sums_cols], the float16 table and the output columns [n, rows]."""
    return (carray(u8_at(raw), (rows, row_bytes)), carray(f32_at(sums), (n, sums_cols)),
            carray(f32_at(table), (TABLE_SIZE,)), carray(f32_at(out), (n, out_stride))[:, :rows])


@intrinsic
def call_q8_product(typingctx, function, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out,
                    out_stride):  # noqa: ARG001
    """Call the :data:`Q8_ROW_PRODUCT` at address ``function`` with the other arguments, every one an int64."""
    operands = (raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride)
    if not all(isinstance(a, types.Integer) for a in (function, *operands)):
        return None

    return types.void(function, *operands), call_at
