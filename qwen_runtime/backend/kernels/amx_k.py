"""Prefill products of Q4_K and Q6_K weights with q8_K activations on AMX tiles (Intel ``amx_int8``, numba).

The numbers are those of ``quants.q8k_act.product_q4_k`` / ``product_q6_k``, bit for bit: per super-block of 256
values an exact int32 ``sumi = sum_j sc_j (q_j . q8_j)`` (and for Q4_K the minimums' ``summ = sum_j m_j
bsum_j``), then one float step ``acc = acc + f32(sumi) * (d_w * d_x)`` (``- f32(summ) * (dmin_w * d_x)``).

The sub-block scales are small integers, so they are folded into the weights when a panel is repacked: ``w' =
sc_j * q`` (Q4_K 0..945, Q6_K -4064..4096) is split into bytes, ``w' = lo + 256 hi`` (``lo`` 0..255, ``hi`` a
small signed value), and ``sumi = A . lo + 256 (A . hi)``: ``tdpbsud`` (signed activations, unsigned ``lo``) and
``tdpbssd`` over the whole super-block (four 64-deep tile products each), one int32 tile store per 16 x 16 x 256
(against 16 x 16 x 32 for Q8_0, whose scale is per 32 values: :mod:`.amx`).  A step is 32 activation rows x
16 weight rows: tiles 0-1 activations, 2 ``lo``, 3 ``hi``, 4-5 ``A . lo``, 6-7 ``A . hi``.  The float step of
super-block ``b - 1`` (:func:`k_scale`, IR on zmm) follows the tile products of ``b``.  The minimums' integer sum
is taken in float32 lanes from the activations' sums per 32: every product (at most 63 x 32 x 127) and partial
sum is an integer below 2^24, so exact; Q6_K passes zero minimums (``acc - 0``, exact).

Weights: 16-row panels repacked (``lo``, ``hi``: 8 KiB per super-block, scales widened to float32)
:data:`CHUNK_BYTES` at a time, every 32-row tile of activations passing over each chunk; nothing is kept between
calls.  Where AMX is absent or refused the kernel classes keep their :mod:`.int8_k` behaviour.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ...errors import KernelsError
from ...quants.q8k_act import Q4_K_BYTES, Q6_K_BYTES, QK_K
from .amx import (
    I64,
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
from .base import F16_TABLE
from .kquants import Q4_KJitKernel, Q6_KJitKernel

KSTEPS = QK_K // 64  # 64-deep tile products per super-block
SUBS = 8  # minimums per super-block (Q4_K's sub-blocks of 32)
FW_ROWS = 2 + SUBS  # per panel and super-block: d, dmin, the 8 minimums (float32 [16] each)
PANEL_BYTES = 2 * KSTEPS * 64 * TILE  # lo and hi of one panel and super-block
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
    """The 16 weight rows' ``values`` int32 [16, 256] (``w' = sc * q`` in value order) of super-block ``b`` into
    the VNNI tiles: ``lo`` (``w' & 255``) and ``hi`` (``w' >> 8``) bytes, 4 consecutive values per int32 of
    ``packed`` int32 [nb, 2, 4, 16, 16], written in order (row by row of a tile, the 16 weight rows across)."""
    for g in range(QK_K // 4):
        for j in range(TILE):
            lo, hi = np.int64(0), np.int64(0)
            for t in range(4):
                v = np.int64(values[j, 4 * g + t])
                lo |= (v & 255) << (8 * t)
                hi |= ((v >> 8) & 255) << (8 * t)
            packed[b, 0, g // 16, g % 16, j] = np.int32(np.uint32(lo))
            packed[b, 1, g // 16, g % 16, j] = np.int32(np.uint32(hi))


@amx_jit
def repack_q4_k(raw, r0, table, packed, fw):
    """Rows ``r0 .. r0 + 15`` of Q4_K ``raw`` [R, nb * 144] into ``packed`` int32 [nb, 2, 4, 16, 16] (``lo`` then
    ``hi`` of ``sc_j * q`` in the VNNI layout: int32 ``[b, part, k // 64, k % 64 // 4, j]`` holds values ``k ..
    k + 3`` of row ``r0 + j``, ``k`` a multiple of 4) and ``fw`` float32 [nb, 10, 16] (d, dmin, the minimums);
    rows past the matrix as zeros."""
    nb = packed.shape[0]
    live = min(TILE, raw.shape[0] - r0)
    fw[:] = 0
    values = np.zeros((TILE, QK_K), np.int32)
    for b in range(nb):
        o = b * Q4_K_BYTES
        for j in range(live):
            row = raw[r0 + j]
            fw[b, 0, j] = table[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]
            fw[b, 1, j] = table[np.int64(row[o + 2]) | (np.int64(row[o + 3]) << 8)]
            for s in range(SUBS):
                if s < 4:
                    sc = np.int32(row[o + 4 + s] & 63)
                    m = np.int32(row[o + 8 + s] & 63)
                else:
                    sc = np.int32(row[o + 8 + s] & 15) | (np.int32(row[o + s] >> 6) << 4)
                    m = np.int32(row[o + 8 + s] >> 4) | (np.int32(row[o + 4 + s] >> 6) << 4)
                fw[b, 2 + s, j] = m
                shift = np.int32(4 * (s % 2))
                qs = row[o + 16 + 32 * (s // 2):o + 48 + 32 * (s // 2)]
                for lane in range(32):
                    values[j, 32 * s + lane] = sc * ((np.int32(qs[lane]) >> shift) & np.int32(15))
        emit(values, packed, b)


@amx_jit
def repack_q6_k(raw, r0, table, packed, fw):
    """As :func:`repack_q4_k` for Q6_K rows [R, nb * 210] (``w' = sc_j * (q - 32)``, ``hi`` signed; ``fw``'s d
    only, its minimums zero)."""
    nb = packed.shape[0]
    live = min(TILE, raw.shape[0] - r0)
    fw[:] = 0
    values = np.zeros((TILE, QK_K), np.int32)
    for b in range(nb):
        o = b * Q6_K_BYTES
        for j in range(live):
            row = raw[r0 + j]
            fw[b, 0, j] = table[np.int64(row[o + 208]) | (np.int64(row[o + 209]) << 8)]
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


@intrinsic
def k_scale(typingctx, acc, sums, fw, dx, dx_stride, bs, bs_stride):  # noqa: ARG001 (numba's intrinsic protocol)
    """For the 32 rows ``i`` of a step and its 16 weight rows (lanes): ``sumi = lo + (hi << 8)`` (int32 ``[32,
    16]`` each at ``sums`` and ``sums + 2048``), ``acc = acc + f32(sumi) * (d_w * dx_i)``, then ``summ = sum_s
    m_s * bs[i, s]`` (exact integers in float32) and ``acc = acc - summ * (dmin_w * dx_i)``, every operation
    rounded (no fast-math flags); ``acc`` float32 [32, 16], ``fw`` float32 [10, 16] (d, dmin, minimums),
    ``dx[i]`` at ``dx + i * dx_stride``, ``bs[i, s]`` at ``bs + i * bs_stride + 4 * s`` (addresses, int64)."""
    def codegen(context, builder, signature, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        v16f, v16i = ir.VectorType(f32, TILE), ir.VectorType(i32, TILE)
        acc_p = builder.inttoptr(args[0], v16f.as_pointer())
        sums_p = builder.inttoptr(args[1], v16i.as_pointer())
        fw_p = builder.inttoptr(args[2], v16f.as_pointer())
        fw = [builder.load(builder.gep(fw_p, [I64(r)]), align=4) for r in range(FW_ROWS)]
        zeros, eight = ir.Constant(v16i, [0] * TILE), ir.Constant(v16i, [8] * TILE)

        def broadcast(at):
            value = builder.load(builder.inttoptr(at, f32.as_pointer()), align=4)
            return builder.shuffle_vector(builder.insert_element(ir.Constant(v16f, ir.Undefined), value, i32(0)),
                                          ir.Constant(v16f, ir.Undefined), zeros)

        for i in range(ROWS):
            lo = builder.load(builder.gep(sums_p, [I64(i)]), align=4)
            hi = builder.load(builder.gep(sums_p, [I64(ROWS + i)]), align=4)
            sumi = builder.sitofp(builder.add(lo, builder.shl(hi, eight)), v16f)
            dxi = broadcast(builder.add(args[3], builder.mul(args[4], I64(i))))
            row_bs = builder.add(args[5], builder.mul(args[6], I64(i)))
            lanes = builder.gep(acc_p, [I64(i)])
            total = builder.fadd(builder.load(lanes, align=4), builder.fmul(sumi, builder.fmul(fw[0], dxi)))
            summ = builder.fmul(fw[2], broadcast(row_bs))
            for s in range(1, SUBS):
                summ = builder.fadd(summ, builder.fmul(fw[2 + s], broadcast(builder.add(row_bs, I64(4 * s)))))
            total = builder.fsub(total, builder.fmul(summ, builder.fmul(fw[1], dxi)))
            builder.store(total, lanes, align=4)
        return context.get_dummy_value()
    return types.void(acc, sums, fw, dx, dx_stride, bs, bs_stride), codegen


@intrinsic
def copy16(typingctx, dst, src):  # noqa: ARG001
    """Copy the 16 float32 at byte address ``src`` to ``dst`` (one zmm load and store)."""
    def codegen(context, builder, signature, args):
        v16f = ir.VectorType(ir.FloatType(), TILE).as_pointer()
        builder.store(builder.load(builder.inttoptr(args[1], v16f), align=4), builder.inttoptr(args[0], v16f),
                      align=4)
        return context.get_dummy_value()
    return types.void(dst, src), codegen


@amx_jit
def kquant_amx(repack, raw, q, d, bs, table, cfg, out):
    """``out`` [M, R] = the q8_K product of K-quant rows ``raw`` (``repack`` their type's) and activations ``q``
    int8 [Mp, nb * 256], ``d`` float32 [Mp, nb], ``bs`` float32 [Mp, nb * 8] (sums per 32), Mp a multiple of 32
    with zero rows past ``out``'s."""
    rows, m = raw.shape[0], out.shape[0]
    cols = q.shape[1]
    nb = cols // QK_K
    panels = -(-rows // TILE)
    chunk = max(1, min(panels, CHUNK_BYTES // (nb * PANEL_BYTES)))
    packed = np.empty((chunk, nb, 2, KSTEPS, TILE, TILE), np.int32)
    fw = np.empty((chunk, nb, FW_ROWS, TILE), np.float32)
    acc = np.empty((ROWS, TILE), np.float32)
    ring = np.empty((2, 2 * ROWS, TILE), np.int32)
    qa, ra, aa, da, ba = q.ctypes.data, ring.ctypes.data, acc.ctypes.data, d.ctypes.data, bs.ctypes.data
    oa, ostride = out.ctypes.data, out.strides[0]
    slot = ring.strides[0]
    ldtilecfg(cfg.ctypes.data)
    for p0 in range(0, panels, chunk):
        for p in range(min(chunk, panels - p0)):
            repack(raw, (p0 + p) * TILE, table, packed[p], fw[p])
        for i0 in range(0, q.shape[0], ROWS):
            for p in range(min(chunk, panels - p0)):
                c0 = (p0 + p) * TILE
                pa, fa = packed[p].ctypes.data, fw[p].ctypes.data
                acc[:] = 0
                for b in range(nb + 1):
                    if b < nb:
                        tilezero(4)
                        tilezero(5)
                        tilezero(6)
                        tilezero(7)
                        for ks in range(KSTEPS):
                            a0 = qa + i0 * cols + b * QK_K + ks * 64
                            w0 = pa + (b * 2 * KSTEPS + ks) * 1024
                            tileload(0, a0, cols)
                            tileload(1, a0 + TILE * cols, cols)
                            tileload(2, w0, 64)
                            tileload(3, w0 + KSTEPS * 1024, 64)
                            dpbsud(4, 0, 2)
                            dpbsud(5, 1, 2)
                            dpbssd(6, 0, 3)
                            dpbssd(7, 1, 3)
                        ca = ra + (b % 2) * slot
                        tilestore(4, ca, 64)
                        tilestore(5, ca + 1024, 64)
                        tilestore(6, ca + 2048, 64)
                        tilestore(7, ca + 3072, 64)
                    if b > 0:
                        e = b - 1
                        k_scale(aa, ra + (e % 2) * slot, fa + e * FW_ROWS * TILE * 4, da + (i0 * nb + e) * 4,
                                4 * nb, ba + (i0 * nb * SUBS + e * SUBS) * 4, 4 * nb * SUBS)
                if rows - c0 >= TILE:
                    for i in range(min(ROWS, m - i0)):
                        copy16(oa + (i0 + i) * ostride + c0 * 4, aa + i * TILE * 4)
                else:
                    for i in range(min(ROWS, m - i0)):
                        for j in range(rows - c0):
                            out[i0 + i, c0 + j] = acc[i, j]
    tilerelease()


@amx_jit
def quantize_q8_k_rows(x, q, d, bs):
    """``quants.q8k_act.quantize_q8_k`` of ``x`` [M, nb * 256] into ``q``, ``d`` (the same float32 operations)
    and ``bs`` float32 [M, nb * 8], the sums of ``q`` per 32."""
    for i in range(x.shape[0]):
        for b in range(d.shape[1]):
            xs = x[i, b * QK_K:(b + 1) * QK_K]
            amax, top = np.float32(0), np.float32(0)
            for k in range(QK_K):
                amax = max(amax, abs(xs[k]))
            for k in range(QK_K):  # the first of largest magnitude (llama.cpp keeps the first: strict >)
                if abs(xs[k]) == amax:
                    top = xs[k]
                    break
            iscale = np.float32(-127) / top if amax > 0 else np.float32(0)
            d[i, b] = np.float32(1) / iscale if amax > 0 else np.float32(0)
            for s in range(SUBS):
                total = 0
                for k in range(32 * s, 32 * s + 32):
                    v = min(np.float32(127), np.rint(iscale * xs[k]))
                    q[i, b * QK_K + k] = np.int8(v)
                    total += np.int32(v)
                bs[i, b * SUBS + s] = total


class KActivations(tuple):
    """:func:`q8_k_padded` of a prompt: (q, d, bsums per 32 as float32), for every tile's product."""


def q8_k_padded(x: np.ndarray) -> KActivations:
    """``quants.q8k_act.quantize_q8_k`` of ``x`` [M, K] (compiled: :func:`quantize_q8_k_rows`), padded with zero
    rows to a multiple of 32, with the sums per 32 (pairs of ``bsums``) as float32 [Mp, K / 32]."""
    m, cols = x.shape
    padded = -(-m // ROWS) * ROWS
    q = np.zeros((padded, cols), np.int8)
    d = np.zeros((padded, cols // QK_K), np.float32)
    bs = np.zeros((padded, cols // 32), np.float32)
    quantize_q8_k_rows(np.ascontiguousarray(x, dtype=np.float32), q, d, bs)
    prepared = KActivations((q, d, bs))
    prepared.rows = m
    return prepared


REPACK = {Q4_K_BYTES: repack_q4_k, Q6_K_BYTES: repack_q6_k}


def kquant_amx_product(raw: np.ndarray, xk: KActivations, out: np.ndarray) -> None:
    """``out`` [M, R] = the q8_K product of Q4_K or Q6_K rows ``raw`` [R, nb * type size] (uint8) and
    :func:`q8_k_padded` activations on AMX tiles; :class:`.KernelsError` where not :func:`.amx.amx_available`."""
    if not amx_available():
        raise KernelsError("AMX int8 tiles are not available here (CPU, compiler target or kernel permission)")
    q, d, bs = xk
    size = raw.shape[1] // d.shape[1] if d.shape[1] else 0
    if (size not in REPACK or raw.shape[1] != size * d.shape[1] or q.shape[1] != QK_K * d.shape[1]
            or len(q) % ROWS or len(out) > len(q) or out.shape[1] != len(raw) or out.dtype != np.float32
            or out.strides[1] != 4):
        raise ValueError(f"K-quant AMX product of {raw.shape} stored rows, activations {q.shape}, output {out.shape}")
    kquant_amx(REPACK[size], raw.view(np.uint8), q, d, bs, F16_TABLE, CONFIG, out)


class KQuantAmxPrompts(AmxPrompts):
    """Q4_K and Q6_K prompts through :func:`kquant_amx_product` with q8_K activations (:func:`q8_k_padded`)."""

    prepared_type = KActivations
    quantize = staticmethod(q8_k_padded)
    amx_product = staticmethod(kquant_amx_product)


class Q4_KAmxPromptKernel(KQuantAmxPrompts, Q4_KJitKernel):
    """Q4_K with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


class Q6_KAmxPromptKernel(KQuantAmxPrompts, Q6_KJitKernel):
    """Q6_K with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""
