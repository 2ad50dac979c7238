"""The K-quants: super-blocks of 256 values in sub-blocks of 16 or 32, each with its own quantized scale.

=====  =====  ===========================================================  =================================
type   bytes  layout                                                       value in sub-block j
=====  =====  ===========================================================  =================================
Q2_K   84     scales[16] (4-bit sc | 4-bit m << 4), qs[64], d, dmin         (d * sc_j) * q - dmin * m_j
Q3_K   110    hmask[32], qs[64], scales[12] (16 x 6 bits), d                (d * (s_j - 32)) * q, q in -4..3
Q4_K   144    d, dmin, scales[12] (8 x 6-bit sc, 8 x 6-bit m), qs[128]      (d * sc_j) * q - dmin * m_j
Q5_K   176    d, dmin, scales[12] (as Q4_K), qh[32], qs[128]                (d * sc_j) * q - dmin * m_j
Q6_K   210    ql[128], qh[64], scales[16] (int8), d                         (d * s_j) * (q - 32)
=====  =====  ===========================================================  =================================

Where the bits of value ``e`` (0..255) are:

* 2-bit fields (Q2_K ``qs``, Q3_K ``qs``, Q6_K ``qh``): 32 bytes serve 128 values; value ``128h + 32s + l``
  is bits ``2s, 2s+1`` of byte ``32h + l`` of the field;
* 4-bit fields (Q4_K/Q5_K ``qs``): value ``64c + l`` is the low nibble of byte ``32c + l``, value
  ``64c + 32 + l`` its high nibble; Q6_K ``ql``: value ``128h + 64n + m`` is nibble ``n`` of byte ``64h + m``;
* 1-bit fields (Q3_K ``hmask``, Q5_K ``qh``): value ``32i + l`` is bit ``i`` of byte ``l``; Q5_K adds it as
  bit 4, Q3_K subtracts 4 where it is *clear*.
* 6-bit scales (Q3_K): low 4 bits of s_j from byte ``j % 8`` (nibble ``j // 8``), high 2 bits from byte
  ``8 + j % 4`` (bits ``2(j // 4)``); (Q4_K/Q5_K): for j < 4, sc_j and m_j are the low 6 bits of bytes j and
  4 + j; for j >= 4, their low 4 bits are the nibbles of byte 4 + j and their high 2 bits the top bits of
  bytes j - 4 and j.
"""

from __future__ import annotations

import numpy as np

from .base import QType, f16_field
from .blocks import SHIFTS_1BIT, SHIFTS_2BIT, BlockCodec, along, nibbles, signed_6bit_scales
from .scratch import Scratch


