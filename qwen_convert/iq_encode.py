"""The 3-bit i-quant writer: float32 rows to the bytes of llama.cpp's ``quantize_iq3_xxs``.

IQ3_XXS stores each group of 4 values as one of 256 points of a lattice of 3-bit levels (the grid, from
``gguf``'s ``IQ3_XXS`` tables), each group's signs with 7 bits (the 8th makes their count even) and one 4-bit
scale per 32 values.  The search (``quantize_row_iq3_xxs_impl``) tries 31 scales per 32 values; a group whose
rounded levels are not a grid point takes the best of the points ``iq3xs_init_impl`` lists as its neighbours:
the grid points at the two smallest squared distances from it.  :func:`iq3_tables` builds that map and those
lists exactly as llama.cpp does (same order, so ties resolve alike); the search itself is compiled in
:func:`qwen_convert.quant_search.iq3xxs_superblocks`.
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import quants

from qwen_runtime.quants.base import QType

from . import quant_search as qs
from .kquant_encode import f16_bytes

QK_K = 256
MAP_SIZE = 1 << 12  # 4 values of 3 bits


@functools.cache
def iq3_tables(grid_size: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``iq3xs_init_impl``'s tables for the 256-point grid: the grid as odd values ``2l + 1`` (int8 [256, 4]),
    the map from packed levels ``sum l_i << 3i`` to a grid index (or ``-(offset + 1)`` of the point's neighbour
    list, int32 [4096]) and the lists (uint16: count, then grid indices by distance, then index)."""
    if grid_size != 256:
        raise ValueError(f"IQ3 grids have 256 or 512 points; only the 256 of IQ3_XXS is built, not {grid_size}")
    quants.IQ3_XXS.init_grid()
    values = np.asarray(quants.IQ3_XXS.grid, np.float32).reshape(grid_size, 4)
    levels = np.searchsorted(np.asarray(quants.IQ3_XXS.grid_map, np.float32), values)  # 0..7
    grid = (2 * levels + 1).astype(np.int8)
    kmap = np.full(MAP_SIZE, -1, np.int32)
    kmap[(levels << (3 * np.arange(4))).sum(axis=1)] = np.arange(grid_size)
    missing = np.flatnonzero(kmap < 0)
    points = 2 * ((missing[:, None] >> (3 * np.arange(4))) & 7) + 1  # [M, 4]
    d2 = ((grid[None, :, :].astype(np.int32) - points[:, None, :]) ** 2).sum(axis=2)  # [M, 256]
    lists = []
    for u, row in zip(missing, d2, strict=True):
        order = np.lexsort((np.arange(grid_size), row))  # by distance, then index (llama.cpp's qsort order)
        cutoff = np.unique(row)[:2][-1]  # the two smallest distances (nwant = 2 for the 256-point grid)
        chosen = order[row[order] <= cutoff]
        kmap[u] = -(sum(len(x) for x in lists) + 1)
        lists.append(np.concatenate([[len(chosen)], chosen]))
    return grid, kmap, np.concatenate(lists).astype(np.uint16)


def quantize_iq3_xxs(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """IQ3_XXS-encode float32 ``[rows, n]`` (n divisible by 256) -> uint8 ``[rows, n // 256 * 98]`` (d, then 64
    grid indices and 8 words of signs and scale per block), weighted by ``importance`` ``[n]`` when given."""
    rows, n = x.shape
    blocks = np.ascontiguousarray(x, np.float32).reshape(-1, QK_K)
    grid, kmap, neighbours = iq3_tables()
    if importance is None:
        d, q3 = qs.iq3xxs_superblocks(blocks, blocks, False, grid, kmap, neighbours)
    else:
        qw = np.ascontiguousarray(importance, np.float32).reshape(n // QK_K, QK_K)
        d, q3 = qs.iq3xxs_superblocks(blocks, qw, True, grid, kmap, neighbours)
    return np.concatenate([f16_bytes(d), q3], axis=1).reshape(rows, -1)


ENCODERS = {QType.IQ3_XXS: quantize_iq3_xxs}
