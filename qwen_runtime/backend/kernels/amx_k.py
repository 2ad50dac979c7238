"""Prefill products of K-quant weights (Q2_K to Q6_K) and IQ4_XS with q8_K activations on AMX tiles (Intel
``amx_int8``, numba).

The numbers are those of ``quants.q8k_act.product``, bit for bit: per super-block of 256 values an exact int32
``sumi = sum_j sc_j (w_j . q8_j)`` (and for the types with minimums ``summ = sum_j m_j bsum_j``), then one float
step ``acc = acc + f32(sumi) * (d_w * d_x)`` (``- f32(summ) * (dmin_w * d_x)``).

The sub-block scales are small integers, so they are folded into the weights when a panel is repacked, ``w' =
sc_j * w``, and each type has a form (:data:`K_FORMS`):

* *wide* (Q4_K 0..945, Q5_K 0..1953, Q6_K -4064..4096, IQ4_XS's ``(ls - 32) * level`` -4064..4032): ``w'`` is
  split into bytes, ``w' = lo + 256 hi`` (``lo`` 0..255, ``hi`` a small signed value), and ``sumi = A . lo + 256
  (A . hi)``: ``tdpbsud`` (signed activations, unsigned ``lo``) and ``tdpbssd``, each four 64-deep tile products
  per super-block;
* *narrow* (Q2_K 0..45; Q3_K's ``sc * q`` is -124..128, so its negation ``-w'`` is stored, -128..124, with ``-d``:
  ``f32(-sumi) * (-d_w * d_x)`` rounds as ``f32(sumi) * (d_w * d_x)``): one int8 byte, ``tdpbssd`` alone, half the
  tile work.

One int32 tile store per 16 x 16 x 256 (against 16 x 16 x 32 for Q8_0, whose scale is per 32 values:
:mod:`.amx`).  A step is 32 activation rows x 16 weight rows: tiles 0-1 activations, 2 ``lo``, 3 ``hi``, 4-5 ``A
. lo``, 6-7 ``A . hi``.  The float step of super-block ``b - 1`` (:func:`k_scale`, IR on zmm) follows the tile
products of ``b``.  The minimums' integer sum is taken in float32 lanes from the activations' sums per sub-block
(per 32 for Q4_K and Q5_K, per 16 for Q2_K): every product (at most 63 x 32 x 127) and partial sum is an integer
below 2^24, so exact; the types without minimums skip that step (``acc - 0`` would change nothing).  The float
step of each form is its own straight-line code (:func:`k_step`: ``mins`` and ``wide`` literal constants of
:func:`k_scale`), one branch per super-block choosing it; the type's repack function is chosen by number, not
passed (numba's cache cannot match a function-typed argument in a new process, so it would compile every time).

Weights: 16-row panels repacked (``lo`` and ``hi``, or the one byte: 4 or 8 KiB per super-block, scales widened
to float32) :data:`CHUNK_BYTES` at a time, every 32-row tile of activations passing over each chunk; nothing is
kept between calls.  Where AMX is absent or refused the kernel classes keep their :mod:`.int8_k` (or float)
behaviour.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import RequireLiteralValue
from numba.extending import intrinsic

from ...errors import KernelsError
from ...quants.base import QType
from ...quants.iq4 import IQ4_LEVELS, IQ4_XS
from ...quants.kquants import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from ...quants.q8k_act import QK_K
from . import lanes
from .amx import (
    ROWS,
    TILE,
    AmxPrompts,
    amx_available,
    amx_jit,
    dpbssd,
    dpbsud,
    ldtilecfg,
    tileload,
    tilerelease,
    tilestore,
    tilezero,
)
from .base import F16_TABLE, I64, Declared
from .iq4 import IQ4_XSJitKernel
from .kquants import Q2_KJitKernel, Q3_KJitKernel, Q4_KJitKernel, Q5_KJitKernel, Q6_KJitKernel
from .q8_act import quantize_k_rows

KSTEPS = QK_K // 64  # 64-deep tile products per super-block
TILE_BYTES = 1024  # one 16 x 64-byte tile
CHUNK_BYTES = 1 << 20  # repacked weights per pass over the activation rows (L2-resident)


def tile_config() -> np.ndarray:
    """The ``ldtilecfg`` block: all eight tiles 16 rows x 64 bytes (activations 16 x 64 int8, weights 16 x 16 x 4
    in the VNNI layout, results 16 x 16 int32)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    cfg[16:48].view(np.uint16)[:8] = 64
    cfg[48:56] = TILE
    return cfg


