"""K-quant writers (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): float32 rows to the bytes llama.cpp's quantizer writes.

Without an importance matrix llama.cpp (``quantize_q*_K`` with ``quant_weights == NULL``, what
``llama_model_quantize`` calls) runs ``quantize_row_q*_K_ref``; with one, ``quantize_row_q*_K_impl``.  Both
are: a search per sub-block (compiled, :mod:`qwen_convert.quant_search`), then the block scales quantized to
6 or 4 bits against a float16 super-block scale, then every value re-rounded against the scale it will be
decoded with.  This module does the second and third steps, vectorised over all super-blocks of a chunk, and
packs the blocks in the layouts of :mod:`qwen_runtime.quants.kquants`.

``x`` is float32 ``[rows, n]`` with ``n`` a multiple of 256; ``importance`` (optional) the float32 per-column
weights ``[n]`` of the tensor (an importance matrix entry); the result is uint8 ``[rows, n // 256 * size]``.
"""

from __future__ import annotations

import numpy as np

from qwen_runtime.quants.base import QType

from . import quant_search as qs

QK_K = 256
MAGIC = np.float32(12582912.0)


def nearest_int(f: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int`` of float32 ``f`` (any shape) as int32: the low 23 bits of ``f + 1.5 * 2**23``."""
    with np.errstate(invalid="ignore", over="ignore"):
        v = np.asarray(f, np.float32) + MAGIC
    return (v.view(np.int32) & 0x7FFFFF) - 0x400000


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """Float32 ``[B]`` -> float16 rounded to nearest even (ggml's ``GGML_FP32_TO_FP16``) as bytes ``[B, 2]``."""
    with np.errstate(over="ignore"):
        return v.astype("<f2").view(np.uint8).reshape(len(v), 2)


def f16_value(v: np.ndarray) -> np.ndarray:
    """Float32 ``[B]`` -> the float32 value of its float16 rounding, ``[B, 1]``."""
    with np.errstate(over="ignore"):
        return v.astype(np.float16).astype(np.float32)[:, None]


def _ratio(a: np.ndarray | np.float32, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.float32(a) / b


def _first_max_abs(scales: np.ndarray) -> np.ndarray:
    """``[B, S]`` -> ``[B]``: the first scale of largest magnitude (0 when all are 0), as llama.cpp's loops."""
    return np.take_along_axis(scales, np.abs(scales).argmax(axis=1)[:, None], axis=1)[:, 0]


def _requantize(x: np.ndarray, L: np.ndarray, d: np.ndarray, offset: np.ndarray | None, lo: int, hi: int
                ) -> np.ndarray:
    """``L [B, S, sub]`` re-rounded: ``clamp(nearest_int((x + offset) / d), lo, hi) - lo`` where the decoded
    sub-block scale ``d [B, S]`` is non-zero; where it is 0 llama.cpp keeps the search's ``L``."""
    sub = x.shape[-1]
    d = np.ascontiguousarray(d, np.float32).reshape(-1)
    m = d if offset is None else np.ascontiguousarray(offset, np.float32).reshape(-1)
    q = np.ascontiguousarray(L, np.uint8).reshape(-1, sub)
    qs.requantize(x.reshape(-1, sub), q, d, m, offset is not None, lo, hi)
    return q.reshape(L.shape)


def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """``L [B, 256]`` (0..3) -> ``[B, 64]``: value ``128h + 32s + l`` in bits ``2s`` of byte ``32h + l``."""
    q = L.reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _pack_bits(bits: np.ndarray) -> np.ndarray:
    """``bits [B, 256]`` (0/1) -> ``[B, 32]``: value ``32i + l`` is bit ``i`` of byte ``l``."""
    shifted = bits.reshape(-1, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
    return np.bitwise_or.reduce(shifted, axis=1)


def _pack_nibbles(L: np.ndarray) -> np.ndarray:
    """``L [B, 256]`` (0..15) -> ``[B, 128]``: value ``64c + l`` low nibble of byte ``32c + l``, ``64c + 32 + l``
    its high nibble."""
    q = L.reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 8 scales and 8 minimums (uint8 ``[B, 8]``, 6 bits meant) -> the 12 scale bytes ``[B, 12]``."""
    out = np.empty((len(ls), 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    return out


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes ``[B, 12]`` -> (sc, m) ``[B, 8]`` float32, as ``get_scale_min_k4`` decodes them."""
    p = packed
    sc = np.concatenate([p[:, 0:4] & 63, (p[:, 8:12] & 15) | ((p[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([p[:, 4:8] & 63, (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), m.astype(np.float32)


def _pack_q3_scales(ls: np.ndarray) -> np.ndarray:
    """Q3_K: 16 six-bit scales (l + 32, uint8 ``[B, 16]``) -> the 12 scale bytes ``[B, 12]``."""
    out = np.empty((len(ls), 12), np.uint8)
    out[:, 0:8] = (ls[:, 0:8] & 15) | ((ls[:, 8:16] & 15) << 4)
    high = (ls >> 4).reshape(-1, 4, 4)  # [B, j // 4, j % 4]
    out[:, 8:12] = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
    return out


def _importance_rows(importance: np.ndarray | None, n: int, sub: int) -> np.ndarray | None:
    """Per-column importance ``[n]`` -> ``[n // sub, sub]`` float32 (one row's (sub-)blocks), or None."""
    if importance is None:
        return None
    return np.ascontiguousarray(importance, np.float32).reshape(n // sub, sub)


# ---------------------------------------------------------------------------------------------- Q4_K, Q5_K

def _q45_scales(blocks: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                qw: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Search and block scales of Q4_K (nmax 15) / Q5_K (nmax 31) super-blocks ``[B, 256]``: returns the
    float16 d and dmin bytes ``[B, 2]`` each, the 12 scale bytes ``[B, 12]`` and the search's L ``[B, 256]``."""
    count = len(blocks)
    if qw is None:
        scales, mins, L = qs.qkx2_subblocks(blocks.reshape(-1, 32), nmax, rmin, rdelta, nstep, False, True)
        scales, mins = scales.reshape(count, 8), mins.reshape(count, 8)
        max_scale = np.maximum(scales.max(axis=1), 0)
        max_min = np.maximum(mins.max(axis=1), 0)
        inv_scale = np.where(max_scale > 0, _ratio(63, max_scale), np.float32(0))[:, None]
        inv_min = np.where(max_min > 0, _ratio(63, max_min), np.float32(0))[:, None]
        ls = np.minimum(nearest_int(inv_scale * scales) & 255, 63).astype(np.uint8)
        lm = np.minimum(nearest_int(inv_min * mins) & 255, 63).astype(np.uint8)
        d, dmin = max_scale / np.float32(63), max_min / np.float32(63)
    else:
        ls, lm, d, dmin, L = qs.kx3_superblocks(blocks, qw, 32, nmax, 63, False)
        if nmax == 31:  # quantize_row_q5_K_impl clamps (the Q4_K one does not)
            ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    return f16_bytes(d), f16_bytes(dmin), _pack_scale_min_k4(ls, lm), L.reshape(count, QK_K)


def _q45_values(blocks: np.ndarray, d16: np.ndarray, dmin16: np.ndarray, packed: np.ndarray, L: np.ndarray,
                nmax: int) -> np.ndarray:
    sc, m = _scale_min_k4(packed)
    d = d16.copy().view("<f2").astype(np.float32) * sc  # [B, 8]
    dm = dmin16.copy().view("<f2").astype(np.float32) * m
    return _requantize(blocks.reshape(-1, 8, 32), L.reshape(-1, 8, 32), d, dm, 0, nmax).reshape(-1, QK_K)


def quantize_q4_k(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """Q4_K-encode float32 ``[rows, n]`` -> uint8 ``[rows, n // 256 * 144]`` (d, dmin, scales[12], qs[128])."""
    rows, n = x.shape
    blocks = np.ascontiguousarray(x, np.float32).reshape(-1, QK_K)
    d16, dmin16, packed, L = _q45_scales(blocks, 15, -1.0, 0.1, 20, _importance_rows(importance, n, QK_K))
    q = _q45_values(blocks, d16, dmin16, packed, L, 15)
    out = np.concatenate([d16, dmin16, packed, _pack_nibbles(q)], axis=1)
    return out.reshape(rows, -1)


def quantize_q5_k(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """Q5_K-encode float32 ``[rows, n]`` -> uint8 ``[rows, n // 256 * 176]`` (d, dmin, scales[12], qh[32],
    qs[128])."""
    rows, n = x.shape
    blocks = np.ascontiguousarray(x, np.float32).reshape(-1, QK_K)
    d16, dmin16, packed, L = _q45_scales(blocks, 31, -0.5, 0.1, 15, _importance_rows(importance, n, QK_K))
    q = _q45_values(blocks, d16, dmin16, packed, L, 31)
    out = np.concatenate([d16, dmin16, packed, _pack_bits(q >> 4), _pack_nibbles(q & 15)], axis=1)
    return out.reshape(rows, -1)


# ------------------------------------------------------------------------------------------------- Q6_K

def quantize_q6_k(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """Q6_K-encode float32 ``[rows, n]`` -> uint8 ``[rows, n // 256 * 210]`` (ql[128], qh[64], scales[16]
    int8, d)."""
    rows, n = x.shape
    blocks = np.ascontiguousarray(x, np.float32).reshape(-1, QK_K)
    count = len(blocks)
    sub = blocks.reshape(-1, 16)
    qw = _importance_rows(importance, n, 16)
    scales, L = qs.qx_subblocks(sub, sub if qw is None else qw, qw is not None, 32)
    scales = scales.reshape(count, 16)
    max_scale = _first_max_abs(scales)
    zero = np.abs(max_scale) < qs.GROUP_MAX_EPS
    iscale = _ratio(-128, max_scale)
    d = _ratio(1, iscale)
    d16 = f16_bytes(d)
    sc = np.minimum(nearest_int(iscale[:, None] * scales), 127).astype(np.int8)  # [B, 16]
    dl = d16.copy().view("<f2").astype(np.float32) * sc.astype(np.float32)
    q = _requantize(sub.reshape(count, 16, 16), L.reshape(count, 16, 16), dl, None, -32, 31).reshape(count, QK_K)
    low, high = (q & 15).reshape(count, 2, 2, 64), q >> 4
    ql = low[:, :, 0] | (low[:, :, 1] << 4)  # byte 64h + m: values 128h + m (low nibble), 128h + 64 + m (high)
    qh = high.reshape(count, 2, 4, 32)
    qh = qh[:, :, 0] | (qh[:, :, 1] << 2) | (qh[:, :, 2] << 4) | (qh[:, :, 3] << 6)
    out = np.concatenate([ql.reshape(count, 128), qh.reshape(count, 64), sc.view(np.uint8), d16], axis=1)
    out[zero] = 0
    return out.reshape(rows, -1)


# ------------------------------------------------------------------------------------------------- Q3_K

def quantize_q3_k(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """Q3_K-encode float32 ``[rows, n]`` -> uint8 ``[rows, n // 256 * 110]`` (hmask[32], qs[64], scales[12],
    d)."""
    rows, n = x.shape
    blocks = np.ascontiguousarray(x, np.float32).reshape(-1, QK_K)
    count = len(blocks)
    qw = _importance_rows(importance, n, QK_K)
    if qw is None:
        scales, L = qs.q3_subblocks(blocks.reshape(-1, 16), 4)
        scales = scales.reshape(count, 16)
        max_scale = _first_max_abs(scales)
        some = max_scale != 0
        iscale = _ratio(-32, max_scale)
        ls = (np.clip(nearest_int(iscale[:, None] * scales).astype(np.int8), -32, 31) + 32).astype(np.uint8)
        ls[~some] = 0
        d = np.where(some, _ratio(1, iscale), np.float32(0))
    else:
        ls, d, L = qs.q3k_superblocks(blocks, qw)
    d16 = f16_bytes(d)
    packed = _pack_q3_scales(ls)
    sc = (ls & 63).astype(np.float32) - 32  # the 6 bits the block stores
    dl = d16.copy().view("<f2").astype(np.float32) * sc
    q = _requantize(blocks.reshape(count, 16, 16), L.reshape(count, 16, 16), dl, None, -4, 3).reshape(count, QK_K)
    out = np.concatenate([_pack_bits(q >> 2), _pack_2bit(q & 3), packed, d16], axis=1)
    return out.reshape(rows, -1)


# ------------------------------------------------------------------------------------------------- Q2_K

def quantize_q2_k(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """Q2_K-encode float32 ``[rows, n]`` -> uint8 ``[rows, n // 256 * 84]`` (scales[16], qs[64], d, dmin)."""
    rows, n = x.shape
    blocks = np.ascontiguousarray(x, np.float32).reshape(-1, QK_K)
    count = len(blocks)
    qw = _importance_rows(importance, n, QK_K)
    if qw is None:
        scales, mins, L = qs.qkx2_subblocks(blocks.reshape(-1, 16), 3, -0.5, 0.1, 15, True, False)
        scales, mins = scales.reshape(count, 16), mins.reshape(count, 16)
        max_scale = np.maximum(scales.max(axis=1), 0)
        max_min = np.maximum(mins.max(axis=1), 0)
        ls = np.where(max_scale[:, None] > 0, nearest_int(_ratio(15, max_scale)[:, None] * scales), 0)
        lm = np.where(max_min[:, None] > 0, nearest_int(_ratio(15, max_min)[:, None] * mins), 0)
        byte = ((ls & 255) | ((lm << 4) & 255)).astype(np.uint8)
        d = np.where(max_scale > 0, max_scale / np.float32(15), np.float32(0))
        dmin = np.where(max_min > 0, max_min / np.float32(15), np.float32(0))
    else:
        ls, lm, d, dmin, L = qs.kx3_superblocks(blocks, qw, 16, 3, 15, True)
        byte = ls | (lm << 4)
    d16, dmin16 = f16_bytes(d), f16_bytes(dmin)
    dl = d16.copy().view("<f2").astype(np.float32) * (byte & 15).astype(np.float32)
    ml = dmin16.copy().view("<f2").astype(np.float32) * (byte >> 4).astype(np.float32)
    q = _requantize(blocks.reshape(count, 16, 16), L.reshape(count, 16, 16), dl, ml, 0, 3).reshape(count, QK_K)
    out = np.concatenate([byte, _pack_2bit(q), d16, dmin16], axis=1)
    return out.reshape(rows, -1)


ENCODERS = {QType.Q2_K: quantize_q2_k, QType.Q3_K: quantize_q3_k, QType.Q4_K: quantize_q4_k,
            QType.Q5_K: quantize_q5_k, QType.Q6_K: quantize_q6_k}
