"""Prompts of Q8_0, Q4_0, Q5_0, Q4_K, Q6_K and IQ4_XS weights on AVX2's integer lanes (numba): a register-blocked
GEMM with 8-bit activations, the numbers of the references the AMX kernels are held to bit for bit
(``quants.q8_act.product_blockwise`` with q8_0 activations for the 32-value blocks, ``quants.q8k_act.product`` with
q8_K for the K-quants and IQ4_XS).

Why its own layout.  The row kernels (:mod:`.int8`, :mod:`.int8_k`) put 32 values of one weight row in a vector,
so each (activation row, weight row) pair ends a block with 8 int32 lanes to add across; at several activation
rows those horizontal sums and their float steps cost about as much as the products.  Here a vector holds **8
weight rows x a few consecutive values** (a *panel*, repacked from the blocks per call) and the activation row's
values are broadcast to all 8: each weight row keeps its own int32 lane, and no lanes are ever added across.

* Unsigned values (Q4_K's and Q4_0's nibbles, Q5_0's 5 bits, Q6_K's 6-bit ``q``): 4 values per row, the
  activations' 4 int8 broadcast (``vpbroadcastd``); one ``pmaddubsw`` against the signed activations (each pair
  at most ``2 * 63 * 127``, no saturation), then ``pmaddwd`` by the sub-block's scales (lanes ``2i, 2i + 1`` hold
  row ``i``'s; ones for the 32-value blocks, whose bias ``q - 8`` / ``q - 16`` leaves through the activations' sums).
* Signed values (Q8_0's int8, IQ4_XS's levels times their sub-block scale, at most 4064), which ``pmaddubsw``
  cannot take unsigned without a sign step per pair: the panel holds 2 values per row as int16, the activations
  (int8 values) widened too, one ``pmaddwd`` per 2 values.

A tile is :data:`ROWS` activation rows x :data:`GROUPS` panels (16 weight rows), 8 int32 accumulators carried
in registers by an explicit loop (:func:`_tile_loops`: unrolled code let LLVM interleave the steps and spill),
the weight vectors loaded once per step for all the activation rows.

Per block (Q8_0's 32 values, a K-quant's super-block of 256) the tile takes the reference's float step on 8
pairs at a time: ``acc = acc + f32(sumi) * (d_w * d_x)`` and, with minimums (Q4_K), ``acc = acc - f32(summ) *
(dmin_w * d_x)``, each operation rounded as the reference rounds it (no contraction).  ``summ = sum_j m_j
bsum_j`` is a sum of integers below 2^24, so exact in float32 in any order.  Q6_K's weights are ``q - 32``:
``sumi = sum_j sc_j (q_j . x_j) - 32 sum_j sc_j bsum_j`` (the second sum from the activations' sums per 16, two
sub-blocks per ``pmaddwd``), exact in int32.  A row's numbers do not depend on the other rows of the product.

Weights: each call repacks :data:`PANELS` panels at a time from the memory-mapped blocks into per-thread
buffers (16 rows of values plus their scales) that every tile of activation rows then reads; nothing is kept
between calls.  Compiled where the CPU has AVX2 (:data:`AVAILABLE`), taken where it has no AVX-512
(:func:`takes`), whose SGEMM on float tiles has twice AVX2's rate.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import RequireLiteralValue
from numba.extending import intrinsic

from ...errors import KernelsError
from ...quants.iq4 import IQ4_LEVELS, IQ4_XS
from ...quants.kquants import Q4_K, Q6_K
from ...quants.legacy import Q4_0, Q5_0
from ...quants.q8_0 import Q8_0_BYTES
from ...quants.q8_act import Q8_ACT_BLOCK
from ...quants.q8k_act import BSUM, QK_K
from .base import (
    F16_TABLE,
    F32_1D,
    F32_2D,
    F32_2D_C,
    FEATURES,
    I8_2D_W,
    I16_2D_W,
    I32,
    I32_2D_W,
    I64,
    MADDUBS,
    U8_2D,
    V8_F32,
    V8_I32,
    V16_I16,
    V32_I8,
    Declared,
    compiled,
    f16_at,
    splat,
    stack_f32,
)
from .lattice import load_le

AVAILABLE = "avx2" in FEATURES
PANEL = 8  # weight rows in one vector (4 values each)
QUAD = 4  # values of one row in one vector
ROWS = 4  # activation rows of a tile
GROUPS = 2  # panels of a tile
PANELS = 2  # panels repacked per pass over the activation rows
TILE_FLOATS = ROWS * GROUPS * PANEL  # one tile's results (a stack buffer)
Q4_K_SUB, Q6_K_SUB = 32, 16  # values per sub-block scale
Q6_BIAS_SHIFT = 5  # Q6_K's q - 32: 32 = 1 << 5
Q4_K_BYTES, Q6_K_BYTES = Q4_K().type_size, Q6_K().type_size
Q4_0_BYTES, Q5_0_BYTES = Q4_0().type_size, Q5_0().type_size
IQ4_XS_BYTES = IQ4_XS().type_size
Q4_K_KIND, Q6_K_KIND = 4, 6


def _data(context, builder: ir.IRBuilder, array_type: types.Array, array: ir.Value) -> ir.Value:
    return context.make_array(array_type)(context, builder, array).data


def _load(builder: ir.IRBuilder, base: ir.Value, at: ir.Value, vector: ir.Type, align: int) -> ir.Value:
    """``vector`` at element ``at`` of the pointer ``base``."""
    return builder.load(builder.bitcast(builder.gep(base, [at]), vector.as_pointer()), align=align)


def _x86(builder: ir.IRBuilder, name: str, result: ir.Type, argument: ir.Type) -> ir.Function:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, [argument] * 2), name)


def _loop_head(builder: ir.IRBuilder, head: ir.Block, pairs: list, zero: ir.Constant) -> tuple[ir.Value, dict]:
    """Branch from the current block to the loop block ``head`` and open it: a counter from 0 and a value per
    pair from ``zero`` (phis whose other incoming values the caller adds)."""
    entry = builder.block
    builder.branch(head)
    builder.position_at_end(head)
    counter = builder.phi(I64)
    counter.add_incoming(I64(0), entry)
    values = {p: builder.phi(zero.type) for p in pairs}
    for v in values.values():
        v.add_incoming(zero, entry)
    return counter, values


def _tile_loops(builder: ir.IRBuilder, blocks: ir.Value, steps: int, step, finish, out: ir.Value) -> None:
    """The loops of a tile: per block (``blocks`` of them) ``steps`` calls of ``step(block, i, sums)``, each
    returning the (row, panel) pairs' next int32 sums, carried in phis (a loop, not unrolled code, so the 8
    accumulators stay in registers), then ``finish(block, sums, acc)``, the pairs' next float32 values; the last
    stored to ``out`` (pair (r, g) at ``(r * GROUPS + g) * PANEL``)."""
    pairs = [(r, g) for r in range(ROWS) for g in range(GROUPS)]
    block_head = builder.append_basic_block("block")
    step_loop = builder.append_basic_block("steps")
    float_step = builder.append_basic_block("float_step")
    done = builder.append_basic_block("done")
    b, acc = _loop_head(builder, block_head, pairs, ir.Constant(V8_F32, [0.0] * 8))
    i, sums = _loop_head(builder, step_loop, pairs, ir.Constant(V8_I32, [0] * 8))
    new = step(b, i, sums)
    following = builder.add(i, I64(1))
    i.add_incoming(following, step_loop)
    for p, v in sums.items():
        v.add_incoming(new[p], step_loop)
    builder.cbranch(builder.icmp_signed("<", following, I64(steps)), step_loop, float_step)

    builder.position_at_end(float_step)
    stepped = finish(b, new, acc)
    after = builder.add(b, I64(1))
    b.add_incoming(after, float_step)
    for p, a in acc.items():
        a.add_incoming(stepped[p], float_step)
    builder.cbranch(builder.icmp_signed("<", after, blocks), block_head, done)

    builder.position_at_end(done)
    for (r, g), v in stepped.items():
        builder.store(v, builder.bitcast(builder.gep(out, [I64((r * GROUPS + g) * PANEL)]), V8_F32.as_pointer()),
                      align=4)


@intrinsic
def k_tile(typingctx, kind, w, s, extra, dw, dm, g0, xq, xd, xsums, x0, nb, out):  # noqa: ARG001
    """``out[(r * GROUPS + g) * 8 + i]`` = the q8_K product of activation row ``x0 + r`` (``r < ROWS``) and row
    ``i`` of panel ``g0 + g`` over all ``nb`` super-blocks (a stack pointer of ``ROWS * GROUPS * 8`` floats).

    Panels (:func:`repack_q4_k`, :func:`repack_q6_k`; flat per panel): ``w`` [K / 4][8][4] uint8 values, ``s``
    [subs][16] int16 scales, ``dw`` (and Q4_K's ``dm``) [nb][8] float32; ``extra`` Q4_K's minimums [nb * 8][8]
    float32, Q6_K's scale pairs [nb * 8][16] int16.  Activations: ``xq`` [M, K] int8, ``xd`` [M, nb], ``xsums``
    Q4_K's float32 sums per 32 [M, nb * 8], Q6_K's int16 sums per 16 [M, nb * 16].  ``kind`` a literal
    (:data:`Q4_K_KIND`, :data:`Q6_K_KIND`)."""
    if not isinstance(kind, types.IntegerLiteral):
        raise RequireLiteralValue("the kind of k_tile must be a literal int")
    q4 = kind.literal_value == Q4_K_KIND
    shift = 3 if q4 else 2  # log2 of the value quads per sub-block

    def codegen(context, builder, signature, args):
        ty = signature.args
        _, w_, s_, extra_, dw_, dm_, g0_, xq_, xd_, xsums_, x0_, nb_, out_ = args
        pmaddubsw = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", V16_I16, V32_I8)
        pmaddwd = _x86(builder, "llvm.x86.avx2.pmadd.wd", V8_I32, V16_I16)
        cols = builder.mul(nb_, I64(QK_K))
        subs = builder.mul(nb_, I64(QK_K // (Q4_K_SUB if q4 else Q6_K_SUB)))
        panels = [builder.add(g0_, I64(g)) for g in range(GROUPS)]
        rows = [builder.add(x0_, I64(r)) for r in range(ROWS)]

        def panel(index, array, per):  # panel g's start in a flat [panels, per] array
            return [builder.gep(_data(context, builder, ty[index], array), [builder.mul(g, per)]) for g in panels]

        w_at = panel(1, w_, builder.mul(cols, I64(PANEL)))
        s_at = panel(2, s_, builder.mul(subs, I64(2 * PANEL)))
        extra_at = panel(3, extra_, builder.mul(nb_, I64(8 * (PANEL if q4 else 2 * PANEL))))
        dw_at = panel(4, dw_, builder.mul(nb_, I64(PANEL)))
        dm_at = panel(5, dm_, builder.mul(nb_, I64(PANEL)))
        x_cols = cgutils.unpack_tuple(builder, context.make_array(ty[7])(context, builder, xq_).shape)[1]
        sums_cols = cgutils.unpack_tuple(builder, context.make_array(ty[9])(context, builder, xsums_).shape)[1]
        x_at = [builder.gep(_data(context, builder, ty[7], xq_), [builder.mul(x, x_cols)]) for x in rows]
        sums_at = [builder.gep(_data(context, builder, ty[9], xsums_), [builder.mul(x, sums_cols)]) for x in rows]
        xd_data = _data(context, builder, ty[8], xd_)

        def step(b, quad, sums):  # 4 values of every pair: int32 sums
            k = builder.add(builder.mul(b, I64(QK_K)), builder.mul(quad, I64(QUAD)))  # first value of the quad
            sub = builder.lshr(builder.add(builder.mul(b, I64(QK_K // QUAD)), quad), I64(shift))
            scales = [_load(builder, s_at[g], builder.mul(sub, I64(2 * PANEL)), V16_I16, 2) for g in range(GROUPS)]
            weights = [_load(builder, w_at[g], builder.mul(k, I64(PANEL)), V32_I8, 1) for g in range(GROUPS)]
            new = {}
            for r in range(ROWS):
                x = builder.bitcast(splat(builder, _load(builder, x_at[r], k, I32, 1), V8_I32), V32_I8)
                for g in range(GROUPS):
                    products = builder.call(pmaddwd, [builder.call(pmaddubsw, [weights[g], x]), scales[g]])
                    new[r, g] = builder.add(sums[r, g], products)
            return new

        def finish(b, sums, acc):
            return _float_step(builder, q4, pmaddwd, sums, acc, b, nb_, rows, xd_data, sums_at, extra_at, dw_at,
                               dm_at)

        _tile_loops(builder, nb_, QK_K // QUAD, step, finish, out_)
        return context.get_dummy_value()

    return types.void(kind, w, s, extra, dw, dm, g0, xq, xd, xsums, x0, nb, out), codegen


def _block_operands(context, builder: ir.IRBuilder, ty: tuple, args: list, w: int, x0: ir.Value,
                    nb: ir.Value, block: int = Q8_ACT_BLOCK) -> tuple[list, list, list, list]:
    """A block type's tile operands (``block`` values a scale) from the intrinsic's arguments ``w, dw, g0, x`` at
    ``args[w:w + 4]``
    and the first activation row ``x0``: the activation rows, and pointers to each panel's values (``K * 8`` elements a
    panel, whatever their type) and scales, and to each row's activations."""
    w_, dw_, g0_, x_ = args[w:w + 4]
    cols = builder.mul(nb, I64(block))
    panels = [builder.add(g0_, I64(g)) for g in range(GROUPS)]
    rows = [builder.add(x0, I64(r)) for r in range(ROWS)]
    w_data, dw_data = _data(context, builder, ty[w], w_), _data(context, builder, ty[w + 1], dw_)
    w_at = [builder.gep(w_data, [builder.mul(g, builder.mul(cols, I64(PANEL)))]) for g in panels]
    dw_at = [builder.gep(dw_data, [builder.mul(g, builder.mul(nb, I64(PANEL)))]) for g in panels]
    x_cols = cgutils.unpack_tuple(builder, context.make_array(ty[w + 3])(context, builder, x_).shape)[1]
    x_at = [builder.gep(_data(context, builder, ty[w + 3], x_), [builder.mul(row, x_cols)]) for row in rows]
    return rows, w_at, dw_at, x_at


