"""8-bit activations per 256 values (llama.cpp's q8_K) against Q4_K and Q6_K weights: the plain numpy reference
of the integer-dot products that the AMX prefill kernels (``backend/kernels/amx_k.py``) are held to bit for bit.

An activation row is quantized per super-block of 256 values as llama.cpp's ``quantize_row_q8_K_ref``: ``max``
the value of largest magnitude (the first such), ``iscale = -127 / max`` (float32), ``q = min(127,
rint(iscale * x))`` in int8, ``d = 1 / iscale`` (an all-zero block: ``d = 0``, ``q = 0``), and the sums of ``q``
per 16 (``bsums``).  A K-quant super-block's sub-block scales are small integers, so its products stay integers
up to one float step per super-block, as in llama.cpp's ``ggml_vec_dot_q4_K_q8_K`` / ``..._q6_K_q8_K``:

* Q4_K (sub-blocks of 32, ``value = d sc_j q - dmin m_j``, ``q`` 0..15): ``sumi = sum_j sc_j (q_j . q8_j)`` and
  ``summ = sum_j m_j (bsums_2j + bsums_2j+1)``, both exact int32; then ``acc = acc + f32(sumi) * (d_w * d_x)``
  and ``acc = acc - f32(summ) * (dmin_w * d_x)``;
* Q6_K (sub-blocks of 16, ``value = d sc_j (q - 32)``, ``sc_j`` int8): ``sumi = sum_j sc_j ((q_j - 32) .
  q8_j)``; then ``acc = acc + f32(sumi) * (d_w * d_x)``;

over the super-blocks in order, every float operation rounded to float32 (no fused add).  llama.cpp adds the same
terms in another order (fused, in lanes), so it agrees within float32 summation error, not bit for bit.
"""

from __future__ import annotations

import numpy as np

from .base import f16_field
from .kquants import _scale_min_k4

QK_K = 256
Q4_K_BYTES, Q6_K_BYTES = 144, 210
BSUM = 16  # activation values per bsums entry
Q8K_MAX = np.float32(127)


def quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of float32 activations as q8_K blocks.  # x [N, nb * 256] -> (q int8 [N, nb * 256], d float32 [N, nb],
    bsums int32 [N, nb * 16])"""
    n, k = x.shape
    blocks = np.asarray(x, np.float32).reshape(n, k // QK_K, QK_K)
    at = np.argmax(np.abs(blocks), axis=2)[..., None]  # the first of largest magnitude, as llama.cpp's strict >
    top = np.take_along_axis(blocks, at, axis=2)[..., 0]  # [N, nb]
    live = top != 0
    iscale = np.divide(-Q8K_MAX, top, out=np.zeros_like(top), where=live)
    q = np.minimum(np.rint(blocks * iscale[..., None]), 127).astype(np.int8)
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=live)
    bsums = q.reshape(n, -1, BSUM).astype(np.int32).sum(axis=2)
    return q.reshape(n, k), d, bsums


def q4_k_parts(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """The integer parts of Q4_K rows.  # raw uint8 [R, nb * 144] -> (q uint8 [R, nb * 256] in value order, sc int32
    [R, nb, 8], m int32 [R, nb, 8], d float32 [R, nb], dmin float32 [R, nb])"""
    r = len(raw)
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, Q4_K_BYTES)
    sc, m = _scale_min_k4(blocks[:, 4:16])
    qs = blocks[:, 16:144].reshape(-1, 4, 1, 32)  # [n, chunk c, 1, byte l]: value 64c + 32h + l
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(r, -1)
    return (q, sc.reshape(r, -1, 8), m.reshape(r, -1, 8), f16_field(blocks[:, 0:2]).reshape(r, -1),
            f16_field(blocks[:, 2:4]).reshape(r, -1))


def q6_k_parts(raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """The integer parts of Q6_K rows.  # raw uint8 [R, nb * 210] -> (q int8 [R, nb * 256] as ``q - 32`` in value
    order, sc int32 [R, nb, 16], d float32 [R, nb])"""
    r = len(raw)
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, Q6_K_BYTES)
    ql = blocks[:, 0:128].reshape(-1, 2, 1, 64)  # [n, half h, nibble, byte]: value 128h + 64n + byte
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 256).astype(np.int16)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = (qh & 3).reshape(-1, 256).astype(np.int16)  # value 128h + 32s + l: bits 2s of byte 32h + l
    q = ((low | (high << 4)) - 32).astype(np.int8)
    sc = blocks[:, 192:208].view(np.int8).astype(np.int32)
    return q.reshape(r, -1), sc.reshape(r, -1, 16), f16_field(blocks[:, 208:210]).reshape(r, -1)


def _sub_sums(w: np.ndarray, q: np.ndarray, b: int, size: int) -> np.ndarray:
    """Exact integer dot products per sub-block of super-block ``b``.  # -> int64 [N, R, 256 / size]"""
    cols = slice(b * QK_K, (b + 1) * QK_K)
    wb = w[:, cols].astype(np.int64).reshape(len(w), -1, size)
    qb = q[:, cols].astype(np.int64).reshape(len(q), -1, size)
    return np.einsum("rjk,njk->nrj", wb, qb)


def product_q4_k(raw: np.ndarray, q: np.ndarray, d: np.ndarray, bsums: np.ndarray) -> np.ndarray:
    """``x @ W.T`` for Q4_K rows ``raw`` [R, nb * 144] and :func:`quantize_q8_k` activations, float32 [N, R] (the
    module docstring's operations in its order)."""
    w, sc, m, dw, dmin = q4_k_parts(raw)
    acc = np.zeros((len(q), len(raw)), np.float32)
    for b in range(dw.shape[1]):
        sumi = np.einsum("nrj,rj->nr", _sub_sums(w, q, b, 32), sc[:, b])
        pairs = bsums[:, 16 * b:16 * b + 16].astype(np.int64).reshape(len(q), 8, 2).sum(axis=2)  # [N, 8]
        summ = pairs @ m[:, b].astype(np.int64).T
        acc = acc + sumi.astype(np.float32) * (dw[None, :, b] * d[:, None, b])
        acc = acc - summ.astype(np.float32) * (dmin[None, :, b] * d[:, None, b])
    return acc


def product_q6_k(raw: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``x @ W.T`` for Q6_K rows ``raw`` [R, nb * 210] and :func:`quantize_q8_k` activations, float32 [N, R]."""
    w, sc, dw = q6_k_parts(raw)
    acc = np.zeros((len(q), len(raw)), np.float32)
    for b in range(dw.shape[1]):
        sumi = np.einsum("nrj,rj->nr", _sub_sums(w, q, b, 16), sc[:, b])
        acc = acc + sumi.astype(np.float32) * (dw[None, :, b] * d[:, None, b])
    return acc
