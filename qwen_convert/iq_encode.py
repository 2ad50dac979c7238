"""The i-quant writers below 4 bits: float32 rows to the bytes of llama.cpp's ``quantize_iq3_xxs``,
``quantize_iq3_s``, ``quantize_iq2_xxs``, ``quantize_iq2_xs``, ``quantize_iq2_s``, ``quantize_iq1_s`` and
``quantize_iq1_m``.

These types store each group of 4 (IQ3) or 8 (IQ2) values as one point of a lattice of 3- or 2-bit levels (the
grid of 256 to 1024 points, from ``gguf``'s tables), the signs of each group of 8 values with 7 bits (the 8th
makes their count even: IQ3_XXS, IQ2_XXS, IQ2_XS) or 8, and one 4-bit scale per 16 or 32 values.  The searches
(``quantize_row_*_impl``) try a range of scales per sub-block; a group whose rounded levels are not a grid point
takes the best of the points ``iq3xs_init_impl`` / ``iq2xs_init_impl`` list as its neighbours: the grid points
at the ``nwant`` smallest squared distances from it.  :func:`grid_tables` builds that map and those lists exactly
as llama.cpp does (same order, so ties resolve alike); the searches are compiled in
:mod:`qwen_convert.lattice_search`.  IQ1_S and IQ1_M store each group of 8 values as a point of a 2048-point
grid of levels -1, 0, 1 shifted by +-1/8, chosen by an exact split of each sub-block's sorted values into three
levels, then the same neighbour lists.  IQ2_XXS, IQ2_XS and IQ1_S need an importance vector (llama.cpp asserts
one).
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import quants

from qwen_runtime.errors import FormatError
from qwen_runtime.quants.base import QType

from . import lattice_search
from .kquant_encode import f16_bytes

QK_K = 256
# Per type: bits per level, how many distinct distances a neighbour list spans (iq*_init_impl's nwant) and
# the number of levels the searches produce (their kMaxQ: levels are clamped to 0 .. kMaxQ - 1).
GRIDS = {QType.IQ3_XXS: (3, 2, 8), QType.IQ2_XXS: (2, 2, 3), QType.IQ2_XS: (2, 2, 3), QType.IQ2_S: (2, 1, 3),
         QType.IQ3_S: (3, 3, 8), QType.IQ1_S: (2, 3, 3)}  # IQ1_M uses IQ1_S's grid and tables
CHUNK = 2048  # off-grid points whose distances to the grid are sorted at once (2048 x 1024 int64: 16 MiB)


@functools.cache
def grid_tables(qtype: QType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``iq2xs_init_impl`` / ``iq3xs_init_impl``'s tables for ``qtype``'s grid (gguf's, as level indices): the
    grid as odd values ``2l + 1`` (int8 [G, m]), the map from packed levels ``sum l_i << (bits * i)`` to a grid
    index or ``-(offset + 1)`` of the point's neighbour list (int32), and the lists (uint16: count, then the
    grid points at the ``nwant`` smallest squared distances, by distance then index: llama.cpp's qsort order).

    Only points whose levels are all below kMaxQ get a list: the searches clamp their levels to that range, so
    no other point is ever looked up (llama.cpp lists them too, unused); the map holds -1 for them."""
    bits, nwant, levels_used = GRIDS[qtype]
    table = getattr(quants, qtype.name)
    table.init_grid()
    size, width = table.grid_shape
    values = np.asarray(table.grid, np.float32).reshape(size, width)
    levels = np.searchsorted(np.asarray(table.grid_map, np.float32), values)
    grid = (2 * levels + 1).astype(np.int8)
    shifts = bits * np.arange(width)
    kmap = np.full(1 << (bits * width), -1, np.int32)
    kmap[(levels << shifts).sum(axis=1)] = np.arange(size)
    reachable = np.stack(np.meshgrid(*[np.arange(levels_used)] * width, indexing="ij"), -1).reshape(-1, width)
    packed = (reachable << shifts).sum(axis=1)
    missing = np.sort(packed[kmap[packed] < 0])
    grid_f = grid.astype(np.float32)
    norms = (grid.astype(np.int64) ** 2).sum(axis=1)
    counts, lists = [], []
    for first in range(0, len(missing), CHUNK):
        u = missing[first:first + CHUNK]
        points = 2 * ((u[:, None] >> shifts) & ((1 << bits) - 1)) + 1  # [C, m]
        # |g - p|^2 = |g|^2 + |p|^2 - 2 p.g: small integers, exact in float32's BLAS product
        d2 = norms[None, :] + (points * points).sum(axis=1)[:, None] - 2 * (
            points.astype(np.float32) @ grid_f.T).astype(np.int64)  # [C, G]
        keys = np.sort(d2 * size + np.arange(size), axis=1)
        d2, index = keys // size, keys % size
        rank = np.concatenate([np.zeros((len(u), 1), np.int64), np.cumsum(np.diff(d2, axis=1) != 0, axis=1)], 1)
        taken = rank < nwant
        counts.append(taken.sum(axis=1))
        lists.append(np.concatenate([counts[-1][:, None], index], axis=1)[np.concatenate(
            [np.ones((len(u), 1), bool), taken], axis=1)])
    lengths = np.concatenate(counts) + 1
    kmap[missing] = -(np.cumsum(lengths) - lengths + 1)
    return grid, kmap, np.concatenate(lists).astype(np.uint16)


