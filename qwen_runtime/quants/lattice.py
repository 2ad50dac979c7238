"""The 1- to 3-bit i-quants: super-blocks of 256 values whose groups of 8 (IQ3: 4) are points of a fixed grid.

=======  =====  ====================================================================  ===========================
type     bytes  layout                                                                value in sub-block j
=======  =====  ====================================================================  ===========================
IQ2_XXS  66     d, 8 x (grid[4] uint8, aux uint32: signs 4 x 7 bits, ls 4 bits)       d*(0.5+ls)*0.25 * ±g
IQ2_XS   74     d, qs uint16[32] (grid 9 bits, signs 7 bits), scales[8] (2 x 4 bits)  d*(0.5+ls)*0.25 * ±g
IQ2_S    82     d, qs[32] (grid low 8 bits), signs[32], qh[8] (4 x 2 bits), scales[8]  d*(0.5+ls)*0.25 * ±g
IQ3_XXS  98     d, qs[64] (grid of 4), 8 x aux uint32 (signs 4 x 7 bits, ls 4 bits)    d*(0.5+ls)*0.5 * ±g
IQ3_S    110    d, qs[64] (grid low 8 bits), qh[8] (8 x 1 bit), signs[32], scales[4]   d*(1+2ls) * ±g
IQ1_S    50     d, qs[32] (grid low 8 bits), qh uint16[8] (4 x 3 bits, ls 3, sign 1)   d*(2ls+1) * (g ± 1/8)
IQ1_M    56     qs[32], qh[16] (2 x (3 bits, delta sign)), scales uint16[4] (+ d)      d*(2ls+1) * (g ± 1/8)
=======  =====  ====================================================================  ===========================

Value ``32b + 8l + k`` (b < 8 groups of 32, l < 4 points, k < 8) is ``g = grid[index_bl][k]`` (IQ3: point ``2l +
k // 4``, value ``k % 4``), negated where bit ``k`` of the point's sign byte is set.  IQ2_XXS and IQ3_XXS store 7
sign bits per 8 values (``SIGNS_EVEN``: the 8th makes the count of minus signs even); IQ2_S and IQ3_S store all
8.  Sub-blocks (one ``ls`` each) are the 32-value groups, 16 values for IQ2_XS, IQ2_S and IQ1_M (``ls`` of
IQ2_XS/IQ2_S: nibble ``h`` of ``scales[b]``; of IQ3_S: nibble ``b % 2`` of ``scales[b // 2]``; of IQ1_M: bits
``3(s % 4)`` of ``scales[s // 4]``, whose top nibbles hold the float16 ``d``, low nibble first).  IQ1's ``delta``
is +1/8, -1/8 where its sign bit is set (IQ1_S: bit 15 of ``qh[b]``, per 32 values; IQ1_M: bit 3 of each
nibble of ``qh``, per 8).

Every grid index field covers its whole grid (8 bits for 256 points ... 11 bits for IQ1's 2048), so every bit
pattern is a valid block.  The fast decoders (:class:`~.blocks.BlockCodec`) store each value's integer part
(IQ1: ``8g ± 1`` with the scale times 1/8, exact, so the products round as the reference's) and per-sub-block
float32 scales computed in the reference's float32 operations, so the decode is bit-exact.
"""

from __future__ import annotations

import numpy as np

from .base import QType, f16_bits_to_f32, f16_field
from .blocks import SHIFTS_1BIT, SHIFTS_2BIT, BlockCodec, along, nibbles
from .grids import GRID_IQ1, GRID_IQ2_S, GRID_IQ2_XS, GRID_IQ2_XXS, GRID_IQ3_S, GRID_IQ3_XXS, SIGNS_EVEN, words
from .scratch import Scratch

SIGN_SHIFTS = np.array([0, 7, 14, 21], np.uint32)  # the four 7-bit sign indices of an aux word
IQ1_SHIFTS = np.array([0, 3, 6, 9], np.uint16)  # IQ1_S's 3-bit grid high bits in qh, IQ1_M's scales