def _two_bit_values(field: np.ndarray) -> np.ndarray:
    """Plain: a 2-bit field [n, 32 * H] -> values [n, 128 * H] (value ``128h + 32s + l``)."""
    n, width = field.shape
    parts = field.reshape(n, width // 32, 1, 32) >> SHIFTS_2BIT.reshape(1, 1, 4, 1)  # [n, H, 4, 32]
    return (parts & 3).reshape(n, -1).astype(np.int32)


def _one_bit_values(field: np.ndarray) -> np.ndarray:
    """Plain: a 32-byte bit field [n, 32] -> bits [n, 256] (value ``32i + l`` is bit i of byte l)."""
    return ((field[:, None, :] >> SHIFTS_1BIT.reshape(1, 8, 1)) & 1).reshape(len(field), -1).astype(np.int32)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Plain: Q4_K/Q5_K 12 scale bytes [n, 12] -> (sc, m), 8 six-bit values each (module docstring)."""
    s = scales.astype(np.int32)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 2) & 48)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 2) & 48)], axis=1)
    return sc, m


def _signed_scales_k3(packed: np.ndarray) -> np.ndarray:
    """Plain: Q3_K's 12 scale bytes [n, 12] -> its 16 six-bit scales minus 32, int32 [n, 16] (module docstring)."""
    packed = packed.astype(np.int32)
    low = np.concatenate([packed[:, 0:8] & 15, packed[:, 0:8] >> 4], axis=1)  # [n, 16]
    high = ((packed[:, 8:12][:, None, :] >> SHIFTS_2BIT.reshape(1, 4, 1)) & 3).reshape(-1, 16)
    return (low | (high << 4)) - 32


def _three_bit_values(blocks: np.ndarray) -> np.ndarray:
    """Plain: Q3_K blocks [n, 110] -> their integers -4..3, int32 [n, 256] (``hmask`` clear: minus 4)."""
    return _two_bit_values(blocks[:, 32:96]) - 4 * (1 - _one_bit_values(blocks[:, 0:32]))


def _by_sub(values: np.ndarray, sub: int) -> np.ndarray:
    return values.reshape(len(values), -1, sub)


class Q2_K(BlockCodec):
    qtype = QType.Q2_K
    sub, has_offset, subtracts, int_range = 16, True, True, (0, 3)
    npy_dtype = np.dtype([("scales", "u1", (16,)), ("qs", "u1", (64,)), ("d", "<f2"), ("dmin", "<f2")])

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        scales, qs = blocks[:, 0:16], blocks[:, 16:80]
        d, dmin = f16_field(blocks[:, 80:82])[:, None], f16_field(blocks[:, 82:84])[:, None]
        q = _by_sub(_two_bit_values(qs), self.sub).astype(np.float32)  # [n, 16, 16]
        dl = (d * (scales & 15).astype(np.float32))[:, :, None]
        ml = (dmin * (scales >> 4).astype(np.float32))[:, :, None]
        return (dl * q - ml).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        q = out.view(np.uint8).reshape(2, 4, 32, *rest)
        np.right_shift(fields[16:80].reshape(2, 1, 32, *rest), along(SHIFTS_2BIT, 1, 3 + len(rest)), out=q)
        np.bitwise_and(q, 3, out=q)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        d, dmin = self.f16_row(fields, 80, "d", scratch), self.f16_row(fields, 82, "dmin", scratch)
        low = scratch.array("scale bits", fields[0:16].shape, np.uint8)
        scale = scratch.array("scale", low.shape)
        np.bitwise_and(fields[0:16], 15, out=low)
        np.multiply(d, low, out=scale)
        offset = scratch.array("offset", low.shape)
        np.right_shift(fields[0:16], 4, out=low)
        np.multiply(dmin, low, out=offset)
        return scale, offset


class Q3_K(BlockCodec):
    qtype = QType.Q3_K
    sub, int_range = 16, (-4, 3)
    npy_dtype = np.dtype([("hmask", "u1", (32,)), ("qs", "u1", (64,)), ("scales", "u1", (12,)), ("d", "<f2")])

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        d = f16_field(blocks[:, 108:110])[:, None]
        s = _signed_scales_k3(blocks[:, 96:108])
        q = _three_bit_values(blocks)  # [n, 256]
        dl = (d * s.astype(np.float32))[:, :, None]
        return (dl * _by_sub(q, self.sub).astype(np.float32)).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        q = out.view(np.uint8)
        low = q.reshape(2, 4, 32, *rest)
        np.right_shift(fields[32:96].reshape(2, 1, 32, *rest), along(SHIFTS_2BIT, 1, 3 + len(rest)), out=low)
        np.bitwise_and(low, 3, out=low)
        clear = scratch.array("high bits", (8, 32, *rest), np.uint8)  # 4 where the hmask bit is clear, else 0
        np.right_shift(fields[0:32][None], along(SHIFTS_1BIT, 0, 2 + len(rest)), out=clear)
        np.bitwise_and(clear, 1, out=clear)
        np.bitwise_xor(clear, 1, out=clear)
        np.multiply(clear, 4, out=clear)  # = << 2
        np.subtract(q, clear.reshape(q.shape), out=q)  # wraps: the int8 view holds q - 4

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        rest = fields.shape[1:]
        s = scratch.array("scale bits", (16, *rest), np.uint8)
        nibbles(fields[96:104], s[0:8], s[8:16])
        high = scratch.array("scale high bits", (4, 4, *rest), np.uint8)
        np.right_shift(fields[104:108][None], along(SHIFTS_2BIT, 0, 2 + len(rest)), out=high)
        return signed_6bit_scales(s, high, self.f16_row(fields, 108, "d", scratch), scratch), None


class _Q45_K(BlockCodec):
    """Q4_K and Q5_K: 8 sub-blocks of 32, 6-bit scales and minimums, 4 low bits in ``qs`` at ``qs_at``."""

    sub, has_offset, subtracts = 32, True, True
    qs_at: int

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        d, dmin = f16_field(blocks[:, 0:2])[:, None], f16_field(blocks[:, 2:4])[:, None]
        sc, m = _scale_min_k4(blocks[:, 4:16])
        qs = blocks[:, self.qs_at:self.qs_at + 128].reshape(-1, 4, 1, 32)  # [n, chunk c, 1, byte l]
        q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 256).astype(np.int32)  # value 64c + 32n + l
        if self.qs_at > 16:  # Q5_K: bit 4 from qh
            q |= _one_bit_values(blocks[:, 16:48]) << 4
        dl = (d * sc.astype(np.float32))[:, :, None]
        ml = (dmin * m.astype(np.float32))[:, :, None]
        return (dl * _by_sub(q, self.sub).astype(np.float32) - ml).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        q = out.view(np.uint8)
        by_chunk = q.reshape(4, 2, 32, *rest)
        nibbles(fields[self.qs_at:self.qs_at + 128].reshape(4, 32, *rest), by_chunk[:, 0], by_chunk[:, 1])
        if self.qs_at > 16:
            high = scratch.array("high bits", (8, 32, *rest), np.uint8)
            np.right_shift(fields[16:48][None], along(SHIFTS_1BIT, 0, 2 + len(rest)), out=high)
            np.bitwise_and(high, 1, out=high)
            np.multiply(high, 16, out=high)  # = << 4 (numpy has no fast uint8 shift left)
            np.bitwise_or(q, high.reshape(q.shape), out=q)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        rest = fields.shape[1:]
        packed = fields[4:16]
        sc = scratch.array("scale bits", (8, *rest), np.uint8)
        m = scratch.array("min bits", (8, *rest), np.uint8)
        tmp = scratch.array("scale tmp", (4, *rest), np.uint8)
        np.bitwise_and(packed[0:4], 63, out=sc[0:4])
        np.bitwise_and(packed[4:8], 63, out=m[0:4])
        np.bitwise_and(packed[8:12], 15, out=sc[4:8])
        np.right_shift(packed[8:12], 4, out=m[4:8])
        np.right_shift(packed[0:4], 2, out=tmp)
        np.bitwise_and(tmp, 48, out=tmp)
        np.bitwise_or(sc[4:8], tmp, out=sc[4:8])
        np.right_shift(packed[4:8], 2, out=tmp)
        np.bitwise_and(tmp, 48, out=tmp)
        np.bitwise_or(m[4:8], tmp, out=m[4:8])
        scale, offset = scratch.array("scale", sc.shape), scratch.array("offset", m.shape)
        np.multiply(self.f16_row(fields, 0, "d", scratch), sc, out=scale)
        np.multiply(self.f16_row(fields, 2, "dmin", scratch), m, out=offset)
        return scale, offset