def _superblocks(x: np.ndarray, importance: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, bool]:
    """``x`` [rows, n] as super-blocks [rows * n / 256, 256], the importance as one row's [n / 256, 256] (the
    blocks themselves, unused, without one) and whether there is one."""
    blocks = np.ascontiguousarray(x, np.float32).reshape(-1, QK_K)
    if importance is None:
        return blocks, blocks, False
    return blocks, np.ascontiguousarray(importance, np.float32).reshape(-1, QK_K), True


def _stored(rows: int, d: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """The float16 scale of each super-block, then its other bytes, as ``[rows, row bytes]``."""
    return np.concatenate([f16_bytes(d), tail], axis=1).reshape(rows, -1)


def _required(qtype: QType, importance: np.ndarray | None) -> None:
    if importance is None:
        raise FormatError(f"{qtype.name} needs an importance vector (llama.cpp's quantize_{qtype.name.lower()} "
                          "asserts one)")


def quantize_iq3_xxs(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """IQ3_XXS-encode float32 ``[rows, n]`` (n divisible by 256) -> uint8 ``[rows, n // 256 * 98]`` (d, then 64
    grid indices and 8 words of signs and scale per block), weighted by ``importance`` ``[n]`` when given."""
    d, q3 = lattice_search.iq3xxs_superblocks(*_superblocks(x, importance), *grid_tables(QType.IQ3_XXS))
    return _stored(len(x), d, q3)


def quantize_iq2_xxs(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """IQ2_XXS-encode float32 ``[rows, n]`` (n divisible by 256) weighted by ``importance`` ``[n]`` -> uint8
    ``[rows, n // 256 * 66]`` (d, then per 32 values 4 grid indices and a word of signs and scale)."""
    _required(QType.IQ2_XXS, importance)
    blocks, qw, _ = _superblocks(x, importance)
    d, q2 = lattice_search.iq2xxs_superblocks(blocks, qw, *grid_tables(QType.IQ2_XXS))
    return _stored(len(x), d, q2)


def quantize_iq2_xs(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """IQ2_XS-encode float32 ``[rows, n]`` (n divisible by 256) weighted by ``importance`` ``[n]`` -> uint8
    ``[rows, n // 256 * 74]`` (d, then per 16 values 2 words of grid index and 7 sign bits, then 4-bit scales)."""
    _required(QType.IQ2_XS, importance)
    d, q2 = lattice_search.iq2_16_superblocks(*_superblocks(x, importance), True, *grid_tables(QType.IQ2_XS))
    return _stored(len(x), d, q2)


def quantize_iq2_s(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """IQ2_S-encode float32 ``[rows, n]`` (n divisible by 256) -> uint8 ``[rows, n // 256 * 82]`` (d, grid
    index low bytes, sign bytes, index high bits, 4-bit scales), weighted by ``importance`` ``[n]`` when given."""
    d, q2 = lattice_search.iq2_16_superblocks(*_superblocks(x, importance), False, *grid_tables(QType.IQ2_S))
    return _stored(len(x), d, q2)


def quantize_iq3_s(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """IQ3_S-encode float32 ``[rows, n]`` (n divisible by 256) -> uint8 ``[rows, n // 256 * 110]`` (d, grid
    index low bytes, their high bits, sign bytes, 4-bit scales), weighted by ``importance`` ``[n]`` when given."""
    d, q3 = lattice_search.iq3s_superblocks(*_superblocks(x, importance), *grid_tables(QType.IQ3_S))
    return _stored(len(x), d, q3)


@functools.cache
def iq1_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ1_S's (and IQ1_M's) grid as levels 0..2 (int8 [2048, 8]: IQ1 looks up its shifted levels by them), map
    and neighbour lists."""
    grid, kmap, neighbours = grid_tables(QType.IQ1_S)
    return (grid - 1) // 2, kmap, neighbours


def quantize_iq1_s(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """IQ1_S-encode float32 ``[rows, n]`` (n divisible by 256) weighted by ``importance`` ``[n]`` -> uint8
    ``[rows, n // 256 * 50]`` (d, grid index low bytes, per 32 values a word of high bits, scale and shift)."""
    _required(QType.IQ1_S, importance)
    blocks, qw, _ = _superblocks(x, importance)
    d, q1 = lattice_search.iq1s_superblocks(blocks, qw, *iq1_tables())
    return _stored(len(x), d, q1)


def quantize_iq1_m(x: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """IQ1_M-encode float32 ``[rows, n]`` (n divisible by 256) -> uint8 ``[rows, n // 256 * 56]``, weighted by
    ``importance`` ``[n]`` when given.  The block has no scale field: the float16 bits of d go, 4 at a time from
    the lowest, to the top nibbles of its four 16-bit scale words (bytes 49, 51, 53, 55)."""
    d, q1 = lattice_search.iq1m_superblocks(*_superblocks(x, importance), *iq1_tables())
    bits = f16_bytes(d).view("<u2")[:, 0]  # [B]
    for k in range(4):
        q1[:, 49 + 2 * k] |= (((bits >> (4 * k)) & 0xF) << 4).astype(np.uint8)
    return q1.reshape(len(x), -1)


ENCODERS = {QType.IQ1_S: quantize_iq1_s, QType.IQ1_M: quantize_iq1_m, QType.IQ2_XXS: quantize_iq2_xxs,
            QType.IQ2_XS: quantize_iq2_xs, QType.IQ2_S: quantize_iq2_s, QType.IQ3_XXS: quantize_iq3_xxs,
            QType.IQ3_S: quantize_iq3_s}
