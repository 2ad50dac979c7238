"""The searches of the i-quants below 4 bits (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S), compiled with numba.

Each kernel walks the super-blocks of 256 values of a chunk of rows and repeats, in float32 and in the same
order, the operations of the llama.cpp function it is named after (``ggml/src/ggml-quants.c``), under the rules
:mod:`qwen_convert.quant_search` states (one IEEE operation each, no fused multiply-add, C's conversions, ggml's
``nearest_int``).  They share one shape: per sub-block of 16 or 32 values, the magnitudes of the values and
their signs; then a range of trial scales, each rounding every group of 4 or 8 magnitudes to odd levels ``2l + 1``
and, when those levels are not a point of the type's grid, taking the best of the point's listed neighbours
(:func:`qwen_convert.iq_encode.grid_tables`); the best scale by weighted least squares; the sub-block scales
then quantized to 4 bits against the largest.  The kernels return the float32 super-block scale before its
float16 rounding and the bytes that follow it in llama.cpp's block, placed where llama.cpp places them.

Shapes: ``x`` is float32 ``[B, 256]``; ``qw`` the importance of one row's super-blocks ``[B_row, 256]``
(super-block ``b`` uses ``qw[b % B_row]``, as llama.cpp restarts ``quant_weights`` at every row).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .quant_search import F32, GROUP_MAX_EPS, ONE, ZERO, make_qp_quants, nearest_int, sum_squares

FLT_MAX = np.float32(3.4028234663852886e38)
GROUP_MAX_EPS_IQ3_XXS = np.float32(1e-8)


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def iq_best_neighbour(neighbours: np.ndarray, start: int, grid: np.ndarray, xval: np.ndarray, weight: np.ndarray,
                      scale: float, L: np.ndarray, o: int, m: int) -> int:
    """``iq{2,3}_find_best_neighbour``: of the grid points listed at ``neighbours[start]`` (count, then
    indices), the first with the least ``sum weight * (scale * q - x)^2`` over the ``m`` values from ``o``; its
    levels go to ``L[o:o + m]``.  ``grid`` holds the odd values ``2l + 1`` of each point [G, m].  Inlined with
    ``m`` a literal at each call, so that the compiler unrolls the loop over the group, as C's over its 8 or 4."""
    best_d2, found = FLT_MAX, -1
    for j in range(1, neighbours[start] + 1):
        index = neighbours[start + j]
        d2 = ZERO
        for i in range(m):
            diff = scale * F32(grid[index, i]) - xval[o + i]
            d2 += weight[o + i] * diff * diff
        if d2 < best_d2:
            best_d2, found = d2, index
    for i in range(m):
        L[o + i] = (grid[found, i] - 1) // 2
    return found


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def _grid_point(xval: np.ndarray, o: int, m: int, bits: int, top: int, inv: float, L: np.ndarray) -> int:
    """The levels (0 .. ``top``, llama.cpp's kMaxQ - 1) of values ``o .. o + m - 1`` at scale ``1 / inv`` into
    ``L``; their packed index u (``bits`` per level)."""
    u = 0
    for i in range(m):
        level = max(0, min(top, nearest_int(F32(0.5) * (inv * xval[o + i] - ONE))))
        L[o + i] = level
        u |= level << (bits * i)
    return u


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def _even_signs(xb: np.ndarray, weight: np.ndarray, xval: np.ndarray, signs: np.ndarray, groups: int) -> None:
    """|x| into ``xval`` and the 7 stored sign bits of each of ``groups`` groups of 8 into ``signs``: with an odd
    count of negatives, the value of least ``weight * x^2`` (first of equals) has its sign flipped, in ``xval``
    too (IQ2_XXS, IQ2_XS, IQ3_XXS: the 8th bit is the parity of the 7)."""
    for k in range(groups):
        nflip, s = 0, 0
        for i in range(8):
            if xb[8 * k + i] >= ZERO:
                xval[8 * k + i] = xb[8 * k + i]
            else:
                xval[8 * k + i] = -xb[8 * k + i]
                nflip += 1
                s |= 1 << i
        if nflip % 2:
            imin, least = 0, weight[8 * k] * xb[8 * k] * xb[8 * k]
            for i in range(1, 8):
                ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
                if ax < least:
                    least, imin = ax, i
            xval[8 * k + imin] = -xval[8 * k + imin]
            s ^= 1 << imin
        signs[k] = s & 127


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def _all_signs(xb: np.ndarray, xval: np.ndarray, signs: np.ndarray, groups: int) -> None:
    """|x| into ``xval`` and the 8 sign bits of each of ``groups`` groups of 8 into ``signs`` (IQ2_S, IQ3_S)."""
    for k in range(groups):
        s = 0
        for i in range(8):
            if xb[8 * k + i] >= ZERO:
                xval[8 * k + i] = xb[8 * k + i]
            else:
                xval[8 * k + i] = -xb[8 * k + i]
                s |= 1 << i
        signs[k] = s


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def _odd_sums(weight: np.ndarray, xval: np.ndarray, L: np.ndarray, n: int) -> tuple[float, float]:
    """``sum w x q`` and ``sum w q^2`` over the first ``n`` values at odd levels ``q = 2 L + 1``."""
    sumqx, sumq2 = ZERO, ZERO
    for i in range(n):
        q = F32(2 * L[i] + 1)
        sumqx += weight[i] * xval[i] * q
        sumq2 += weight[i] * q * q
    return sumqx, sumq2


