"""8-bit activations per 256 values (llama.cpp's q8_K) against the K-quants and IQ4_XS: the plain numpy reference
of the integer-dot products that the AMX prefill kernels (``backend/kernels/amx_k.py``) are held to bit for bit.

An activation row is quantized per super-block of 256 values as llama.cpp's ``quantize_row_q8_K_ref``: ``max``
the value of largest magnitude (the first such), ``iscale = -127 / max`` (float32), ``q = min(127,
rint(iscale * x))`` in int8, ``d = 1 / iscale`` (an all-zero block: ``d = 0``, ``q = 0``), and the sums of ``q``
per 16 (``bsums``).  A K-quant super-block's sub-block scales are small integers (:class:`KParts`: value ``(d *
sc_j) * w - dmin * m_j`` in sub-block ``j``), so its products stay integers up to one float step per super-block,
as in llama.cpp's ``ggml_vec_dot_<type>_q8_K``:

* ``sumi = sum_j sc_j (w_j . q8_j)``, exact (int32 on the tiles: at most 256 * 4096 * 128 < 2^31), and for the
  types with minimums (Q2_K per 16, Q4_K and Q5_K per 32) ``summ = sum_j m_j bsum_j``, ``bsum_j`` the sum of
  ``q8`` over sub-block ``j`` (pairs of ``bsums`` for sub-blocks of 32);
* ``acc = acc + f32(sumi) * (d_w * d_x)``, then with minimums ``acc = acc - f32(summ) * (dmin_w * d_x)``;

over the super-blocks in order, every float operation rounded to float32 (no fused add).  The integers ``w`` and
``sc`` per type: Q2_K ``q`` 0..3 and ``sc`` 0..15 (its minimums ``m`` 0..15 per 16); Q3_K ``q`` -4..3 and ``sc =
s - 32``; Q4_K and Q5_K ``q`` 0..15 / 0..31, ``sc`` and ``m`` 0..63 per 32; Q6_K ``q - 32`` and ``sc`` int8 per 16;
IQ4_XS its levels (-127..113) and ``sc = ls - 32`` per 32 (llama.cpp's AVX2 kernel's integer sum per
super-block; its generic code adds a float per sub-block instead).  llama.cpp's own kernels add the same terms
in other orders (lanes of partial sums, fused adds; its generic Q3_K and Q5_K code keeps eight lanes of int32 and
adds ``d * lane`` per lane), so it agrees within float32 summation error, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .base import QType, f16_field
from .iq4 import xs_levels, xs_scales
from .kquants import _one_bit_values, _scale_min_k4, _signed_scales_k3, _three_bit_values, _two_bit_values

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


@dataclass(frozen=True)
class KParts:
    """The integer parts of K-quant rows: value ``(d * sc_j) * w - dmin * m_j`` in sub-block ``j``.

    ``w`` int [R, nb * 256] in value order, ``sc`` int32 [R, nb, J] (J sub-blocks of 256 / J values), ``d``
    float32 [R, nb]; ``m`` int32 [R, nb, J] and ``dmin`` float32 [R, nb] for the types with minimums, else None."""

    w: np.ndarray
    sc: np.ndarray
    d: np.ndarray
    m: np.ndarray | None = None
    dmin: np.ndarray | None = None


def _blocks(raw: np.ndarray, size: int) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size)


def q2_k_parts(raw: np.ndarray) -> KParts:
    """Q2_K rows [R, nb * 84]: ``q`` 0..3, ``sc`` and ``m`` the low and high nibbles of ``scales`` (per 16)."""
    r, blocks = len(raw), _blocks(raw, 84)
    scales = blocks[:, 0:16].astype(np.int32)
    return KParts(_two_bit_values(blocks[:, 16:80]).reshape(r, -1), (scales & 15).reshape(r, -1, 16),
                  f16_field(blocks[:, 80:82]).reshape(r, -1), (scales >> 4).reshape(r, -1, 16),
                  f16_field(blocks[:, 82:84]).reshape(r, -1))


def q3_k_parts(raw: np.ndarray) -> KParts:
    """Q3_K rows [R, nb * 110]: ``q`` -4..3, ``sc = s - 32`` per 16."""
    r, blocks = len(raw), _blocks(raw, 110)
    return KParts(_three_bit_values(blocks).reshape(r, -1), _signed_scales_k3(blocks[:, 96:108]).reshape(r, -1, 16),
                  f16_field(blocks[:, 108:110]).reshape(r, -1))


def _q45_k_parts(raw: np.ndarray, size: int) -> KParts:
    """Q4_K (``size`` 144: ``q`` 0..15) or Q5_K (176: bit ``j`` of ``qh`` as bit 4 in sub-block ``j``) rows."""
    r, blocks = len(raw), _blocks(raw, size)
    sc, m = _scale_min_k4(blocks[:, 4:16])
    qs = blocks[:, size - 128:size].reshape(-1, 4, 1, 32)  # [n, chunk c, 1, byte l]: value 64c + 32h + l
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(len(blocks), -1).astype(np.int32)
    if size > Q4_K_BYTES:
        q |= _one_bit_values(blocks[:, 16:48]) << 4
    return KParts(q.reshape(r, -1), sc.reshape(r, -1, 8), f16_field(blocks[:, 0:2]).reshape(r, -1),
                  m.reshape(r, -1, 8), f16_field(blocks[:, 2:4]).reshape(r, -1))


def q4_k_parts(raw: np.ndarray) -> KParts:
    """Q4_K rows [R, nb * 144]: ``q`` 0..15, 6-bit ``sc`` and ``m`` per 32."""
    return _q45_k_parts(raw, Q4_K_BYTES)


def q5_k_parts(raw: np.ndarray) -> KParts:
    """Q5_K rows [R, nb * 176]: ``q`` 0..31, 6-bit ``sc`` and ``m`` per 32."""
    return _q45_k_parts(raw, 176)


def q6_k_parts(raw: np.ndarray) -> KParts:
    """Q6_K rows [R, nb * 210]: ``q - 32`` (-32..31), ``sc`` int8 per 16."""
    r, blocks = len(raw), _blocks(raw, Q6_K_BYTES)
    ql = blocks[:, 0:128].reshape(-1, 2, 1, 64)  # [n, half h, nibble, byte]: value 128h + 64n + byte
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 256).astype(np.int32)
    q = (low | (_two_bit_values(blocks[:, 128:192]) << 4)) - 32
    sc = blocks[:, 192:208].view(np.int8).astype(np.int32)
    return KParts(q.reshape(r, -1), sc.reshape(r, -1, 16), f16_field(blocks[:, 208:210]).reshape(r, -1))


def iq4_xs_parts(raw: np.ndarray) -> KParts:
    """IQ4_XS rows [R, nb * 136]: each value's level (-127..113), ``sc = ls - 32`` per 32."""
    r, blocks = len(raw), _blocks(raw, 136)
    return KParts(xs_levels(blocks).reshape(r, -1), xs_scales(blocks).reshape(r, -1, 8),
                  f16_field(blocks[:, 0:2]).reshape(r, -1))