CONFIG = tile_config()


@numba.njit(inline="always")
def emit(values, packed, b):
    """The 16 weight rows' ``values`` int32 [16, 256] (``w'`` in value order) of super-block ``b`` into the VNNI
    tiles of ``packed`` int32 [nb, parts, 4, 16, 16]: ``lo`` (``w' & 255``) and, with two parts, ``hi`` (``w' >>
    8``) bytes, 4 consecutive values per int32, written in order (row by row of a tile, the 16 weight rows
    across)."""
    wide = packed.shape[1] > 1
    for g in range(QK_K // 4):
        for j in range(TILE):
            lo, hi = np.int64(0), np.int64(0)
            for t in range(4):
                v = np.int64(values[j, 4 * g + t])
                lo |= (v & 255) << (8 * t)
                hi |= ((v >> 8) & 255) << (8 * t)
            packed[b, 0, g // 16, g % 16, j] = np.int32(np.uint32(lo))
            if wide:
                packed[b, 1, g // 16, g % 16, j] = np.int32(np.uint32(hi))


@numba.njit(inline="always")
def f16_at(row, at, table):
    """The float16 at bytes ``at, at + 1`` of ``row`` as float32."""
    return table[np.int64(row[at]) | (np.int64(row[at + 1]) << 8)]


@numba.njit(inline="always")
def scale_min_k4(row, o, s):
    """Sub-block ``s``'s 6-bit scale and minimum of the Q4_K/Q5_K block at byte ``o`` of ``row``."""
    if s < 4:
        return np.int32(row[o + 4 + s] & 63), np.int32(row[o + 8 + s] & 63)
    sc = np.int32(row[o + 8 + s] & 15) | (np.int32(row[o + s] >> 6) << 4)
    m = np.int32(row[o + 8 + s] >> 4) | (np.int32(row[o + 4 + s] >> 6) << 4)
    return sc, m


@amx_jit
def repack_q45_k(raw, r0, table, packed, fw):
    """Rows ``r0 .. r0 + 15`` of Q4_K ``raw`` [R, nb * 144] or Q5_K [R, nb * 176] into ``packed`` int32 [nb, 2, 4,
    16, 16] (``lo`` then ``hi`` of ``sc_j * q`` in the VNNI layout: int32 ``[b, part, k // 64, k % 64 // 4, j]``
    holds values ``k .. k + 3`` of row ``r0 + j``, ``k`` a multiple of 4) and ``fw`` float32 [nb, 10, 16] (d,
    dmin, the minimums); rows past the matrix as zeros.  Q5_K's bit 4 of sub-block ``s`` is bit ``s`` of its
    ``qh`` bytes (16..47)."""
    nb = packed.shape[0]
    size = raw.shape[1] // nb
    high = size > 144
    live = min(TILE, raw.shape[0] - r0)
    fw[:] = 0
    values = np.zeros((TILE, QK_K), np.int32)
    for b in range(nb):
        o = b * size
        for j in range(live):
            row = raw[r0 + j]
            fw[b, 0, j] = f16_at(row, o, table)
            fw[b, 1, j] = f16_at(row, o + 2, table)
            for s in range(8):
                sc, m = scale_min_k4(row, o, s)
                fw[b, 2 + s, j] = m
                shift = np.int32(4 * (s % 2))
                at = o + size - 128 + 32 * (s // 2)
                for lane in range(32):
                    q = (np.int32(row[at + lane]) >> shift) & np.int32(15)
                    if high:
                        q |= ((np.int32(row[o + 16 + lane]) >> np.int32(s)) & np.int32(1)) << np.int32(4)
                    values[j, 32 * s + lane] = sc * q
        emit(values, packed, b)


@amx_jit
def repack_q6_k(raw, r0, table, packed, fw):
    """As :func:`repack_q45_k` for Q6_K rows [R, nb * 210] (``w' = sc_j * (q - 32)``, ``hi`` signed; ``fw`` [nb,
    2, 16]: its d)."""
    nb = packed.shape[0]
    live = min(TILE, raw.shape[0] - r0)
    fw[:] = 0
    values = np.zeros((TILE, QK_K), np.int32)
    for b in range(nb):
        o = b * 210
        for j in range(live):
            row = raw[r0 + j]
            fw[b, 0, j] = f16_at(row, o + 208, table)
            for h in range(2):
                for a in range(4):
                    ql = row[o + 64 * h + 32 * (a % 2):o + 64 * h + 32 * (a % 2) + 32]
                    qh = row[o + 128 + 32 * h:o + 160 + 32 * h]
                    low_shift, high_shift = np.int32(4 * (a // 2)), np.int32(2 * a)
                    for half in range(2):
                        sc = np.int32(np.int8(row[o + 192 + 8 * h + 2 * a + half]))
                        for lane in range(16 * half, 16 * half + 16):
                            low = (np.int32(ql[lane]) >> low_shift) & np.int32(15)
                            high = (np.int32(qh[lane]) >> high_shift) & np.int32(3)
                            values[j, 128 * h + 32 * a + lane] = sc * ((low | (high << np.int32(4))) - np.int32(32))
        emit(values, packed, b)


@amx_jit
def repack_q2_k(raw, r0, table, packed, fw):
    """Q2_K rows [R, nb * 84] into ``packed`` int32 [nb, 1, 4, 16, 16] (``sc_j * q``, 0..45, one byte) and ``fw``
    [nb, 18, 16] (d, dmin, the 16 minimums); value ``128h + 32s + l`` is bits ``2s`` of ``qs`` byte ``32h + l``,
    its sub-block ``j`` the value's index / 16 (scale: low nibble of ``scales[j]``, minimum: high nibble)."""
    nb = packed.shape[0]
    live = min(TILE, raw.shape[0] - r0)
    fw[:] = 0
    values = np.zeros((TILE, QK_K), np.int32)
    for b in range(nb):
        o = b * 84
        for j in range(live):
            row = raw[r0 + j]
            fw[b, 0, j] = f16_at(row, o + 80, table)
            fw[b, 1, j] = f16_at(row, o + 82, table)
            for s in range(16):
                fw[b, 2 + s, j] = np.int32(row[o + s] >> 4)
            for h in range(2):
                for s in range(4):
                    shift = np.int32(2 * s)
                    for half in range(2):
                        sc = np.int32(row[o + 8 * h + 2 * s + half] & 15)
                        for lane in range(16 * half, 16 * half + 16):
                            q = (np.int32(row[o + 16 + 32 * h + lane]) >> shift) & np.int32(3)
                            values[j, 128 * h + 32 * s + lane] = sc * q
        emit(values, packed, b)


@amx_jit
def repack_q3_k(raw, r0, table, packed, fw):
    """Q3_K rows [R, nb * 110] into ``packed`` int32 [nb, 1, 4, 16, 16] (``-(sc_j * q)``: -128..124, one byte)
    and ``fw`` [nb, 2, 16] (``-d``): value ``128h + 32s + l`` is bits ``2s`` of ``qs`` byte ``32h + l`` (bytes
    32..95) minus 4 where bit ``4h + s`` of ``hmask`` byte ``l`` is clear; ``sc_j`` (``j``: the value's index / 16)
    has its low 4 bits in nibble ``j // 8`` of byte ``96 + j % 8``, its high 2 in bits ``2 (j // 4)`` of byte ``104
    + j % 4``, minus 32."""
    nb = packed.shape[0]
    live = min(TILE, raw.shape[0] - r0)
    fw[:] = 0
    values = np.zeros((TILE, QK_K), np.int32)
    for b in range(nb):
        o = b * 110
        for j in range(live):
            row = raw[r0 + j]
            fw[b, 0, j] = -f16_at(row, o + 108, table)
            for h in range(2):
                for s in range(4):
                    shift, bit = np.int32(2 * s), np.int32(4 * h + s)
                    for half in range(2):
                        k = 8 * h + 2 * s + half
                        low = (np.int32(row[o + 96 + k % 8]) >> np.int32(4 * (k // 8))) & np.int32(15)
                        top = (np.int32(row[o + 104 + k % 4]) >> np.int32(2 * (k // 4))) & np.int32(3)
                        sc = (low | (top << np.int32(4))) - np.int32(32)
                        for lane in range(16 * half, 16 * half + 16):
                            q = (np.int32(row[o + 32 + 32 * h + lane]) >> shift) & np.int32(3)
                            q -= np.int32(4) * (np.int32(1) - ((np.int32(row[o + lane]) >> bit) & np.int32(1)))
                            values[j, 128 * h + 32 * s + lane] = -(sc * q)
        emit(values, packed, b)


@amx_jit
def repack_iq4_xs(raw, r0, table, packed, fw):
    """IQ4_XS rows [R, nb * 136] into ``packed`` int32 [nb, 2, 4, 16, 16] (``(ls_s - 32) * level``, -4064..4032:
    ``lo`` and ``hi``) and ``fw`` [nb, 2, 16] (d): value ``32s + 16n + l`` is the level of nibble ``n`` of ``qs``
    byte ``16s + l`` (bytes 8..135); ``ls_s`` is nibble ``s % 2`` of byte ``4 + s // 2`` with bits ``2s, 2s + 1`` of
    the little-endian ``scales_h`` (bytes 2, 3) as bits 4-5."""
    nb = packed.shape[0]
    live = min(TILE, raw.shape[0] - r0)
    fw[:] = 0
    values = np.zeros((TILE, QK_K), np.int32)
    for b in range(nb):
        o = b * 136
        for j in range(live):
            row = raw[r0 + j]
            fw[b, 0, j] = f16_at(row, o, table)
            high = np.int32(row[o + 2]) | (np.int32(row[o + 3]) << np.int32(8))
            for s in range(8):
                low = (np.int32(row[o + 4 + s // 2]) >> np.int32(4 * (s % 2))) & np.int32(15)
                sc = (low | (((high >> np.int32(2 * s)) & np.int32(3)) << np.int32(4))) - np.int32(32)
                for n in range(2):
                    for lane in range(16):
                        index = (np.int32(row[o + 8 + 16 * s + lane]) >> np.int32(4 * n)) & np.int32(15)
                        values[j, 32 * s + 16 * n + lane] = sc * np.int32(IQ4_LEVELS[index])
        emit(values, packed, b)


# Each type's repack function by number (:func:`kquant_amx` takes the number: module docstring).
REPACK_Q2_K, REPACK_Q3_K, REPACK_Q45_K, REPACK_Q6_K, REPACK_IQ4_XS = range(5)


@numba.njit(inline="always")
def repack(kind, raw, r0, table, packed, fw):
    """The repack function number ``kind`` of 16 rows from ``r0`` (:data:`REPACK_Q2_K` ...)."""
    if kind == REPACK_Q2_K:
        repack_q2_k(raw, r0, table, packed, fw)
    elif kind == REPACK_Q3_K:
        repack_q3_k(raw, r0, table, packed, fw)
    elif kind == REPACK_Q45_K:
        repack_q45_k(raw, r0, table, packed, fw)
    elif kind == REPACK_IQ4_XS:
        repack_iq4_xs(raw, r0, table, packed, fw)
    else:
        repack_q6_k(raw, r0, table, packed, fw)


class KForm(NamedTuple):
    """How a type's super-blocks go through :func:`kquant_amx`."""

    repack: int  # its repack function's number: 16 rows into the tiles' layout and ``fw``
    mins: int  # minimums per super-block (0: none, 8 per 32, 16 per 16), the activations' sums they need
    wide: bool  # ``w'`` takes a ``lo`` and a ``hi`` byte (two tile products per 64 values)


K_FORMS: dict[QType, KForm] = {
    QType.Q2_K: KForm(REPACK_Q2_K, 16, False),
    QType.Q3_K: KForm(REPACK_Q3_K, 0, False),
    QType.Q4_K: KForm(REPACK_Q45_K, 8, True),
    QType.Q5_K: KForm(REPACK_Q45_K, 8, True),
    QType.Q6_K: KForm(REPACK_Q6_K, 0, True),
    QType.IQ4_XS: KForm(REPACK_IQ4_XS, 0, True),
}


def _literal(value: types.Type) -> int:
    if not isinstance(value, (types.IntegerLiteral, types.BooleanLiteral)):
        raise RequireLiteralValue("the form's mins and wide must be literal constants")
    return int(value.literal_value)


@intrinsic
def k_scale(typingctx, acc, sums, fw, dx, dx_stride, bs, bs_stride, mins, wide):  # noqa: ARG001 (numba's protocol)
    """For the 32 rows ``i`` of a step and its 16 weight rows (lanes): ``sumi = lo + (hi << 8)`` (int32 ``[32,
    16]`` each at ``sums`` and, if ``wide``, ``sums + 2048``), ``acc = acc + f32(sumi) * (d_w * dx_i)``, then with
    ``mins`` minimums ``summ = sum_s m_s * bs[i, s]`` (exact integers in float32, so fused multiply-adds give the
    same sum) and ``acc = acc - summ * (dmin_w * dx_i)``, every other operation rounded (no fast-math flags);
    ``acc`` float32 [32, 16], ``fw`` float32 [2 + mins, 16] (d, dmin, minimums), ``dx[i]`` at ``dx + i *
    dx_stride``, ``bs[i, s]`` at ``bs + i * bs_stride + 4 * s`` (addresses, int64); ``mins`` and ``wide``
    literals."""
    n_mins, is_wide = _literal(mins), _literal(wide)

    def codegen(context, builder, signature, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        v16f, v16i = ir.VectorType(f32, TILE), ir.VectorType(i32, TILE)
        acc_p = builder.inttoptr(args[0], v16f.as_pointer())
        sums_p = builder.inttoptr(args[1], v16i.as_pointer())
        fw_p = builder.inttoptr(args[2], v16f.as_pointer())
        fw = [builder.load(builder.gep(fw_p, [I64(r)]), align=4) for r in range(2 + n_mins)]
        zeros, eight = ir.Constant(v16i, [0] * TILE), ir.Constant(v16i, [8] * TILE)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f] * 3), "llvm.fma.v16f32")

        def broadcast(at):
            value = builder.load(builder.inttoptr(at, f32.as_pointer()), align=4)
            return builder.shuffle_vector(builder.insert_element(ir.Constant(v16f, ir.Undefined), value, i32(0)),
                                          ir.Constant(v16f, ir.Undefined), zeros)

        for i in range(ROWS):
            sumi = builder.load(builder.gep(sums_p, [I64(i)]), align=4)
            if is_wide:
                sumi = builder.add(sumi, builder.shl(builder.load(builder.gep(sums_p, [I64(ROWS + i)]), align=4),
                                                     eight))
            dxi = broadcast(builder.add(args[3], builder.mul(args[4], I64(i))))
            lanes = builder.gep(acc_p, [I64(i)])
            total = builder.fadd(builder.load(lanes, align=4),
                                 builder.fmul(builder.sitofp(sumi, v16f), builder.fmul(fw[0], dxi)))
            if n_mins:
                row_bs = builder.add(args[5], builder.mul(args[6], I64(i)))
                summ = builder.fmul(fw[2], broadcast(row_bs))
                for s in range(1, n_mins):
                    summ = builder.call(fma, [fw[2 + s], broadcast(builder.add(row_bs, I64(4 * s))), summ])
                total = builder.fsub(total, builder.fmul(summ, builder.fmul(fw[1], dxi)))
            builder.store(total, lanes, align=4)
        return context.get_dummy_value()
    return types.void(acc, sums, fw, dx, dx_stride, bs, bs_stride, mins, wide), codegen


@intrinsic
def copy16(typingctx, dst, src):  # noqa: ARG001
    """Copy the 16 float32 at byte address ``src`` to ``dst`` (one zmm load and store)."""
    def codegen(context, builder, signature, args):
        v16f = ir.VectorType(ir.FloatType(), TILE).as_pointer()
        builder.store(builder.load(builder.inttoptr(args[1], v16f), align=4), builder.inttoptr(args[0], v16f),
                      align=4)
        return context.get_dummy_value()
    return types.void(dst, src), codegen


@numba.njit(inline="always")
def k_step(acc, sums, fw, dx, dx_stride, bs, bs_stride, mins, wide):
    """:func:`k_scale` of the form ``mins``, ``wide`` (one of :data:`K_FORMS`'), its constants given as literals."""
    if mins == 16:
        k_scale(acc, sums, fw, dx, dx_stride, bs, bs_stride, 16, False)
    elif mins == 8:
        k_scale(acc, sums, fw, dx, dx_stride, bs, bs_stride, 8, True)
    elif wide:
        k_scale(acc, sums, fw, dx, dx_stride, bs, bs_stride, 0, True)
    else:
        k_scale(acc, sums, fw, dx, dx_stride, bs, bs_stride, 0, False)


@amx_jit
def kquant_amx(kind, raw, q, d, bs, table, cfg, out, mins, wide):
    """``out`` [M, R] = the q8_K product of K-quant rows ``raw`` (repacked by function number ``kind``, in the
    form ``mins``, ``wide``: :class:`KForm`) and activations ``q`` int8 [Mp, nb * 256], ``d`` float32 [Mp, nb],
    ``bs`` float32 [Mp, nb * mins] (the sums per sub-block of the minimums), Mp a multiple of 32 with zero rows past
    ``out``'s."""
    rows, m = raw.shape[0], out.shape[0]
    cols = q.shape[1]
    nb = cols // QK_K
    parts = 2 if wide else 1
    panels = -(-rows // TILE)
    chunk = max(1, min(panels, CHUNK_BYTES // (nb * parts * KSTEPS * TILE_BYTES)))
    packed = np.empty((chunk, nb, parts, KSTEPS, TILE, TILE), np.int32)
    fw = np.empty((chunk, nb, 2 + mins, TILE), np.float32)
    acc = np.empty((ROWS, TILE), np.float32)
    ring = np.empty((2, 2 * ROWS, TILE), np.int32)
    qa, ra, aa, da, ba = q.ctypes.data, ring.ctypes.data, acc.ctypes.data, d.ctypes.data, bs.ctypes.data
    oa, ostride = out.ctypes.data, out.strides[0]
    slot = ring.strides[0]
    ldtilecfg(cfg.ctypes.data)
    for p0 in range(0, panels, chunk):
        for p in range(min(chunk, panels - p0)):
            repack(kind, raw, (p0 + p) * TILE, table, packed[p], fw[p])
        for i0 in range(0, q.shape[0], ROWS):
            for p in range(min(chunk, panels - p0)):
                c0 = (p0 + p) * TILE
                pa, fa = packed[p].ctypes.data, fw[p].ctypes.data
                acc[:] = 0
                for b in range(nb + 1):
                    if b < nb:
                        tilezero(4)
                        tilezero(5)
                        if wide:
                            tilezero(6)
                            tilezero(7)
                        for ks in range(KSTEPS):
                            a0 = qa + i0 * cols + b * QK_K + ks * 64
                            w0 = pa + (b * parts * KSTEPS + ks) * TILE_BYTES
                            tileload(0, a0, cols)
                            tileload(1, a0 + TILE * cols, cols)
                            tileload(2, w0, 64)
                            if wide:
                                tileload(3, w0 + KSTEPS * TILE_BYTES, 64)
                                dpbsud(4, 0, 2)
                                dpbsud(5, 1, 2)
                                dpbssd(6, 0, 3)
                                dpbssd(7, 1, 3)
                            else:
                                dpbssd(4, 0, 2)
                                dpbssd(5, 1, 2)
                        ca = ra + (b % 2) * slot
                        tilestore(4, ca, 64)
                        tilestore(5, ca + TILE_BYTES, 64)
                        if wide:
                            tilestore(6, ca + 2 * TILE_BYTES, 64)
                            tilestore(7, ca + 3 * TILE_BYTES, 64)
                    if b > 0:
                        e = b - 1
                        k_step(aa, ra + (e % 2) * slot, fa + e * (2 + mins) * TILE * 4, da + (i0 * nb + e) * 4,
                               4 * nb, ba + (i0 * nb + e) * mins * 4, 4 * nb * mins, mins, wide)
                if rows - c0 >= TILE:
                    for i in range(min(ROWS, m - i0)):
                        copy16(oa + (i0 + i) * ostride + c0 * 4, aa + i * TILE * 4)
                else:
                    for i in range(min(ROWS, m - i0)):
                        for j in range(rows - c0):
                            out[i0 + i, c0 + j] = acc[i, j]
    tilerelease()


@amx_jit
def quantize_q8_k_rows(x, bits, q, d, bs):
    """``quants.q8k_act.quantize_q8_k`` of ``x`` [M, nb * 256] into ``q``, ``d`` (:func:`.q8_act.quantize_k_rows`)
    and ``bs`` float32 [M, nb * S], the sums of ``q`` per 256 / S values (S = 0: none)."""
    quantize_k_rows(x, bits, q, d)
    nb = d.shape[1]
    per = bs.shape[1] // nb if nb else 0
    if not per:
        return
    width = QK_K // per
    for i in range(x.shape[0]):
        for s in range(nb * per):
            total = np.int32(0)
            for k in range(width):
                total += np.int32(q[i, s * width + k])
            bs[i, s] = np.float32(total)


class KActivations(tuple):
    """:func:`q8_k_padded` of a prompt: (q, d, the sums per sub-block of the minimums as float32), for every
    tile's product."""


def q8_k_padded(x: np.ndarray, sums: int = 8) -> KActivations:
    """``quants.q8k_act.quantize_q8_k`` of ``x`` [M, K] (compiled: :func:`quantize_q8_k_rows`), padded with zero
    rows to a multiple of 32, with ``sums`` sums of ``q`` per super-block (8: per 32, pairs of ``bsums``; 16: the
    ``bsums``; 0: none) as float32 [Mp, K / 256 * sums]."""
    m, cols = x.shape
    padded = -(-m // ROWS) * ROWS
    q = np.zeros((padded, cols), np.int8)
    d = np.zeros((padded, cols // QK_K), np.float32)
    bs = np.zeros((padded, cols // QK_K * sums), np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    quantize_q8_k_rows(x, x.view(np.int32), q, d, bs)
    prepared = KActivations((q, d, bs))
    prepared.rows = m
    return prepared


# The type of K-quant rows of each stored size (bytes per super-block).
BY_SIZE = {c.type_size: c.qtype for c in (Q2_K(), Q3_K(), Q4_K(), Q5_K(), Q6_K(), IQ4_XS())}


def kquant_amx_product(raw: np.ndarray, xk: KActivations, out: np.ndarray) -> None:
    """``out`` [M, R] = the q8_K product of K-quant rows ``raw`` [R, nb * type size] (uint8; the type from its
    size, :data:`BY_SIZE`) and :func:`q8_k_padded` activations (with the sums the type's minimums need) on AMX
    tiles; :class:`.KernelsError` where not :func:`.amx.amx_available`."""
    if not amx_available():
        raise KernelsError("AMX int8 tiles are not available here (CPU, compiler target or kernel permission)")
    q, d, bs = xk
    nb = d.shape[1]
    form = K_FORMS.get(BY_SIZE.get(raw.shape[1] // nb if nb else 0))
    if (form is None or raw.shape[1] % nb or q.shape[1] != QK_K * nb
            or (form.mins and bs.shape != (len(q), nb * form.mins)) or len(q) % ROWS or len(out) > len(q)
            or out.shape[1] != len(raw) or out.dtype != np.float32 or out.strides[1] != 4):
        raise ValueError(f"K-quant AMX product of {raw.shape} stored rows, activations {q.shape}, output {out.shape}")
    kquant_amx(form.repack, raw.view(np.uint8), q, d, bs, F16_TABLE, CONFIG, out, form.mins, form.wide)


class KQuantAmxPrompts(AmxPrompts):
    """K-quant prompts through :func:`kquant_amx_product` with q8_K activations (:func:`q8_k_padded`, with the
    sums the type's minimums need), or for Q4_K, Q6_K and IQ4_XS through AVX2's integer lanes
    (:func:`.lanes.kquant_lanes_product`, the same numbers) where :func:`.lanes.takes` them."""

    prepared_type = KActivations
    type_size: int

    def quantize(self, x: np.ndarray) -> KActivations:
        return q8_k_padded(x, K_FORMS[BY_SIZE[self.type_size]].mins)

    def amx_product(self, raw: np.ndarray, xk: KActivations, out: np.ndarray) -> None:
        kquant_amx_product(raw, xk, out)

    def lane_quantize(self, x: np.ndarray) -> lanes.LaneActivations | None:
        if self.lane_kernel() is None:
            return None
        per, dtype = lanes.LANE_SUMS[self.type_size]
        q, d, sums = q8_k_padded(x, per)
        q = q.astype(np.int16) if self.type_size in lanes.WIDE else q
        return lanes.lane_activations(q, d, sums.astype(dtype, copy=False), len(x))

    def lane_product(self, raw: np.ndarray, xk: lanes.LaneActivations, out: np.ndarray) -> None:
        lanes.kquant_lanes_product(raw, xk, out)

    def lane_kernel(self) -> Declared | None:
        return lanes.prompt_kernel(self.type_size)


class Q2_KAmxPromptKernel(KQuantAmxPrompts, Q2_KJitKernel):
    """Q2_K with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


class Q3_KAmxPromptKernel(KQuantAmxPrompts, Q3_KJitKernel):
    """Q3_K with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


class Q4_KAmxPromptKernel(KQuantAmxPrompts, Q4_KJitKernel):
    """Q4_K with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


class Q5_KAmxPromptKernel(KQuantAmxPrompts, Q5_KJitKernel):
    """Q5_K with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


class Q6_KAmxPromptKernel(KQuantAmxPrompts, Q6_KJitKernel):
    """Q6_K with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


class IQ4_XSAmxPromptKernel(KQuantAmxPrompts, IQ4_XSJitKernel):
    """IQ4_XS with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


# This family's AMX prompt kernels (:func:`.kernel_table`).
KERNELS = (Q2_KAmxPromptKernel, Q3_KAmxPromptKernel, Q4_KAmxPromptKernel, Q5_KAmxPromptKernel, Q6_KAmxPromptKernel,
           IQ4_XSAmxPromptKernel)