@njit(cache=True, error_model="numpy", nogil=True)
def iq3xxs_superblocks(x: np.ndarray, qw: np.ndarray, use_qw: bool, grid: np.ndarray, kmap: np.ndarray,
                       neighbours: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``quantize_row_iq3_xxs_impl`` (grid of 256) for super-blocks ``x`` [B, 256], importance ``qw``
    [B_row, 256] when ``use_qw`` (else weights x^2).  ``grid`` [256, 4] (odd values 2l + 1), ``kmap`` [4096]
    (packed levels -> grid index, or -(offset + 1) of its neighbour list) and ``neighbours`` as ``iq3xs_init_impl``
    builds them.  Returns the float32 block scale before float16 (d * 1.0125, 0 for an all-zero block) [B] and
    the 96 bytes after it [B, 96]: grid indices [64], then per sub-block of 32 the 7-bit signs of its 4 groups of
    8 and its 4-bit scale (little-endian uint32)."""
    count = x.shape[0]
    d_out = np.zeros(count, np.float32)
    q3 = np.zeros((count, 96), np.uint8)
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int8)
    Laux = np.zeros(32, np.int8)
    on_grid = np.ones(8, np.bool_)
    on_grid_aux = np.ones(8, np.bool_)
    signs = np.zeros(4, np.uint32)
    scales = np.zeros(8, np.float32)
    packed = np.zeros(8, np.uint32)
    for b in range(count):
        xbl = x[b]
        packed[:] = 0
        max_scale = ZERO
        sigma2 = F32(2.0) * sum_squares(xbl) / F32(256.0)
        for ib in range(8):
            xb = xbl[32 * ib:32 * ib + 32]
            for i in range(32):
                if use_qw:
                    weight[i] = qw[b % len(qw), 32 * ib + i] * F32(np.sqrt(sigma2 + xb[i] * xb[i]))
                else:
                    weight[i] = xb[i] * xb[i]
                waux[i] = F32(np.sqrt(weight[i]))
            _even_signs(xb, weight, xval, signs, 4)
            top = xval[0]
            for i in range(1, 32):
                top = top if top > xval[i] else xval[i]
            L[:] = 0
            if top < GROUP_MAX_EPS_IQ3_XXS:
                scales[ib] = ZERO
                continue
            best = ZERO
            scale = top / F32(15.0)
            on_grid[:] = True
            for step in range(-15, 16):
                inv = (F32(15.0) + F32(step) * F32(0.2)) / top
                this_scale = ONE / inv
                for k in range(8):
                    u = _grid_point(xval, 4 * k, 4, 3, 7, inv, Laux)
                    on_grid_aux[k] = kmap[u] >= 0
                    if not on_grid_aux[k]:
                        iq_best_neighbour(neighbours, -kmap[u] - 1, grid, xval, waux, this_scale, Laux, 4 * k, 4)
                sumqx, sumq2 = _odd_sums(weight, xval, Laux, 32)
                if sumq2 > ZERO and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    L[:] = Laux
                    on_grid[:] = on_grid_aux
            if not on_grid.all() and scale > ZERO:
                inv = ONE / scale
                for k in range(8):
                    if on_grid[k]:
                        continue
                    u = _grid_point(xval, 4 * k, 4, 3, 7, inv, L)
                    index = kmap[u]
                    if index < 0:
                        index = iq_best_neighbour(neighbours, -kmap[u] - 1, grid, xval, waux, scale, L, 4 * k, 4)
                    for i in range(4):
                        L[4 * k + i] = (grid[index, i] - 1) // 2
                sumqx, sumq2 = _odd_sums(weight, xval, L, 32)
                if sumq2 > ZERO:
                    scale = sumqx / sumq2
            if scale < ZERO:  # llama.cpp: "should never happen"; flip the scale and the signs
                scale = -scale
                for k in range(4):
                    signs[k] = ~signs[k] & 127
            for k in range(8):
                u = 0
                for i in range(4):
                    u |= L[4 * k + i] << (3 * i)
                q3[b, 8 * ib + k] = kmap[u]
            packed[ib] = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == ZERO:
            q3[b, :] = 0
            continue
        d = max_scale / F32(31.0)
        d_out[b] = d * F32(1.0125)
        inv = ONE / d
        for ib in range(8):
            level = max(0, min(15, nearest_int(F32(0.5) * (inv * scales[ib] - ONE))))
            word = packed[ib] | (np.uint32(level) << 28)
            for j in range(4):
                q3[b, 64 + 4 * ib + j] = (word >> (8 * j)) & 255
    return d_out, q3


@njit(cache=True, error_model="numpy", nogil=True)
def iq2xxs_superblocks(x: np.ndarray, qw: np.ndarray, grid: np.ndarray, kmap: np.ndarray, neighbours: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """``quantize_row_iq2_xxs_impl`` for super-blocks ``x`` [B, 256] with importance ``qw`` [B_row, 256] (it
    has no unweighted form).  ``grid`` [256, 8] (odd values 2l + 1), ``kmap`` [65536] and ``neighbours`` as
    ``iq2xs_init_impl`` builds them.  Returns the float32 block scale before float16 (0 for an all-zero block)
    [B] and the 64 bytes after it [B, 64]: per 32 values 4 grid indices, then a little-endian word of the 7-bit
    signs of its 4 groups of 8 and its 4-bit scale."""
    count = x.shape[0]
    d_out = np.zeros(count, np.float32)
    q2 = np.zeros((count, 64), np.uint8)
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int8)
    Laux = np.zeros(32, np.int8)
    Lqp = np.zeros(32, np.uint8)
    ls = np.zeros(32, np.int32)
    signs = np.zeros(4, np.uint32)
    scales = np.zeros(8, np.float32)
    packed = np.zeros(8, np.uint32)
    for b in range(count):
        xbl, qb = x[b], qw[b % len(qw)]
        packed[:] = 0
        max_scale = ZERO
        sigma2 = sum_squares(xbl) / F32(256.0)
        for ib in range(8):
            xb = xbl[32 * ib:32 * ib + 32]
            for i in range(32):
                weight[i] = qb[32 * ib + i] * F32(np.sqrt(sigma2 + xb[i] * xb[i]))
                waux[i] = F32(np.sqrt(weight[i]))
            _even_signs(xb, weight, xval, signs, 4)
            top = xval[0]
            for i in range(1, 32):
                top = top if top > xval[i] else xval[i]
            if top < GROUP_MAX_EPS:
                scales[ib] = ZERO
                continue
            scale = make_qp_quants(xval, Lqp, 4, weight, ls)
            L[:] = Lqp  # C hands make_qp_quants L itself
            eff_max = scale * F32(3.0)
            if eff_max <= ZERO:
                scales[ib] = ZERO
                continue
            best = ZERO
            for step in range(-6, 7):
                inv = (F32(5.0) + F32(step) * F32(0.1)) / eff_max
                this_scale = ONE / inv
                for k in range(4):
                    u = _grid_point(xval, 8 * k, 8, 2, 2, inv, Laux)
                    if kmap[u] < 0:
                        iq_best_neighbour(neighbours, -kmap[u] - 1, grid, xval, waux, this_scale, Laux, 8 * k, 8)
                sumqx, sumq2 = _odd_sums(weight, xval, Laux, 32)
                if sumq2 > ZERO and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    L[:] = Laux
            if scale > ZERO:
                inv = ONE / scale
                for k in range(4):
                    u = _grid_point(xval, 8 * k, 8, 2, 2, inv, L)
                    index = kmap[u]
                    if index < 0:
                        index = iq_best_neighbour(neighbours, -kmap[u] - 1, grid, xval, waux, scale, L, 8 * k, 8)
                    for i in range(8):
                        L[8 * k + i] = (grid[index, i] - 1) // 2
                sumqx, sumq2 = _odd_sums(weight, xval, L, 32)
                if sumq2 > ZERO:
                    scale = sumqx / sumq2
            if scale < ZERO:  # llama.cpp: "should never happen"; flip the scale and the signs
                scale = -scale
                for k in range(4):
                    signs[k] = ~signs[k] & 127
            for k in range(4):
                u = 0
                for i in range(8):
                    u |= L[8 * k + i] << (2 * i)
                q2[b, 8 * ib + k] = kmap[u]
                packed[ib] |= signs[k] << (7 * k)
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == ZERO:
            q2[b, :] = 0
            continue
        d = max_scale / F32(31.0)
        d_out[b] = d
        inv = ONE / d
        for ib in range(8):
            level = max(0, min(15, nearest_int(F32(0.5) * (inv * scales[ib] - ONE))))
            word = packed[ib] | (np.uint32(level) << 28)
            for j in range(4):
                q2[b, 8 * ib + 4 + j] = (word >> (8 * j)) & 255
    return d_out, q2


# ------------------------------------------------------------------------------------- IQ2_XS, IQ2_S

GROUP_MAX_EPS_IQ2_S = np.float32(1e-8)
IQ2_XS_BYTES, IQ2_S_BYTES = 72, 80  # after the float16 scale: qs (+ qh) and the 4-bit scales


@njit(cache=True, error_model="numpy", nogil=True)
def iq2_16_superblocks(x: np.ndarray, qw: np.ndarray, use_qw: bool, even_signs: bool, grid: np.ndarray,
                       kmap: np.ndarray, neighbours: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``quantize_row_iq2_xs_impl`` (``even_signs``: 7 sign bits per 8, importance required) or
    ``quantize_row_iq2_s_impl`` (8 sign bits; weights ``0.25 sigma^2 + x^2`` without importance): sub-blocks of
    16 values as two groups of 8 on a grid of 512 (IQ2_XS) or 1024 (IQ2_S) points of 2-bit levels, ``kmap`` and
    ``neighbours`` as ``iq2xs_init_impl`` builds them.  Returns the float32 scale before float16 (IQ2_S's times
    0.9875) [B] and the bytes after it: IQ2_XS [B, 72]: per group a little-endian uint16 ``index | signs << 9``,
    then the 4-bit sub-block scales; IQ2_S [B, 80]: the 32 low bytes of the indices, the 32 sign bytes, 2 high
    bits per index, the scales."""
    count = x.shape[0]
    width = IQ2_XS_BYTES if even_signs else IQ2_S_BYTES
    at_scales = 64 if even_signs else 72
    eps = GROUP_MAX_EPS if even_signs else GROUP_MAX_EPS_IQ2_S
    mask = 127 if even_signs else 255
    d_out = np.zeros(count, np.float32)
    out = np.zeros((count, width), np.uint8)
    weight = np.empty(16, np.float32)
    waux = np.empty(16, np.float32)
    xval = np.empty(16, np.float32)
    L = np.zeros(16, np.int8)
    Laux = np.zeros(16, np.int8)
    on_grid = np.ones(2, np.bool_)
    on_grid_aux = np.ones(2, np.bool_)
    signs = np.zeros(2, np.uint32)
    scales = np.zeros(16, np.float32)
    for b in range(count):
        xbl = x[b]
        max_scale = ZERO
        sumx2 = sum_squares(xbl)
        sigma2 = sumx2 / F32(256.0) if even_signs else F32(2.0) * sumx2 / F32(256.0)
        for ib in range(16):
            xb = xbl[16 * ib:16 * ib + 16]
            for i in range(16):
                if use_qw:
                    weight[i] = qw[b % len(qw), 16 * ib + i] * F32(np.sqrt(sigma2 + xb[i] * xb[i]))
                else:
                    weight[i] = F32(0.25) * sigma2 + xb[i] * xb[i]
                waux[i] = F32(np.sqrt(weight[i]))
            if even_signs:
                _even_signs(xb, weight, xval, signs, 2)
            else:
                _all_signs(xb, xval, signs, 2)
            top = xval[0]
            for i in range(1, 16):
                top = top if top > xval[i] else xval[i]
            L[:] = 0
            if top < eps:
                scales[ib] = ZERO
                continue
            best = ZERO
            scale = top / F32(5.0)
            on_grid[:] = True
            for step in range(-9, 10):
                inv = (F32(5.0) + F32(step) * F32(0.1)) / top
                this_scale = ONE / inv
                for k in range(2):
                    u = _grid_point(xval, 8 * k, 8, 2, 2, inv, Laux)
                    on_grid_aux[k] = kmap[u] >= 0
                    if not on_grid_aux[k]:
                        iq_best_neighbour(neighbours, -kmap[u] - 1, grid, xval, waux, this_scale, Laux, 8 * k, 8)
                sumqx, sumq2 = _odd_sums(weight, xval, Laux, 16)
                if sumq2 > ZERO and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    L[:] = Laux
                    on_grid[:] = on_grid_aux
            if not on_grid.all() and scale > ZERO:
                inv = ONE / scale
                for k in range(2):
                    if on_grid[k]:
                        continue
                    u = _grid_point(xval, 8 * k, 8, 2, 2, inv, L)
                    if kmap[u] < 0:
                        iq_best_neighbour(neighbours, -kmap[u] - 1, grid, xval, waux, scale, L, 8 * k, 8)
                sumqx, sumq2 = _odd_sums(weight, xval, L, 16)
                if sumq2 > ZERO:
                    scale = sumqx / sumq2
            if scale < ZERO:  # llama.cpp: "should never happen"; flip the scale and the signs
                scale = -scale
                for k in range(2):
                    signs[k] = ~signs[k] & mask
            for k in range(2):
                u = 0
                for i in range(8):
                    u |= L[8 * k + i] << (2 * i)
                index = kmap[u]
                group = 2 * ib + k
                if even_signs:
                    word = index | (signs[k] << 9)
                    out[b, 2 * group] = word & 255
                    out[b, 2 * group + 1] = (word >> 8) & 255
                else:
                    out[b, group] = index & 255
                    out[b, 32 + group] = signs[k]
                    out[b, 64 + group // 4] |= (index >> 8) << (2 * (group % 4))
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == ZERO:  # IQ2_XS clears its indices; IQ2_S keeps what it wrote (d = 0 either way)
            if even_signs:
                out[b, :64] = 0
            continue
        d = max_scale / F32(31.0)
        d_out[b] = d if even_signs else d * F32(0.9875)
        inv = ONE / d
        for ib in range(16):
            level = max(0, min(15, nearest_int(F32(0.5) * (inv * scales[ib] - ONE))))
            out[b, at_scales + ib // 2] |= level << (4 * (ib % 2))
    return d_out, out


# ------------------------------------------------------------------------------------- IQ3_S

IQ3_S_BYTES = 108  # after the float16 scale: qs [64], qh [8], signs [32], scales [4]


@njit(cache=True, error_model="numpy", nogil=True)
def iq3s_superblocks(x: np.ndarray, qw: np.ndarray, use_qw: bool, grid: np.ndarray, kmap: np.ndarray,
                     neighbours: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``quantize_row_iq3_s_impl`` (sub-blocks of 32, grid of 512 points of 3-bit levels, ``kmap`` and
    ``neighbours`` as ``iq3xs_init_impl(512)`` builds them), importance ``qw`` when ``use_qw`` (else weights
    x^2).  Returns the float32 scale before float16 (d * 1.033) [B] and the 108 bytes after it: the low bytes
    of 64 grid indices, their 9th bits [8], the 8-bit signs of each group of 8 [32], the 4-bit sub-block scales
    [4].  As in llama.cpp, a sub-block of zeros writes no indices or signs and does not advance their position,
    so the later sub-blocks' low bytes and signs move forward by one sub-block (their 9th bits do not)."""
    count = x.shape[0]
    d_out = np.zeros(count, np.float32)
    out = np.zeros((count, IQ3_S_BYTES), np.uint8)
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int8)
    Laux = np.zeros(32, np.int8)
    on_grid = np.zeros(8, np.bool_)
    on_grid_aux = np.zeros(8, np.bool_)
    signs = np.zeros(4, np.uint32)
    scales = np.zeros(8, np.float32)
    for b in range(count):
        xbl = x[b]
        max_scale = ZERO
        sigma2 = F32(2.0) * sum_squares(xbl) / F32(256.0)
        written = 0  # sub-blocks whose indices and signs are stored so far (llama.cpp's qs/signs pointers)
        for ib in range(8):
            xb = xbl[32 * ib:32 * ib + 32]
            for i in range(32):
                if use_qw:
                    weight[i] = qw[b % len(qw), 32 * ib + i] * F32(np.sqrt(sigma2 + xb[i] * xb[i]))
                else:
                    weight[i] = xb[i] * xb[i]
                waux[i] = F32(np.sqrt(weight[i]))
            _all_signs(xb, xval, signs, 4)
            top = xval[0]
            for i in range(1, 32):
                top = top if top > xval[i] else xval[i]
            L[:] = 0
            if top == ZERO:
                scales[ib] = ZERO
                continue
            best = ZERO
            scale = top / F32(15.0)
            on_grid[:] = False
            for step in range(-9, 10):
                inv = (F32(15.0) + F32(step) * F32(0.2)) / top
                this_scale = ONE / inv
                for k in range(8):
                    u = _grid_point(xval, 4 * k, 4, 3, 7, inv, Laux)
                    on_grid_aux[k] = kmap[u] >= 0
                    if not on_grid_aux[k]:
                        iq_best_neighbour(neighbours, -kmap[u] - 1, grid, xval, waux, this_scale, Laux, 4 * k, 4)
                sumqx, sumq2 = _odd_sums(weight, xval, Laux, 32)
                if sumq2 > ZERO and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    L[:] = Laux
                    on_grid[:] = on_grid_aux
            if not on_grid.all() and scale > ZERO:
                inv = ONE / scale
                for k in range(8):  # every group, on the grid or not (llama.cpp's skip is commented out)
                    u = _grid_point(xval, 4 * k, 4, 3, 7, inv, L)
                    index = kmap[u]
                    if index < 0:
                        index = iq_best_neighbour(neighbours, -kmap[u] - 1, grid, xval, waux, scale, L, 4 * k, 4)
                    for i in range(4):
                        L[4 * k + i] = (grid[index, i] - 1) // 2
                sumqx, sumq2 = _odd_sums(weight, xval, L, 32)
                if sumq2 > ZERO:
                    scale = sumqx / sumq2
            if scale < ZERO:  # llama.cpp: "should never happen"; flip the scale and the signs
                scale = -scale
                for k in range(4):
                    signs[k] = ~signs[k] & 255
            for k in range(8):
                u = 0
                for i in range(4):
                    u |= L[4 * k + i] << (3 * i)
                index = kmap[u]
                out[b, 8 * written + k] = index & 255
                out[b, 64 + ib] |= (index >> 8) << k
            for k in range(4):
                out[b, 72 + 4 * written + k] = signs[k]
            written += 1
            scales[ib] = scale
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == ZERO:
            continue
        d = max_scale / F32(31.0)
        d_out[b] = d * F32(1.033)
        inv = ONE / d
        for ib in range(0, 8, 2):
            lo = max(0, min(15, nearest_int(F32(0.5) * (inv * scales[ib] - ONE))))
            hi = max(0, min(15, nearest_int(F32(0.5) * (inv * scales[ib + 1] - ONE))))
            out[b, 104 + ib // 2] = lo | (hi << 4)
    return d_out, out


# ------------------------------------------------------------------------------------- IQ1_S, IQ1_M

GROUP_MAX_EPS_IQ1_S = np.float32(1e-12)
GROUP_MAX_EPS_IQ1_M = np.float32(1e-7)
IQ1_DELTA = np.float32(0.125)  # IQ1S_DELTA = IQ1M_DELTA
IQ1_S_BYTES, IQ1_M_BYTES = 48, 56  # IQ1_S after its float16 scale; IQ1_M's whole block (its scale is spread)
IQ1_M_MASKS = np.array([0x00, 0x80, 0x08, 0x88], np.uint8)  # per (first, second) group shift: +, +  +, -  -, +  -, -


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def _ascending(x: np.ndarray, order: np.ndarray, values: np.ndarray, tmp: np.ndarray, tmp_order: np.ndarray) -> None:
    """The indices of ``x`` [n] (n a power of two) in ascending order of value into ``order``, ties (and NaN,
    "equal" to everything) resolved as glibc's ``qsort`` does for llama.cpp's arrays of fewer than 1 KiB: its
    merge sort (halves sorted, then merged taking the left element unless it is greater), bottom-up here, the
    same merges for a power of two."""
    n = len(x)
    for i in range(n):
        values[i] = x[i]
        order[i] = i
    width = 1
    while width < n:
        for lo in range(0, n, 2 * width):
            a, b, out = lo, lo + width, lo
            while a < lo + width and b < lo + 2 * width:
                if values[a] > values[b]:
                    tmp[out], tmp_order[out] = values[b], order[b]
                    b += 1
                else:
                    tmp[out], tmp_order[out] = values[a], order[a]
                    a += 1
                out += 1
            while a < lo + width:
                tmp[out], tmp_order[out] = values[a], order[a]
                a += 1
                out += 1
            while b < lo + 2 * width:
                tmp[out], tmp_order[out] = values[b], order[b]
                b += 1
                out += 1
        values[:] = tmp
        order[:] = tmp_order
        width *= 2


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def iq1_best_neighbour(neighbours: np.ndarray, start: int, grid: np.ndarray, xb: np.ndarray, weight: np.ndarray,
                       o: int, scale: float, xx: np.ndarray, L: np.ndarray) -> int:
    """``iq1_find_best_neighbour2``: of the listed grid points, the first with the least
    ``sum w (scale * xx[l] - x)^2`` over the 8 signed values from ``o`` (``xx``: the three shifted levels,
    ``grid``: the levels 0..2 of each point [2048, 8]); its levels go to ``L[o:o + 8]``.  When no listed point
    gives a finite distance llama.cpp scans the whole grid reading past its arrays (then aborts unless that
    memory happens to help); here the scan reads the values it means to, so such rows (values whose squares
    overflow float32, NaN) are not promised llama.cpp's bytes."""
    best, found = FLT_MAX, -1
    for j in range(1, neighbours[start] + 1):
        index = neighbours[start + j]
        d2 = ZERO
        for i in range(8):
            diff = scale * xx[grid[index, i]] - xb[o + i]
            d2 += weight[o + i] * diff * diff
        if d2 < best:
            best, found = d2, index
    if found < 0:
        found = neighbours[start + 1]
        for index in range(grid.shape[0]):
            d2 = ZERO
            for i in range(8):
                diff = scale * xx[grid[index, i]] - xb[o + i]
                d2 += weight[o + i] * diff * diff
            if d2 < best:
                best, found = d2, index
    for i in range(8):
        L[o + i] = grid[found, i]
    return found


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def _iq1_packed(L: np.ndarray, o: int) -> int:
    u = 0
    for i in range(8):
        u |= L[o + i] << (2 * i)
    return u


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def _shifted(x_p: np.ndarray, x_m: np.ndarray, plus: bool) -> np.ndarray:
    return x_p if plus else x_m


@njit(cache=True, error_model="numpy", nogil=True)
def iq1s_superblocks(x: np.ndarray, qw: np.ndarray, grid: np.ndarray, kmap: np.ndarray, neighbours: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``quantize_row_iq1_s_impl`` (importance required): sub-blocks of 32 as 4 points of the 2048-point grid of
    levels -1, 0, 1, shifted by +-0.125 per sub-block.  The exact split of the sorted values into three levels
    (every pair of boundaries, both shifts), then grid points for the groups of 8 (the listed neighbours where
    the split is off the grid).  Returns the float32 scale before float16 (d * 1.125) [B] and the 48 bytes after
    it: the low bytes of 32 grid indices, then per sub-block a little-endian uint16 of the indices' 3 high bits
    each, the 3-bit scale at bit 12 and the shift's sign at bit 15."""
    count = x.shape[0]
    d_out = np.zeros(count, np.float32)
    out = np.zeros((count, IQ1_S_BYTES), np.uint8)
    x_p = np.array([-ONE + IQ1_DELTA, IQ1_DELTA, ONE + IQ1_DELTA], np.float32)
    x_m = np.array([-ONE - IQ1_DELTA, -IQ1_DELTA, ONE - IQ1_DELTA], np.float32)
    weight = np.empty(32, np.float32)
    sumx = np.zeros(33, np.float32)
    sumw = np.zeros(33, np.float32)
    order = np.empty(32, np.int64)
    values = np.empty(32, np.float32)
    tmp = np.empty(32, np.float32)
    tmp_order = np.empty(32, np.int64)
    L = np.zeros(32, np.int64)
    index = np.zeros(4, np.int64)
    scales = np.zeros(8, np.float32)
    shifts = np.zeros(8, np.int64)
    qh = np.zeros(8, np.int64)
    for b in range(count):
        xbl = x[b]
        max_scale = ZERO
        sigma2 = F32(2.0) * sum_squares(xbl) / F32(256.0)
        qh[:] = 0
        for ib in range(8):
            xb = xbl[32 * ib:32 * ib + 32]
            top = abs(xb[0])
            for i in range(32):
                weight[i] = qw[b % len(qw), 32 * ib + i] * F32(np.sqrt(sigma2 + xb[i] * xb[i]))
                if i:
                    top = top if top > abs(xb[i]) else abs(xb[i])
            scales[ib], shifts[ib] = ZERO, 1
            if top < GROUP_MAX_EPS_IQ1_S:
                continue
            _ascending(xb, order, values, tmp, tmp_order)
            for j in range(32):
                i = order[j]
                sumx[j + 1] = sumx[j] + weight[i] * xb[i]
                sumw[j + 1] = sumw[j] + weight[i]
            best, scale = -FLT_MAX, top
            best1, best2, best_shift = -1, -1, 0
            for i1 in range(33):
                for i2 in range(i1, 33):
                    for shift in (1, -1):
                        xx = _shifted(x_p, x_m, shift == 1)
                        sumqx = ((sumx[i1] - sumx[0]) * xx[0] + (sumx[i2] - sumx[i1]) * xx[1]
                                 + (sumx[32] - sumx[i2]) * xx[2])
                        sumq2 = ((sumw[i1] - sumw[0]) * xx[0] * xx[0] + (sumw[i2] - sumw[i1]) * xx[1] * xx[1]
                                 + (sumw[32] - sumw[i2]) * xx[2] * xx[2])
                        if sumq2 > ZERO and sumqx * sumqx > best * sumq2:
                            scale = sumqx / sumq2
                            best = scale * sumqx
                            best1, best2, best_shift = i1, i2, shift
            if best1 < 0 or best2 < 0 or best_shift == 0:
                continue
            for j in range(32):
                L[order[j]] = 0 if j < best1 else 1 if j < best2 else 2
            if scale < ZERO:
                for j in range(32):
                    L[j] = 2 - L[j]
                scale = -scale
                best_shift = -best_shift
            xx = _shifted(x_p, x_m, best_shift == 1)
            on_grid = True
            for k in range(4):
                u = _iq1_packed(L, 8 * k)
                index[k] = kmap[u]
                if index[k] < 0:
                    on_grid = False
                    index[k] = iq1_best_neighbour(neighbours, -kmap[u] - 1, grid, xb, weight, 8 * k, scale, xx, L)
            if not on_grid:
                sumqx, sumq2 = ZERO, ZERO
                for k in range(4):
                    for j in range(8):
                        w = weight[8 * k + j]
                        q = xx[grid[index[k], j]]
                        sumqx += w * q * xb[8 * k + j]
                        sumq2 += w * q * q
                if sumqx > ZERO and sumq2 > ZERO:
                    scale = sumqx / sumq2
            for k in range(4):
                out[b, 4 * ib + k] = index[k] & 255
                qh[ib] |= (index[k] >> 8) << (3 * k)
            scales[ib], shifts[ib] = scale, best_shift
            max_scale = max_scale if max_scale > scale else scale
        if max_scale != ZERO:
            d = max_scale / F32(15.0)
            d_out[b] = d * F32(1.125)
            inv = ONE / d
            for ib in range(8):
                level = max(0, min(7, nearest_int(F32(0.5) * (inv * scales[ib] - ONE))))
                qh[ib] |= (level | (8 if shifts[ib] == -1 else 0)) << 12
        for ib in range(8):
            out[b, 32 + 2 * ib] = qh[ib] & 255
            out[b, 33 + 2 * ib] = (qh[ib] >> 8) & 255
    return d_out, out


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def _iq1m_weights(xb: np.ndarray, qw: np.ndarray, use_qw: bool, row: int, o: int, sigma2: float,
                  weight: np.ndarray) -> None:
    for i in range(16):
        if use_qw:
            weight[i] = qw[row, o + i] * F32(np.sqrt(sigma2 + xb[i] * xb[i]))
        else:
            weight[i] = xb[i] * xb[i]


@njit(cache=True, error_model="numpy", nogil=True)
def iq1m_superblocks(x: np.ndarray, qw: np.ndarray, use_qw: bool, grid: np.ndarray, kmap: np.ndarray,
                     neighbours: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``quantize_row_iq1_m_impl``: sub-blocks of 16 as 2 points of IQ1_S's grid, each group of 8 with its own
    shift sign; weights from ``qw`` when ``use_qw``, else x^2.  Returns the float32 super-block scale before
    float16 (the least-squares d of the final levels times 1.1125; 0 for a block of zeros) [B] and the 56 bytes
    of the block without that scale, which :func:`qwen_convert.iq_encode.quantize_iq1_m` spreads over the top
    nibbles of the 4 scale words: the low bytes of 32 grid indices, per sub-block a byte of the two indices' 3
    high bits and shift signs (bits 3, 7), then 4 little-endian uint16 of 3-bit sub-block scales."""
    count = x.shape[0]
    d_out = np.zeros(count, np.float32)
    out = np.zeros((count, IQ1_M_BYTES), np.uint8)
    x_p = np.array([-ONE + IQ1_DELTA, IQ1_DELTA, ONE + IQ1_DELTA], np.float32)
    x_m = np.array([-ONE - IQ1_DELTA, -IQ1_DELTA, ONE - IQ1_DELTA], np.float32)
    p2, m2 = x_p[2], x_m[2]
    cp1, cp2 = x_p[0] * x_p[0] - x_p[1] * x_p[1], x_p[1] * x_p[1] - x_p[2] * x_p[2]
    cm1, cm2 = x_m[0] * x_m[0] - x_m[1] * x_m[1], x_m[1] * x_m[1] - x_m[2] * x_m[2]
    weight = np.empty(16, np.float32)
    px = np.zeros((2, 17), np.float32)
    pw = np.zeros((2, 17), np.float32)
    sumqx = np.empty(4, np.float32)
    sumq2 = np.empty(4, np.float32)
    order = np.empty(16, np.int64)
    values = np.empty(16, np.float32)
    tmp = np.empty(16, np.float32)
    tmp_order = np.empty(16, np.int64)
    L = np.zeros(16, np.int64)
    index = np.zeros(2, np.int64)
    scales = np.zeros(16, np.float32)
    shifts = np.zeros(16, np.int64)
    sc = np.zeros(4, np.int64)
    for b in range(count):
        xbl, row = x[b], b % len(qw)
        max_scale = ZERO
        sigma2 = F32(2.0) * sum_squares(xbl) / F32(256.0)
        for ib in range(16):
            xb = xbl[16 * ib:16 * ib + 16]
            _iq1m_weights(xb, qw, use_qw, row, 16 * ib, sigma2, weight)
            top = abs(xb[0])
            for i in range(1, 16):
                top = top if top > abs(xb[i]) else abs(xb[i])
            scales[ib], shifts[ib] = ZERO, 0
            if top < GROUP_MAX_EPS_IQ1_M:
                continue
            _ascending(xb, order, values, tmp, tmp_order)
            for j in range(16):
                i = order[j]
                h = 0 if i < 8 else 1
                px[h, j + 1] = px[h, j] + weight[i] * xb[i]
                px[1 - h, j + 1] = px[1 - h, j]
                pw[h, j + 1] = pw[h, j] + weight[i]
                pw[1 - h, j + 1] = pw[1 - h, j]
            best, scale = -FLT_MAX, top
            best1, best2, best_k = -1, -1, -1
            for i1 in range(17):
                for i2 in range(i1, 17):
                    sx0, sx1 = px[0, i1] + px[0, i2], px[1, i1] + px[1, i2]
                    qx_p0, qx_p1 = px[0, 16] * p2 - sx0, px[1, 16] * p2 - sx1
                    qx_m0, qx_m1 = px[0, 16] * m2 - sx0, px[1, 16] * m2 - sx1
                    q2_p0 = pw[0, 16] * p2 * p2 + pw[0, i1] * cp1 + pw[0, i2] * cp2
                    q2_p1 = pw[1, 16] * p2 * p2 + pw[1, i1] * cp1 + pw[1, i2] * cp2
                    q2_m0 = pw[0, 16] * m2 * m2 + pw[0, i1] * cm1 + pw[0, i2] * cm2
                    q2_m1 = pw[1, 16] * m2 * m2 + pw[1, i1] * cm1 + pw[1, i2] * cm2
                    sumqx[0], sumqx[1], sumqx[2], sumqx[3] = qx_p0 + qx_p1, qx_p0 + qx_m1, qx_m0 + qx_p1, qx_m0 + qx_m1
                    sumq2[0], sumq2[1], sumq2[2], sumq2[3] = q2_p0 + q2_p1, q2_p0 + q2_m1, q2_m0 + q2_p1, q2_m0 + q2_m1
                    for k in range(4):
                        if sumq2[k] > ZERO and sumqx[k] * sumqx[k] > best * sumq2[k]:
                            scale = sumqx[k] / sumq2[k]
                            best = scale * sumqx[k]
                            best1, best2, best_k = i1, i2, k
            if best1 < 0 or best2 < 0 or best_k < 0:
                continue
            for j in range(16):
                L[order[j]] = 0 if j < best1 else 1 if j < best2 else 2
            if scale < ZERO:
                for j in range(16):
                    L[j] = 2 - L[j]
                scale = -scale
                best_k = 3 - best_k
            on_grid = True
            for k in range(2):
                xx = _shifted(x_p, x_m, best_k < 2 if k == 0 else best_k % 2 == 0)
                u = _iq1_packed(L, 8 * k)
                index[k] = kmap[u]
                if index[k] < 0:
                    on_grid = False
                    index[k] = iq1_best_neighbour(neighbours, -kmap[u] - 1, grid, xb, weight, 8 * k, scale, xx, L)
            if not on_grid:
                sumqx_f, sumq2_f = ZERO, ZERO
                for k in range(2):
                    xx = _shifted(x_p, x_m, best_k < 2 if k == 0 else best_k % 2 == 0)
                    for j in range(8):
                        w = weight[8 * k + j]
                        q = xx[grid[index[k], j]]
                        sumqx_f += w * q * xb[8 * k + j]
                        sumq2_f += w * q * q
                if sumqx_f > ZERO and sumq2_f > ZERO:
                    scale = sumqx_f / sumq2_f
            out[b, 2 * ib] = index[0] & 255
            out[b, 2 * ib + 1] = index[1] & 255
            out[b, 32 + ib] = (index[0] >> 8) | ((index[1] >> 8) << 4)
            scales[ib], shifts[ib] = scale, best_k
            max_scale = max_scale if max_scale > scale else scale
        if max_scale == ZERO:
            continue
        sc[:] = 0
        d = max_scale / F32(15.0)
        inv = ONE / d
        sumqx_f, sumq2_f = ZERO, ZERO
        for ib in range(16):
            level = max(0, min(7, nearest_int(F32(0.5) * (inv * scales[ib] - ONE))))
            sc[ib // 4] |= level << (3 * (ib % 4))
            out[b, 32 + ib] |= IQ1_M_MASKS[shifts[ib]]
            xb = xbl[16 * ib:16 * ib + 16]
            _iq1m_weights(xb, qw, use_qw, row, 16 * ib, sigma2, weight)
            for k in range(2):
                xx = _shifted(x_p, x_m, shifts[ib] < 2 if k == 0 else shifts[ib] % 2 == 0)
                at = np.int64(out[b, 2 * ib + k]) + ((np.int64(out[b, 32 + ib]) << (8 - 4 * k)) & 0x700)
                odd = F32(2 * level + 1)
                for j in range(8):
                    w = weight[8 * k + j]
                    q = xx[grid[at, j]] * odd
                    sumqx_f += w * q * xb[8 * k + j]
                    sumq2_f += w * q * q
        if sumq2_f > ZERO:
            d = sumqx_f / sumq2_f
        d_out[b] = d * F32(1.1125)
        for k in range(4):
            out[b, 48 + 2 * k] = sc[k] & 255
            out[b, 49 + 2 * k] = (sc[k] >> 8) & 255
    return d_out, out