class Q4_K(_Q45_K):
    qtype = QType.Q4_K
    qs_at, int_range = 16, (0, 15)
    npy_dtype = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qs", "u1", (128,))])


class Q5_K(_Q45_K):
    qtype = QType.Q5_K
    qs_at, int_range = 48, (0, 31)
    npy_dtype = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qh", "u1", (32,)),
                          ("qs", "u1", (128,))])


class Q6_K(BlockCodec):
    qtype = QType.Q6_K
    sub, int_range = 16, (-32, 31)
    npy_dtype = np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)), ("d", "<f2")])

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        ql = blocks[:, 0:128].reshape(-1, 2, 1, 64)  # [n, half h, 1, byte m]
        low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 256).astype(np.int32)  # value 128h + 64n + m
        q = (low | (_two_bit_values(blocks[:, 128:192]) << 4)) - 32
        s = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = f16_field(blocks[:, 208:210])[:, None]
        return ((d * s)[:, :, None] * _by_sub(q, self.sub).astype(np.float32)).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        q = out.view(np.uint8)
        by_half = q.reshape(2, 2, 64, *rest)
        nibbles(fields[0:128].reshape(2, 64, *rest), by_half[:, 0], by_half[:, 1])
        high = scratch.array("high bits", (2, 4, 32, *rest), np.uint8)
        np.right_shift(fields[128:192].reshape(2, 1, 32, *rest), along(SHIFTS_2BIT, 1, 3 + len(rest)), out=high)
        np.bitwise_and(high, 3, out=high)
        np.multiply(high, 16, out=high)  # = << 4 (numpy has no fast uint8 shift left)
        np.bitwise_or(q, high.reshape(q.shape), out=q)
        np.subtract(q, 32, out=q)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        scale = scratch.array("scale", fields[192:208].shape)
        np.multiply(self.f16_row(fields, 208, "d", scratch), fields[192:208].view(np.int8), out=scale)
        return scale, None