PARTS: dict[QType, Callable[[np.ndarray], KParts]] = {
    QType.Q2_K: q2_k_parts, QType.Q3_K: q3_k_parts, QType.Q4_K: q4_k_parts, QType.Q5_K: q5_k_parts,
    QType.Q6_K: q6_k_parts, QType.IQ4_XS: iq4_xs_parts,
}


def _sub_sums(w: np.ndarray, q: np.ndarray, b: int, size: int) -> np.ndarray:
    """Exact integer dot products per sub-block of super-block ``b``.  # -> int64 [N, R, 256 / size]"""
    cols = slice(b * QK_K, (b + 1) * QK_K)
    wb = w[:, cols].astype(np.int64).reshape(len(w), -1, size)
    qb = q[:, cols].astype(np.int64).reshape(len(q), -1, size)
    return np.einsum("rjk,njk->nrj", wb, qb)


def product(qtype: QType, raw: np.ndarray, q: np.ndarray, d: np.ndarray, bsums: np.ndarray) -> np.ndarray:
    """``x @ W.T`` for K-quant rows ``raw`` [R, nb * type size] of ``qtype`` and :func:`quantize_q8_k`
    activations, float32 [N, R] (the module docstring's operations in its order)."""
    p = PARTS[qtype](raw)
    subs = p.sc.shape[2]
    acc = np.zeros((len(q), len(raw)), np.float32)
    for b in range(p.d.shape[1]):
        sumi = np.einsum("nrj,rj->nr", _sub_sums(p.w, q, b, QK_K // subs), p.sc[:, b])
        acc = acc + sumi.astype(np.float32) * (p.d[None, :, b] * d[:, None, b])
        if p.m is not None:
            per_sub = bsums[:, 16 * b:16 * b + 16].astype(np.int64).reshape(len(q), subs, -1).sum(axis=2)  # [N, J]
            summ = per_sub @ p.m[:, b].astype(np.int64).T
            acc = acc - summ.astype(np.float32) * (p.dmin[None, :, b] * d[:, None, b])
    return acc
