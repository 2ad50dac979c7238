"""8-bit activations (``activations="q8"``): the plain numpy reference of the integer-dot products.

An activation row is quantized per block of 32 values, as llama.cpp's q8_0 activations: ``d = max|x| / 127``
(float32, where llama.cpp rounds it to float16), ``q = rint(x * (1 / d))`` in int8 (``q = 0`` for an all-zero
block).  A stored block of 32 integer weights ``w`` (Q8_0's ``q``, Q4_0's ``q - 8``, Q5_0's ``q - 16``,
IQ4_NL's levels) with scale ``d_w`` then contributes ``(d_w * d) * sum(w * q)``, the sum exact in int32 (at most
32 * 128 * 127).  The types with a minimum (Q4_1, Q5_1: ``value = d_w * w + m_w``) take llama.cpp's q8_1
activations: the same ``q`` and ``d`` and per block ``s = d * sum(q)`` (float32, where llama.cpp rounds it to
float16), and a block contributes ``(d_w * d) * sum(w * q) + m_w * s``.  This changes the numbers: the
activations carry 8 bits, so a product's relative error is about 2^-9 of the row's magnitude, not float32's 2^-24
(measured logit errors: docs/performance.md, "8-bit activations").  A block holding an infinity or NaN quantizes
to unspecified values (the float path would carry them into the product).
"""

from __future__ import annotations

import numpy as np

from .base import QType, f16_field
from .iq4 import IQ4_LEVELS
from .legacy import Q4_0, Q4_1, Q5_0, Q5_1

Q8_ACT_BLOCK = 32  # activation values per scale
Q8_ACT_MAX = np.float32(127)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of float32 activations as int8 blocks.  # x [N, nb * 32] -> (q int8 [N, nb * 32], d float32 [N, nb])"""
    n, k = x.shape
    blocks = np.asarray(x, np.float32).reshape(n, k // Q8_ACT_BLOCK, Q8_ACT_BLOCK)  # [N, nb, 32]
    d = np.max(np.abs(blocks), axis=2) / Q8_ACT_MAX  # [N, nb]
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.rint(blocks * inverse[:, :, None]).astype(np.int8)
    return q.reshape(n, k), d


def block_sums(w: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Exact integer dot products per block.  # w int [R, nb * 32], q int8 [N, nb * 32] -> int32 [N, R, nb]"""
    nb = w.shape[1] // Q8_ACT_BLOCK
    wb = w.astype(np.int32).reshape(len(w), nb, Q8_ACT_BLOCK)
    qb = q.astype(np.int32).reshape(len(q), nb, Q8_ACT_BLOCK)
    return np.einsum("rbk,nbk->nrb", wb, qb).astype(np.int32)


def product(w: np.ndarray, w_scales: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``x @ W.T`` with 8-bit activations, in float64 from the exact block sums (the reference the compiled
    kernels are held to).  # w int [R, nb * 32], w_scales [R, nb], x [N, nb * 32] -> float64 [N, R]"""
    q, d = quantize_activations(x)
    sums = block_sums(w, q).astype(np.float64)  # [N, R, nb]
    return np.einsum("nrb,rb,nb->nr", sums, w_scales.astype(np.float64), d.astype(np.float64))


def q8_0_weights(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The integer weights and float32 scales of Q8_0 rows.  # raw uint8 [R, nb * 34] -> (int8 [R, nb * 32], [R, nb])"""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(len(raw), -1, 34)
    scales = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    return blocks[:, :, 2:].view(np.int8).reshape(len(raw), -1), scales


def activation_sums(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """llama.cpp's q8_1 block sums of quantized activations, ``s = d * f32(sum(q))`` per block (the sum exact).
    # q int8 [N, nb * 32], d [N, nb] -> float32 [N, nb]"""
    sums = q.reshape(len(q), -1, Q8_ACT_BLOCK).astype(np.int32).sum(axis=2)
    return d.astype(np.float32) * sums.astype(np.float32)


LEGACY = {c.qtype: c for c in (Q4_0(), Q4_1(), Q5_0(), Q5_1())}


def block_weights(qtype: QType, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The integer weights, float32 scales and minimums (None for the types without) of rows of a type of 32-value
    blocks with one float16 scale: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (``q - bias``, bit 4 from ``qh``; the codec's
    geometry) and IQ4_NL (its levels).  # raw uint8 [R, nb * size] -> (int8 [R, nb * 32], [R, nb], [R, nb])"""
    if qtype == QType.Q8_0:
        return (*q8_0_weights(raw), None)
    r = len(raw)
    if qtype == QType.IQ4_NL:
        blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 18)
        qs = blocks[:, 2:18]
        w = IQ4_LEVELS[np.concatenate([qs & 15, qs >> 4], axis=1)]
        return w.reshape(r, -1), f16_field(blocks[:, 0:2]).reshape(r, -1), None
    c = LEGACY[qtype]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, c.type_size)
    qs = blocks[:, c.qs_at:c.qs_at + Q8_ACT_BLOCK // 2]
    q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int32)  # [n, 32]: low nibbles first
    if c.qh_at is not None:
        qh = blocks[:, c.qh_at:c.qh_at + 4].copy().view("<u4")  # [n, 1]
        q |= ((qh >> np.arange(Q8_ACT_BLOCK, dtype=np.uint32)) & 1).astype(np.int32) << 4
    mins = f16_field(blocks[:, 2:4]).reshape(r, -1) if c.has_offset else None
    return (q - c.bias).astype(np.int8).reshape(r, -1), f16_field(blocks[:, 0:2]).reshape(r, -1), mins


def product_blockwise(w: np.ndarray, w_scales: np.ndarray, q: np.ndarray, d: np.ndarray,
                      w_mins: np.ndarray | None = None, s: np.ndarray | None = None) -> np.ndarray:
    """``x @ W.T`` with 8-bit activations ``q``, ``d`` (:func:`quantize_activations`) in float32, the blocks in
    order: ``acc = acc + f32(sum(w q)) * (d_w * d_x)``, every operation rounded to float32 (no fused add); with
    minimums ``w_mins`` and the activations' :func:`activation_sums` ``s``, ``acc = acc + (f32(sum(w q)) * (d_w *
    d_x) + m_w * s)``.  The compiled prefill kernels (:mod:`qwen_runtime.backend.kernels.amx`) use exactly these
    operations in this order, so they are held to it bit for bit; the decode kernels sum in another order (lanes
    over pairs of blocks), so they agree with it within float32 summation error.  # w int [R, nb * 32], w_scales
    [R, nb], q int8 [N, nb * 32], d [N, nb] (w_mins [R, nb], s [N, nb]) -> [N, R]"""
    sums = block_sums(w, q)  # [N, R, nb] exact
    acc = np.zeros(sums.shape[:2], np.float32)
    for b in range(sums.shape[2]):
        scale = w_scales[None, :, b].astype(np.float32) * d[:, None, b].astype(np.float32)  # [N, R]
        term = sums[:, :, b].astype(np.float32) * scale
        if w_mins is not None:
            term = term + w_mins[None, :, b].astype(np.float32) * s[:, None, b].astype(np.float32)
        acc = acc + term
    return acc