def _dx(builder: ir.IRBuilder, xd: ir.Value, row: ir.Value, nb: ir.Value, b: ir.Value) -> ir.Value:
    """Activation row ``row``'s scale of block ``b`` (``xd`` [M, nb] float32), in all 8 lanes."""
    return splat(builder, builder.load(builder.gep(xd, [builder.add(builder.mul(row, nb), b)])), V8_F32)


def _block_step(builder: ir.IRBuilder, sums: dict, acc: dict, b: ir.Value, nb: ir.Value, rows: list, xd: ir.Value,
                dw_at: list) -> dict:
    """Block ``b``'s float step of every pair: ``acc + f32(sumi) * (d_w * d_x)``, each operation rounded (no
    contraction; ``sums``: each pair's exact int32 ``sumi``)."""
    dw = [_load(builder, at, builder.mul(b, I64(PANEL)), V8_F32, 4) for at in dw_at]
    stepped = {}
    for r, row in enumerate(rows):
        dx = _dx(builder, xd, row, nb, b)
        for g in range(len(dw_at)):
            term = builder.fmul(builder.sitofp(sums[r, g], V8_F32), builder.fmul(dw[g], dx))
            stepped[r, g] = builder.fadd(acc[r, g], term)
    return stepped

@intrinsic
def int16_tile(typingctx, block, w, dw, g0, x, xd, x0, nb, out):  # noqa: ARG001
    """``out[(r * GROUPS + g) * 8 + i]`` = the product of activation row ``x0 + r`` and row ``i`` of panel ``g0 +
    g`` over ``nb`` blocks of ``block`` values (a literal: Q8_0's 32 with q8_0 activations,
    ``q8_act.product_blockwise``'s numbers; IQ4_XS's 256 with q8_K, ``q8k_act.product``'s).  Panels
    (:func:`repack_q8_0`, :func:`repack_iq4_xs`): ``w`` [K / 2][8][2] int16 weights (IQ4_XS: level times its
    sub-block's scale, at most 4064), ``dw`` [nb][8] float32; activations ``x`` [M, K] int16 (int8 values), ``xd``
    [M, nb]: per 2 values one ``pmaddwd`` of the panel and the broadcast pair, exact, then per block ``acc = acc +
    f32(sumi) * (d_w * d_x)``."""
    if not isinstance(block, types.IntegerLiteral):
        raise RequireLiteralValue("the block of int16_tile must be a literal int")
    size = block.literal_value

    def codegen(context, builder, signature, args):
        ty = signature.args
        nb_, out_ = args[7], args[8]
        pmaddwd = _x86(builder, "llvm.x86.avx2.pmadd.wd", V8_I32, V16_I16)
        rows, w_at, dw_at, x_at = _block_operands(context, builder, ty, args, 1, args[6], nb_, size)
        xd_data = _data(context, builder, ty[5], args[5])

        def step(b, pair, sums):  # 2 values of every pair
            k = builder.add(builder.mul(b, I64(size)), builder.mul(pair, I64(2)))
            weights = [_load(builder, at, builder.mul(k, I64(PANEL)), V16_I16, 2) for at in w_at]
            new = {}
            for r in range(ROWS):
                xr = builder.bitcast(splat(builder, _load(builder, x_at[r], k, I32, 2), V8_I32), V16_I16)
                for g in range(GROUPS):
                    new[r, g] = builder.add(sums[r, g], builder.call(pmaddwd, [weights[g], xr]))
            return new

        def finish(b, sums, acc):
            return _block_step(builder, sums, acc, b, nb_, rows, xd_data, dw_at)

        _tile_loops(builder, nb_, size // 2, step, finish, out_)
        return context.get_dummy_value()

    return types.void(block, w, dw, g0, x, xd, x0, nb, out), codegen


@intrinsic
def nibble_tile(typingctx, bias, w, dw, g0, xq, xd, xsums, x0, nb, out):  # noqa: ARG001
    """``out[(r * GROUPS + g) * 8 + i]`` = the q8_0 product (``q8_act.product_blockwise``'s numbers) of
    activation row ``x0 + r`` and row ``i`` of panel ``g0 + g`` of Q4_0 or Q5_0 weights over ``nb`` blocks of 32.
    Panels (:func:`repack_nibbles`): ``w`` [K / 4][8][4] uint8 values ``q`` (0..15 or 0..31; the weight is ``q -
    bias``, ``bias`` a literal 8 or 16), ``dw`` [nb][8]; activations ``xq`` [M, >= K] int8, ``xd`` [M, nb] and
    ``xsums`` [M, nb] int32, the sums of ``q`` per block: ``sumi = (q . x) - bias sum(x)``, exact, then per block
    ``acc = acc + f32(sumi) * (d_w * d_x)``."""
    if not isinstance(bias, types.IntegerLiteral):
        raise RequireLiteralValue("the bias of nibble_tile must be a literal int")
    shift = bias.literal_value.bit_length() - 1

    def codegen(context, builder, signature, args):
        ty = signature.args
        nb_, out_ = args[8], args[9]
        pmaddubsw = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", V16_I16, V32_I8)
        pmaddwd = _x86(builder, "llvm.x86.avx2.pmadd.wd", V8_I32, V16_I16)
        ones = ir.Constant(V16_I16, [1] * 16)
        rows, w_at, dw_at, x_at = _block_operands(context, builder, ty, args, 1, args[7], nb_)
        xd_data, sums_data = _data(context, builder, ty[5], args[5]), _data(context, builder, ty[6], args[6])

        def step(b, quad, sums):  # 4 values of every pair
            k = builder.add(builder.mul(b, I64(Q8_ACT_BLOCK)), builder.mul(quad, I64(QUAD)))
            weights = [_load(builder, at, builder.mul(k, I64(PANEL)), V32_I8, 1) for at in w_at]
            new = {}
            for r in range(ROWS):
                x = builder.bitcast(splat(builder, _load(builder, x_at[r], k, I32, 1), V8_I32), V32_I8)
                for g in range(GROUPS):
                    products = builder.call(pmaddwd, [builder.call(pmaddubsw, [weights[g], x]), ones])
                    new[r, g] = builder.add(sums[r, g], products)
            return new

        def finish(b, sums, acc):  # sumi = (q . x) - bias * sum(x)
            exact = {}
            for r, row in enumerate(rows):
                total = builder.load(builder.gep(sums_data, [builder.add(builder.mul(row, nb_), b)]))
                offset = splat(builder, builder.shl(total, I32(shift)), V8_I32)
                exact.update({(r, g): builder.sub(sums[r, g], offset) for g in range(GROUPS)})
            return _block_step(builder, exact, acc, b, nb_, rows, xd_data, dw_at)

        _tile_loops(builder, nb_, Q8_ACT_BLOCK // QUAD, step, finish, out_)
        return context.get_dummy_value()

    return types.void(bias, w, dw, g0, xq, xd, xsums, x0, nb, out), codegen


def _float_step(builder: ir.IRBuilder, q4: bool, pmaddwd, sums: dict, acc: dict, b: ir.Value, nb: ir.Value,
                rows: list, xd: ir.Value, sums_at: list, extra_at: list, dw_at: list, dm_at: list) -> dict:
    """Super-block ``b``'s float step of every (row, panel) pair of a tile (:func:`_block_step`): Q6_K first takes
    ``32 sum_j sc_j bsum_j`` off the int32 sums, Q4_K then takes ``f32(summ) * (dmin_w * d_x)`` off the result, each
    operation rounded as the reference rounds it."""
    b8 = builder.mul(b, I64(PANEL))
    if not q4:  # pairs of sub-blocks: lane i = sc_2p bsum_2p + sc_2p+1 bsum_2p+1 of row i
        exact = {}
        for (r, g), sumi in sums.items():
            bias = None
            for p in range(QK_K // Q6_K_SUB // 2):
                pair = _load(builder, sums_at[r], builder.add(builder.mul(b, I64(QK_K // BSUM)), I64(2 * p)), I32, 2)
                scale_pairs = _load(builder, extra_at[g], builder.mul(builder.add(b8, I64(p)), I64(2 * PANEL)),
                                    V16_I16, 2)
                term = builder.call(pmaddwd, [scale_pairs, builder.bitcast(splat(builder, pair, V8_I32), V16_I16)])
                bias = term if bias is None else builder.add(bias, term)
            exact[r, g] = builder.sub(sumi, builder.shl(bias, ir.Constant(V8_I32, [Q6_BIAS_SHIFT] * 8)))
        return _block_step(builder, exact, acc, b, nb, rows, xd, dw_at)
    stepped = _block_step(builder, sums, acc, b, nb, rows, xd, dw_at)
    dm = [_load(builder, at, b8, V8_F32, 4) for at in dm_at]
    for r, row in enumerate(rows):
        dx = _dx(builder, xd, row, nb, b)
        for g in range(len(dw_at)):
            summ = None
            for j in range(QK_K // Q4_K_SUB):
                m = _load(builder, extra_at[g], builder.mul(builder.add(b8, I64(j)), I64(PANEL)), V8_F32, 4)
                bsum = splat(builder, builder.load(builder.gep(sums_at[r], [builder.add(b8, I64(j))])), V8_F32)
                term = builder.fmul(m, bsum)
                summ = term if summ is None else builder.fadd(summ, term)
            stepped[r, g] = builder.fsub(stepped[r, g], builder.fmul(summ, builder.fmul(dm[g], dx)))
    return stepped


@numba.njit(inline="always")
def _put(w32, g, quad, i, word):
    """Row ``i``'s 4 values of value quad ``quad`` in panel ``g`` (``w32``: the panels as uint32)."""
    w32[g, quad * PANEL + i] = word


LOW4, LOW2 = np.uint32(0x0F0F0F0F), np.uint32(0x03030303)


@numba.njit(inline="always")
def _panel_row(raw, r0, n, c):
    """Row ``c`` of the panels being repacked: (panel, row in it, whether it is a stored row (``c < n``), the
    stored row ``r0 + c``, or ``r0`` in place of one past the end)."""
    live = c < n
    return c // PANEL, c % PANEL, live, raw[r0 + c] if live else raw[r0]


@numba.njit(inline="always")
def repack_q4_k(raw, r0, n, table, w32, s, m, dw, dm):
    """Stored Q4_K rows ``r0 .. r0 + n`` into panels of 8 (rows past ``n`` all zero): the nibbles by words (4
    values of a row at once), the 6-bit scales and minimums, d and dmin."""
    nb = dw.shape[1] // PANEL
    for c in range(w32.shape[0] * PANEL):
        g, i, live, blk = _panel_row(raw, r0, n, c)
        for b in range(nb):
            o = b * Q4_K_BYTES
            dw[g, b * PANEL + i] = f16_at(table, blk, o) if live else np.float32(0)
            dm[g, b * PANEL + i] = f16_at(table, blk, o + 2) if live else np.float32(0)
            for j in range(QK_K // Q4_K_SUB):
                if j < 4:
                    sc, mn = blk[o + 4 + j] & 63, blk[o + 8 + j] & 63
                else:
                    sc = (blk[o + 8 + j] & 15) | ((blk[o + j] >> 6) << 4)
                    mn = (blk[o + 8 + j] >> 4) | ((blk[o + 4 + j] >> 6) << 4)
                t = b * (QK_K // Q4_K_SUB) + j
                s[g, t * 2 * PANEL + 2 * i] = sc if live else 0
                s[g, t * 2 * PANEL + 2 * i + 1] = sc if live else 0
                m[g, t * PANEL + i] = np.float32(mn) if live else np.float32(0)
            for chunk in range(4):  # 64 values: bytes l hold value 64 chunk + l (low) and + 32 (high)
                for lq in range(8):
                    word = load_le(blk, o + 16 + 32 * chunk + 4 * lq, 4) if live else np.uint32(0)
                    quad = b * (QK_K // QUAD) + 16 * chunk + lq
                    _put(w32, g, quad, i, word & LOW4)
                    _put(w32, g, quad + 8, i, (word >> np.uint32(4)) & LOW4)


@numba.njit(inline="always")
def _six(low, high, low_shift, high_shift):
    """Four 6-bit values: the nibbles of ``low >> low_shift`` and bits 4-5 from ``high >> high_shift``."""
    return (((low >> np.uint32(low_shift)) & LOW4)
            | (((high >> np.uint32(high_shift)) & LOW2) << np.uint32(4)))


@numba.njit(inline="always")
def repack_q6_k(raw, r0, n, table, w32, s, pairs, dw):
    """Stored Q6_K rows into panels of 8: ``q`` (0..63) by words, the int8 scales per 16 (and in pairs of
    sub-blocks for the ``-32`` term), d."""
    nb = dw.shape[1] // PANEL
    for c in range(w32.shape[0] * PANEL):
        g, i, live, blk = _panel_row(raw, r0, n, c)
        for b in range(nb):
            o = b * Q6_K_BYTES
            dw[g, b * PANEL + i] = f16_at(table, blk, o + 208) if live else np.float32(0)
            for j in range(QK_K // Q6_K_SUB):
                sc = np.int16(np.int8(blk[o + 192 + j])) if live else np.int16(0)
                t = b * (QK_K // Q6_K_SUB) + j
                s[g, t * 2 * PANEL + 2 * i] = sc
                s[g, t * 2 * PANEL + 2 * i + 1] = sc
                p = b * (QK_K // Q6_K_SUB // 2) + j // 2
                pairs[g, p * 2 * PANEL + 2 * i + j % 2] = sc
            for half in range(2):  # 128 values: ql bytes 64 half + l (l < 64), qh bytes 128 + 32 half + l
                for lq in range(8):
                    a = load_le(blk, o + 64 * half + 4 * lq, 4) if live else np.uint32(0)
                    a2 = load_le(blk, o + 64 * half + 32 + 4 * lq, 4) if live else np.uint32(0)
                    h = load_le(blk, o + 128 + 32 * half + 4 * lq, 4) if live else np.uint32(0)
                    quad = b * (QK_K // QUAD) + 32 * half + lq
                    _put(w32, g, quad, i, _six(a, h, 0, 0))
                    _put(w32, g, quad + 8, i, _six(a2, h, 0, 2))
                    _put(w32, g, quad + 16, i, _six(a, h, 4, 4))
                    _put(w32, g, quad + 24, i, _six(a2, h, 4, 6))


@numba.njit(inline="always")
def repack_q8_0(raw, r0, n, table, w32, dw):
    """Stored Q8_0 rows ``r0 .. r0 + n`` into panels of 8 (rows past ``n`` all zero): each pair of int8 values
    widened to two int16 in one word, d."""
    nb = dw.shape[1] // PANEL
    for c in range(w32.shape[0] * PANEL):
        g, i, live, blk = _panel_row(raw, r0, n, c)
        for b in range(nb):
            o = b * Q8_0_BYTES
            dw[g, b * PANEL + i] = f16_at(table, blk, o) if live else np.float32(0)
            for p in range(Q8_ACT_BLOCK // 2):
                low = np.uint32(np.uint16(np.int16(np.int8(blk[o + 2 + 2 * p]))))
                high = np.uint32(np.uint16(np.int16(np.int8(blk[o + 3 + 2 * p]))))
                w32[g, (b * (Q8_ACT_BLOCK // 2) + p) * PANEL + i] = (low | (high << np.uint32(16))) if live else 0


@numba.njit(inline="always")
def repack_iq4_xs(raw, r0, n, table, levels, w16, dw):
    """Stored IQ4_XS rows ``r0 .. r0 + n`` into panels of 8 (rows past ``n`` all zero): each value's level times
    its sub-block's scale ``ls - 32`` as int16, in pairs; d."""
    nb = dw.shape[1] // PANEL
    for c in range(w16.shape[0] * PANEL):
        g, i, live, blk = _panel_row(raw, r0, n, c)
        for b in range(nb):
            o = b * IQ4_XS_BYTES
            dw[g, b * PANEL + i] = f16_at(table, blk, o) if live else np.float32(0)
            high = np.int64(blk[o + 2]) | (np.int64(blk[o + 3]) << 8)
            for j in range(QK_K // Q8_ACT_BLOCK):
                ls = ((np.int64(blk[o + 4 + j // 2]) >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)
                scale = (ls - 32) if live else 0
                for half in range(2):  # values 32 j + e (low nibbles of bytes e) and 32 j + 16 + e (high)
                    for e in range(16):
                        byte = np.int64(blk[o + 8 + 16 * j + e])
                        k = b * QK_K + Q8_ACT_BLOCK * j + 16 * half + e
                        w16[g, (k // 2) * 2 * PANEL + 2 * i + k % 2] = levels[(byte >> (4 * half)) & 15] * scale


@numba.njit(inline="always")
def repack_nibbles(raw, r0, n, table, w32, dw, size):
    """Stored Q4_0 (``size`` 18) or Q5_0 (22: bit 4 of value ``l`` is bit ``l`` of ``qh``) rows into panels of 8:
    the unsigned values ``q`` by words, d."""
    nb = dw.shape[1] // PANEL
    first = 2 if size == Q4_0_BYTES else 6
    for c in range(w32.shape[0] * PANEL):
        g, i, live, blk = _panel_row(raw, r0, n, c)
        for b in range(nb):
            o = b * size
            dw[g, b * PANEL + i] = f16_at(table, blk, o) if live else np.float32(0)
            qh = load_le(blk, o + 2, 4) if size != Q4_0_BYTES else np.uint32(0)
            for lq in range(4):  # values 4 lq .. 4 lq + 3 (low nibbles) and 16 + 4 lq .. (high)
                word = load_le(blk, o + first + 4 * lq, 4) if live else np.uint32(0)
                low, high = word & LOW4, (word >> np.uint32(4)) & LOW4
                if size != Q4_0_BYTES and live:
                    low |= _bits4(qh >> np.uint32(4 * lq))
                    high |= _bits4(qh >> np.uint32(16 + 4 * lq))
                quad = b * (Q8_ACT_BLOCK // QUAD) + lq
                _put(w32, g, quad, i, low)
                _put(w32, g, quad + 4, i, high)


@numba.njit(inline="always")
def _bits4(bits):
    """Bits 0-3 of ``bits`` as bit 4 of four bytes (bit ``j`` into byte ``j``)."""
    return (((bits & np.uint32(1)) << np.uint32(4)) | ((bits & np.uint32(2)) << np.uint32(11))
            | ((bits & np.uint32(4)) << np.uint32(18)) | ((bits & np.uint32(8)) << np.uint32(25)))

@numba.njit(inline="always")
def _store_tile(tile, m, n, x0, p0, c0, out):
    """A tile's results (activation rows ``x0 ..``, rows ``p0 ..`` of the repacked panels) into ``out[x0 + r,
    c0 + p0 + c]``, for the activation rows below ``m`` and the panel rows below ``n``."""
    for r in range(min(ROWS, m - x0)):
        for c in range(min(GROUPS * PANEL, n - p0)):
            out[x0 + r, c0 + p0 + c] = tile[r * GROUPS * PANEL + c]


if AVAILABLE:
    @compiled(types.void(U8_2D, I8_2D_W, F32_2D_C, F32_2D_C, F32_1D, F32_2D), contract=False)
    def q4_k_prompts(raw, q, d, sums, table, out):
        """``out`` [M, R] = the q8_K product of Q4_K rows ``raw`` [R, nb * 144] and activations ``q``, ``d``,
        ``sums`` (per 32, float32) whose first M rows are real (the rest padding of a multiple of :data:`ROWS`)."""
        m, rows = out.shape
        nb = d.shape[1]
        w = np.empty((PANELS, nb * QK_K * PANEL // 4), np.uint32)
        s = np.empty((PANELS, nb * (QK_K // Q4_K_SUB) * 2 * PANEL), np.int16)
        mins = np.empty((PANELS, nb * (QK_K // Q4_K_SUB) * PANEL), np.float32)
        dw = np.empty((PANELS, nb * PANEL), np.float32)
        dm = np.empty((PANELS, nb * PANEL), np.float32)
        buffer = stack_f32(TILE_FLOATS)
        tile = numba.carray(buffer, (TILE_FLOATS,))
        wbytes = w.view(np.uint8)
        for c0 in range(0, rows, PANELS * PANEL):
            n = min(PANELS * PANEL, rows - c0)
            repack_q4_k(raw, c0, n, table, w, s, mins, dw, dm)
            for x0 in range(0, m, ROWS):
                for g0 in range(0, PANELS, GROUPS):
                    k_tile(Q4_K_KIND, wbytes, s, mins, dw, dm, g0, q, d, sums, x0, nb, buffer)
                    _store_tile(tile, m, n, x0, g0 * PANEL, c0, out)

    @compiled(types.void(U8_2D, I16_2D_W, F32_2D_C, F32_1D, F32_2D), contract=False)
    def q8_0_prompts(raw, x, d, table, out):
        """``out`` [M, R] = the q8_0 product of Q8_0 rows ``raw`` [R, nb * 34] and int16 activations ``x``, ``d``
        (blocks of 32) whose first M rows are real."""
        m, rows = out.shape
        nb = raw.shape[1] // Q8_0_BYTES
        w32 = np.empty((PANELS, nb * Q8_ACT_BLOCK * PANEL // 2), np.uint32)
        w = w32.view(np.int16)
        dw = np.empty((PANELS, nb * PANEL), np.float32)
        buffer = stack_f32(TILE_FLOATS)
        tile = numba.carray(buffer, (TILE_FLOATS,))
        for c0 in range(0, rows, PANELS * PANEL):
            n = min(PANELS * PANEL, rows - c0)
            repack_q8_0(raw, c0, n, table, w32, dw)
            for x0 in range(0, m, ROWS):
                for g0 in range(0, PANELS, GROUPS):
                    int16_tile(Q8_ACT_BLOCK, w, dw, g0, x, d, x0, nb, buffer)
                    _store_tile(tile, m, n, x0, g0 * PANEL, c0, out)

    @compiled(types.void(U8_2D, I16_2D_W, F32_2D_C, types.Array(types.int8, 1, "C", readonly=True), F32_1D, F32_2D),
              contract=False)
    def iq4_xs_prompts(raw, x, d, levels, table, out):
        """``out`` [M, R] = the q8_K product of IQ4_XS rows ``raw`` [R, nb * 136] and int16 activations ``x``,
        ``d`` (per 256) whose first M rows are real; ``levels`` the 16 values of a nibble."""
        m, rows = out.shape
        nb = d.shape[1]
        w = np.empty((PANELS, nb * QK_K * PANEL), np.int16)
        dw = np.empty((PANELS, nb * PANEL), np.float32)
        buffer = stack_f32(TILE_FLOATS)
        tile = numba.carray(buffer, (TILE_FLOATS,))
        for c0 in range(0, rows, PANELS * PANEL):
            n = min(PANELS * PANEL, rows - c0)
            repack_iq4_xs(raw, c0, n, table, levels, w, dw)
            for x0 in range(0, m, ROWS):
                for g0 in range(0, PANELS, GROUPS):
                    int16_tile(QK_K, w, dw, g0, x, d, x0, nb, buffer)
                    _store_tile(tile, m, n, x0, g0 * PANEL, c0, out)

    @numba.njit(inline="always")
    def nibble_prompts(raw, q, d, sums, table, out, size, bias):
        """``out`` [M, R] = the q8_0 product of Q4_0 or Q5_0 rows (``size`` bytes a block, ``bias`` a literal)
        and activations ``q`` int8, ``d``, ``sums`` (int32 per block) whose first M rows are real."""
        m, rows = out.shape
        nb = raw.shape[1] // size
        w = np.empty((PANELS, nb * Q8_ACT_BLOCK * PANEL // 4), np.uint32)
        dw = np.empty((PANELS, nb * PANEL), np.float32)
        buffer = stack_f32(TILE_FLOATS)
        tile = numba.carray(buffer, (TILE_FLOATS,))
        wbytes = w.view(np.uint8)
        for c0 in range(0, rows, PANELS * PANEL):
            n = min(PANELS * PANEL, rows - c0)
            repack_nibbles(raw, c0, n, table, w, dw, size)
            for x0 in range(0, m, ROWS):
                for g0 in range(0, PANELS, GROUPS):
                    nibble_tile(bias, wbytes, dw, g0, q, d, sums, x0, nb, buffer)
                    _store_tile(tile, m, n, x0, g0 * PANEL, c0, out)

    @compiled(types.void(U8_2D, I8_2D_W, F32_2D_C, I32_2D_W, F32_1D, F32_2D), contract=False)
    def q4_0_prompts(raw, q, d, sums, table, out):
        nibble_prompts(raw, q, d, sums, table, out, Q4_0_BYTES, 8)

    @compiled(types.void(U8_2D, I8_2D_W, F32_2D_C, I32_2D_W, F32_1D, F32_2D), contract=False)
    def q5_0_prompts(raw, q, d, sums, table, out):
        nibble_prompts(raw, q, d, sums, table, out, Q5_0_BYTES, 16)

    @compiled(types.void(U8_2D, I8_2D_W, F32_2D_C, I16_2D_W, F32_1D, F32_2D), contract=False)
    def q6_k_prompts(raw, q, d, sums, table, out):
        """:func:`q4_k_prompts` of Q6_K rows [R, nb * 210]; ``sums`` the activations' int16 sums per 16."""
        m, rows = out.shape
        nb = d.shape[1]
        w = np.empty((PANELS, nb * QK_K * PANEL // 4), np.uint32)
        s = np.empty((PANELS, nb * (QK_K // Q6_K_SUB) * 2 * PANEL), np.int16)
        pairs = np.empty((PANELS, nb * (QK_K // Q6_K_SUB // 2) * 2 * PANEL), np.int16)
        dw = np.empty((PANELS, nb * PANEL), np.float32)
        buffer = stack_f32(TILE_FLOATS)
        tile = numba.carray(buffer, (TILE_FLOATS,))
        wbytes = w.view(np.uint8)
        for c0 in range(0, rows, PANELS * PANEL):
            n = min(PANELS * PANEL, rows - c0)
            repack_q6_k(raw, c0, n, table, w, s, pairs, dw)
            for x0 in range(0, m, ROWS):
                for g0 in range(0, PANELS, GROUPS):
                    k_tile(Q6_K_KIND, wbytes, s, pairs, dw, dw, g0, q, d, sums, x0, nb, buffer)
                    _store_tile(tile, m, n, x0, g0 * PANEL, c0, out)


class LaneActivations(tuple):
    """A prompt's q8_K activations for :func:`kquant_lanes_product`: (q int8 [Mp, K], d float32 [Mp, K / 256],
    the sums the type needs), ``rows`` the real ones (the rest zero padding)."""

    rows: int


# The types multiplied here, by stored bytes per super-block: (kernel, sums of q per super-block, their dtype).
LANE_SUMS = {Q4_K_BYTES: (QK_K // Q4_K_SUB, np.float32), Q6_K_BYTES: (QK_K // BSUM, np.int16),
             IQ4_XS_BYTES: (0, np.float32)}
WIDE = frozenset({IQ4_XS_BYTES})  # types whose activations the kernel reads widened to int16 (signed weights)


def takes(type_size: int) -> bool:
    """Whether prompts of this K-quant or IQ4_XS (by its bytes per super-block) go through these kernels on this
    CPU: Q4_K, Q6_K and IQ4_XS, on a CPU with AVX2 but not AVX-512 (:data:`.base.MADDUBS`)."""
    return MADDUBS and AVAILABLE and type_size in LANE_SUMS


def lane_activations(q: np.ndarray, d: np.ndarray, sums: np.ndarray, rows: int) -> LaneActivations:
    """:class:`LaneActivations` of q8_K activations (``sums`` as float32 from the quantizer, converted to the
    dtype the kernel reads: exact, as they are integers of at most 16 * 127)."""
    prepared = LaneActivations((q, d, sums))
    prepared.rows = rows
    return prepared


def prompt_kernel(type_size: int) -> Declared | None:
    """The compiled prompt product of a type (by its bytes per block or super-block) where this CPU takes it
    (:func:`takes_q8_0`, :func:`takes`), else None: what a weight of the type readies while the model loads."""
    if not takes_q8_0():  # the lanes run on this CPU
        return None
    return {Q8_0_BYTES: q8_0_prompts, Q4_0_BYTES: q4_0_prompts, Q5_0_BYTES: q5_0_prompts, Q4_K_BYTES: q4_k_prompts,
            Q6_K_BYTES: q6_k_prompts, IQ4_XS_BYTES: iq4_xs_prompts}.get(type_size)


def takes_q8_0() -> bool:
    """Whether Q8_0 prompts go through :func:`q8_0_lanes_product` on this CPU (as :func:`takes`)."""
    return MADDUBS and AVAILABLE


def q8_0_lane_activations(q: np.ndarray, d: np.ndarray, rows: int, cols: int) -> LaneActivations:
    """:class:`LaneActivations` of q8_0 activations ``q`` [Mp, >= cols] int8, ``d`` (blocks of 32): the first
    ``cols`` values widened to int16 (each pair one ``pmaddwd`` operand)."""
    prepared = LaneActivations((q[:, :cols].astype(np.int16), np.ascontiguousarray(d[:, :cols // Q8_ACT_BLOCK])))
    prepared.rows = rows
    return prepared


def q8_0_lanes_product(raw: np.ndarray, xk: LaneActivations, out: np.ndarray) -> None:
    """``out`` [M, R] = the q8_0 product (``q8_act.product_blockwise``'s numbers) of Q8_0 rows ``raw`` [R, nb *
    34] and :func:`q8_0_lane_activations` ``xk``; :class:`.KernelsError` where :func:`takes_q8_0` does not."""
    if not takes_q8_0():
        raise KernelsError("the AVX2 prompt kernels need a CPU with AVX2 (and not AVX-512)")
    x, d = xk
    nb = raw.shape[1] // Q8_0_BYTES
    if (raw.shape[1] % Q8_0_BYTES or x.shape[1] != nb * Q8_ACT_BLOCK or d.shape != (len(x), nb) or len(x) % ROWS
            or len(out) > len(x) or out.shape[1] != len(raw) or out.dtype != np.float32):
        raise ValueError(f"Q8_0 lanes product of {raw.shape} stored rows, activations {x.shape}, output {out.shape}")
    prompt_kernel(Q8_0_BYTES)(raw.view(np.uint8), x, d, F16_TABLE, out)


NIBBLES = {Q4_0_BYTES: 8, Q5_0_BYTES: 16}  # bytes per block -> the bias of its values


def nibble_lane_activations(q: np.ndarray, d: np.ndarray, rows: int, cols: int) -> LaneActivations:
    """:class:`LaneActivations` of q8_0 activations for Q4_0/Q5_0: ``q`` [Mp, >= cols] int8 as it is, ``d`` and
    the int32 sums of ``q`` per block of the first ``cols`` values."""
    blocks = cols // Q8_ACT_BLOCK
    sums = q[:, :cols].reshape(len(q), blocks, Q8_ACT_BLOCK).sum(axis=2, dtype=np.int32)
    prepared = LaneActivations((q, np.ascontiguousarray(d[:, :blocks]), sums))
    prepared.rows = rows
    return prepared


def nibble_lanes_product(raw: np.ndarray, xk: LaneActivations, out: np.ndarray) -> None:
    """``out`` [M, R] = the q8_0 product (``q8_act.product_blockwise``'s numbers) of Q4_0 or Q5_0 rows ``raw`` (the
    type from its bytes per block of the activations' blocks) and :func:`nibble_lane_activations` ``xk``."""
    if not takes_q8_0():
        raise KernelsError("the AVX2 prompt kernels need a CPU with AVX2 (and not AVX-512)")
    q, d, sums = xk
    nb = d.shape[1]
    size = raw.shape[1] // nb if nb else 0
    if (size not in NIBBLES or raw.shape[1] % nb or q.shape[1] < nb * Q8_ACT_BLOCK or sums.shape != d.shape
            or len(q) != len(d) or len(q) % ROWS or len(out) > len(q) or out.shape[1] != len(raw)
            or out.dtype != np.float32):
        raise ValueError(f"Q4_0/Q5_0 lanes product of {raw.shape} stored rows, activations {q.shape}, output "
                         f"{out.shape}")
    prompt_kernel(size)(raw.view(np.uint8), q, d, sums, F16_TABLE, out)


def kquant_lanes_product(raw: np.ndarray, xk: LaneActivations, out: np.ndarray) -> None:
    """``out`` [M, R] = the q8_K product (``quants.q8k_act.product``'s numbers) of Q4_K, Q6_K or IQ4_XS rows
    ``raw`` [R, nb * type size] (the type from its size) and :class:`LaneActivations` ``xk`` (``q`` int16 for
    the :data:`WIDE` types); :class:`.KernelsError` where :func:`takes` does not."""
    q, d, sums = xk
    nb = d.shape[1]
    size = raw.shape[1] // nb if nb else 0
    if not takes(size):
        raise KernelsError("the AVX2 prompt kernels need a CPU with AVX2 (and not AVX-512) and Q4_K, Q6_K or IQ4_XS "
                           "rows")
    per, dtype = LANE_SUMS[size]
    if (raw.shape[1] % nb or q.shape != (len(d), QK_K * nb) or sums.shape != (len(q), nb * per)
            or sums.dtype != dtype or len(q) % ROWS or len(out) > len(q) or out.shape[1] != len(raw)
            or out.dtype != np.float32 or q.dtype != (np.int16 if size in WIDE else np.int8)):
        raise ValueError(f"K-quant lanes product of {raw.shape} stored rows, activations {q.shape}, output {out.shape}")
    levels_or_sums = IQ4_LEVELS if size == IQ4_XS_BYTES else sums  # IQ4_XS reads its levels, the others their sums
    prompt_kernel(size)(raw.view(np.uint8), q, d, levels_or_sums, F16_TABLE, out)
