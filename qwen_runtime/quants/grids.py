"""The fixed tables of the 1- to 3-bit i-quants, the ternary types and MXFP4, in one place.

The lattice grids (llama.cpp's ``iq2xxs_grid`` ... ``iq1s_grid``) are the ``gguf`` package's (``gguf.quants``
keeps each packed with its value map); here they become int8 arrays ``[points, width]`` and, for the fast
decoders, one unsigned word per point holding its ``width`` int8 values (little-endian, value ``k`` in byte
``k``), so that a gather of words is a gather of whole points.  The sign table and the MXFP4 levels are derived
from their definitions (and tested against gguf-py and llama.cpp's header).
"""

from __future__ import annotations

import numpy as np
from gguf import quants as gguf_quants

from .base import QType


def _grid(qtype: QType) -> np.ndarray:
    """The grid of an i-quant as int8 ``[points, width]`` (values as stored: IQ2 8/25/43, IQ3 odd levels,
    IQ1 -1/0/1)."""
    cls = getattr(gguf_quants, qtype.name)
    cls.init_grid()
    grid = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
    return np.ascontiguousarray(grid.astype(np.int8))


def words(grid: np.ndarray) -> np.ndarray:
    """One little-endian word per grid point holding its int8 values (uint64 for 8 values, uint32 for 4)."""
    return np.ascontiguousarray(grid).view({8: np.dtype("<u8"), 4: np.dtype("<u4")}[grid.shape[1]])[:, 0]


GRID_IQ2_XXS = _grid(QType.IQ2_XXS)  # [256, 8]
GRID_IQ2_XS = _grid(QType.IQ2_XS)  # [512, 8]
GRID_IQ2_S = _grid(QType.IQ2_S)  # [1024, 8]
GRID_IQ3_XXS = _grid(QType.IQ3_XXS)  # [256, 4]
GRID_IQ3_S = _grid(QType.IQ3_S)  # [512, 4]
GRID_IQ1 = _grid(QType.IQ1_S)  # [2048, 8], IQ1_S and IQ1_M

# llama.cpp's ksigns_iq2xs: 7 stored sign bits and an 8th that makes the number of minus signs even.
_SEVEN = np.arange(128, dtype=np.uint8)
_PARITY = np.unpackbits(_SEVEN[:, None], axis=1).sum(axis=1) & 1
SIGNS_EVEN = (_SEVEN | (_PARITY << 7).astype(np.uint8)).astype(np.uint8)  # [128]

# FP4 (E2M1) levels doubled to integers (llama.cpp's kvalues_mxfp4): index bit 3 is the sign, bits 0-2 the
# magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (times 2); the block's E8M0 scale is halved to match.
MXFP4_LEVELS = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)

# TQ1_0 packs 5 (4 in qh) base-3 digits per byte as ceil(v * 256 / 243); digit n of byte b is
# ((b * 3**n mod 256) * 3) >> 8.
POWERS_OF_3 = np.array([1, 3, 9, 27, 81], np.uint8)
