"""The legacy 4- and 5-bit types: blocks of 32 values with one float16 scale (and a float16 minimum for _1).

=====  =====  ========================================================  ==================
type   bytes  layout                                                    value
=====  =====  ========================================================  ==================
Q4_0   18     d, qs[16]                                                 d * (q - 8)
Q4_1   20     d, m, qs[16]                                              d * q + m
Q5_0   22     d, qh[4], qs[16]                                          d * (q - 16)
Q5_1   24     d, m, qh[4], qs[16]                                       d * q + m
=====  =====  ========================================================  ==================

Value ``j`` (0..31) takes its low 4 bits from ``qs[j % 16]``, the low nibble for j < 16 and the high nibble
for j >= 16; the 5-bit types add bit ``j`` of the little-endian 32-bit ``qh`` as bit 4.
"""

from __future__ import annotations

import numpy as np

from .base import QType, f16_field
from .blocks import BlockCodec, bit_planes, nibbles
from .scratch import Scratch


class _Legacy(BlockCodec):
    """Shared geometry: ``qs_at`` (first byte of qs), ``qh_at`` (5-bit types), ``bias`` subtracted from q."""

    qs_at: int
    qh_at: int | None = None
    bias = 0

    def __init__(self) -> None:
        self.sub = self.block_size

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        half = self.block_size // 2
        qs = blocks[:, self.qs_at:self.qs_at + half]  # [n_blocks, 16]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int32)  # [n_blocks, 32]: low nibbles first
        if self.qh_at is not None:
            qh = blocks[:, self.qh_at:self.qh_at + 4].copy().view("<u4")  # [n_blocks, 1]
            q |= ((qh >> np.arange(self.block_size, dtype=np.uint32)) & 1).astype(np.int32) << 4
        d = f16_field(blocks[:, 0:2])[:, None]
        values = d * (q - self.bias).astype(np.float32)
        if self.has_offset:
            values = values + f16_field(blocks[:, 2:4])[:, None]
        return values.reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        half = self.block_size // 2
        q = out.view(np.uint8)
        nibbles(fields[self.qs_at:self.qs_at + half], q[:half], q[half:])
        if self.qh_at is not None:
            high = scratch.array("high bits", (4, 8, *fields.shape[1:]), np.uint8)
            bit_planes(fields[self.qh_at:self.qh_at + 4], high)
            np.multiply(high, 16, out=high)  # = << 4 (numpy has no fast uint8 shift left)
            np.bitwise_or(q, high.reshape(q.shape), out=q)
        if self.bias:
            np.subtract(q, self.bias, out=q)  # wraps: the int8 view holds q - bias

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        d = self.f16_row(fields, 0, "d", scratch)[None]
        return d, self.f16_row(fields, 2, "m", scratch)[None] if self.has_offset else None


class Q4_0(_Legacy):
    qtype = QType.Q4_0
    qs_at, bias, int_range = 2, 8, (-8, 7)
    npy_dtype = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])


class Q4_1(_Legacy):
    qtype = QType.Q4_1
    qs_at, has_offset, int_range = 4, True, (0, 15)
    npy_dtype = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])


class Q5_0(_Legacy):
    qtype = QType.Q5_0
    qh_at, qs_at, bias, int_range = 2, 6, 16, (-16, 15)
    npy_dtype = np.dtype([("d", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (16,))])


class Q5_1(_Legacy):
    qtype = QType.Q5_1
    qh_at, qs_at, has_offset, int_range = 4, 8, True, (0, 31)
    npy_dtype = np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (16,))])
