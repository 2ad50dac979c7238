"""The non-linear 4-bit types: each 4-bit index selects one of 16 fixed int8 levels (``IQ4_LEVELS``,
MXFP4's ``MXFP4_LEVELS``).

======  =====  =========================================================  ======================
type    bytes  layout                                                     value
======  =====  =========================================================  ======================
IQ4_NL  18     d, qs[16] (as Q4_0: low nibbles first)                     d * level[q]
IQ4_XS  136    d, scales_h (uint16), scales_l[4], qs[128]                 (d * (ls_j - 32)) * level[q]
MXFP4   17     e (E8M0), qs[16] (as Q4_0)                                 2**(e - 128) * level[q]
======  =====  =========================================================  ======================

MXFP4's levels are the FP4 (E2M1) values doubled, so its scale is the E8M0 ``2**(e - 127)`` halved (llama.cpp's
``ggml_e8m0_to_fp32_half``: subnormal float32 for e < 2); every byte is a valid scale, every nibble a level.

IQ4_XS has 8 sub-blocks of 32: ``ls_j`` is nibble ``j % 2`` of ``scales_l[j // 2]`` plus bits ``2j, 2j+1`` of
``scales_h`` as bits 4-5; value ``32j + 16n + l`` is nibble ``n`` of ``qs[16j + l]``.
"""

from __future__ import annotations

import numpy as np

from .base import QType, f16_field
from .blocks import SHIFTS_2BIT, BlockCodec, along, nibbles, signed_6bit_scales
from .grids import MXFP4_LEVELS
from .scratch import Scratch

# The 16 levels of llama.cpp's kvalues_iq4nl (a fixed part of the format).
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _levels(indices: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = IQ4_LEVELS[indices[i]]`` for 4-bit ``indices`` (uint8) into int8 ``out``."""
    np.take(IQ4_LEVELS, indices, out=out)


def xs_scales(blocks: np.ndarray) -> np.ndarray:
    """Plain: IQ4_XS blocks [n, 136] -> their sub-block scales ``ls_j - 32``, int32 [n, 8] (module docstring)."""
    high = blocks[:, 2:4].copy().view("<u2").astype(np.int32)  # [n, 1]
    low = blocks[:, 4:8].astype(np.int32)
    j = np.arange(8)
    return (((low[:, j // 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)) - 32


def xs_levels(blocks: np.ndarray) -> np.ndarray:
    """Plain: IQ4_XS blocks [n, 136] -> the level of each value, int8 [n, 256] in value order."""
    qs = blocks[:, 8:136].reshape(-1, 8, 1, 16)
    return IQ4_LEVELS[np.concatenate([qs & 15, qs >> 4], axis=2).reshape(len(blocks), -1)]


class IQ4_NL(BlockCodec):
    qtype = QType.IQ4_NL
    sub, int_range, max_gap = 32, (int(IQ4_LEVELS[0]), int(IQ4_LEVELS[-1])), int(np.diff(IQ4_LEVELS).max())
    npy_dtype = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        qs = blocks[:, 2:18]
        q = IQ4_LEVELS[np.concatenate([qs & 15, qs >> 4], axis=1)].astype(np.float32)  # [n, 32]
        return (f16_field(blocks[:, 0:2])[:, None] * q).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        index = scratch.array("indices", out.shape, np.uint8)
        nibbles(fields[2:18], index[:16], index[16:])
        _levels(index, out)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        return self.f16_row(fields, 0, "d", scratch)[None], None


class IQ4_XS(BlockCodec):
    qtype = QType.IQ4_XS
    sub, int_range, max_gap = 32, (int(IQ4_LEVELS[0]), int(IQ4_LEVELS[-1])), int(np.diff(IQ4_LEVELS).max())
    npy_dtype = np.dtype([("d", "<f2"), ("scales_h", "<u2"), ("scales_l", "u1", (4,)), ("qs", "u1", (128,))])

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        d = f16_field(blocks[:, 0:2])[:, None]
        dl = (d * xs_scales(blocks).astype(np.float32))[:, :, None]
        q = xs_levels(blocks).reshape(-1, 8, 32).astype(np.float32)
        return (dl * q).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        index = scratch.array("indices", out.shape, np.uint8)
        by_sub = index.reshape(8, 2, 16, *rest)
        nibbles(fields[8:136].reshape(8, 16, *rest), by_sub[:, 0], by_sub[:, 1])
        _levels(index, out)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        rest = fields.shape[1:]
        ls = scratch.array("scale bits", (8, *rest), np.uint8)
        pairs = ls.reshape(4, 2, *rest)
        nibbles(fields[4:8], pairs[:, 0], pairs[:, 1])
        high = scratch.array("scale high bits", (2, 4, *rest), np.uint8)  # [byte of scales_h, pair in it]
        np.right_shift(fields[2:4][:, None], along(SHIFTS_2BIT, 1, 2 + len(rest)), out=high)
        return signed_6bit_scales(ls, high, self.f16_row(fields, 0, "d", scratch), scratch), None


def e8m0_half_bits(e: np.ndarray) -> np.ndarray:
    """The float32 bits of ``2**(e - 128)`` for E8M0 bytes ``e`` (uint32, any shape)."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(np.uint32)


class MXFP4(BlockCodec):
    qtype = QType.MXFP4
    sub, int_range, max_gap = 32, (int(MXFP4_LEVELS.min()), int(MXFP4_LEVELS.max())), 4

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        d = e8m0_half_bits(blocks[:, 0:1]).view(np.float32)
        qs = blocks[:, 1:17]
        q = MXFP4_LEVELS[np.concatenate([qs & 15, qs >> 4], axis=1)].astype(np.float32)  # [n, 32]
        return (d * q).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        index = scratch.array("indices", out.shape, np.uint8)
        nibbles(fields[1:17], index[:16], index[16:])
        np.take(MXFP4_LEVELS, index, out=out)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        e = fields[0]
        bits = scratch.array("e8m0 bits", (1, *e.shape), np.uint32)
        np.copyto(bits[0], e)
        low = bits < 2
        np.subtract(bits, 1, out=bits, where=~low)
        np.left_shift(bits, 23, out=bits, where=~low)
        np.left_shift(np.uint32(0x00200000), bits, out=bits, where=low)
        return bits.view(np.float32), None
