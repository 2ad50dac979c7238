"""IQ4_NL and IQ4_XS writers: float32 rows to the bytes of llama.cpp's ``quantize_iq4_nl`` / ``quantize_iq4_xs``.

Both run ``quantize_row_iq4_nl_impl`` with ``ntry = 7`` whether or not an importance matrix is given (only the
weights change: x^2, or ``qw * sqrt(sigma2 + x^2)``); the search is compiled in
:func:`qwen_convert.quant_search.iq4_superblocks`, the float16 rounding and packing are here.  ``x`` is
float32 ``[rows, n]``; ``importance`` (optional) the per-column weights ``[n]``.
"""

from __future__ import annotations

import numpy as np

from qwen_runtime.quants.base import QType
from qwen_runtime.quants.iq4 import IQ4_LEVELS

from . import quant_search as qs
from .kquant_encode import f16_bytes

IQ4_NL_BLOCK, IQ4_XS_BLOCK = 32, 256


def _search(x: np.ndarray, block: int, importance: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows, n = x.shape
    blocks = np.ascontiguousarray(x, np.float32).reshape(-1, block)
    if importance is None:
        return qs.iq4_superblocks(blocks, blocks, False, IQ4_LEVELS)
    qw = np.ascontiguousarray(importance, np.float32).reshape(n // block, block)
    return qs.iq4_superblocks(blocks, qw, True, IQ4_LEVELS)


def _pack_halves(L: np.ndarray) -> np.ndarray:
    """Level indices ``[B, 32k]`` -> ``[B, 16k]``: value ``32i + j`` low nibble of byte ``16i + j``, ``32i + 16 + j``
    its high nibble."""
    q = L.reshape(len(L), -1, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(L), -1)


def quantize_iq4_nl(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """IQ4_NL-encode float32 ``[rows, n]`` (n divisible by 32) -> uint8 ``[rows, n // 32 * 18]`` (d, qs[16])."""
    d, _, L = _search(x, IQ4_NL_BLOCK, importance)
    return np.concatenate([f16_bytes(d), _pack_halves(L)], axis=1).reshape(len(x), -1)


def quantize_iq4_xs(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """IQ4_XS-encode float32 ``[rows, n]`` (n divisible by 256) -> uint8 ``[rows, n // 256 * 136]`` (d,
    scales_h, scales_l[4], qs[128])."""
    d, ls, L = _search(x, IQ4_XS_BLOCK, importance)
    high = (ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))  # [B, 8]
    scales_h = np.bitwise_or.reduce(high, axis=1).astype("<u2").view(np.uint8).reshape(-1, 2)
    scales_l = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
    return np.concatenate([f16_bytes(d), scales_h, scales_l, _pack_halves(L)], axis=1).reshape(len(x), -1)


ENCODERS = {QType.IQ4_NL: quantize_iq4_nl, QType.IQ4_XS: quantize_iq4_xs}
