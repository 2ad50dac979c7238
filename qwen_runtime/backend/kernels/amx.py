"""Prefill products of Q8_0 weights with 8-bit activations on AMX tiles (Intel ``amx_int8``, numba).

``x @ W.T`` for many activation rows: the rows are quantized per 32 values as :func:`.q8_act.quantize_activations`
(llama.cpp's q8_0 activations) and the integer dot product of each weight block with each activation block is
taken by ``tdpbssd`` (a 16 x 16 int32 tile += a 16 x K int8 tile times a K x 16 int8 tile in the VNNI layout).  A
block has its own weight scale ``d_w`` and activation scale ``d_x``, so the tiles multiply one block (K = 32) at a
time: per block, four ``tdpbssd`` (32 activation rows x 32 weight rows) whose int32 tiles are stored to a ring,
and float32 accumulators updated as ``acc = acc + f32(sum) * (d_w * d_x)``, every operation rounded (no fused
add): :func:`.q8_act.product_blockwise`'s operations in its order, so the result equals that reference bit for
bit.  That float step is written as IR (:func:`scale_group`): per group of :data:`GROUP` blocks each zmm
accumulator is loaded once, takes four ``vcvtdq2ps``/``vmulps``/``vmulps``/``vaddps``, and is stored once, while
the tile unit multiplies the next group (software pipelining, :func:`q8_0_amx`).

Blocking: 32-row panels of weights are repacked from their stored blocks into the VNNI layout (``nb`` x 1 KiB
each, scales widened to float32), :data:`CHUNK_BYTES` of them at a time (L2-resident), and every 32-row tile of
the activations (quantized once per product, padded with zeros to whole tiles and groups) passes over each
chunk, its outputs written row by row with zmm copies; nothing of the weights is kept between calls.  The
per-block scales bound what the integer unit can do: each 16 x 16 x 32 tile product (8,192 multiply-adds) leaves
1 KiB of int32 to store and 16 zmm of float work, so this kernel runs at a fraction of ``tdpbssd``'s peak
(measured: docs/performance.md); the K-quant kernels (:mod:`.amx_k`) keep int32 sums over 256 values.

The tile permission is asked of the kernel once per process (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``: without it the first tile instruction is an illegal instruction); :func:`amx_available` is
False where numba's target lacks ``amx-int8``/``amx-tile`` (so nothing here is compiled) or the kernel refuses, and
:func:`q8_0_q8_product` then takes the numpy reference (callers of the prefill keep their float path).
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable
from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core.errors import RequireLiteralValue
from numba.extending import intrinsic

from ...errors import KernelsError
from ...quants.iq4 import IQ4_LEVELS
from ...quants.q8_0 import Q8_0_BYTES
from ...quants.q8_act import Q8_ACT_BLOCK, product_blockwise, q8_0_weights
from ...quants.scratch import Scratch
from . import lanes
from .base import F16_TABLE, FEATURES, I8, I64, Declared
from .q8_0 import Q8_0JitKernel
from .q8_act import quantize_rows

TILE = 16  # rows of an int32 result tile (and columns)
ROWS = 2 * TILE  # activation rows and weight rows of one step (2 x 2 result tiles)
# Activation rows from which a Q8_0AmxKernel product goes through the tiles: with fewer, the padding to 32 rows costs
# more than the exact kernel's row products (measured crossover between 9 and 16 rows: docs/performance.md).
AMX_MIN_ROWS = 16
# Blocks whose int32 results the float step takes together (each accumulator loaded and stored once per group),
# the activation rows it takes after each block's tile products (all 32 over a group), and one block's results.
GROUP = 4
GROUP_ROWS = ROWS // GROUP
SLOT_BYTES = 4 * ROWS * ROWS
# Repacked weights per pass over the activation rows: 32-row panels kept in the core's L2 (2 MiB here) beside the
# activations, each panel reused by every 32-row tile of activations.
CHUNK_BYTES = 1 << 20
PACKED_BLOCK = ROWS * Q8_ACT_BLOCK  # bytes of one block of 32 weight rows in the VNNI layout (two 512-byte tiles)
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18
I8P = I8.as_pointer()


def tile_config() -> np.ndarray:
    """The 64-byte ``ldtilecfg`` block (palette 1): tiles 0-1 activations (16 rows x 32 int8), 2-3 weights in the
    VNNI layout (8 rows x 64 bytes: 16 columns x 4 consecutive k), 4-7 int32 results (16 x 16).  Every tile used
    must be configured (an unconfigured one is an illegal instruction)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:48].view(np.uint16), cfg[48:64]
    colsb[:2], rows[:2] = Q8_ACT_BLOCK, TILE
    colsb[2:4], rows[2:4] = 4 * TILE, Q8_ACT_BLOCK // 4
    colsb[4:8], rows[4:8] = 4 * TILE, TILE
    return cfg


