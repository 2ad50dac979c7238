"""The ternary types: super-blocks of 256 values -1, 0 or 1 times one float16 scale.

=====  =====  ==========================================================  ============
type   bytes  layout                                                      value
=====  =====  ==========================================================  ============
TQ1_0  54     qs[48] (5 base-3 digits a byte), qh[4] (4 digits a byte), d  d * (t - 1)
TQ2_0  66     qs[64] (4 x 2 bits a byte), d                               d * (q - 1)
=====  =====  ==========================================================  ============

TQ1_0 stores a byte ``ceil(v * 256 / 243)`` for the base-3 number ``v`` of its digits; digit ``n`` (most
significant first) comes back as ``((byte * 3**n mod 256) * 3) >> 8``.  Value ``32n + m`` is digit ``n`` of
``qs[m]`` (m < 32), value ``160 + 16n + m`` digit ``n`` of ``qs[32 + m]`` (m < 16), value ``240 + 4n + m`` digit
``n`` of ``qh[m]`` (n, m < 4).  TQ2_0's value ``128c + 32n + m`` is bits ``2n, 2n+1`` of ``qs[32c + m]``.  Every
byte decodes to digits 0..2 (TQ1_0, bytes above 242 included) and 0..3 (TQ2_0: 3 is never written by a
quantizer; llama.cpp and gguf-py read it as ``2d``, and so does this module), so every bit pattern is a block.
"""

from __future__ import annotations

import numpy as np

from .base import QType, f16_field
from .blocks import SHIFTS_2BIT, BlockCodec, along
from .grids import POWERS_OF_3
from .scratch import Scratch

# (first byte, bytes, digits per byte, first value) of TQ1_0's three packed regions.
TQ1_REGIONS = ((0, 32, 5, 0), (32, 16, 5, 160), (48, 4, 4, 240))


def _digits(packed: np.ndarray, count: int) -> np.ndarray:
    """Plain: the first ``count`` base-3 digits of TQ1_0 bytes [n, m] -> [n, count, m] (0..2)."""
    shifted = (packed[:, None, :] * POWERS_OF_3[:count, None]).astype(np.uint8)  # mod 256
    return (shifted.astype(np.uint16) * 3) >> 8


class TQ1_0(BlockCodec):
    qtype = QType.TQ1_0
    sub, int_range = 256, (-1, 1)

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        t = np.concatenate([_digits(blocks[:, a:a + size], count).reshape(len(blocks), -1)
                            for a, size, count, _ in TQ1_REGIONS], axis=1)
        return (f16_field(blocks[:, 52:54])[:, None] * (t.astype(np.float32) - 1)).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        for at, size, count, first in TQ1_REGIONS:
            shifted = scratch.array("shifted", (count, size, *rest), np.uint8)
            np.multiply(fields[at:at + size][None], along(POWERS_OF_3[:count], 0, shifted.ndim), out=shifted)
            wide = scratch.array("digits", shifted.shape, np.uint16)
            np.multiply(shifted, 3, out=wide, dtype=np.uint16)
            np.right_shift(wide, 8, out=wide)
            values = out[first:first + count * size].reshape(count, size, *rest)
            np.copyto(values, wide, casting="unsafe")
            np.subtract(values, 1, out=values)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        return self.f16_row(fields, 52, "d", scratch)[None], None


class TQ2_0(BlockCodec):
    qtype = QType.TQ2_0
    sub, int_range = 256, (-1, 2)

    def reference(self, raw: np.ndarray) -> np.ndarray:
        blocks = raw.reshape(-1, self.type_size)
        q = (blocks[:, 0:64].reshape(-1, 2, 1, 32) >> SHIFTS_2BIT.reshape(1, 1, 4, 1)) & 3  # [n, c, n, m]
        d = f16_field(blocks[:, 64:66])[:, None]
        return (d * (q.reshape(len(blocks), -1).astype(np.float32) - 1)).reshape(*raw.shape[:-1], -1)

    def ints(self, fields: np.ndarray, out: np.ndarray, scratch: Scratch) -> None:
        rest = fields.shape[1:]
        q = out.view(np.uint8).reshape(2, 4, 32, *rest)
        np.right_shift(fields[0:64].reshape(2, 1, 32, *rest), along(SHIFTS_2BIT, 1, q.ndim), out=q)
        np.bitwise_and(q, 3, out=q)
        np.subtract(out, 1, out=out)

    def scales(self, fields: np.ndarray, scratch: Scratch) -> tuple[np.ndarray, np.ndarray | None]:
        return self.f16_row(fields, 64, "d", scratch)[None], None