WORDS_IQ2_XXS, WORDS_IQ2_XS, WORDS_IQ2_S = words(GRID_IQ2_XXS), words(GRID_IQ2_XS), words(GRID_IQ2_S)
WORDS_IQ3_XXS, WORDS_IQ3_S = words(GRID_IQ3_XXS), words(GRID_IQ3_S)
WORDS_IQ1_X8 = words(GRID_IQ1 * np.int8(8))  # IQ1's points times 8: the delta becomes +-1


def _levels(values: np.ndarray) -> tuple[tuple[int, int], int]:
    """(int_range, max_gap) of the integer parts ``values`` (any shape) a type's values can take."""
    levels = np.unique(values.astype(np.int32))
    return (int(levels[0]), int(levels[-1])), int(np.diff(levels).max())


def _signed_levels(grid: np.ndarray) -> tuple[tuple[int, int], int]:
    return _levels(np.concatenate([grid.ravel(), -grid.ravel()]))


# -- plain decoders: blocks [n, type_size] in their natural order ------------------------------------------------

def _u32(b: np.ndarray) -> np.ndarray:
    """Little-endian uint32 fields: bytes [..., 4k] -> [..., k]."""
    return np.ascontiguousarray(b).view("<u4").astype(np.uint32)


def _u16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u2").astype(np.uint16)