def cpu_has_amx(features: frozenset[str] | None = None) -> bool:
    """Whether numba compiles for a CPU with AMX int8 tiles (``features``: numba's target's, :data:`FEATURES`, by
    default; x86-64 Linux only: the permission is a Linux call)."""
    on_target = {"amx-int8", "amx-tile"} <= (FEATURES if features is None else features)
    return on_target and platform.system() == "Linux" and platform.machine() == "x86_64"


@functools.cache
def tiles_granted() -> bool:
    """Ask the kernel once for the AMX tile-data permission (process-wide); True if it granted it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def amx_available() -> bool:
    """Whether :func:`q8_0_q8_product` multiplies on AMX tiles here (CPU, compiler target and kernel permission)."""
    return cpu_has_amx() and tiles_granted()


def _call(builder: ir.IRBuilder, name: str, argtys: list, args: list) -> None:
    fn = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(ir.VoidType(), argtys), name)
    builder.call(fn, args)


def _tiles(*tiles) -> list[ir.Constant]:
    """Tile numbers are immediates of the instructions: numba must type them as literal ints."""
    if not all(isinstance(t, types.IntegerLiteral) for t in tiles):
        raise RequireLiteralValue("tile numbers must be literal ints")
    return [ir.Constant(I8, t.literal_value) for t in tiles]


@intrinsic
def ldtilecfg(typingctx, address):  # noqa: ARG001 (numba's intrinsic protocol)
    """Load the tile configuration at ``address`` (int64)."""
    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.ldtilecfg", [I8P], [builder.inttoptr(args[0], I8P)])
        return context.get_dummy_value()
    return types.void(address), codegen


@intrinsic
def tilerelease(typingctx):  # noqa: ARG001
    """Return the tiles to their initial state (the thread's tile state stays small across context switches)."""
    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def tileload(typingctx, tile, address, stride):  # noqa: ARG001
    """Load tile ``tile`` (a literal) from ``address``, rows ``stride`` bytes apart (int64 each)."""
    [t] = _tiles(tile)

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tileloadd64", [I8, I8P, I64], [t, builder.inttoptr(args[1], I8P), args[2]])
        return context.get_dummy_value()
    return types.void(tile, address, stride), codegen


@intrinsic
def tilestore(typingctx, tile, address, stride):  # noqa: ARG001
    """Store tile ``tile`` (a literal) to ``address``, rows ``stride`` bytes apart."""
    [t] = _tiles(tile)

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tilestored64", [I8, I8P, I64], [t, builder.inttoptr(args[1], I8P), args[2]])
        return context.get_dummy_value()
    return types.void(tile, address, stride), codegen


@intrinsic
def tilezero(typingctx, tile):  # noqa: ARG001
    [t] = _tiles(tile)

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tilezero", [I8], [t])
        return context.get_dummy_value()
    return types.void(tile), codegen


@intrinsic
def dpbssd(typingctx, dst, a, b):  # noqa: ARG001
    """``tile[dst] += tile[a] @ tile[b]`` in int32, both int8 signed (``b`` in the VNNI layout)."""
    consts = _tiles(dst, a, b)

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tdpbssd", [I8] * 3, consts)
        return context.get_dummy_value()
    return types.void(dst, a, b), codegen


@intrinsic
def dpbsud(typingctx, dst, a, b):  # noqa: ARG001
    """``tile[dst] += tile[a] @ tile[b]`` in int32, ``a`` int8 signed, ``b`` uint8 (in the VNNI layout)."""
    consts = _tiles(dst, a, b)

    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tdpbsud", [I8] * 3, consts)
        return context.get_dummy_value()
    return types.void(dst, a, b), codegen


@intrinsic
def scale_group(typingctx, acc, sums, dw, dx, dx_stride, row0, mw, sx, mins):  # noqa: ARG001 (numba's protocol)
    """For rows ``row0 .. row0 + GROUP_ROWS - 1`` of a 32 x 32 step, both 16-column halves, and the :data:`GROUP`
    blocks ``g`` in order: ``acc[i, j] = acc[i, j] + f32(sums[g, i, j]) * (dw[g, j] * dx[i, g])``, with ``mins``
    (a literal) ``acc[i, j] = acc[i, j] + (f32(sums[g, i, j]) * (dw[g, j] * dx[i, g]) + mw[g, j] * sx[i, g])``,
    every operation rounded (no fast-math flags, so LLVM fuses nothing).  ``acc`` float32 [32, 32] and ``sums``
    int32 [GROUP, 32, 32] at those addresses, ``dw`` and ``mw`` float32 [GROUP, 32] (consecutive blocks' rows),
    ``dx[i, g]`` the float32 at ``dx + i * dx_stride + 4 g``, ``sx[i, g]`` at ``sx + i * dx_stride + 4 g`` (all
    int64).  Written as IR, unrolled: each accumulator is loaded and stored once per group, not once per block
    (the stores shared the cache port with the tile stores), between them GROUP ``vcvtdq2ps``/``vmulps``/``vmulps``
    /``vaddps`` on zmm (two more per block with minimums)."""
    if not isinstance(mins, types.BooleanLiteral):
        raise RequireLiteralValue("mins must be a literal bool")
    with_mins = mins.literal_value

    def codegen(context, builder, signature, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        v16f, v16i = ir.VectorType(f32, TILE), ir.VectorType(i32, TILE)
        acc_p = builder.inttoptr(args[0], v16f.as_pointer())
        sums_p = builder.inttoptr(args[1], v16i.as_pointer())

        def lanes(at):  # the GROUP x 2 rows of 16 float32 of a [GROUP, 32] array at address ``at``
            p = builder.inttoptr(at, v16f.as_pointer())
            return [[builder.load(builder.gep(p, [I64(2 * g + h)]), align=4) for h in range(2)] for g in range(GROUP)]

        def broadcasts(at):  # the GROUP float32 at ``at``, each in all 16 lanes
            zeros = ir.Constant(v16i, [0] * TILE)
            out = []
            for g in range(GROUP):
                value = builder.load(builder.inttoptr(builder.add(at, I64(4 * g)), f32.as_pointer()), align=4)
                out.append(builder.shuffle_vector(builder.insert_element(ir.Constant(v16f, ir.Undefined), value,
                                                                        i32(0)), ir.Constant(v16f, ir.Undefined),
                                                  zeros))
            return out

        dw = lanes(args[2])
        mw = lanes(args[6]) if with_mins else None
        for r in range(GROUP_ROWS):
            i = builder.add(args[5], I64(r))
            dx16 = broadcasts(builder.add(args[3], builder.mul(args[4], i)))
            sx16 = broadcasts(builder.add(args[7], builder.mul(args[4], i))) if with_mins else None
            for h in range(2):
                k = builder.add(builder.mul(i, I64(2)), I64(h))
                at_acc = builder.gep(acc_p, [k])
                total = builder.load(at_acc, align=4)
                for g in range(GROUP):
                    at = builder.gep(sums_p, [builder.add(k, I64(SLOT_BYTES // 64 * g))])
                    term = builder.fmul(builder.sitofp(builder.load(at, align=4), v16f),
                                        builder.fmul(dw[g][h], dx16[g]))
                    if with_mins:
                        term = builder.fadd(term, builder.fmul(mw[g][h], sx16[g]))
                    total = builder.fadd(total, term)
                builder.store(total, at_acc, align=4)
        return context.get_dummy_value()
    return types.void(acc, sums, dw, dx, dx_stride, row0, mw, sx, mins), codegen


@intrinsic
def copy_row(typingctx, dst, src):  # noqa: ARG001
    """Copy the 32 float32 at byte address ``src`` to ``dst`` (int64 each) as two zmm loads and stores: numba's
    loop over a strided ``out`` stored them one by one (the copy out of the accumulators was a third of a
    product)."""
    def codegen(context, builder, signature, args):
        v16f = ir.VectorType(ir.FloatType(), TILE).as_pointer()
        src, dst = builder.inttoptr(args[1], v16f), builder.inttoptr(args[0], v16f)
        for h in range(2):
            builder.store(builder.load(builder.gep(src, [I64(h)]), align=4), builder.gep(dst, [I64(h)]), align=4)
        return context.get_dummy_value()
    return types.void(dst, src), codegen


amx_jit = numba.njit(nogil=True, cache=True)  # compiled on first use only (where amx_available())


@intrinsic
def load_u32(typingctx, address):  # noqa: ARG001
    """The 4 bytes at byte address ``address`` (int64), any alignment, as an unsigned value in an int64."""
    def codegen(context, builder, signature, args):
        word = builder.load(builder.inttoptr(args[0], ir.IntType(32).as_pointer()), align=1)
        return builder.zext(word, I64)
    return types.int64(address), codegen


class BlockGeometry(NamedTuple):
    """Where a type of 32-value blocks keeps its parts (byte offsets in a block; -1: absent), for
    :func:`repack_blocks`: ``size`` bytes per block, float16 ``d`` at 0 and ``m`` at ``m_at``, the values at
    ``qs_at`` as :data:`BYTES` (int8, Q8_0) or nibbles (value ``j`` < 16 the low nibble of byte ``j``, else the
    high nibble of byte ``j - 16``) with bit 4 from bit ``j`` of the 32-bit ``qh`` at ``qh_at``, minus ``bias``
    (:data:`NIBBLES`) or looked up in the IQ4_NL levels (:data:`LEVELS`)."""

    size: int
    qs_at: int
    qh_at: int
    bias: int
    m_at: int
    kind: int


BYTES, NIBBLES, LEVELS = range(3)  # how a block stores its 32 integers (BlockGeometry.kind)
Q8_0_GEOMETRY = BlockGeometry(Q8_0_BYTES, 2, -1, 0, -1, BYTES)


@amx_jit
def repack_blocks(raw, c0, geometry, table, levels, packed, dw, mw):
    """Weight rows ``c0 .. c0 + 31`` of 32-value blocks ``raw`` [R, nb * size] (:class:`BlockGeometry`) into
    ``packed`` int32 [nb, 2, 8, 16] (per block two 8 x 64-byte VNNI tiles: int32 ``[b, h, kk, j]`` is the 4 int8
    values ``4 kk .. 4 kk + 3`` of row ``c0 + 16 h + j``), their scales into ``dw`` [nb, 32] and minimums into
    ``mw`` [nb, 32]; rows past the matrix and blocks past ``raw``'s (the padding to whole groups) as zeros.  Whole
    4-byte groups, not bytes (a byte-by-byte copy was a large share of a product's time): nibbles by masks and
    shifts, ``qh``'s 4 bits spread to bit 4 of each byte by one multiplication, ``- bias`` in each byte as ``(v +
    128 - bias) ^ 128`` (no carries: v + 128 - bias < 256), IQ4_NL's levels by 4 lookups of ``levels`` (int8
    [16])."""
    size, qs_at, qh_at, bias, m_at, kind = geometry
    row_bytes = raw.shape[1]
    live = min(ROWS, raw.shape[0] - c0)
    base = raw.ctypes.data + c0 * row_bytes
    stored = row_bytes // size
    packed[stored:] = 0
    dw[stored:] = 0
    mw[:] = 0
    offset = np.int64(128 - bias) * np.int64(0x01010101)
    for b in range(stored):
        o = b * size
        for j in range(live):
            dw[b, j] = table[np.int64(raw[c0 + j, o]) | (np.int64(raw[c0 + j, o + 1]) << 8)]
            if m_at >= 0:
                mw[b, j] = table[np.int64(raw[c0 + j, o + m_at]) | (np.int64(raw[c0 + j, o + m_at + 1]) << 8)]
        for j in range(live, ROWS):
            dw[b, j] = 0
        for h in range(2):
            for kk in range(Q8_ACT_BLOCK // 4):
                for j in range(TILE):
                    r = h * TILE + j
                    at = base + r * row_bytes + o
                    if r >= live:
                        v = np.int64(0)
                    elif kind == BYTES:
                        v = load_u32(at + qs_at + 4 * kk)
                    else:
                        v = (load_u32(at + qs_at + 4 * (kk % 4)) >> (4 * (kk // 4))) & 0x0F0F0F0F
                        if qh_at >= 0:
                            bits = (load_u32(at + qh_at) >> (4 * kk)) & 15
                            v |= ((bits * 0x00204081) & 0x01010101) << 4
                        if kind == LEVELS:
                            v = ((np.int64(np.uint8(levels[v & 15])) | (np.int64(np.uint8(levels[(v >> 8) & 15])) << 8))
                                 | (np.int64(np.uint8(levels[(v >> 16) & 15])) << 16)
                                 | (np.int64(np.uint8(levels[(v >> 24) & 15])) << 24))
                        else:
                            v = ((v + offset) & 0xFFFFFFFF) ^ 0x80808080
                    packed[b, h, kk, j] = np.int32(np.uint32(v))


@amx_jit
def block_amx(raw, geometry, q, d, s, table, levels, cfg, out):
    """``out[i, r] = sum_b f32(q[i, b] . w[r, b]) * (d_w[r, b] * d[i, b])`` (with minimums ``m_w``: ``+ (... +
    m_w[r, b] * s[i, b])``) over the blocks in order, for rows ``raw`` [R, nb * size] of 32-value blocks
    (:class:`BlockGeometry` ``geometry``) and quantized activations ``q`` [Mp, nbp * 32] int8, ``d`` and ``s``
    [Mp, nbp] (:func:`quantized_padded`: Mp a multiple of 32, nbp of :data:`GROUP`, zeros past ``x``); ``out``
    [M, R] (any leading stride).  The padding blocks add ``f32(0) * 0`` (and ``0 * 0``) to an accumulator that is
    never -0, so nothing.

    Software-pipelined by groups of :data:`GROUP` blocks: while the tile unit multiplies group ``g`` (its int32
    results stored to one half of a ring), the float step (:func:`scale_group`) takes group ``g - 1`` from the
    other half, :data:`GROUP_ROWS` rows after each block's tile products, so the two units work side by side and
    the vector loads never wait on a tile store that has not yet reached the cache."""
    rows, m = raw.shape[0], out.shape[0]
    cols = q.shape[1]
    nb = cols // Q8_ACT_BLOCK
    groups = nb // GROUP
    mins = geometry.m_at >= 0
    panels = -(-rows // ROWS)
    chunk = max(1, min(panels, CHUNK_BYTES // (nb * PACKED_BLOCK)))
    packed = np.empty((chunk, nb, 2, Q8_ACT_BLOCK // 4, TILE), np.int32)
    dw = np.empty((chunk, nb, ROWS), np.float32)
    mw = np.empty((chunk, nb, ROWS), np.float32)
    acc = np.empty((ROWS, ROWS), np.float32)
    ring = np.empty(2 * GROUP * SLOT_BYTES // 4, np.int32)
    qa, ra, aa, da, sa = q.ctypes.data, ring.ctypes.data, acc.ctypes.data, d.ctypes.data, s.ctypes.data
    oa, ostride = out.ctypes.data, out.strides[0]
    ldtilecfg(cfg.ctypes.data)
    for p0 in range(0, panels, chunk):
        for p in range(min(chunk, panels - p0)):
            repack_blocks(raw, (p0 + p) * ROWS, geometry, table, levels, packed[p], dw[p], mw[p])
        for i0 in range(0, q.shape[0], ROWS):
            for p in range(min(chunk, panels - p0)):
                c0 = (p0 + p) * ROWS
                pa, dwa, mwa = packed[p].ctypes.data, dw[p].ctypes.data, mw[p].ctypes.data
                acc[:] = 0
                for g in range(groups + 1):
                    for t in range(GROUP):
                        if g < groups:
                            b = g * GROUP + t
                            a0 = qa + i0 * cols + b * Q8_ACT_BLOCK
                            ca = ra + ((g % 2) * GROUP + t) * SLOT_BYTES
                            tileload(0, a0, cols)
                            tileload(1, a0 + TILE * cols, cols)
                            tileload(2, pa + b * PACKED_BLOCK, 64)
                            tileload(3, pa + b * PACKED_BLOCK + PACKED_BLOCK // 2, 64)
                            tilezero(4)
                            tilezero(5)
                            tilezero(6)
                            tilezero(7)
                            dpbssd(4, 0, 2)
                            dpbssd(5, 0, 3)
                            dpbssd(6, 1, 2)
                            dpbssd(7, 1, 3)
                            tilestore(4, ca, 4 * ROWS)
                            tilestore(5, ca + 4 * TILE, 4 * ROWS)
                            tilestore(6, ca + 4 * ROWS * TILE, 4 * ROWS)
                            tilestore(7, ca + 4 * ROWS * TILE + 4 * TILE, 4 * ROWS)
                        if g > 0:
                            e = (g - 1) * GROUP
                            sums, row0 = ra + ((g - 1) % 2) * GROUP * SLOT_BYTES, t * GROUP_ROWS
                            at_x = (i0 * nb + e) * 4
                            if mins:
                                scale_group(aa, sums, dwa + e * 4 * ROWS, da + at_x, 4 * nb, row0,
                                            mwa + e * 4 * ROWS, sa + at_x, True)
                            else:
                                scale_group(aa, sums, dwa + e * 4 * ROWS, da + at_x, 4 * nb, row0,
                                            mwa, sa, False)
                if rows - c0 >= ROWS:
                    for i in range(min(ROWS, m - i0)):
                        copy_row(oa + (i0 + i) * ostride + c0 * 4, aa + i * ROWS * 4)
                else:
                    for i in range(min(ROWS, m - i0)):
                        for j in range(rows - c0):
                            out[i0 + i, c0 + j] = acc[i, j]
    tilerelease()


def quantized_padded(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`.q8_act.quantize_rows` of ``x`` [M, K] into int8 [Mp, Kp] and float32 [Mp, Kp / 32], ``Mp`` the
    next multiple of 32 and ``Kp`` of ``32 GROUP``, zeros past ``x`` (rows that multiply to zeros that are not
    written, blocks that add nothing)."""
    m, cols = x.shape
    padded = -(-m // ROWS) * ROWS
    blocks = -(-cols // (GROUP * Q8_ACT_BLOCK)) * GROUP
    q = np.zeros((padded, blocks * Q8_ACT_BLOCK), np.int8)
    d = np.zeros((padded, blocks), np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if blocks * Q8_ACT_BLOCK == cols:
        quantize_rows(x, q[:m], d[:m])
    else:
        q[:m, :cols], d[:m, :cols // Q8_ACT_BLOCK] = quantize_activations_rows(x)
    return q, d


def quantize_activations_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`.q8_act.quantize_rows` of ``x`` [M, K] into new arrays."""
    q = np.empty(x.shape, np.int8)
    d = np.empty((len(x), x.shape[1] // Q8_ACT_BLOCK), np.float32)
    quantize_rows(x, q, d)
    return q, d


@functools.cache
def _config() -> np.ndarray:
    return tile_config()


def blocks_amx_product(geometry: BlockGeometry, raw: np.ndarray, q: np.ndarray, d: np.ndarray, s: np.ndarray,
                       out: np.ndarray) -> None:
    """``out`` [M, R] = the 8-bit-activation product of rows ``raw`` [R, nb * size] of 32-value blocks
    (``geometry``) and :func:`quantized_padded` activations (``s``: their :func:`scaled_sums` for the types with
    minimums, else any array of ``d``'s shape), on AMX tiles; :class:`.KernelsError` where not
    :func:`amx_available` (the tile instructions would stop the process: illegal instruction)."""
    if not amx_available():
        raise KernelsError("AMX int8 tiles are not available here (CPU, compiler target or kernel permission)")
    nb = -(-raw.shape[1] // (GROUP * geometry.size)) * GROUP
    if (raw.shape[1] % geometry.size or q.shape != (len(q), nb * Q8_ACT_BLOCK) or len(q) % ROWS or len(out) > len(q)
            or out.shape[1] != len(raw) or out.dtype != np.float32 or out.strides[1] != 4
            or d.shape != (len(q), nb) or d.dtype != np.float32 or s.shape != d.shape or s.dtype != np.float32
            or not (q.flags.c_contiguous and d.flags.c_contiguous and s.flags.c_contiguous)):
        raise ValueError(f"AMX product of {raw.shape} stored rows, activations {q.shape}, output {out.shape}")
    block_amx(raw.view(np.uint8), geometry, q, d, s, F16_TABLE, IQ4_LEVELS, _config(), out)


def q8_0_amx_product(raw: np.ndarray, q: np.ndarray, d: np.ndarray, out: np.ndarray) -> None:
    """:func:`blocks_amx_product` of Q8_0 rows ``raw`` [R, nb * 34] (uint8 or int8)."""
    blocks_amx_product(Q8_0_GEOMETRY, raw, q, d, d, out)


@amx_jit
def scaled_sums(q, d, s):
    """``s[i, b] = d[i, b] * f32(sum(q[i, 32 b .. 32 b + 31]))``: :func:`.q8_act.activation_sums` (llama.cpp's
    q8_1 ``s``) of ``q`` int8 [M, nb * 32], ``d`` float32 [M, nb] into ``s`` [M, nb]."""
    for i in range(q.shape[0]):
        row = q[i]
        for b in range(d.shape[1]):
            total = np.int32(0)
            for k in range(Q8_ACT_BLOCK):
                total += np.int32(row[b * Q8_ACT_BLOCK + k])
            s[i, b] = d[i, b] * np.float32(total)


def q8_0_q8_product(raw: np.ndarray, x: np.ndarray, out: np.ndarray) -> str:
    """``out`` [M, R] = ``x`` [M, nb * 32] times Q8_0 rows ``raw`` [R, nb * 34] with 8-bit activations
    (:func:`.q8_act.product_blockwise`'s numbers): on AMX tiles where :func:`amx_available`, else by that numpy
    reference.  Returns which ran: ``"amx"`` or ``"reference"``."""
    q, d = quantized_padded(x)
    if amx_available():
        q8_0_amx_product(raw, q, d, out)
        return "amx"
    w, scales = q8_0_weights(raw)
    out[...] = product_blockwise(w, scales, q[:len(x), :w.shape[1]], d[:len(x), :scales.shape[1]])
    return "reference"


class AmxActivations(tuple):
    """:func:`quantized_padded` activations of a prompt (q, d, and for the types with minimums their
    :func:`scaled_sums`) and its row count, for every tile's product."""


def q8_0_padded(x: np.ndarray) -> AmxActivations:
    """:func:`quantized_padded` of ``x`` [M, K] as the prepared activations of :class:`Q8_0AmxPrompts`."""
    prepared = AmxActivations(quantized_padded(x))
    prepared.rows = len(x)
    return prepared


class AmxPrompts:
    """Prompts on AMX tiles: a product of :data:`AMX_MIN_ROWS` rows or more (not ``rowwise``) quantizes its
    activations once (:meth:`prepare`, by ``quantize``) and multiplies each tile of weight rows by ``amx_product``
    where :func:`amx_available`.  Where AMX is not, a product of more than ``direct_rows`` rows goes through the
    integer lanes of :mod:`.lanes` for the types and CPUs it takes (``lane_quantize`` not None; ``lane_product``).
    Fewer rows, ``rowwise`` products (the decode step, speculative verification, the server's batch invariance)
    and the other CPUs take the kernel this mixin precedes: the exact float kernel (``activations="q8-prompts"``)
    or the integer-dot one (``activations="q8"``)."""

    prepared_type: type = tuple  # what ``quantize`` returns (a tuple subclass with ``rows``)
    quantize: Callable[[np.ndarray], tuple]
    amx_product: Callable[[np.ndarray, tuple, np.ndarray], None]

    def lane_quantize(self, x: np.ndarray) -> lanes.LaneActivations | None:
        """``x`` as :meth:`lane_product` reads it, or None where the lanes do not take this type here."""
        return None

    def lane_product(self, raw: np.ndarray, xk: lanes.LaneActivations, out: np.ndarray) -> None:
        raise NotImplementedError

    def lane_kernel(self) -> Declared | None:
        """The lanes' compiled prompt product :meth:`lane_product` calls on this CPU (None: the lanes do not take
        this type here)."""
        return None

    def compiled_functions(self) -> list:
        """The kernel's own compiled functions and the lanes' prompt product where prompts go there."""
        lane = self.lane_kernel()
        return [*super().compiled_functions(), *([] if lane is None else [lane])]

    def prepare(self, x: np.ndarray, rowwise: bool = False) -> tuple:
        amx = amx_available()
        if rowwise or len(x) < AMX_MIN_ROWS or (not amx and len(x) <= self.direct_rows):
            return super().prepare(x, rowwise)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"activations of shape {x.shape} for a matrix of {self.in_features} columns")
        x = np.ascontiguousarray(x, dtype=np.float32)
        if amx:
            return self.quantize(x)
        prepared = self.lane_quantize(x)
        return super().prepare(x, rowwise) if prepared is None else prepared

    @property
    def segments_exact(self) -> bool:
        """Prompts on AMX tiles are not the tile-and-BLAS products :meth:`product_segments` splits; through the
        lanes each row's numbers do not depend on the other rows, so any split is exact."""
        return not amx_available() and super().segments_exact

    def product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        if not isinstance(xk, (self.prepared_type, lanes.LaneActivations)):
            super().product(r0, r1, xk, out, scratch)
            return
        if out.shape != (xk.rows, r1 - r0) or out.dtype != np.float32:
            raise ValueError(f"output of shape {out.shape} for {xk.rows} rows and {r1 - r0} columns")
        if isinstance(xk, lanes.LaneActivations):
            self.lane_product(self.raw[r0:r1], xk, out)
        else:
            self.amx_product(self.raw[r0:r1], xk, out)

    def product_segments(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch,
                         lengths: tuple[int, ...]) -> None:
        if isinstance(xk, lanes.LaneActivations):  # one product: each row's numbers are its own
            self.product(r0, r1, xk, out, scratch)
        else:
            super().product_segments(r0, r1, xk, out, scratch, lengths)


class Q8_0AmxPrompts(AmxPrompts):
    """Q8_0 prompts through :func:`q8_0_amx_product` or the lanes' :func:`.lanes.q8_0_lanes_product` (both the
    numbers of :func:`.q8_act.product_blockwise`)."""

    prepared_type = AmxActivations
    quantize = staticmethod(q8_0_padded)
    amx_product = staticmethod(lambda raw, xk, out: q8_0_amx_product(raw, xk[0], xk[1], out))

    def lane_quantize(self, x: np.ndarray) -> lanes.LaneActivations | None:
        if self.lane_kernel() is None:
            return None
        q, d = quantized_padded(x)
        return lanes.q8_0_lane_activations(q, d, len(x), self.in_features)

    def lane_product(self, raw: np.ndarray, xk: lanes.LaneActivations, out: np.ndarray) -> None:
        lanes.q8_0_lanes_product(raw, xk, out)

    def lane_kernel(self) -> Declared | None:
        return lanes.prompt_kernel(Q8_0_BYTES)


class Q8_0AmxPromptKernel(Q8_0AmxPrompts, Q8_0JitKernel):
    """Q8_0 with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


# This family's AMX prompt kernels (:func:`.kernel_table`).
KERNELS = (Q8_0AmxPromptKernel,)
