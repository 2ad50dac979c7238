"""Q4_0, Q4_1, Q5_0 and Q5_1 weighted by an importance matrix: the bytes of llama.cpp's
``quantize_row_q{4,5}_{0,1}_impl``.

Without importance llama.cpp runs the reference quantizers, which ``gguf.quants`` reproduces
(:func:`qwen_convert.quantize.encode_rows`); with it, a weighted search per block of 32
(:func:`qwen_convert.quant_search.legacy_weighted_rows`) whose integers are stored as found (no re-rounding).
``x`` is float32 ``[rows, n]`` (n divisible by 32), ``importance`` float32 ``[n]``.
"""

from __future__ import annotations

import numpy as np

from qwen_runtime.quants.base import QType

from . import quant_search as qs
from .kquant_encode import f16_bytes

# type -> (nmax of the search, with an offset m)
SEARCH = {QType.Q4_0: (8, False), QType.Q4_1: (15, True), QType.Q5_0: (16, False), QType.Q5_1: (31, True)}


def quantize_weighted(x: np.ndarray, qtype: QType, importance: np.ndarray) -> np.ndarray:
    """``qtype`` (Q4_0/Q4_1/Q5_0/Q5_1) blocks of float32 ``[rows, n]`` -> uint8 ``[rows, n // 32 * size]``."""
    rows, n = x.shape
    nmax, offset = SEARCH[qtype]
    qw = np.ascontiguousarray(importance, np.float32).reshape(n // 32, 32)
    d, m, L = qs.legacy_weighted_rows(np.ascontiguousarray(x, np.float32), qw, nmax, offset)
    fields = [f16_bytes(d)] + ([f16_bytes(m)] if offset else [])
    if nmax > 15:  # Q5: bit 4 of value j (j < 16) is bit j of qh, of value 16 + j bit 16 + j
        bits = (L >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)
        fields.append(np.bitwise_or.reduce(bits, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4))
    low = L & 15
    fields.append(low[:, :16] | (low[:, 16:] << 4))
    return np.concatenate(fields, axis=1).reshape(rows, -1)