def _signed(points: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """Plain: ``points`` int8 [..., 8] negated where bit k of ``signs`` [...] is set, as float32."""
    negate = ((signs[..., None] >> SHIFTS_1BIT) & 1).astype(bool)
    return np.where(negate, -points, points).astype(np.float32)


def _half_scales(d: np.ndarray, ls: np.ndarray, times: float) -> np.ndarray:
    """``d * (0.5 + ls) * times`` in float32, as gguf.quants computes the IQ2/IQ3_XXS scales."""
    return d * (np.float32(0.5) + ls.astype(np.float32)) * np.float32(times)


# -- fast decoders: fields [type_size, *B] (field-major, one axis per block coordinate) ----------------------------

def _little_endian(parts: np.ndarray, name: str, dtype: type, scratch: Scratch) -> np.ndarray:
    """``parts`` uint8 [K, bytes, *B] -> little-endian words [K, *B] of ``dtype``."""
    out = scratch.array(name, (parts.shape[0], *parts.shape[2:]), dtype)
    np.copyto(out, parts[:, -1])
    for k in range(parts.shape[1] - 2, -1, -1):
        np.left_shift(out, 8, out=out)
        np.bitwise_or(out, parts[:, k], out=out)
    return out


def _points(table: np.ndarray, index: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
    """``out`` int8 [K, width, *B] = the grid points ``table[index]`` of ``index`` [K, *B] (``table``: one word per
    point, :func:`.grids.words`).  Indices are masked fields no wider than the grid (``mode="clip"`` never clips)."""
    width = table.dtype.itemsize
    gathered = scratch.array("grid points", index.shape, table.dtype)
    np.take(table, index, out=gathered, mode="clip")
    np.copyto(out, np.moveaxis(gathered.view(np.int8).reshape(*index.shape, width), -1, 1))


def _apply_signs(values: np.ndarray, signs: np.ndarray, scratch: Scratch) -> None:
    """Negate ``values`` int8 [K, 8, *B] where bit k of ``signs`` uint8 [K, *B] is set: ``(v ^ m) - m``, m = -bit."""
    bits = scratch.array("sign bits", values.shape, np.uint8)
    np.right_shift(signs[:, None], along(SHIFTS_1BIT, 1, values.ndim), out=bits)
    np.bitwise_and(bits, 1, out=bits)
    mask = bits.view(np.int8)
    np.negative(mask, out=mask)
    np.bitwise_xor(values, mask, out=values)
    np.subtract(values, mask, out=values)


def _even_signs(aux: np.ndarray, scratch: Scratch) -> np.ndarray:
    """The sign bytes [K, 4, *B] of aux words [K, *B] holding four 7-bit indices of :data:`SIGNS_EVEN`."""
    index = scratch.array("sign index", (aux.shape[0], 4, *aux.shape[1:]), np.uint32)
    np.right_shift(aux[:, None], along(SIGN_SHIFTS, 1, index.ndim), out=index)
    np.bitwise_and(index, 127, out=index)
    signs = scratch.array("signs", index.shape, np.uint8)
    np.take(SIGNS_EVEN, index, out=signs, mode="clip")
    return signs


def _fast_half_scales(ls: np.ndarray, d: np.ndarray, times: float, scratch: Scratch) -> np.ndarray:
    """:func:`_half_scales` for ``ls`` [J, *B] (any integer type) and ``d`` [*B]."""
    scale = scratch.array("scale", ls.shape)
    np.copyto(scale, ls, casting="unsafe")
    np.add(scale, np.float32(0.5), out=scale)
    np.multiply(scale, d, out=scale)
    np.multiply(scale, np.float32(times), out=scale)
    return scale


def _nibble_scales(packed: np.ndarray, scratch: Scratch) -> np.ndarray:
    """4-bit scales [2K, *B] (byte k's low nibble, then its high one) of ``packed`` [K, *B]."""
    ls = scratch.array("scale bits", (packed.shape[0], 2, *packed.shape[1:]), np.uint8)
    nibbles(packed, ls[:, 0], ls[:, 1])
    return ls.reshape(-1, *packed.shape[1:])


class IQ2_XXS(BlockCodec):
    qtype = QType.IQ2_XXS
    sub = 32
    int_range, max_gap = _signed_levels(GRID_IQ2_XXS)

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        d = f16_field(blocks[:, 0:2])[:, None]
        groups = blocks[:, 2:66].reshape(-1, 8, 8)  # [n, b, 4 grid indices + aux]
        aux = _u32(groups[:, :, 4:8])[..., 0]  # [n, b]
        signs = SIGNS_EVEN[(aux[..., None] >> SIGN_SHIFTS) & 127]  # [n, b, l]
        values = _signed(GRID_IQ2_XXS[groups[:, :, 0:4]], signs)  # [n, b, l, 8]
        return (_half_scales(d, aux >> 28, 0.25)[..., None, None] * values).reshape(*raw.shape[:-1], -1)

    def _aux(self, fields: np.ndarray, scratch: Scratch) -> np.ndarray:
        return _little_endian(fields[2:66].reshape(8, 8, *fields.shape[1:])[:, 4:8], "aux", np.uint32, scratch)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        values = out.reshape(32, 8, *rest)
        index = fields[2:66].reshape(8, 8, *rest)[:, 0:4].reshape(32, *rest)
        _points(WORDS_IQ2_XXS, index, values, scratch)
        _apply_signs(values, _even_signs(self._aux(fields, scratch), scratch).reshape(32, *rest), scratch)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        aux = self._aux(fields, scratch)
        np.right_shift(aux, 28, out=aux)
        return _fast_half_scales(aux, self.f16_row(fields, 0, "d", scratch), 0.25, scratch), None


class IQ2_XS(BlockCodec):
    qtype = QType.IQ2_XS
    sub = 16
    int_range, max_gap = _signed_levels(GRID_IQ2_XS)

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        d = f16_field(blocks[:, 0:2])[:, None]
        qs = _u16(blocks[:, 2:66])  # [n, 32]: grid index | sign index << 9
        values = _signed(GRID_IQ2_XS[qs & 511], SIGNS_EVEN[qs >> 9])  # [n, 32, 8]
        ls = np.stack([blocks[:, 66:74] & 15, blocks[:, 66:74] >> 4], axis=2).reshape(-1, 16)
        return (_half_scales(d, ls, 0.25)[..., None] * values.reshape(-1, 16, 16)).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        qs = _little_endian(fields[2:66].reshape(32, 2, *rest), "qs", np.uint16, scratch)
        index = scratch.array("grid index", qs.shape, np.uint16)
        np.bitwise_and(qs, 511, out=index)
        values = out.reshape(32, 8, *rest)
        _points(WORDS_IQ2_XS, index, values, scratch)
        np.right_shift(qs, 9, out=index)
        signs = scratch.array("signs", qs.shape, np.uint8)
        np.take(SIGNS_EVEN, index, out=signs, mode="clip")
        _apply_signs(values, signs, scratch)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        ls = _nibble_scales(fields[66:74], scratch)
        return _fast_half_scales(ls, self.f16_row(fields, 0, "d", scratch), 0.25, scratch), None


class IQ2_S(BlockCodec):
    qtype = QType.IQ2_S
    sub = 16
    int_range, max_gap = _signed_levels(GRID_IQ2_S)

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        d = f16_field(blocks[:, 0:2])[:, None]
        high = (blocks[:, 66:74, None] >> SHIFTS_2BIT) & 3  # [n, b, l]
        index = blocks[:, 2:34].astype(np.int32) | (high.reshape(-1, 32).astype(np.int32) << 8)
        values = _signed(GRID_IQ2_S[index], blocks[:, 34:66])  # [n, 32, 8]
        ls = np.stack([blocks[:, 74:82] & 15, blocks[:, 74:82] >> 4], axis=2).reshape(-1, 16)
        return (_half_scales(d, ls, 0.25)[..., None] * values.reshape(-1, 16, 16)).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        index = scratch.array("grid index", (8, 4, *rest), np.uint16)
        np.right_shift(fields[66:74][:, None], along(SHIFTS_2BIT, 1, index.ndim), out=index)
        np.bitwise_and(index, 3, out=index)
        np.left_shift(index, 8, out=index)
        np.bitwise_or(index, fields[2:34].reshape(8, 4, *rest), out=index)
        values = out.reshape(32, 8, *rest)
        _points(WORDS_IQ2_S, index.reshape(32, *rest), values, scratch)
        _apply_signs(values, fields[34:66], scratch)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        ls = _nibble_scales(fields[74:82], scratch)
        return _fast_half_scales(ls, self.f16_row(fields, 0, "d", scratch), 0.25, scratch), None


class IQ3_XXS(BlockCodec):
    qtype = QType.IQ3_XXS
    sub = 32
    int_range, max_gap = _signed_levels(GRID_IQ3_XXS)

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        d = f16_field(blocks[:, 0:2])[:, None]
        aux = _u32(blocks[:, 66:98])  # [n, b]
        signs = SIGNS_EVEN[(aux[..., None] >> SIGN_SHIFTS) & 127]  # [n, b, l]
        points = GRID_IQ3_XXS[blocks[:, 2:66]].reshape(-1, 8, 4, 8)  # two points of 4 per 8 values
        values = _signed(points, signs)
        return (_half_scales(d, aux >> 28, 0.5)[..., None, None] * values).reshape(*raw.shape[:-1], -1)

    def _aux(self, fields: np.ndarray, scratch: Scratch) -> np.ndarray:
        return _little_endian(fields[66:98].reshape(8, 4, *fields.shape[1:]), "aux", np.uint32, scratch)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        _points(WORDS_IQ3_XXS, fields[2:66], out.reshape(64, 4, *rest), scratch)
        signs = _even_signs(self._aux(fields, scratch), scratch).reshape(32, *rest)
        _apply_signs(out.reshape(32, 8, *rest), signs, scratch)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        aux = self._aux(fields, scratch)
        np.right_shift(aux, 28, out=aux)
        return _fast_half_scales(aux, self.f16_row(fields, 0, "d", scratch), 0.5, scratch), None


class IQ3_S(BlockCodec):
    qtype = QType.IQ3_S
    sub = 32
    int_range, max_gap = _signed_levels(GRID_IQ3_S)

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        d = f16_field(blocks[:, 0:2])[:, None]
        high = (blocks[:, 66:74, None] >> SHIFTS_1BIT) & 1  # [n, b, 8 points]
        index = blocks[:, 2:66].astype(np.int32) | (high.reshape(-1, 64).astype(np.int32) << 8)
        values = _signed(GRID_IQ3_S[index].reshape(-1, 32, 8), blocks[:, 74:106])  # [n, 32, 8]
        ls = np.stack([blocks[:, 106:110] & 15, blocks[:, 106:110] >> 4], axis=2).reshape(-1, 8)
        db = d * (1 + 2 * ls).astype(np.float32)
        return (db[..., None] * values.reshape(-1, 8, 32)).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        index = scratch.array("grid index", (8, 8, *rest), np.uint16)
        np.right_shift(fields[66:74][:, None], along(SHIFTS_1BIT, 1, index.ndim), out=index)
        np.bitwise_and(index, 1, out=index)
        np.left_shift(index, 8, out=index)
        np.bitwise_or(index, fields[2:66].reshape(8, 8, *rest), out=index)
        _points(WORDS_IQ3_S, index.reshape(64, *rest), out.reshape(64, 4, *rest), scratch)
        _apply_signs(out.reshape(32, 8, *rest), fields[74:106], scratch)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        ls = _nibble_scales(fields[106:110], scratch)
        np.multiply(ls, 2, out=ls)
        np.add(ls, 1, out=ls)
        scale = scratch.array("scale", ls.shape)
        np.multiply(self.f16_row(fields, 0, "d", scratch), ls, out=scale)
        return scale, None


def _iq1_x8_scales(ls: np.ndarray, d: np.ndarray, scratch: Scratch) -> np.ndarray:
    """``(d * (2 ls + 1)) / 8`` [J, *B] for 3-bit ``ls`` (uint16, overwritten): IQ1's scale for ints ``8g ± 1``
    (exact: an 11-bit significand times 4 bits, then a power of two)."""
    np.multiply(ls, 2, out=ls)
    np.add(ls, 1, out=ls)
    scale = scratch.array("scale", ls.shape)
    np.multiply(d, ls, out=scale)
    np.multiply(scale, np.float32(0.125), out=scale)
    return scale


def _add_delta(values: np.ndarray, sign_bits: np.ndarray, scratch: Scratch) -> None:
    """``values`` int8 [K, W, *B] += 1, or -1 where ``sign_bits`` [K, *B] (0 or 1, any integer type) is 1."""
    delta = scratch.array("delta", sign_bits.shape, np.int8)
    np.copyto(delta, sign_bits, casting="unsafe")
    np.multiply(delta, np.int8(-2), out=delta)
    np.add(delta, np.int8(1), out=delta)
    np.add(values, delta[:, None], out=values)


class IQ1_S(BlockCodec):
    qtype = QType.IQ1_S
    sub = 32
    int_range, max_gap = _levels(np.array([-9, -7, -1, 1, 7, 9]))  # 8g + 1 or 8g - 1: eighths of the scale

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        d = f16_field(blocks[:, 0:2])[:, None]
        qh = _u16(blocks[:, 34:50])  # [n, b]
        index = blocks[:, 2:34].reshape(-1, 8, 4).astype(np.int32) | ((qh[..., None] >> IQ1_SHIFTS) & 7) << 8
        dl = d * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)  # [n, b]
        delta = np.where(qh & 0x8000, np.float32(-0.125), np.float32(0.125))
        values = GRID_IQ1[index].astype(np.float32) + delta[..., None, None]  # [n, b, l, 8]
        return (dl[..., None, None] * values).reshape(*raw.shape[:-1], -1)

    def _qh(self, fields: np.ndarray, scratch: Scratch) -> np.ndarray:
        return _little_endian(fields[34:50].reshape(8, 2, *fields.shape[1:]), "qh", np.uint16, scratch)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        qh = self._qh(fields, scratch)
        index = scratch.array("grid index", (8, 4, *rest), np.uint16)
        np.right_shift(qh[:, None], along(IQ1_SHIFTS, 1, index.ndim), out=index)
        np.bitwise_and(index, 7, out=index)
        np.left_shift(index, 8, out=index)
        np.bitwise_or(index, fields[2:34].reshape(8, 4, *rest), out=index)
        _points(WORDS_IQ1_X8, index.reshape(32, *rest), out.reshape(32, 8, *rest), scratch)
        np.right_shift(qh, 15, out=qh)
        _add_delta(out.reshape(8, 32, *rest), qh, scratch)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        qh = self._qh(fields, scratch)
        np.right_shift(qh, 12, out=qh)
        np.bitwise_and(qh, 7, out=qh)
        return _iq1_x8_scales(qh, self.f16_row(fields, 0, "d", scratch), scratch), None


class IQ1_M(BlockCodec):
    qtype = QType.IQ1_M
    sub = 16
    int_range, max_gap = IQ1_S.int_range, IQ1_S.max_gap

    @staticmethod
    def _d_bits(sc: np.ndarray) -> np.ndarray:
        """Plain: the float16 bits of ``d`` from the top nibbles of the 4 scale words [n, 4]."""
        return (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        sc = _u16(blocks[:, 48:56])  # [n, 4]
        d = self._d_bits(sc).astype(np.uint16).view(np.float16).astype(np.float32)[:, None]
        ls = ((sc[..., None] >> IQ1_SHIFTS) & 7).reshape(-1, 16)
        dl = d * (2 * ls + 1).astype(np.float32)  # [n, 16]
        nib = np.stack([blocks[:, 32:48] & 15, blocks[:, 32:48] >> 4], axis=2).reshape(-1, 32)  # per 8 values
        index = blocks[:, 0:32].astype(np.int32) | (nib & 7).astype(np.int32) << 8
        delta = np.where(nib & 8, np.float32(-0.125), np.float32(0.125))
        values = GRID_IQ1[index].astype(np.float32) + delta[..., None]  # [n, 32, 8]
        return (dl[..., None] * values.reshape(-1, 16, 16)).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        nib = _nibble_scales(fields[32:48], scratch)  # [32, *B]: (3 grid bits, delta sign) per 8 values
        index = scratch.array("grid index", nib.shape, np.uint16)
        np.bitwise_and(nib, 7, out=index)
        np.left_shift(index, 8, out=index)
        np.bitwise_or(index, fields[0:32], out=index)
        values = out.reshape(32, 8, *rest)
        _points(WORDS_IQ1_X8, index, values, scratch)
        np.right_shift(nib, 3, out=nib)
        _add_delta(values, nib, scratch)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        rest = fields.shape[1:]
        sc = _little_endian(fields[48:56].reshape(4, 2, *rest), "scale words", np.uint16, scratch)
        bits, part = scratch.array("d bits", rest, np.uint16), scratch.array("d part", rest, np.uint16)
        np.right_shift(sc[0], 12, out=bits)
        for k, mask in ((1, 0xF0), (2, 0xF00), (3, 0xF000)):
            np.right_shift(sc[k], 12 - 4 * k, out=part)
            np.bitwise_and(part, mask, out=part)
            np.bitwise_or(bits, part, out=bits)
        d = f16_bits_to_f32(bits, scratch.array("d", rest), scratch)
        ls = scratch.array("scale bits", (4, 4, *rest), np.uint16)
        np.right_shift(sc[:, None], along(IQ1_SHIFTS, 1, ls.ndim), out=ls)
        np.bitwise_and(ls, 7, out=ls)
        return _iq1_x8_scales(ls.reshape(16, *rest), d, scratch), None
