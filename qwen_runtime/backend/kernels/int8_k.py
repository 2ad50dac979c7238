"""Compiled integer-dot kernels of Q4_K, Q5_K and Q6_K with 8-bit activations (``activations="q8"``, numba; see
:mod:`.int8`).

A Q4_K block of 256 values has 8 sub-blocks of 32 with ``value = ds_j * q - dm_j`` (``q`` 0..15;
:func:`.kquants.q4_k_scales`), so against activations quantized per 32 (``d_x[j]``, ``q_x``) a row is
``sum_j ds_j * d_x[j] * (q_j . q_x[j]) - dm_j * xsum[j]``: the integer part by
:func:`.int8.group_nibbles32_pairs_fma` (the 32 low or high nibbles of 32 consecutive bytes; Q5_K adds bit
``j`` of its ``qh`` bytes as bit 4, :func:`.int8.group_q5_k_pairs_fma`), the minimums against the float32
activation sums per 32 (exact activations, as the float kernel).  A Q6_K block has 16 sub-blocks of 16 values
``d * sc_j * (q - 32)`` (``sc_j`` int8, ``q`` 6 bits): each activation block of 32 spans two, whose integer
scales go into ``pmaddwd`` (:func:`.int8.group_q6_block_fma`), the block's ``d`` once on its lanes.

With AVX-512 VNNI, Q4_K goes 64 weights at a time instead (:func:`q4_k_vnni_group`): a chunk's 32 bytes give
sub-blocks ``2c`` (low nibbles) and ``2c + 1`` (high) as one ``<64 x i8>`` against the row's 64 activations in
one ``vpdpbusd``, lanes 0-7 the first sub-block, 8-15 the second, each lane's scale ``ds_j * d_x[j]`` from an
``<8 x float>`` computed once per block and row (:func:`scale_products`; the minimums in 8 lanes, as the float kernel):
about twice as fast as the pairs it replaced.  Q6_K likewise (:func:`q6_k_vnni_group`): its 6-bit ``q`` (0..63)
taken unsigned, the ``- 32`` as a start value of ``vpdpbusd`` (``-32`` times the activations' sums of 4, once per
product: :meth:`Q6_KInt8Kernel.forms`).  Figures, with the 7B-shaped file's decode: docs/performance.md.  One and
several activation rows run the same loops (groups of 1, or :func:`.int8.row_groups`), rows longer than
:data:`WHOLE_COLS` columns by chunks of columns (:func:`chunked`).  A module of its own so that models without
K-quants do not load these kernels.

On AVX2 without AVX-512 VNNI (:data:`Q8K`) Q4_K and Q6_K take activations quantized per 256 values instead (q8_K,
:mod:`.q8k_rows`): a super-block sums in int32 with one float step, ``quants.q8k_act.product``'s numbers bit for
bit, the same as the prompts' lanes, so a row's numbers depend on neither the batch nor the prompt's length; their
rows go whole, each block's every cache line asked for ahead (:func:`q8k_whole_rows`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...quants.kquants import Q2_K, Q3_K
from .amx_k import KQuantAmxPrompts
from .base import (
    ACC_FLOATS,
    CHUNK_COLS,
    F32,
    F32_1D,
    F32_2D,
    F32_2D_C,
    GEMV_ROWS,
    I8_2D,
    I16_2D,
    I64,
    LINE,
    TILE_ROWS,
    U8_2D,
    V8_F32,
    V16_F32,
    V16_I32,
    V32_I8,
    V64_I8,
    compiled,
    deposit,
    fetch_row,
    prefetch,
    prefetch_block,
    prefetch_q8k,
    stack_f32,
    sums_of,
)
from .int8 import (
    LEGACY_GEMV,
    LEGACY_GEMV_ROWS,
    MIN_GEMV,
    MIN_GEMV_ROWS,
    START_GEMV,
    VNNI,
    Int8Kernel,
    _literal,
    _pointer,
    _vpdpbusd,
    group_k23_scaled_fma,
    group_nibbles32_pairs_fma,
    group_q5_k_pairs_fma,
    group_q6_block_fma,
    inline,
    lanes_fold,
    lanes_sums,
    lanes_zero,
    pairs_product,
    pairs_sums_product,
    q8_cfunc,
    row_groups,
)
from .kquants import (
    MIN_LANES,
    Q4_K_BYTES,
    Q5_K_BYTES,
    Q6_K_BYTES,
    QK_K,
    Q2_KJitKernel,
    Q3_KJitKernel,
    Q4_KJitKernel,
    Q5_KJitKernel,
    Q6_KJitKernel,
    k23_d,
    minimums_fma,
    minimums_sum,
    q3_k_scale,
    q4_k_scales,
    q6_k_scales_at,
)
from .q8_act import (
    B32,
    K_SLOTS,
    D,
    Q,
    form_arrays,
    k_form_arrays,
    product_arrays,
    quantize_k,
    slots,
    start_values,
)
from .q8k_rows import AVAILABLE as Q8K_AVAILABLE
from .q8k_rows import SUMS as K_SUMS
from .q8k_rows import q4_k_block, q6_k_block

Q2_K_BYTES, Q3_K_BYTES = Q2_K().type_size, Q3_K().type_size
# Q4_K and Q6_K against q8_K activations (:mod:`.q8k_rows`) on AVX2 without AVX-512 VNNI, whose per-32 kernels
# spend as much on float steps as on products; with VNNI the 64-value ``vpdpbusd`` kernels below.
Q8K = Q8K_AVAILABLE and not VNNI
K_GEMV = types.void(U8_2D, I8_2D, F32_2D_C, I16_2D, F32_1D, F32_2D)  # q8_K values, scales, sums per 16

# The same scale unpacking inlined into the loops (a call per block kept the lanes in memory across it).
k45_scales = inline(q4_k_scales.py_func)


@inline
def k45_group_update(blk, j, size, xq, x_at, cols, xd, d_at, nd, ds, acc, group):
    """Sub-block ``j``'s pair sums for ``group`` activation rows of a Q4_K (``size`` 144) or Q5_K (176) block:
    the nibbles of the 32 bytes of chunk ``j // 2``, plus for Q5_K bit ``j`` of ``qh`` (bytes 16..47) as bit 4."""
    at, shift = size - 128 + 32 * (j // 2), 4 * (j % 2)
    if size == Q5_K_BYTES:
        group_q5_k_pairs_fma(blk, at, shift, 16, j, xq, x_at, cols, xd, d_at, nd, ds, acc, group)
    else:
        group_nibbles32_pairs_fma(blk, at, shift, xq, x_at, cols, xd, d_at, nd, ds, acc, group)


@inline
def q4_k_group(update, size, group, r0, r1, i0, raw, xq, xd, xsum, table, out, b0, b1):  # noqa: ARG001 (row_groups')
    """``out[i, r] = sum_j ds_j * d_x[i, j] * (q_j . q_x[i, j]) - dm_j * xsum[i, j]`` over the 32-value
    sub-blocks ``j`` of Q4_K/Q5_K rows ``r0 <= r < r1`` (blocks of ``size`` bytes) for the activation rows
    ``i0 <= i < i0 + group`` (``ds``, ``dm``: :func:`.kquants.q4_k_scales`; ``xsum``: the float32 activation
    sums per 32, as the float kernel's minimums, 8 lanes a row: :func:`.kquants.minimums_fma`;
    :func:`.int8.row_group`'s protocol): each block's scales decoded and its weights unpacked once for the group."""
    cols, nd = xq.shape[1], xd.shape[1]
    acc, sums = stack_f32(ACC_FLOATS), stack_f32(GEMV_ROWS)
    minp = stack_f32(MIN_LANES)
    mins = carray(minp, (MIN_LANES,))
    dsp, dmp = stack_f32(8), stack_f32(8)
    ds = carray(dsp, (8,))
    s = carray(sums, (GEMV_ROWS,))
    for r in range(r0, r1):
        lanes_zero(acc, group)
        mins[:8 * group] = 0
        for b in range(b0, b1):
            blk = raw[r, b * size: b * size + size]
            prefetch_block(blk, size)
            k45_scales(blk, table, dsp, dmp)
            minimums_fma(dmp, xsum, i0 * nd + b * 8, nd, minp, group)
            for j in range(8):
                k45_group_update(blk, j, size, xq, i0 * cols + b * 256 + 32 * j, cols, xd, i0 * nd + b * 8 + j, nd,
                                 ds[j], acc, group)
        lanes_sums(acc, group, sums)
        for g in range(group):
            deposit(out, i0 + g, r, s[g] - minimums_sum(mins, g), b0)


@inline
def q6_k_group(update, geo, group, r0, r1, i0, raw, xq, xd, xsum, table, out, b0, b1):  # noqa: ARG001 (row_groups')
    """``out[i, r] = sum_b d_b * sum_j sc_j * d_x[i, j // 2] * (w_j . q_x[i, j])`` over the blocks ``b`` of Q6_K rows
    ``r0 <= r < r1`` and their 16-value sub-blocks ``j`` for the activation rows ``i0 <= i < i0 + group`` (``w = q -
    32``): two sub-blocks per activation block of 32, their int8 scales ``sc_j`` in ``pmaddwd``
    (:func:`.int8.group_q6_block_fma`), each block's ``d`` once on its lanes (:func:`.int8.lanes_fold`)."""
    cols, nd = xq.shape[1], xd.shape[1]
    acc, part, sums = stack_f32(ACC_FLOATS), stack_f32(ACC_FLOATS), stack_f32(GEMV_ROWS)
    t = carray(sums, (GEMV_ROWS,))
    for r in range(r0, r1):
        lanes_zero(acc, group)
        lanes_zero(part, group)
        for b in range(b0, b1):
            o = b * Q6_K_BYTES
            blk = raw[r, o: o + Q6_K_BYTES]
            prefetch_block(blk, Q6_K_BYTES)
            group_q6_block_fma(blk, xq, i0 * cols + b * 256, cols, xd, i0 * nd + b * 8, nd, part, group)
            lanes_fold(part, acc, table[np.int64(blk[208]) | (np.int64(blk[209]) << 8)], group)
        lanes_sums(acc, group, sums)
        for g in range(group):
            deposit(out, i0 + g, r, t[g], b0)


@inline
def k23_group(update, q3, group, r0, r1, i0, raw, xq, xd, xsum, table, out, b0, b1):  # noqa: ARG001 (row_groups')
    """``out[i, r] = sum_b d_b * sum_j sc_j * d_x[i, j // 2] * (w_j . q_x[i, j]) - dm_j * xsum[i, j]`` over the
    blocks ``b`` and 16-value sub-blocks ``j`` of Q2_K rows (``q3`` False; ``sc_j`` 4 bits; ``dm_j = dmin * m_j``;
    ``xsum`` the float32 activation sums per 16) or Q3_K rows (``sc_j = s_j - 32``, no minimums) ``r0 <= r < r1``,
    for the activation rows ``i0 <= i < i0 + group``: step ``(h, s)`` of a block is its activation block of 32
    ``4h + s``, pair lanes 0-7 sub-block ``8h + 2s`` and 8-15 the next one, their integer scales in ``pmaddwd``
    (:func:`.int8.group_k23_scaled_fma`), the block's ``d`` once on its lanes (:func:`.int8.lanes_fold`)."""
    size = Q3_K_BYTES if q3 else Q2_K_BYTES
    cols, nd = xq.shape[1], xd.shape[1]
    acc, part, sums = stack_f32(ACC_FLOATS), stack_f32(ACC_FLOATS), stack_f32(GEMV_ROWS)
    t, mins = carray(sums, (GEMV_ROWS,)), carray(stack_f32(GEMV_ROWS), (GEMV_ROWS,))
    for r in range(r0, r1):
        lanes_zero(acc, group)
        lanes_zero(part, group)
        for g in range(group):
            mins[g] = 0
        for b in range(b0, b1):
            blk = raw[r, b * size: b * size + size]
            prefetch_block(blk, size)
            d, dmin = k23_d(blk, table, q3)
            for h in range(2):
                for s in range(4):
                    j, a = 8 * h + 2 * s, 4 * h + s
                    x_at, d_at = i0 * cols + b * 256 + 32 * a, i0 * nd + b * 8 + a
                    if q3:
                        group_k23_scaled_fma(blk, 32 + 32 * h, 2 * s, 0, 4 * h + s, q3_k_scale(blk, j),
                                             q3_k_scale(blk, j + 1), xq, x_at, cols, xd, d_at, nd, part, group)
                    else:
                        m0, m1 = dmin * np.float32(blk[j] >> 4), dmin * np.float32(blk[j + 1] >> 4)
                        for g in range(group):
                            mins[g] += m0 * xsum[i0 + g, b * 16 + j] + m1 * xsum[i0 + g, b * 16 + j + 1]
                        group_k23_scaled_fma(blk, 16 + 32 * h, 2 * s, None, 0, np.int64(blk[j] & 15),
                                             np.int64(blk[j + 1] & 15), xq, x_at, cols, xd, d_at, nd, part, group)
            lanes_fold(part, acc, d, group)
        lanes_sums(acc, group, sums)
        for g in range(group):
            deposit(out, i0 + g, r, t[g] - mins[g], b0)


SCALES = 8 * GEMV_ROWS  # floats of a group's per-block scale products (8 per activation row)
Q6_SCALES = 16 * GEMV_ROWS  # the same for Q6_K (16 per activation row)


@intrinsic
def scale_products(typingctx, ds, xd, at, stride, p, width, group):  # noqa: ARG001
    """For ``g < group``: ``p[width g + j] = ds[j] * xd[at + g stride + j * 8 // width]`` (j < ``width``, a literal:
    8 for Q4_K's sub-blocks of 32, one activation block each; 16 for Q6_K's sub-blocks of 16, two per activation
    block): a block's sub-block scales times each activation row's scales, one vector product per row."""
    if not _literal(group) or not isinstance(width, types.IntegerLiteral) or width.literal_value not in (8, 16):
        return None
    count, n = group.literal_value, width.literal_value
    vector = ir.VectorType(F32, n)

    def codegen(context, builder, signature, args):
        scales = builder.load(builder.bitcast(args[0], vector.as_pointer()), align=4)
        blocks = ir.Constant(ir.VectorType(ir.IntType(32), n), [j * 8 // n for j in range(n)])
        for g in range(count):
            at = builder.add(args[2], builder.mul(args[3], I64(g)))
            xd_g = builder.load(_pointer(context, builder, signature.args[1], args[1], at, V8_F32), align=4)
            wide = builder.shuffle_vector(xd_g, ir.Constant(V8_F32, ir.Undefined), blocks)
            builder.store(builder.fmul(scales, wide),
                          builder.bitcast(builder.gep(args[4], [I64(n * g)]), vector.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(ds, xd, at, stride, p, width, group), codegen


@intrinsic
def group_nibbles64_vnni_fma(typingctx, blk, at, x, x_at, x_stride, p, chunk, acc, group):  # noqa: ARG001
    """Chunk ``chunk`` (a literal, 0..3) of a Q4_K block times ``group`` activation rows: the 32 bytes at
    ``blk[at]`` give sub-block ``2 chunk`` (low nibbles) and ``2 chunk + 1`` (high), as one ``<64 x i8>`` against
    row ``g``'s 64 int8 activations at ``x[x_at + g x_stride]`` in one ``vpdpbusd`` (16 exact sums of 4 products:
    lanes 0-7 the first sub-block, 8-15 the second), converted to float32 and fused into the row's 16 lanes
    (``acc + 16 g``) with the two sub-blocks' scales ``p[8g + 2 chunk]``, ``p[8g + 2 chunk + 1]``."""
    if not _literal(group) or not isinstance(chunk, types.IntegerLiteral):
        return None
    count, c = group.literal_value, chunk.literal_value

    def codegen(context, builder, signature, args):
        q = builder.load(_pointer(context, builder, signature.args[0], args[0], args[1], V32_I8), align=1)
        low = builder.and_(q, ir.Constant(V32_I8, [15] * 32))
        high = builder.lshr(q, ir.Constant(V32_I8, [4] * 32))
        w = builder.bitcast(builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(ir.IntType(32), 64),
                                                                          list(range(64)))), V16_I32)
        zero = ir.Constant(V16_I32, [0] * 16)
        pick = ir.Constant(V16_I32, [2 * c] * 8 + [2 * c + 1] * 8)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16_F32, [V16_F32] * 3),
                                             "llvm.fma.v16f32")
        for g in range(count):
            x_at = builder.add(args[3], builder.mul(args[4], I64(g)))
            xv = builder.load(_pointer(context, builder, signature.args[2], args[2], x_at, V64_I8), align=1)
            sums = builder.sitofp(builder.call(_vpdpbusd(builder), [zero, w, builder.bitcast(xv, V16_I32)]),
                                  V16_F32)
            scales = builder.load(builder.bitcast(builder.gep(args[5], [I64(8 * g)]), V8_F32.as_pointer()), align=4)
            scale = builder.shuffle_vector(scales, ir.Constant(V8_F32, ir.Undefined), pick)
            lanes = builder.bitcast(builder.gep(args[7], [I64(16 * g)]), V16_F32.as_pointer())
            builder.store(builder.call(fma, [sums, scale, builder.load(lanes, align=4)]), lanes, align=4)
        return context.get_dummy_value()

    return types.void(blk, at, x, x_at, x_stride, p, chunk, acc, group), codegen


@inline
def q4_k_vnni_group(update, geo, group, r0, r1, i0, raw, xq, xd, xsum, table, out, b0, b1):  # noqa: ARG001 (row_groups')
    """:func:`q4_k_group`'s sums with AVX-512 VNNI: per block the scales once and their products with each row's
    activation scales (:func:`scale_products`), each row's minimums into 8 lanes
    (:func:`.kquants.minimums_fma`, as the float kernel), then each chunk of 64 weights in one ``vpdpbusd`` per
    activation row (:func:`group_nibbles64_vnni_fma`).  ``xq`` int8 for one row and several alike."""
    cols, nd = xq.shape[1], xd.shape[1]
    acc, sums = stack_f32(ACC_FLOATS), stack_f32(GEMV_ROWS)
    s = carray(sums, (GEMV_ROWS,))
    p, minp = stack_f32(SCALES), stack_f32(MIN_LANES)
    mins = carray(minp, (MIN_LANES,))
    dsp, dmp = stack_f32(8), stack_f32(8)
    for r in range(r0, r1):
        lanes_zero(acc, group)
        for k in range(8 * group):
            mins[k] = 0
        for b in range(b0, b1):
            blk = raw[r, b * Q4_K_BYTES: b * Q4_K_BYTES + Q4_K_BYTES]
            prefetch(blk, 0)
            k45_scales(blk, table, dsp, dmp)
            scale_products(dsp, xd, i0 * nd + b * 8, nd, p, 8, group)
            minimums_fma(dmp, xsum, i0 * nd + b * 8, nd, minp, group)
            x_at = i0 * cols + b * QK_K
            group_nibbles64_vnni_fma(blk, 16, xq, x_at, cols, p, 0, acc, group)
            group_nibbles64_vnni_fma(blk, 48, xq, x_at + 64, cols, p, 1, acc, group)
            group_nibbles64_vnni_fma(blk, 80, xq, x_at + 128, cols, p, 2, acc, group)
            group_nibbles64_vnni_fma(blk, 112, xq, x_at + 192, cols, p, 3, acc, group)
        lanes_sums(acc, group, sums)
        for g in range(group):
            deposit(out, i0 + g, r, s[g] - minimums_sum(mins, g), b0)


@intrinsic
def group_q6_vnni_fma(typingctx, blk, h, x, x_at, x_stride, bias, bias_at, bias_stride, p, part, acc,
                      group):  # noqa: ARG001
    """Values ``128 h + 64 part`` .. ``+ 63`` of a Q6_K block (``part`` a literal, 0 or 1) times ``group`` activation
    rows: steps ``s = 2 part`` and ``2 part + 1`` of half ``h``, their 6-bit ``q`` (0..63, from ``ql`` and ``qh`` as
    :func:`.int8.group_q6_block_fma` takes them) as one ``<64 x i8>`` against row ``g``'s 64 int8 activations
    in one ``vpdpbusd`` started from ``bias`` (``-32`` times the row's sums of 4 activations, so the lanes hold the
    sums of ``(q - 32) x``), converted to float32 and fused into the row's 16 lanes with the scales of sub-blocks
    ``8 h + 4 part`` .. ``+ 3``, four lanes each, from ``p[16 g ...]`` (:func:`scale_products`)."""
    if not _literal(group) or not isinstance(part, types.IntegerLiteral):
        return None
    count, k = group.literal_value, part.literal_value

    def codegen(context, builder, signature, args):
        def load32(at):
            return builder.load(_pointer(context, builder, signature.args[0], args[0], at, V32_I8), align=1)

        def bits(v, shift, mask):
            return builder.and_(builder.lshr(v, ir.Constant(V32_I8, [shift] * 32)), ir.Constant(V32_I8, [mask] * 32))

        h64 = builder.mul(args[1], I64(64))
        qh = load32(builder.add(builder.mul(args[1], I64(32)), I64(128)))
        steps = []
        for s in (2 * k, 2 * k + 1):
            low = bits(load32(builder.add(h64, I64(32 * (s % 2)))), 4 * (s // 2), 15)
            high = builder.shl(bits(qh, 2 * s, 3), ir.Constant(V32_I8, [4] * 32))
            steps.append(builder.or_(low, high))
        w = builder.bitcast(builder.shuffle_vector(steps[0], steps[1], ir.Constant(ir.VectorType(ir.IntType(32), 64),
                                                                                   list(range(64)))), V16_I32)
        pick = ir.Constant(V16_I32, [4 * k + j // 4 for j in range(16)])  # of half h's 8 sub-blocks
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16_F32, [V16_F32] * 3),
                                             "llvm.fma.v16f32")
        for g in range(count):
            x_at = builder.add(args[3], builder.mul(args[4], I64(g)))
            xv = builder.load(_pointer(context, builder, signature.args[2], args[2], x_at, V64_I8), align=1)
            b_at = builder.add(args[6], builder.mul(args[7], I64(g)))
            start = builder.load(_pointer(context, builder, signature.args[5], args[5], b_at, V16_I32), align=4)
            sums = builder.sitofp(builder.call(_vpdpbusd(builder), [start, w, builder.bitcast(xv, V16_I32)]),
                                  V16_F32)
            half = builder.gep(args[8], [builder.add(I64(16 * g), builder.mul(args[1], I64(8)))])
            scales = builder.load(builder.bitcast(half, V8_F32.as_pointer()), align=4)
            scale = builder.shuffle_vector(scales, ir.Constant(V8_F32, ir.Undefined), pick)
            lanes = builder.bitcast(builder.gep(args[10], [I64(16 * g)]), V16_F32.as_pointer())
            builder.store(builder.call(fma, [sums, scale, builder.load(lanes, align=4)]), lanes, align=4)
        return context.get_dummy_value()

    return types.void(blk, h, x, x_at, x_stride, bias, bias_at, bias_stride, p, part, acc, group), codegen


@inline
def q6_k_vnni_group(update, geo, group, r0, r1, i0, raw, xq, xd, xbias, table, out, b0, b1):  # noqa: ARG001 (row_groups')
    """:func:`q6_k_group`'s sums with AVX-512 VNNI: per block the 16 scales once and per row their products with
    the activation scales (:func:`scale_products`), then 64 values at a time in one ``vpdpbusd`` per row
    (:func:`group_q6_vnni_fma`); ``xbias`` int32 [N, cols / 4] the rows' ``-32 * (sum of 4 activations)``."""
    cols, nd, nbias = xq.shape[1], xd.shape[1], xbias.shape[1]
    acc, sums = stack_f32(ACC_FLOATS), stack_f32(GEMV_ROWS)
    s = carray(sums, (GEMV_ROWS,))
    p, dsp = stack_f32(Q6_SCALES), stack_f32(16)
    for r in range(r0, r1):
        lanes_zero(acc, group)
        for b in range(b0, b1):
            blk = raw[r, b * Q6_K_BYTES: b * Q6_K_BYTES + Q6_K_BYTES]
            prefetch(blk, 0)
            q6_k_scales_at(blk, table[np.int64(blk[208]) | (np.int64(blk[209]) << 8)], dsp)
            scale_products(dsp, xd, i0 * nd + b * 8, nd, p, 16, group)
            for h in range(2):
                x_at, b_at = i0 * cols + b * QK_K + 128 * h, i0 * nbias + b * 64 + 32 * h
                group_q6_vnni_fma(blk, h, xq, x_at, cols, xbias, b_at, nbias, p, 0, acc, group)
                group_q6_vnni_fma(blk, h, xq, x_at + 64, cols, xbias, b_at + 16, nbias, p, 1, acc, group)
        lanes_sums(acc, group, sums)
        for g in range(group):
            deposit(out, i0 + g, r, s[g], b0)


# Rows of up to this many columns go whole through the 8-bit-activation K-quant kernels, longer ones by chunks of
# CHUNK_COLS (:func:`chunked`): very long rows (the 7B shape's down projection) ran several times faster chunked,
# as their activations no longer fit the L1 cache, and rows up to a few thousand columns a little faster whole
# (docs/performance.md).
WHOLE_COLS = 8192


@inline
def chunked(group_fn, geo, group, r0, r1, i0, raw, xq, xd, xsum, table, out):
    """:func:`.int8.row_groups`' protocol for a K-quant's ``group_fn`` (in the place of ``update``), called as
    ``group_fn(None, geo, group, r, r + 1, i0, raw, xq, xd, xsum, table, out, b0, b1)`` for each stored row ``r``
    and its blocks ``b0:b1``: whole rows of up to :data:`WHOLE_COLS` columns, longer ones by tiles of
    :data:`.base.TILE_ROWS` stored rows and chunks of :data:`.base.CHUNK_COLS` columns, each row's chunk
    asking first for the same chunk of the row a tile further (the float kernels' order,
    :func:`.base.gemv_groups`: the chunks' sums added in order, whatever the group).  One call site serves both:
    a second one for whole rows made the first compile of this module longer, for the same speed."""
    nb = xq.shape[1] // QK_K
    whole = nb * QK_K <= WHOLE_COLS
    step = max(nb, 1) if whole else CHUNK_COLS // QK_K
    tile = r1 - r0 if whole else TILE_ROWS
    for t0 in range(r0, r1, max(tile, 1)):
        t1 = min(t0 + tile, r1)
        for b0 in range(0, max(nb, 1), step):  # once for rows of no blocks, which get 0
            b1 = min(b0 + step, nb)
            for r in range(t0, t1):
                if not whole:
                    fetch_row(raw, r + TILE_ROWS, b0, b1, nb)
                group_fn(None, geo, group, r, r + 1, i0, raw, xq, xd, xsum, table, out, b0, b1)


if VNNI:
    @compiled(START_GEMV)
    def q6_k_gemv1_vnni(raw, xq, xd, xbias, table, out):
        chunked(q6_k_vnni_group, None, 1, 0, raw.shape[0], 0, raw, xq, xd, xbias, table, out)

    @compiled(START_GEMV)
    def q6_k_gemv_vnni(raw, xq, xd, xbias, table, out):
        row_groups(chunked, q6_k_vnni_group, None, raw, xq, xd, xbias, table, out)


@compiled(LEGACY_GEMV)
def q6_k_gemv1_q8(raw, xq, xd, table, out):
    chunked(q6_k_group, None, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def q6_k_gemv_q8(raw, xq, xd, table, out):
    row_groups(chunked, q6_k_group, None, raw, xq, xd, xd, table, out)


@compiled(MIN_GEMV)
def q2_k_gemv1_q8(raw, xq, xd, xsum, table, out):
    chunked(k23_group, False, 1, 0, raw.shape[0], 0, raw, xq, xd, xsum, table, out)


@compiled(MIN_GEMV_ROWS)
def q2_k_gemv_q8(raw, xq, xd, xsum, table, out):
    row_groups(chunked, k23_group, False, raw, xq, xd, xsum, table, out)


@compiled(MIN_GEMV)
def q3_k_gemv1_q8(raw, xq, xd, xsum, table, out):
    chunked(k23_group, True, 1, 0, raw.shape[0], 0, raw, xq, xd, xsum, table, out)


@compiled(MIN_GEMV_ROWS)
def q3_k_gemv_q8(raw, xq, xd, xsum, table, out):
    row_groups(chunked, k23_group, True, raw, xq, xd, xsum, table, out)


@compiled(MIN_GEMV)
def q4_k_gemv1_q8(raw, xq, xd, xsum, table, out):
    chunked(q4_k_group, Q4_K_BYTES, 1, 0, raw.shape[0], 0, raw, xq, xd, xsum, table, out)


@compiled(MIN_GEMV_ROWS)
def q4_k_gemv_q8(raw, xq, xd, xsum, table, out):
    row_groups(chunked, q4_k_group, Q4_K_BYTES, raw, xq, xd, xsum, table, out)


if VNNI:  # compiled only where the CPU has the instruction
    @compiled(MIN_GEMV)
    def q4_k_gemv1_vnni(raw, xq, xd, xsum, table, out):
        chunked(q4_k_vnni_group, None, 1, 0, raw.shape[0], 0, raw, xq, xd, xsum, table, out)

    @compiled(MIN_GEMV)
    def q4_k_gemv_vnni(raw, xq, xd, xsum, table, out):
        row_groups(chunked, q4_k_vnni_group, None, raw, xq, xd, xsum, table, out)


@compiled(MIN_GEMV)
def q5_k_gemv1_q8(raw, xq, xd, xsum, table, out):
    chunked(q4_k_group, Q5_K_BYTES, 1, 0, raw.shape[0], 0, raw, xq, xd, xsum, table, out)


@compiled(MIN_GEMV_ROWS)
def q5_k_gemv_q8(raw, xq, xd, xsum, table, out):
    row_groups(chunked, q4_k_group, Q5_K_BYTES, raw, xq, xd, xsum, table, out)


@inline
def q8k_whole_rows(q4, group, r0, r1, i0, raw, xq, xd, bs, out):
    """``out[i, r]`` = the q8_K product (``quants.q8k_act.product``'s numbers) of the whole Q4_K (``q4``) or Q6_K
    rows ``r0 <= r < r1`` for the activation rows ``i0 <= i < i0 + group`` (:mod:`.q8k_rows`), every cache line of
    a block asked for :data:`.base.Q8K_PREFETCH_BYTES` ahead.  Whole rows, however long: unlike the kernels of
    32-value blocks, these lost to chunks of columns at every length and batch measured (docs/performance.md)."""
    cols, nb, nbs, row_bytes = xq.shape[1], xd.shape[1], bs.shape[1], raw.shape[1]
    size = Q4_K_BYTES if q4 else Q6_K_BYTES
    accp = stack_f32(GEMV_ROWS)
    acc = carray(accp, (GEMV_ROWS,))
    for r in range(r0, r1):
        for g in range(group):
            acc[g] = np.float32(0)
        for b in range(nb):
            at = r * row_bytes + b * size
            for line in range(0, size, LINE):
                prefetch_q8k(raw, at + line)
            x_at, d_at, s_at = i0 * cols + b * QK_K, i0 * nb + b, i0 * nbs + b * K_SUMS
            if q4:
                q4_k_block(raw, at, xq, x_at, cols, xd, d_at, nb, bs, s_at, nbs, accp, group)
            else:
                q6_k_block(raw, at, xq, x_at, cols, xd, d_at, nb, bs, s_at, nbs, accp, group)
        for g in range(group):
            out[i0 + g, r] = acc[g]


@inline
def q4_k_q8k_rows(update, geo, group, r0, r1, i0, raw, xq, xd, bs, table, out):  # noqa: ARG001
    """:func:`q8k_whole_rows` of Q4_K (:func:`.int8.row_groups`' protocol)."""
    q8k_whole_rows(True, group, r0, r1, i0, raw, xq, xd, bs, out)


@inline
def q6_k_q8k_rows(update, geo, group, r0, r1, i0, raw, xq, xd, bs, table, out):  # noqa: ARG001
    """:func:`q8k_whole_rows` of Q6_K (:func:`.int8.row_groups`' protocol)."""
    q8k_whole_rows(False, group, r0, r1, i0, raw, xq, xd, bs, out)


if Q8K:  # AVX2 without AVX-512 VNNI
    @compiled(K_GEMV, contract=False)
    def q4_k_gemv_q8k(raw, xq, xd, bs, table, out):
        row_groups(q4_k_q8k_rows, None, None, raw, xq, xd, bs, table, out)

    @compiled(K_GEMV, contract=False)
    def q6_k_gemv_q8k(raw, xq, xd, bs, table, out):
        row_groups(q6_k_q8k_rows, None, None, raw, xq, xd, bs, table, out)

    @inline
    def q8k_product(gemv, raw, rows, row_bytes, forms, first, n, cols, table, out, out_stride):
        """A :data:`.q8_act.Q8_ROW_PRODUCT` of the q8_K kernels: the slots KQ, KD, KB."""
        w, _, t, o = product_arrays(raw, rows, row_bytes, n, 0, 0, table, out, out_stride)
        q, d, bs = k_form_arrays(forms, first, n, cols)
        gemv(w, q, d, bs, t, o)


@inline
def int8_sums_product(gemv1, gemv, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out,
                      out_stride):
    """A :data:`.q8_act.Q8_ROW_PRODUCT` of Q4_K's VNNI kernels: ``q``, ``d`` and the float sums per 32 for
    any number of rows."""
    w, s, t, o = product_arrays(raw, rows, row_bytes, n, sums, sums_cols, table, out, out_stride)
    q, _, _, d, _, _ = form_arrays(forms, first, n, cols)
    if n == 1:
        gemv1(w, q, d, s, t, o)
    else:
        gemv(w, q, d, s, t, o)


if VNNI:
    @inline
    def q6_k_vnni_product(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
        """The :data:`.q8_act.Q8_ROW_PRODUCT` of Q6_K's VNNI kernels: ``q``, ``d`` and ``b32``."""
        w, _, t, o = product_arrays(raw, rows, row_bytes, n, sums, 0, table, out, out_stride)
        q, _, _, d, _, b32 = form_arrays(forms, first, n, cols)
        if n == 1:
            q6_k_gemv1_vnni(w, q, d, b32, t, o)
        else:
            q6_k_gemv_vnni(w, q, d, b32, t, o)

    @q8_cfunc
    def q4_k_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
        int8_sums_product(q4_k_gemv1_vnni, q4_k_gemv_vnni, raw, rows, row_bytes, forms, first, n, cols, sums,
                          sums_cols, table, out, out_stride)

    @q8_cfunc
    def q6_k_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
        q6_k_vnni_product(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride)
elif Q8K:
    @q8_cfunc
    def q4_k_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
        q8k_product(q4_k_gemv_q8k, raw, rows, row_bytes, forms, first, n, cols, table, out, out_stride)

    @q8_cfunc
    def q6_k_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
        q8k_product(q6_k_gemv_q8k, raw, rows, row_bytes, forms, first, n, cols, table, out, out_stride)
else:
    @q8_cfunc
    def q4_k_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
        pairs_sums_product(q4_k_gemv1_q8, q4_k_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums,
                           sums_cols, table, out, out_stride)

    @q8_cfunc
    def q6_k_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
        pairs_product(q6_k_gemv1_q8, q6_k_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                      table, out, out_stride)


@q8_cfunc
def q5_k_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_sums_product(q5_k_gemv1_q8, q5_k_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                       table, out, out_stride)


@q8_cfunc
def q2_k_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_sums_product(q2_k_gemv1_q8, q2_k_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                       table, out, out_stride)


@q8_cfunc
def q3_k_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_sums_product(q3_k_gemv1_q8, q3_k_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                       table, out, out_stride)


class Q8KRows(Int8Kernel):
    """A K-quant whose rows take q8_K activations (:func:`q8k_whole_rows`): ``q``, ``d`` and the int16 sums per 16
    (:func:`.q8_act.quantize_k`), one kernel for any number of rows."""

    q8_slots, sums_width = K_SLOTS, 0

    def activations(self, x: np.ndarray) -> tuple:
        return quantize_k(x)

    def _rows(self, raw: np.ndarray, x: np.ndarray, extra: list, out: np.ndarray) -> None:
        self.gemv_q8(raw, *extra, *self.constants, out)


class Q4_KInt8Kernel(Q8KRows if Q8K else Int8Kernel):
    """Q4_K with 8-bit activations: ``vpdpbusd`` on 64 weights at a time where the CPU has AVX-512 VNNI (int8
    activations for any number of rows), against q8_K activations on other AVX2 CPUs (:class:`Q8KRows`), else
    :func:`q4_k_group`'s pairs (int16 activations for several rows)."""

    block, type_size, exact = QK_K, Q4_K_BYTES, Q4_KJitKernel
    q8_row_product = q4_k_q8_rows
    if VNNI:
        gemv1_q8, gemv_q8 = staticmethod(q4_k_gemv1_vnni), staticmethod(q4_k_gemv_vnni)
        q8_slots, sums_width = slots(Q, D), 32
    elif Q8K:
        gemv_q8 = staticmethod(q4_k_gemv_q8k)
    else:
        gemv1_q8, gemv_q8 = staticmethod(q4_k_gemv1_q8), staticmethod(q4_k_gemv_q8)
        sums_width = 32

    if not Q8K:
        def activations(self, x: np.ndarray) -> tuple:
            return (*super().activations(x), sums_of(x, self.sums_width))

        def forms(self, q: np.ndarray, d: np.ndarray) -> tuple:
            return (q, d, q, d) if VNNI else super().forms(q, d)


class Q5_KInt8Kernel(Int8Kernel):
    """Q5_K: the pairs kernel on every CPU (int16 activations for several rows), the minimums against the float
    activation sums per 32."""

    block, type_size, exact = QK_K, Q5_K_BYTES, Q5_KJitKernel
    gemv1_q8, gemv_q8 = staticmethod(q5_k_gemv1_q8), staticmethod(q5_k_gemv_q8)
    q8_row_product, sums_width = q5_k_q8_rows, 32

    def activations(self, x: np.ndarray) -> tuple:
        return (*super().activations(x), sums_of(x, self.sums_width))


class Q6_KInt8Kernel(Q8KRows if Q8K else Int8Kernel):
    """Q6_K with 8-bit activations: ``vpdpbusd`` on 64 weights at a time where the CPU has AVX-512 VNNI (int8
    activations and their ``-32 *`` sums of 4 for any number of rows), against q8_K activations on other AVX2 CPUs
    (:class:`Q8KRows`), else :func:`q6_k_group`'s pairs."""

    block, type_size, exact = QK_K, Q6_K_BYTES, Q6_KJitKernel
    q8_row_product = q6_k_q8_rows
    if VNNI:
        gemv1_q8, gemv_q8 = staticmethod(q6_k_gemv1_vnni), staticmethod(q6_k_gemv_vnni)
        q8_slots = slots(Q, D, B32)
    elif Q8K:
        gemv_q8 = staticmethod(q6_k_gemv_q8k)
    else:
        gemv1_q8, gemv_q8 = staticmethod(q6_k_gemv1_q8), staticmethod(q6_k_gemv_q8)

    if VNNI:
        def forms(self, q: np.ndarray, d: np.ndarray) -> tuple:
            return q, d, q, d, start_values(q)


class Q2_KInt8Kernel(Int8Kernel):
    """Q2_K: the minimums against the float32 activation sums per 16 (as the float kernel's)."""

    block, type_size, exact = QK_K, Q2_K_BYTES, Q2_KJitKernel
    gemv1_q8, gemv_q8 = staticmethod(q2_k_gemv1_q8), staticmethod(q2_k_gemv_q8)
    q8_row_product, sums_width = q2_k_q8_rows, 16

    def activations(self, x: np.ndarray) -> tuple:
        return (*super().activations(x), sums_of(x, self.sums_width))


class Q3_KInt8Kernel(Q2_KInt8Kernel):
    type_size, exact = Q3_K_BYTES, Q3_KJitKernel
    gemv1_q8, gemv_q8 = staticmethod(q3_k_gemv1_q8), staticmethod(q3_k_gemv_q8)
    q8_row_product, sums_width = q3_k_q8_rows, 0  # no minimums: its kernels never read the sums

    def activations(self, x: np.ndarray) -> tuple:
        return (*Int8Kernel.activations(self, x), np.zeros((len(x), 1), np.float32))  # no minimums


class Q2_KAmxKernel(KQuantAmxPrompts, Q2_KInt8Kernel):
    """Q2_K with 8-bit activations in every product (``activations="q8"``); prompts on AMX tiles (:mod:`.amx_k`)."""


class Q3_KAmxKernel(KQuantAmxPrompts, Q3_KInt8Kernel):
    """Q3_K with 8-bit activations in every product (``activations="q8"``); prompts on AMX tiles (:mod:`.amx_k`)."""


class Q4_KAmxKernel(KQuantAmxPrompts, Q4_KInt8Kernel):
    """Q4_K with 8-bit activations in every product (``activations="q8"``); prompts on AMX tiles (:mod:`.amx_k`)."""


class Q5_KAmxKernel(KQuantAmxPrompts, Q5_KInt8Kernel):
    """Q5_K with 8-bit activations in every product (``activations="q8"``); prompts on AMX tiles (:mod:`.amx_k`)."""


class Q6_KAmxKernel(KQuantAmxPrompts, Q6_KInt8Kernel):
    """Q6_K with 8-bit activations in every product (``activations="q8"``); prompts on AMX tiles (:mod:`.amx_k`)."""


# This family's 8-bit kernels (:func:`.kernel_table`).
KERNELS = (Q2_KAmxKernel, Q3_KAmxKernel, Q4_KAmxKernel, Q5_KAmxKernel, Q6_KAmxKernel)
