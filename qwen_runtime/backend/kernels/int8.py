"""Compiled integer-dot kernels with 8-bit activations (``activations="q8"``, numba): Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, IQ4_NL and IQ4_XS weights times activations quantized per 32-block (:mod:`.q8_act`, the plain
reference; the K-quants in :mod:`.int8_k`).

A product first quantizes its activation rows once (:func:`.q8_act.quantize_rows`, the same float32 operations
as :func:`.q8_act.quantize_activations`, bit for bit).  Row ``r`` then keeps 16 float32 lanes; per block ``b``
the 32 integer weights (Q4_0's and Q5_0's nibbles and bit 4 unpacked in int8 vector arithmetic, minus the
bias; IQ4's levels looked up with ``pshufb``) and the 32 activations are taken to int16, multiplied in pairs
and the pairs added in int32 (``<16 x i32>``, exact: :func:`_pairs16`), converted to float32 (exact: below 2^24)
and fused into the lanes, ``lanes = fma(pairs, d_w * d_x, lanes)``; the lanes are summed once at the end,
pairwise (:func:`lanes_sums`).  Q8_0 goes by pairs of blocks (:func:`q8_0_quads_fma`): the 64 weights against the
64 activations stored as ``x + 128`` (uint8) in one ``vpdpbusd`` (AVX-512 VNNI; the ``128 * sum(w)`` it adds
taken off by a bias computed once per weight pair) gives 16 exact sums of 4 products, lanes 0-7 of the first
block, 8-15 of the second: half the conversions and fused adds per block (elsewhere the same sums from
``pmaddwd`` pairs).  With VNNI, Q4_0 and Q5_0 go the same way (:func:`quads_group`), their nibbles (and bit 4,
selected by a mask register: :func:`.legacy.bit4_bytes`) minus the bias as the signed weights.  One activation
row goes the other way round (:data:`START`): the weights are the unsigned operand (Q8_0's plus 128, the nibbles
as stored) against the int8 activations, and each ``vpdpbusd`` starts from ``-bias`` times the activations' sums
of 4 (computed once per product, :func:`.q8_act.start_values`, shifted to the type's bias): no second
``vpdpbusd`` per pair of blocks for the weights' sums, and a shorter chain (151936 x 896, one thread: Q8_0 0.087 ->
0.070, the exact kernel 0.072; Q4_0 0.053 -> 0.048).  The sums are exact either way, so a row's numbers are the
same alone and in a group.  Q4_1's and Q5_1's minimums multiply the float32 activation sums per 32 (as Q4_K's).

Rows: one activation row (``gemv1_q8``) and several (``gemv_q8``) run the same inline loop
(:func:`row_group`), for several rows in fixed groups of :data:`GROUP` (then 4, 2, 1: :func:`row_groups`) over
chunks of :data:`CHUNK` stored rows: per block the weights are read, unpacked and widened once for the group,
each row of the group does one ``vpmaddwd`` (``vpdpbusd``) with its activations (widened to int16 once per
product, so read straight from memory), the conversion and the fused add into its own lanes, which stay in
zmm registers for the whole stored row (``group`` a literal of the intrinsics, so every lane access has a
constant offset).  A row's operations are the same whatever its group, so its numbers are the same whatever
the other rows (the server's batch invariance).  The groups, then the quads for Q4_0/Q5_0, the mask for bit 4
and the pairwise lane sums each made the products faster than the loops before them (one activation row at a
time); the A/B figures are in docs/performance.md.

With AVX2 but not AVX-512 (:data:`.base.MADDUBS`) every block goes through ``vpmaddubsw`` instead (:func:`_quads8`):
the weights' magnitudes (``vpabsb``; the K-quants' unsigned nibbles as they are) against the activations with the
weights' signs (``vpsignb``), then ``vpmaddwd`` by ones: eight exact sums of 4 products per block of 32, fused into
8 of the row's 16 lanes, for one row and several alike (int8 activations for both), so the numbers are again the
same alone and in a group.  Without it the exact float kernels are bound by arithmetic far below the memory's rate
there, so ``activations="auto"`` is ``"q8"`` on such CPUs (:func:`.base.auto_activations`).  Assembly (this AVX2
EPYC): per block ``vpabsb``, ``vpsignb``, ``vpmaddubsw``, ``vpmaddwd``, ``vcvtdq2ps``, ``vfmadd``; Q4_K and Q2_K
without the first two.

Each type also has a :data:`.q8_act.Q8_ROW_PRODUCT` (``<type>_q8_rows``), the compiled decode step's call by
address with the forms it prepared once per product input (:func:`quads_product`, :func:`pairs_product`).

Assembly (numba 0.68, this Xeon with AVX-512; ``inspect_asm``), per block of the 1-row loop: ``prefetcht0``
4 KiB ahead, the scale's table load and ``vmulss``, ``vpmovsxbw`` to zmm (Q4_0 first ``vpand``/
``vgf2p8affineqb``/``vinserti128``/``vpaddb`` on the 16 bytes, Q5_0 a ``kmovd`` and a masked move for bit 4),
one ``vpmaddwd`` zmm, ``vcvtdq2ps`` and ``vfmadd213ps`` with the lanes in a register; Q8_0 (and with VNNI Q4_0,
Q5_0 after their unpacking and one ``vpermt2q``) per pair of blocks ``vinserti64x4``, two ``vpdpbusd``,
``vcvtdq2ps``, ``vmulps`` and ``vfmadd231ps``.  The group-of-8 loop: the weights once, then per row a
``vpmaddwd`` (``vpdpbusd``) from memory, ``vcvtdq2ps``, the scale and a ``vfmadd231ps`` into one of 8 zmm lanes,
no stack traffic (Q4_0 pairs: 73 instructions per block for 8 rows, Q8_0: 91 per pair of blocks).  Written as
generic IR (``sext``, ``mul``, even/odd ``add`` in int32) LLVM narrowed the products to int16 and emitted
``vpmullw``/``vpmovdw``/``vpmovsxwd`` shuffles instead of ``vpmaddwd``, hence the x86 intrinsics.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...quants.iq4 import IQ4_LEVELS, IQ4_NL, IQ4_XS
from ...quants.legacy import Q4_0, Q4_1, Q5_0, Q5_1
from ...quants.q8_0 import Q8_0_BYTES
from ...quants.q8_act import Q8_ACT_BLOCK
from ...quants.scratch import Scratch
from .amx import Q8_0AmxPrompts
from .amx_blocks import IQ4_NLAmxPrompts, Q4_0AmxPrompts, Q4_1AmxPrompts, Q5_0AmxPrompts, Q5_1AmxPrompts
from .amx_k import KQuantAmxPrompts
from .base import (
    ACC_FLOATS,
    F16_TABLE,
    F32,
    F32_1D,
    F32_2D,
    F32_2D_C,
    FEATURES,
    GEMV_ROWS,
    I8_2D,
    I16,
    I16_2D,
    I32,
    I32_2D,
    MADDUBS,
    U8_2D,
    V8_F32,
    V8_I32,
    V16_F32,
    V16_I8,
    V16_I16,
    V16_I32,
    V32_I8,
    V32_I16,
    V32_I32,
    V64_I8,
    JitKernel,
    compiled,
    declared_cfunc,
    prefetch,
    splat,
    stack_f32,
    sums_of,
)
from .iq4 import IQ4_NLJitKernel, IQ4_XSJitKernel
from .legacy import Q4_0JitKernel, Q4_1JitKernel, Q5_0JitKernel, Q5_1JitKernel, bit4_bytes
from .q8_0 import Q8_0JitKernel
from .q8_act import (
    B32,
    D8,
    Q8_ROW_PRODUCT,
    Q16,
    XU,
    D,
    Q,
    form_arrays,
    product_arrays,
    quantize_rows,
    slots,
    start_values,
)

PAIRS = Q8_ACT_BLOCK // 2  # int32 lanes of a block's products (pairs of adjacent products)
# Activation rows whose lanes a multi-row kernel keeps in registers at once: 8 x 16 float32 in zmm registers; with
# AVX2 (:data:`MADDUBS`) 4, as 8 rows' lanes and the block's operands did not fit its 16 ymm registers (Q8_0's 16
# lanes a row, Q4_K's scales and minimums): the spilled lanes went through the stack every block.
GROUP = 4 if MADDUBS else 8
CHUNK = 16  # stored rows a multi-row kernel takes through all its groups of activation rows before the next ones
inline = numba.njit(inline="always", cache=True, fastmath={"contract"})


def _pointer(context, builder: ir.IRBuilder, array_type: types.Array, array: ir.Value, at: ir.Value,
             vector: ir.VectorType) -> ir.Value:
    """``&array[at]`` (flat element index) as a pointer to ``vector``."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [at]), vector.as_pointer())


VNNI = {"avx512vnni", "avx512bw"} <= FEATURES  # vpdpbusd: the quads kernels (else pmaddwd pairs)


def _pairs16(builder: ir.IRBuilder, w16: ir.Value, x16: ir.Value) -> ir.Value:
    """:func:`_pairs` of two ``<32 x i16>`` holding int8 values: ``pmaddwd`` (LLVM does not match the generic
    form, which it narrows to int16 products, to it), in one 512-bit instruction with AVX-512BW, two 256-bit
    ones with AVX2, the generic IR elsewhere."""
    if "avx512bw" in FEATURES:
        pmaddwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16_I32, [V32_I16] * 2),
                                                 "llvm.x86.avx512.pmaddw.d.512")
        return builder.call(pmaddwd, [w16, x16])
    undef = ir.Constant(V32_I16, ir.Undefined)
    if "avx2" in FEATURES:
        pmaddwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8_I32, [V16_I16] * 2),
                                                 "llvm.x86.avx2.pmadd.wd")
        halves = [builder.call(pmaddwd, [builder.shuffle_vector(w16, undef, half),
                                         builder.shuffle_vector(x16, undef, half)])
                  for half in (ir.Constant(V16_I32, list(range(h, h + PAIRS))) for h in (0, PAIRS))]
        return builder.shuffle_vector(halves[0], halves[1], ir.Constant(V16_I32, list(range(PAIRS))))
    total = None
    for parity in (0, 1):
        pick = ir.Constant(V16_I32, list(range(parity, Q8_ACT_BLOCK, 2)))
        a = builder.sext(builder.shuffle_vector(w16, undef, pick), V16_I32)
        b = builder.sext(builder.shuffle_vector(x16, undef, pick), V16_I32)
        product = builder.mul(a, b)
        total = product if total is None else builder.add(total, product)
    return total


def magnitudes(builder: ir.IRBuilder, w: ir.Value) -> ir.Value:
    """``|w|`` of ``<32 x i8>`` weights (``vpabsb``): the unsigned operand of ``pmaddubsw``, whose signs go onto
    the activations (``vpsignb``)."""
    absolute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V32_I8, [V32_I8, ir.IntType(1)]),
                                              "llvm.abs.v32i8")
    return builder.call(absolute, [w, ir.Constant(ir.IntType(1), 0)])


def _quads8(builder: ir.IRBuilder, w: ir.Value, x: ir.Value, unsigned: bool) -> ir.Value:
    """``<8 x i32>``: ``sum_{k<4} w[4j+k] * x[4j+k]`` for 32 int8 weights ``w`` and activations ``x``, exact:
    ``pmaddubsw`` of ``|w|`` (unsigned) and ``x`` with the sign of ``w`` (``psignb``) gives 16 pair sums in int16
    (at most ``2 * 128 * 127``: no saturation, as the activations lie in -127..127), ``pmaddwd`` by ones adds the
    pairs in int32.  ``unsigned`` weights (0..31, the K-quants' nibbles) go in as they are, without the signs."""
    module = builder.module
    if not unsigned:
        psign = cgutils.get_or_insert_function(module, ir.FunctionType(V32_I8, [V32_I8] * 2), "llvm.x86.avx2.psign.b")
        w, x = magnitudes(builder, w), builder.call(psign, [x, w])
    pmaddubsw = cgutils.get_or_insert_function(module, ir.FunctionType(V16_I16, [V32_I8] * 2),
                                               "llvm.x86.avx2.pmadd.ub.sw")
    pmaddwd = cgutils.get_or_insert_function(module, ir.FunctionType(V8_I32, [V16_I16] * 2), "llvm.x86.avx2.pmadd.wd")
    return builder.call(pmaddwd, [builder.call(pmaddubsw, [w, x]), ir.Constant(V16_I16, [1] * PAIRS)])


def _iq4_levels(context, builder: ir.IRBuilder, signature, args: list) -> ir.Value:
    """The ``<32 x i8>`` weights of an IQ4 block of 32: ``IQ4_LEVELS`` at the 4-bit indices of the 16 bytes at
    ``blocks[at]`` (the first two arguments; Q4_0's nibble order), looked up with ``pshufb`` (the 16 levels in
    each 128-bit half) where the CPU has AVX2, element by element elsewhere."""
    q = builder.load(_pointer(context, builder, signature.args[0], args[0], args[1], V16_I8), align=1)
    low = builder.and_(q, ir.Constant(V16_I8, [15] * PAIRS))
    high = builder.lshr(q, ir.Constant(V16_I8, [4] * PAIRS))
    index = builder.shuffle_vector(low, high, ir.Constant(V32_I32, list(range(Q8_ACT_BLOCK))))
    levels = [int(v) for v in IQ4_LEVELS]
    if "avx2" in FEATURES:
        pshufb = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V32_I8, [V32_I8] * 2),
                                                "llvm.x86.avx2.pshuf.b")
        return builder.call(pshufb, [ir.Constant(V32_I8, levels * 2), index])
    table, w = ir.Constant(V16_I8, levels), ir.Constant(V32_I8, ir.Undefined)
    for k in range(Q8_ACT_BLOCK):
        w = builder.insert_element(w, builder.extract_element(table, builder.extract_element(index, I32(k))), I32(k))
    return w


def _nibbles32(context, builder: ir.IRBuilder, signature, args: list) -> ir.Value:
    """The ``<32 x i8>`` weights 0..15 of a Q4_K sub-block: the low (``shift`` 0) or high (4) nibbles of the 32
    bytes at ``blocks[at]`` (the first three arguments)."""
    q = builder.load(_pointer(context, builder, signature.args[0], args[0], args[1], V32_I8), align=1)
    count = splat(builder, builder.trunc(args[2], ir.IntType(8)), V32_I8)
    return builder.and_(builder.lshr(q, count), ir.Constant(V32_I8, [15] * Q8_ACT_BLOCK))


def _nibbles32_high(context, builder: ir.IRBuilder, signature, args: list) -> ir.Value:
    """The ``<32 x i8>`` weights 0..31 of a Q5_K sub-block: :func:`_nibbles32` plus bit ``bit`` of the 32 bytes
    at ``blocks[qh_at]`` as bit 4 (the first five arguments ``blocks, at, shift, qh_at, bit``), tested against a
    mask rather than shifted (x86 has no shift of bytes by a variable count: LLVM widened each to words)."""
    h = builder.load(_pointer(context, builder, signature.args[0], args[0], args[3], V32_I8), align=1)
    mask = splat(builder, builder.trunc(builder.shl(ir.Constant(args[4].type, 1), args[4]), ir.IntType(8)), V32_I8)
    zero = ir.Constant(V32_I8, [0] * Q8_ACT_BLOCK)
    bit4 = builder.select(builder.icmp_unsigned("!=", builder.and_(h, mask), zero),
                          ir.Constant(V32_I8, [16] * Q8_ACT_BLOCK), zero)
    return builder.or_(_nibbles32(context, builder, signature, args), bit4)


def _q6(context, builder: ir.IRBuilder, signature, args: list) -> ir.Value:
    """The ``<32 x i8>`` weights of 32 values of a Q6_K block: ``((blocks[low_at + k] >> shift) & 15) |
    (((blocks[high_at + k] >> high) & 3) << 4)`` minus 32 (the first five arguments)."""

    def bits(at, by, mask):
        q = builder.load(_pointer(context, builder, signature.args[0], args[0], at, V32_I8), align=1)
        count = splat(builder, builder.trunc(by, ir.IntType(8)), V32_I8)
        return builder.and_(builder.lshr(q, count), ir.Constant(V32_I8, [mask] * Q8_ACT_BLOCK))

    w = builder.or_(bits(args[1], args[2], 15),
                    builder.shl(bits(args[3], args[4], 3), ir.Constant(V32_I8, [4] * Q8_ACT_BLOCK)))
    return builder.sub(w, ir.Constant(V32_I8, [32] * Q8_ACT_BLOCK))


def _k23(context, builder: ir.IRBuilder, signature, args: list) -> ir.Value:
    """The ``<32 x i8>`` weights of 32 values of a Q2_K or Q3_K block, from the arguments ``blocks, qs_at, shift,
    hm_at, bit``: bits ``shift, shift + 1`` of the 32 bytes at ``blocks[qs_at]`` (Q2_K: 0..3), for Q3_K
    (``hm_at`` not None) minus 4 where bit ``bit`` of the 32 bytes at ``blocks[hm_at]`` is clear (-4..3)."""

    def bits(at, by, mask):
        q = builder.load(_pointer(context, builder, signature.args[0], args[0], at, V32_I8), align=1)
        count = splat(builder, builder.trunc(by, ir.IntType(8)), V32_I8)
        return builder.and_(builder.lshr(q, count), ir.Constant(V32_I8, [mask] * Q8_ACT_BLOCK))

    w = bits(args[1], args[2], 3)
    if signature.args[3] == types.none:
        return w
    clear = builder.xor(bits(args[3], args[4], 1), ir.Constant(V32_I8, [1] * Q8_ACT_BLOCK))
    return builder.sub(w, builder.shl(clear, ir.Constant(V32_I8, [2] * Q8_ACT_BLOCK)))


def _fma_group(context, builder: ir.IRBuilder, signature, w: ir.Value, args: list, unsigned: bool = False) -> None:
    """For each of ``group`` activation rows ``g``: ``acc[g] = fma(f32(pairs(w, x_g)), d_w * d_x[g], acc[g])``,
    the block's ``<32 x i8>`` weights ``w`` unpacked and widened once for all the rows.  The last arguments are
    ``x, x_at, x_stride, xd, d_at, d_stride, d_w, acc, group``: row ``g``'s 32 activations (int8, or already
    widened to int16) at ``x[x_at + g * x_stride]``, its scale ``d_x[g] = xd[d_at + g * d_stride]`` (flat
    indices), its 16 float32 lanes at ``acc + 16 g`` (a stack pointer; ``group`` a literal, so LLVM keeps the
    lanes in registers).  With :data:`MADDUBS` (int8 activations) the block's 8 sums of 4 products
    (:func:`_quads8`, ``unsigned`` weights 0..31) go into lanes 0-7 and lanes 8-15 stay zero.  Every row of every
    group goes through the same operations, so a row's numbers do not depend on its group."""
    x, x_at, x_stride, xd, d_at, d_stride, d_w, acc, _ = args[-9:]
    tx, txd = signature.args[-9], signature.args[-6]
    group = signature.args[-1].literal_value
    narrow = tx.dtype == types.int8
    lanes = PAIRS // 2 if MADDUBS else PAIRS
    vector = ir.VectorType(F32, lanes)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                         f"llvm.fma.v{lanes}f32")
    w16 = None if MADDUBS else builder.sext(w, V32_I16)
    scale_w = splat(builder, d_w, vector)
    f32_pointer = _pointer(context, builder, txd, xd, d_at, F32)
    x_pointer = _pointer(context, builder, tx, x, x_at, ir.IntType(8) if narrow else I16)
    for g in range(group):
        row = ir.Constant(ir.IntType(64), g)
        at = builder.gep(x_pointer, [builder.mul(row, x_stride)])
        if MADDUBS:
            sums = _quads8(builder, w, builder.load(builder.bitcast(at, V32_I8.as_pointer()), align=1), unsigned)
        elif narrow:
            sums = _pairs16(builder, w16, builder.sext(builder.load(builder.bitcast(at, V32_I8.as_pointer()), align=1),
                                                       V32_I16))
        else:
            sums = _pairs16(builder, w16, builder.load(builder.bitcast(at, V32_I16.as_pointer()), align=2))
        dx = splat(builder, builder.load(builder.gep(f32_pointer, [builder.mul(row, d_stride)])), vector)
        at = builder.bitcast(builder.gep(acc, [ir.Constant(ir.IntType(64), g * PAIRS)]), vector.as_pointer())
        lanes_then = builder.load(at, align=4)
        builder.store(builder.call(fma, [builder.sitofp(sums, vector), builder.fmul(scale_w, dx), lanes_then]), at,
                      align=4)


def _literal(group) -> bool:
    return isinstance(group, types.IntegerLiteral) and 1 <= group.literal_value <= GEMV_ROWS


def _nibbles(context, builder: ir.IRBuilder, signature, args: list) -> ir.Value:
    """The ``<32 x i8>`` weights of a Q4_0/Q5_0 block, from the arguments ``blocks, at, qh, bias``: the 16 bytes
    at ``blocks[at]`` (value ``k`` the low nibble of byte ``k``, value ``16 + k`` the high one), bit 4 of value
    ``k`` from bit ``k`` of ``qh`` (a uint32, or None), minus ``bias``; unpacked in int8 vector arithmetic."""
    q = builder.load(_pointer(context, builder, signature.args[0], args[0], args[1], V16_I8), align=1)
    low = builder.and_(q, ir.Constant(V16_I8, [15] * PAIRS))
    high = builder.lshr(q, ir.Constant(V16_I8, [4] * PAIRS))
    w = builder.shuffle_vector(low, high, ir.Constant(V32_I32, list(range(Q8_ACT_BLOCK))))
    if signature.args[2] != types.none:
        w = builder.or_(w, bit4_bytes(builder, args[2], 0, Q8_ACT_BLOCK))
    return builder.sub(w, splat(builder, builder.trunc(args[3], ir.IntType(8)), V32_I8))


@intrinsic
def group_nibble_pairs_fma(typingctx, blocks, at, qh, bias, x, x_at, x_stride, xd, d_at, d_stride, d_w, acc,
                           group):  # noqa: ARG001
    """A Q4_0/Q5_0 block (:func:`_nibbles`) times ``group`` activation rows (:func:`_fma_group`)."""
    if not _literal(group):
        return None

    def codegen(context, builder, signature, args):
        _fma_group(context, builder, signature, _nibbles(context, builder, signature, args), args)
        return context.get_dummy_value()

    return types.void(blocks, at, qh, bias, x, x_at, x_stride, xd, d_at, d_stride, d_w, acc, group), codegen


@intrinsic
def group_nibbles32_pairs_fma(typingctx, blocks, at, shift, x, x_at, x_stride, xd, d_at, d_stride, d_w, acc,
                              group):  # noqa: ARG001
    """A Q4_K sub-block (:func:`_nibbles32`) times ``group`` activation rows (:func:`_fma_group`)."""
    if not _literal(group):
        return None

    def codegen(context, builder, signature, args):
        _fma_group(context, builder, signature, _nibbles32(context, builder, signature, args), args, unsigned=True)
        return context.get_dummy_value()

    return types.void(blocks, at, shift, x, x_at, x_stride, xd, d_at, d_stride, d_w, acc, group), codegen


@intrinsic
def group_q5_k_pairs_fma(typingctx, blocks, at, shift, qh_at, bit, x, x_at, x_stride, xd, d_at, d_stride, d_w, acc,
                         group):  # noqa: ARG001
    """A Q5_K sub-block (:func:`_nibbles32_high`) times ``group`` activation rows (:func:`_fma_group`)."""
    if not _literal(group):
        return None

    def codegen(context, builder, signature, args):
        _fma_group(context, builder, signature, _nibbles32_high(context, builder, signature, args), args,
                   unsigned=True)
        return context.get_dummy_value()

    return (types.void(blocks, at, shift, qh_at, bit, x, x_at, x_stride, xd, d_at, d_stride, d_w, acc, group),
            codegen)


@intrinsic
def group_iq4_pairs_fma(typingctx, blocks, at, x, x_at, x_stride, xd, d_at, d_stride, d_w, acc, group):  # noqa: ARG001
    """An IQ4 block of 32 (:func:`_iq4_levels`) times ``group`` activation rows (:func:`_fma_group`)."""
    if not _literal(group):
        return None

    def codegen(context, builder, signature, args):
        _fma_group(context, builder, signature, _iq4_levels(context, builder, signature, args), args)
        return context.get_dummy_value()

    return types.void(blocks, at, x, x_at, x_stride, xd, d_at, d_stride, d_w, acc, group), codegen


def _quads(builder: ir.IRBuilder, w: ir.Value, xu: ir.Value, negative_bias: ir.Value | None) -> ir.Value:
    """``<16 x i32>``: ``sum_{k<4} w[4j+k] * x[4j+k]`` for 64 int8 weights ``w`` and 64 activations stored as
    ``xu = x + 128`` (uint8), exact.  With AVX-512 VNNI one ``vpdpbusd`` from ``negative_bias`` (``-128`` times
    the weights' sums of 4, :func:`_vnni_bias`, shared by every activation row); with :data:`MADDUBS` each half
    by :func:`_quads8`; elsewhere ``pmaddwd`` pairs (:func:`_pairs16`) of ``xu - 128`` added in adjacent pairs."""
    if negative_bias is not None:
        operands = [negative_bias, builder.bitcast(xu, V16_I32), builder.bitcast(w, V16_I32)]
        return builder.call(_vpdpbusd(builder), operands)
    x = builder.xor(xu, ir.Constant(V64_I8, [-128] * 64))
    halves = []
    for h in (0, 32):
        pick = ir.Constant(V32_I32, list(range(h, h + 32)))
        undef = ir.Constant(V64_I8, ir.Undefined)
        if MADDUBS:
            halves.append(_quads8(builder, builder.shuffle_vector(w, undef, pick),
                                  builder.shuffle_vector(x, undef, pick), unsigned=False))
            continue
        pairs = _pairs16(builder, builder.sext(builder.shuffle_vector(w, undef, pick), V32_I16),
                         builder.sext(builder.shuffle_vector(x, undef, pick), V32_I16))  # <16 x i32>
        even, odd = (builder.shuffle_vector(pairs, pairs, ir.Constant(V8_I32, list(range(k, PAIRS, 2))))
                     for k in (0, 1))
        halves.append(builder.add(even, odd))
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(V16_I32, list(range(PAIRS))))


def _vpdpbusd(builder: ir.IRBuilder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16_I32, [V16_I32] * 3),
                                          "llvm.x86.avx512.vpdpbusd.512")


def _vnni_bias(builder: ir.IRBuilder, w: ir.Value) -> ir.Value | None:
    """``-128 * (w[4j] + ... + w[4j+3])`` (``<16 x i32>``) where the CPU has AVX-512 VNNI, else None."""
    if not VNNI:
        return None
    zero = ir.Constant(V16_I32, [0] * PAIRS)
    sums = builder.call(_vpdpbusd(builder), [zero, builder.bitcast(ir.Constant(V64_I8, [-128] * 64), V16_I32),
                                              builder.bitcast(w, V16_I32)])  # 0x80 as uint8: 128
    return builder.sub(zero, sums)


BYTES, NIBBLES, BIT4 = 0, 1, 2  # q8_0_quads_fma's kinds of weights: Q8_0's bytes, Q4_0's nibbles, Q5_0's (bit 4)
# q8_0_quads_fma's forms (bits): block 0 alone, the scales expanded, one row from start values (signed activations)
ALONE, EXPANDED, START = 1, 2, 4
EXPANDED_ALONE, START_ALONE = EXPANDED | ALONE, START | ALONE


def _weights64(context, builder: ir.IRBuilder, signature, args: list, kind: int, alone: int,
               unsigned: bool = False) -> ir.Value:
    """The ``<64 x i8>`` weights of two blocks of 32 for :func:`q8_0_quads_fma` (its arguments ``blocks, o0, o1,
    qh0, qh1, bias``): :data:`BYTES`, Q8_0's quants at ``blocks[o0]`` and ``blocks[o1]``; :data:`NIBBLES`, the 16
    bytes there as Q4_0's nibbles (a block's values ``k`` and ``16 + k`` the low and high nibble of byte ``k``);
    :data:`BIT4`, those with bit 4 of each value from ``qh0``/``qh1`` (Q5_0).  Signed: the nibbles minus ``bias``;
    ``unsigned``: the nibbles as they are, Q8_0's quants plus 128 (``vpdpbusd``'s unsigned operand).  With
    ``alone`` block 0 alone: block 1's weights are zeros."""
    blocks, o0, o1, qh0, qh1, bias = args[:6]
    pick = ir.Constant(ir.VectorType(I32, 64), list(range(64)))
    keep = ir.Constant(V64_I8, [-1] * Q8_ACT_BLOCK + [0] * Q8_ACT_BLOCK)
    if kind == BYTES:
        def load32(at):
            return builder.load(_pointer(context, builder, signature.args[0], blocks, at, V32_I8), align=1)

        zeros = ir.Constant(V32_I8, [0] * Q8_ACT_BLOCK)
        w = builder.shuffle_vector(load32(o0), zeros if alone else load32(o1), pick)
        if unsigned:
            w = builder.xor(w, ir.Constant(V64_I8, [-128] * 64))
            w = builder.and_(w, keep) if alone else w
        return w
    q0, q1 = (builder.load(_pointer(context, builder, signature.args[0], blocks, o, V16_I8), align=1) for o in (o0, o1))
    both = builder.shuffle_vector(q0, q1, ir.Constant(V32_I32, list(range(Q8_ACT_BLOCK))))
    low = builder.and_(both, ir.Constant(V32_I8, [15] * Q8_ACT_BLOCK))
    high = builder.lshr(both, ir.Constant(V32_I8, [4] * Q8_ACT_BLOCK))
    order = [*range(16), *range(32, 48), *range(16, 32), *range(48, 64)]  # lo0, hi0, lo1, hi1
    w = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, 64), order))
    if kind == BIT4:
        masks = [builder.bitcast(builder.trunc(qh, I32) if qh.type.width > 32 else qh, ir.VectorType(ir.IntType(1), 32))
                 for qh in (qh0, qh1)]
        mask = builder.shuffle_vector(*masks, ir.Constant(ir.VectorType(I32, 64), list(range(64))))
        w = builder.or_(w, builder.select(mask, ir.Constant(V64_I8, [16] * 64), ir.Constant(V64_I8, [0] * 64)))
    if not unsigned:
        w = builder.sub(w, splat(builder, builder.trunc(bias, ir.IntType(8)), V64_I8))
    return builder.and_(w, keep) if alone else w


def _start_values(context, builder: ir.IRBuilder, array_type, start: ir.Value, at: ir.Value, kind: int,
                  alone: int) -> ir.Value:
    """``vpdpbusd``'s start values for unsigned weights against signed activations: ``-bias`` times each sum of 4
    activations (bias 128 for Q8_0's quants plus 128, 8 for Q4_0's nibbles, 16 for Q5_0's), from the 16 values
    ``-32 * (sum of 4)`` at ``start[at]`` (:data:`.q8_act.B32`) by a shift; lanes 8-15 zero ``alone``."""
    if alone:
        eight = builder.load(_pointer(context, builder, array_type, start, at, ir.VectorType(I32, 8)), align=4)
        values = builder.shuffle_vector(eight, ir.Constant(ir.VectorType(I32, 8), [0] * 8),
                                        ir.Constant(V16_I32, list(range(16))))
    else:
        values = builder.load(_pointer(context, builder, array_type, start, at, V16_I32), align=4)
    if kind == BYTES:
        return builder.shl(values, ir.Constant(V16_I32, [2] * PAIRS))
    return builder.ashr(values, ir.Constant(V16_I32, [2 if kind == NIBBLES else 1] * PAIRS))


@intrinsic
def q8_0_quads_fma(typingctx, blocks, o0, o1, qh0, qh1, bias, kind, form, xu, x_at, x_stride, xd, d_at, d_stride,
                   d0, d1, start, start_at, acc, group):  # noqa: ARG001
    """Two blocks of 32 weights (:func:`_weights64`: Q8_0's, or Q4_0's and Q5_0's by ``form``; scales ``d0``,
    ``d1``) times ``group`` activation rows (a literal) at once: row ``g``'s 64 activations ``xu[x_at + g *
    x_stride]`` (uint8, ``x + 128``) with scales ``d_x0``, ``d_x1`` from ``xd[d_at + g * d_stride]``; its 16 lanes
    at ``acc + 16 g``: lanes 0-7 ``fma(f32(quads of block 0), d0 * d_x0, lanes)``, 8-15 block 1's
    (:func:`_quads`).  ``form`` (a literal): bit 0 set, block 0 alone (the row's last, odd block; lanes 8-15 add
    exact zeros); bit 1 set, ``xd`` holds each block's scale 8 times (:meth:`Q8_0Int8Kernel.forms`: one 64-byte
    load per row, no shuffle), else once; bit 2 (:data:`START`, one row): ``xu`` holds the signed activations
    (int8) and the weights are the unsigned operand, the sums started from :func:`_start_values` of ``start``
    [``start_at``] (fewer operations and a shorter chain for one row; the same exact sums); ``kind`` (a literal)
    the weights' (:data:`BYTES` ...)."""
    if not (_literal(group) and all(isinstance(a, types.IntegerLiteral) for a in (kind, form))):
        return None
    if form.literal_value & START and group.literal_value != 1:
        return None

    def codegen(context, builder, signature, args):
        xu, x_at, x_stride, xd, d_at, d_stride, d0, d1, start, start_at, acc, _ = args[8:]
        form, kind = signature.args[7].literal_value, signature.args[6].literal_value
        alone, expanded, started = form & 1, form & 2, form & START
        zeros = ir.Constant(V32_I8, [0] * Q8_ACT_BLOCK)
        pick = ir.Constant(ir.VectorType(I32, 64), list(range(64)))
        w = _weights64(context, builder, signature, args, kind, alone, unsigned=bool(started))
        bias = None if started else _vnni_bias(builder, w)
        upper = ir.Constant(V16_I32, [*range(8), *range(24, 32)])
        scale_w = builder.shuffle_vector(splat(builder, d0, V16_F32), splat(builder, d0 if alone else d1, V16_F32),
                                         upper)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16_F32, [V16_F32] * 3),
                                             "llvm.fma.v16f32")
        x_pointer = _pointer(context, builder, signature.args[8], xu, x_at, ir.IntType(8))
        f32_pointer = _pointer(context, builder, signature.args[11], xd, d_at, F32)
        v8_f32 = ir.VectorType(F32, 8)
        for g in range(signature.args[-1].literal_value):
            row = ir.Constant(ir.IntType(64), g)
            at = builder.gep(x_pointer, [builder.mul(row, x_stride)])
            if alone:
                x = builder.shuffle_vector(builder.load(builder.bitcast(at, V32_I8.as_pointer()), align=1), zeros, pick)
            else:
                x = builder.load(builder.bitcast(at, V64_I8.as_pointer()), align=1)
            if started:
                values = _start_values(context, builder, signature.args[16], start, start_at, kind, alone)
                quads = builder.sitofp(builder.call(_vpdpbusd(builder), [values, builder.bitcast(w, V16_I32),
                                                                          builder.bitcast(x, V16_I32)]), V16_F32)
            else:
                quads = builder.sitofp(_quads(builder, w, x, bias), V16_F32)
            d_row = builder.gep(f32_pointer, [builder.mul(row, d_stride)])
            if expanded and alone:
                eight = builder.load(builder.bitcast(d_row, v8_f32.as_pointer()), align=4)
                dx = builder.shuffle_vector(eight, eight, ir.Constant(V16_I32, [*range(8), *range(8)]))
            elif expanded:
                dx = builder.load(builder.bitcast(d_row, V16_F32.as_pointer()), align=4)
            else:
                dx0 = builder.load(d_row)
                dx1 = dx0 if alone else builder.load(builder.gep(d_row, [ir.Constant(ir.IntType(64), 1)]))
                dx = builder.shuffle_vector(splat(builder, dx0, V16_F32), splat(builder, dx1, V16_F32), upper)
            lanes = builder.bitcast(builder.gep(acc, [ir.Constant(ir.IntType(64), g * PAIRS)]), V16_F32.as_pointer())
            builder.store(builder.call(fma, [quads, builder.fmul(scale_w, dx), builder.load(lanes, align=4)]), lanes,
                          align=4)
        return context.get_dummy_value()

    return (types.void(blocks, o0, o1, qh0, qh1, bias, kind, form, xu, x_at, x_stride, xd, d_at, d_stride, d0, d1,
                       start, start_at, acc, group), codegen)


def _even_odd(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Adjacent pairs of ``v`` added: element ``k`` = ``v[2k] + v[2k + 1]`` (the generic form of ``pmadd*``)."""
    n = v.type.count // 2
    undef = ir.Constant(v.type, ir.Undefined)
    return builder.add(*(builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(I32, n), list(range(o, 2 * n, 2))))
                         for o in (0, 1)))


def _psign(builder: ir.IRBuilder, x: ir.Value, signs: ir.Value) -> ir.Value:
    """``x`` negated where ``signs`` is negative and zero where it is zero (``vpsignb``, in generic IR without
    AVX2)."""
    if "avx2" in FEATURES:
        psign = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V32_I8, [V32_I8] * 2),
                                               "llvm.x86.avx2.psign.b")
        return builder.call(psign, [x, signs])
    zero = ir.Constant(V32_I8, [0] * Q8_ACT_BLOCK)
    kept = builder.select(builder.icmp_signed("==", signs, zero), zero, x)
    return builder.select(builder.icmp_signed("<", signs, zero), builder.sub(zero, x), kept)


def scaled_quads(builder: ir.IRBuilder, grid: ir.Value, signs: ir.Value | None, x: ir.Value,
                 scales: ir.Value) -> ir.Value:
    """``<8 x i32>``: lane ``j`` = ``s_j * sum_{k<4} g[4j+k] * sign[4j+k] * x[4j+k]``, exact, for unsigned weights ``g``
    (grid points or magnitudes, at most 62), signs (-1, 0 or 1, as ``vpsignb`` takes them; None: all 1),
    activations in -127..127 and the ``<16 x i16>`` scales (``s_j`` the scale of words ``2j``, ``2j + 1``;
    -128..127): ``pmaddubsw(g, psignb(x, sign))`` (pairs at most 2 * 62 * 127, no saturation), then ``pmaddwd``
    by the scales (lanes below 2^24 in magnitude, so exact in float32 too), where the CPU has AVX2; the same
    integer arithmetic in generic IR elsewhere."""
    signed = x if signs is None else _psign(builder, x, signs)
    if "avx2" in FEATURES:
        pmaddubsw = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16_I16, [V32_I8] * 2),
                                                   "llvm.x86.avx2.pmadd.ub.sw")
        pmaddwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8_I32, [V16_I16] * 2),
                                                 "llvm.x86.avx2.pmadd.wd")
        return builder.call(pmaddwd, [builder.call(pmaddubsw, [grid, signed]), scales])
    pairs = _even_odd(builder, builder.mul(builder.zext(grid, V32_I16), builder.sext(signed, V32_I16)))
    return _even_odd(builder, builder.mul(builder.sext(pairs, V16_I32), builder.sext(scales, V16_I32)))


def _int16(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    width = value.type.width
    return value if width == 16 else builder.trunc(value, I16) if width > 16 else builder.sext(value, I16)


def halves16(builder: ir.IRBuilder, s0: ir.Value, s1: ir.Value) -> ir.Value:
    """``<16 x i16>``: the integer ``s0`` in lanes 0-7 (the pair sums of values 0-15), ``s1`` in lanes 8-15."""
    halves = [splat(builder, _int16(builder, s), V16_I16) for s in (s0, s1)]
    half = PAIRS // 2
    return builder.shuffle_vector(*halves, ir.Constant(ir.VectorType(I32, PAIRS),
                                                       [*range(half), *range(PAIRS + half, 2 * PAIRS)]))


def scaled_fma_group(context, builder: ir.IRBuilder, signature, grid: ir.Value, signs: ir.Value | None,
                     scales: ir.Value, args: list) -> None:
    """For each of ``group`` activation rows ``g``: ``part[g] = fma(f32(scaled_quads(grid, signs, x_g, scales)),
    d_x[g], part[g])`` in 8 float32 lanes, the block's vectors made once for all the rows.  The last
    arguments are ``x, x_at, x_stride, xd, d_at, d_stride, part, group``: row ``g``'s 32 activations (int8, or
    int16 holding int8 values) at ``x[x_at + g * x_stride]``, its scale ``xd[d_at + g * d_stride]`` (flat
    indices), its lanes at ``part + 16 g`` (a stack pointer, ``group`` a literal: the lanes stay in registers).
    The weights' float scale is applied later, once per super-block (:func:`lanes_fold`)."""
    tx, txd = signature.args[-8], signature.args[-5]
    x, x_at, x_stride, xd, d_at, d_stride, part, _ = args[-8:]
    narrow = tx.dtype == types.int8
    x_pointer = _pointer(context, builder, tx, x, x_at, ir.IntType(8) if narrow else I16)
    d_pointer = _pointer(context, builder, txd, xd, d_at, F32)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8_F32, [V8_F32] * 3), "llvm.fma.v8f32")
    for g in range(signature.args[-1].literal_value):
        row = ir.Constant(ir.IntType(64), g)
        at = builder.gep(x_pointer, [builder.mul(row, x_stride)])
        if narrow:
            xg = builder.load(builder.bitcast(at, V32_I8.as_pointer()), align=1)
        else:  # the int16 activations of the pairs kernels' multi-row form (:meth:`Int8Kernel.forms`)
            xg = builder.trunc(builder.load(builder.bitcast(at, V32_I16.as_pointer()), align=2), V32_I8)
        sums = builder.sitofp(scaled_quads(builder, grid, signs, xg, scales), V8_F32)
        dx = splat(builder, builder.load(builder.gep(d_pointer, [builder.mul(row, d_stride)])), V8_F32)
        lanes = builder.bitcast(builder.gep(part, [ir.Constant(ir.IntType(64), g * PAIRS)]), V8_F32.as_pointer())
        builder.store(builder.call(fma, [sums, dx, builder.load(lanes, align=4)]), lanes, align=4)


@intrinsic
def group_q6_block_fma(typingctx, blocks, x, x_at, x_stride, xd, d_at, d_stride, part, group):  # noqa: ARG001
    """A whole Q6_K block times ``group`` activation rows: its 8 runs of 32 values (:func:`_q6`, ``q - 32``; run
    ``a = 4h + s`` at its constant offsets) each with the int8 scales of its two 16-value sub-blocks ``2a, 2a + 1``,
    picked by a constant shuffle from the block's 16 scales, widened once (:func:`scaled_fma_group`: the
    magnitudes against the activations with the values' signs; run ``a`` reads activation block ``a`` of the
    256 at ``x_at``, ``d_at``)."""
    if not _literal(group):
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        scales = builder.load(_pointer(context, builder, signature.args[0], args[0], i64(192), V16_I8), align=1)
        scales = builder.sext(scales, V16_I16)
        x, x_at, x_stride, xd, d_at, d_stride, part, group_ = args[1:]
        for h in range(2):
            for s in range(4):
                a = 4 * h + s
                fields = [args[0], i64(64 * h + 32 * (s % 2)), i64(4 * (s // 2)), i64(128 + 32 * h), i64(2 * s)]
                w = _q6(context, builder, signature, fields)
                pick = builder.shuffle_vector(scales, scales, ir.Constant(ir.VectorType(I32, PAIRS),
                                                                          [2 * a] * 8 + [2 * a + 1] * 8))
                rows = [x, builder.add(x_at, i64(Q8_ACT_BLOCK * a)), x_stride, xd, builder.add(d_at, i64(a)),
                        d_stride, part, group_]
                scaled_fma_group(context, builder, signature, magnitudes(builder, w), w, pick, rows)
        return context.get_dummy_value()

    return types.void(blocks, x, x_at, x_stride, xd, d_at, d_stride, part, group), codegen


@intrinsic
def group_k23_scaled_fma(typingctx, blocks, qs_at, shift, hm_at, bit, s0, s1, x, x_at, x_stride, xd, d_at, d_stride,
                         part, group):  # noqa: ARG001
    """32 values of a Q2_K/Q3_K block (:func:`_k23`: Q2_K's unsigned, Q3_K's signed) with the two 16-value
    sub-blocks' integer scales ``s0``, ``s1`` times ``group`` activation rows (:func:`scaled_fma_group`)."""
    if not _literal(group):
        return None

    def codegen(context, builder, signature, args):
        w = _k23(context, builder, signature, args)
        unsigned = signature.args[3] == types.none  # Q2_K's 0..3
        scaled_fma_group(context, builder, signature, w if unsigned else magnitudes(builder, w),
                         None if unsigned else w, halves16(builder, args[5], args[6]), args)
        return context.get_dummy_value()

    return (types.void(blocks, qs_at, shift, hm_at, bit, s0, s1, x, x_at, x_stride, xd, d_at, d_stride, part, group),
            codegen)


@intrinsic
def lanes_fold(typingctx, part, acc, scale, group):  # noqa: ARG001
    """``acc[g] = fma(part[g], scale, acc[g])`` and ``part[g] = 0`` for the 8 lanes of each row ``g < group`` (at
    ``+ 16 g``): a super-block's sums into the row's lanes with its float scale."""
    if not _literal(group):
        return None

    def codegen(context, builder, signature, args):
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8_F32, [V8_F32] * 3), "llvm.fma.v8f32")
        d = splat(builder, args[2], V8_F32)
        for g in range(signature.args[-1].literal_value):
            at = [ir.Constant(ir.IntType(64), g * PAIRS)]
            p, a = (builder.bitcast(builder.gep(v, at), V8_F32.as_pointer()) for v in args[0:2])
            builder.store(builder.call(fma, [builder.load(p, align=4), d, builder.load(a, align=4)]), a, align=4)
            builder.store(ir.Constant(V8_F32, [0.0] * (PAIRS // 2)), p, align=4)
        return context.get_dummy_value()

    return types.void(part, acc, scale, group), codegen


@intrinsic
def lanes_zero(typingctx, acc, group):  # noqa: ARG001
    """``acc[0 : 16 group] = 0`` (the stack lanes of :func:`_fma_group`)."""
    if not _literal(group):
        return None

    def codegen(context, builder, signature, args):
        for g in range(signature.args[1].literal_value):
            at = builder.gep(args[0], [ir.Constant(ir.IntType(64), g * PAIRS)])
            builder.store(ir.Constant(V16_F32, [0.0] * PAIRS), builder.bitcast(at, V16_F32.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(acc, group), codegen


@intrinsic
def lanes_sums(typingctx, acc, group, sums):  # noqa: ARG001
    """``sums[g]`` = the sum of row ``g``'s 16 lanes at ``acc + 16 g`` for ``g < group``, pairwise (the upper half
    onto the lower, 16 -> 8 -> 4 -> 2 -> 1: four dependent adds instead of sixteen), the one-row loop's order too."""
    if not _literal(group):
        return None

    def codegen(context, builder, signature, args):
        for g in range(signature.args[1].literal_value):
            at = builder.gep(args[0], [ir.Constant(ir.IntType(64), g * PAIRS)])
            lanes = builder.load(builder.bitcast(at, V16_F32.as_pointer()), align=4)
            width = PAIRS
            while width > 1:
                width //= 2
                halves = [builder.shuffle_vector(lanes, lanes, ir.Constant(ir.VectorType(I32, width),
                                                                           list(range(k, k + width))))
                          for k in (0, width)]
                lanes = builder.fadd(*halves)
            out = builder.gep(args[2], [ir.Constant(ir.IntType(64), g)])
            builder.store(builder.extract_element(lanes, I32(0)), out)
        return context.get_dummy_value()

    return types.void(acc, group, sums), codegen


@inline
def _block(table, blocks, b, geo):
    """(first byte, scale ``d``) of block ``b`` of 32 values of a stored row; ``geo`` = (bytes per block, first
    quant byte, bias, byte of Q5's ``qh`` or -1, sub-blocks of 32 per block: 1, or IQ4_XS's 8, whose block
    ``b`` is sub-block ``b % 8`` of super-block ``b // 8``, returned as the byte 16 (b % 8) past the super-block's
    start, its scale ``d * (ls - 32)``)."""
    if geo[4] == 1:
        o = b * geo[0]
        prefetch(blocks, o)
        return o, table[np.int64(np.uint8(blocks[o])) | (np.int64(np.uint8(blocks[o + 1])) << 8)]
    sb, j = b // geo[4], b % geo[4]
    o = sb * geo[0]
    prefetch(blocks, o + 16 * j)
    low = (np.int64(np.uint8(blocks[o + 4 + j // 2])) >> (4 * (j % 2))) & 15
    high = (((np.int64(np.uint8(blocks[o + 2])) | (np.int64(np.uint8(blocks[o + 3])) << 8)) >> (2 * j)) & 3) << 4
    d = table[np.int64(np.uint8(blocks[o])) | (np.int64(np.uint8(blocks[o + 1])) << 8)]
    return o + 16 * j, d * np.float32(low + high - 32)


@inline
def _q5_bits(blocks, o, geo):
    """Q5_0's or Q5_1's ``qh`` (bit 4 of each value) of the block at byte ``o``, as a uint32."""
    qh = geo[3] + o
    return (np.uint32(np.uint8(blocks[qh])) | (np.uint32(np.uint8(blocks[qh + 1])) << np.uint32(8))
            | (np.uint32(np.uint8(blocks[qh + 2])) << np.uint32(16))
            | (np.uint32(np.uint8(blocks[qh + 3])) << np.uint32(24)))


@inline
def _qh(blocks, o, geo):
    """:func:`_q5_bits` of a 5-bit type, 0 for the others (``geo[3]`` -1)."""
    return _q5_bits(blocks, o, geo) if geo[3] >= 0 else np.uint32(0)


@inline
def _iq4_group(blocks, o, geo, xq, x_at, cols, xd, d_at, nb, d, acc, group):
    group_iq4_pairs_fma(blocks, o + geo[1], xq, x_at, cols, xd, d_at, nb, d, acc, group)


@inline
def _q4_group(blocks, o, geo, xq, x_at, cols, xd, d_at, nb, d, acc, group):
    group_nibble_pairs_fma(blocks, o + geo[1], None, geo[2], xq, x_at, cols, xd, d_at, nb, d, acc, group)


@inline
def _q5_group(blocks, o, geo, xq, x_at, cols, xd, d_at, nb, d, acc, group):
    group_nibble_pairs_fma(blocks, o + geo[1], _q5_bits(blocks, o, geo), geo[2], xq, x_at, cols, xd, d_at, nb, d,
                           acc, group)


@inline
def row_group(update, geo, group, r0, r1, i0, raw, xq, xd, xsum, table, out):
    """``out[i0 + g, r]`` for ``g < group`` (a literal) and stored rows ``r0 <= r < r1``: each block's pair sums
    by ``update`` (its weights read and unpacked once for the group), fused into each row's 16 lanes (in
    registers), the lanes summed in order; for the types with a minimum (``geo[5]``, its byte) plus
    ``sum_b m_b * xsum[i, b]`` (``xsum``: the float32 activation sums per 32)."""
    nb, cols = xd.shape[1], xq.shape[1]
    acc, sums = stack_f32(ACC_FLOATS), stack_f32(GEMV_ROWS)
    s, mins = carray(sums, (GEMV_ROWS,)), carray(stack_f32(GEMV_ROWS), (GEMV_ROWS,))
    for r in range(r0, r1):
        blocks = raw[r]
        lanes_zero(acc, group)
        for g in range(group):
            mins[g] = 0
        for b in range(nb):
            o, d = _block(table, blocks, b, geo)
            update(blocks, o, geo, xq, i0 * cols + b * 32, cols, xd, i0 * nb + b, nb, d, acc, group)
            if geo[5] >= 0:
                m = table[np.int64(np.uint8(blocks[o + geo[5]])) | (np.int64(np.uint8(blocks[o + geo[5] + 1])) << 8)]
                for g in range(group):
                    mins[g] += m * xsum[i0 + g, b]
        lanes_sums(acc, group, sums)
        for g in range(group):
            out[i0 + g, r] = s[g] + mins[g] if geo[5] >= 0 else s[g]


@inline
def quads_group(kind, form, geo, group, r0, r1, i0, raw, xu, xd, start, table, out):
    """:func:`row_group` by pairs of blocks (:func:`q8_0_quads_fma`, weights of ``kind``, a literal), each lane a
    sum over every other block of 4-product sums.  ``form`` (a literal): 0, ``xu`` [N, nb * 32] the activations plus
    128 as uint8 and ``xd`` [N, nb] their scales; :data:`EXPANDED`, ``xd`` [N, nb * 8] each block's scale 8 times;
    :data:`START` (one row, VNNI), ``xu`` the activations as int8, ``xd`` [N, nb] and ``start`` [N, nb * 8] the
    rows' -32 times each sum of 4 activations (:data:`.q8_act.B32`)."""
    cols, nd = xu.shape[1], xd.shape[1]
    nb = cols // 32
    per = nd // nb
    acc, sums = stack_f32(ACC_FLOATS), stack_f32(GEMV_ROWS)
    s = carray(sums, (GEMV_ROWS,))
    bias = geo[2]
    for r in range(r0, r1):
        blocks = raw[r]
        lanes_zero(acc, group)
        for b2 in range(nb // 2):
            b = 2 * b2
            o0, d0 = _block(table, blocks, b, geo)
            o1, d1 = _block(table, blocks, b + 1, geo)
            h0, h1 = _qh(blocks, o0, geo), _qh(blocks, o1, geo)
            x_at, d_at, s_at = i0 * cols + b * 32, i0 * nd + b * per, i0 * (cols // 4) + b * 8
            q0, q1 = o0 + geo[1], o1 + geo[1]
            q8_0_quads_fma(blocks, q0, q1, h0, h1, bias, kind, form, xu, x_at, cols, xd, d_at, nd, d0, d1, start,
                           s_at, acc, group)
        if nb % 2:
            b = nb - 1
            o0, d0 = _block(table, blocks, b, geo)
            h0 = _qh(blocks, o0, geo)
            x_at, d_at, s_at, q0 = i0 * cols + b * 32, i0 * nd + b * per, i0 * (cols // 4) + b * 8, o0 + geo[1]
            if form == START:
                q8_0_quads_fma(blocks, q0, q0, h0, h0, bias, kind, START_ALONE, xu, x_at, cols, xd, d_at, nd, d0, d0,
                               start, s_at, acc, group)
            elif form == EXPANDED:
                q8_0_quads_fma(blocks, q0, q0, h0, h0, bias, kind, EXPANDED_ALONE, xu, x_at, cols, xd, d_at, nd, d0,
                               d0, start, s_at, acc, group)
            else:
                q8_0_quads_fma(blocks, q0, q0, h0, h0, bias, kind, ALONE, xu, x_at, cols, xd, d_at, nd, d0, d0, start,
                               s_at, acc, group)
        # The row's last use after the branch of an odd last block: released in that branch or after it, the row
        # cost a call pair of numba's reference counting (and the lanes' spill around it) per row, measurable in
        # cache (docs/performance.md).
        prefetch(blocks, 0)
        lanes_sums(acc, group, sums)
        for g in range(group):
            out[i0 + g, r] = s[g]


@inline
def q8_0_quads(form, geo, group, r0, r1, i0, raw, xu, xd, start, table, out):
    """:func:`quads_group` of Q8_0 (``form`` in the protocol's ``update`` place, the start values in its ``xsum``)."""
    quads_group(BYTES, form, geo, group, r0, r1, i0, raw, xu, xd, start, table, out)


@inline
def q4_0_quads(form, geo, group, r0, r1, i0, raw, xu, xd, start, table, out):
    """:func:`quads_group` of Q4_0."""
    quads_group(NIBBLES, form, geo, group, r0, r1, i0, raw, xu, xd, start, table, out)


@inline
def q5_0_quads(form, geo, group, r0, r1, i0, raw, xu, xd, start, table, out):
    """:func:`quads_group` of Q5_0."""
    quads_group(BIT4, form, geo, group, r0, r1, i0, raw, xu, xd, start, table, out)


@inline
def row_groups(row, update, geo, raw, xq, xd, xsum, table, out):
    """``row(update, geo, group, r0, r1, i0, ...)`` (:func:`row_group`) over chunks of :data:`CHUNK` stored rows
    and, for each chunk, the activation rows in groups of :data:`GROUP`, then one of 4, 2 and 1 for the rest: a
    chunk's blocks come from memory once per product (the other groups find them in cache), and each activation
    row goes through the same operations whatever its group."""
    n, rows = xq.shape[0], raw.shape[0]
    full = n - n % GROUP
    for r0 in range(0, rows, CHUNK):
        r1 = min(r0 + CHUNK, rows)
        for i0 in range(0, full, GROUP):
            row(update, geo, GROUP, r0, r1, i0, raw, xq, xd, xsum, table, out)
        i0 = full
        if n - i0 >= 4:
            row(update, geo, 4, r0, r1, i0, raw, xq, xd, xsum, table, out)
            i0 += 4
        if n - i0 >= 2:
            row(update, geo, 2, r0, r1, i0, raw, xq, xd, xsum, table, out)
            i0 += 2
        if n - i0 >= 1:
            row(update, geo, 1, r0, r1, i0, raw, xq, xd, xsum, table, out)


# (bytes per block, first quant byte, bias, byte of qh or -1, sub-blocks of 32 per block, byte of the minimum or -1)
Q8_0_GEO, Q4_0_GEO = (Q8_0_BYTES, 2, 0, -1, 1, -1), (Q4_0().type_size, 2, 8, -1, 1, -1)
Q5_0_GEO, Q4_1_GEO = (Q5_0().type_size, 6, 16, 2, 1, -1), (Q4_1().type_size, 4, 0, -1, 1, 2)
Q5_1_GEO = (Q5_1().type_size, 8, 0, 4, 1, 2)
XS_SUBS = IQ4_XS().block_size // Q8_ACT_BLOCK
IQ4_NL_GEO, IQ4_XS_GEO = (IQ4_NL().type_size, 2, 0, -1, 1, -1), (IQ4_XS().type_size, 8, 0, -1, XS_SUBS, -1)
Q8_0_GEMV = types.void(I8_2D, U8_2D, F32_2D_C, F32_1D, F32_2D)  # activations + 128 as uint8
LEGACY_GEMV = types.void(U8_2D, I8_2D, F32_2D_C, F32_1D, F32_2D)
ROWS_Q = I8_2D if MADDUBS else I16_2D  # the multi-row kernels' activations (:meth:`Int8Kernel.forms`)
LEGACY_GEMV_ROWS = types.void(U8_2D, ROWS_Q, F32_2D_C, F32_1D, F32_2D)
MIN_GEMV = types.void(U8_2D, I8_2D, F32_2D_C, F32_2D_C, F32_1D, F32_2D)  # + activation sums per 32
MIN_GEMV_ROWS = types.void(U8_2D, ROWS_Q, F32_2D_C, F32_2D_C, F32_1D, F32_2D)
START_GEMV = types.void(U8_2D, I8_2D, F32_2D_C, I32_2D, F32_1D, F32_2D)  # int8 activations, scales, start values
QUADS_GEMV = types.void(U8_2D, U8_2D, F32_2D_C, F32_1D, F32_2D)  # Q4_0/Q5_0 by quads: activations + 128 as uint8


@compiled(Q8_0_GEMV)
def q8_0_gemv_q8(raw, xu, xd, table, out):
    row_groups(q8_0_quads, EXPANDED, Q8_0_GEO, raw, xu, xd, xd, table, out)


if VNNI:  # one row from start values: int8 activations, the weights as vpdpbusd's unsigned operand
    @compiled(types.void(I8_2D, I8_2D, F32_2D_C, I32_2D, F32_1D, F32_2D))
    def q8_0_gemv1_q8(raw, xq, xd, start, table, out):
        q8_0_quads(START, Q8_0_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, start, table, out)

    @compiled(START_GEMV)
    def q4_0_gemv1_vnni(raw, xq, xd, start, table, out):
        q4_0_quads(START, Q4_0_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, start, table, out)

    @compiled(QUADS_GEMV)
    def q4_0_gemv_vnni(raw, xu, xd, table, out):
        row_groups(q4_0_quads, EXPANDED, Q4_0_GEO, raw, xu, xd, xd, table, out)

    @compiled(START_GEMV)
    def q5_0_gemv1_vnni(raw, xq, xd, start, table, out):
        q5_0_quads(START, Q5_0_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, start, table, out)

    @compiled(QUADS_GEMV)
    def q5_0_gemv_vnni(raw, xu, xd, table, out):
        row_groups(q5_0_quads, EXPANDED, Q5_0_GEO, raw, xu, xd, xd, table, out)
else:
    @compiled(Q8_0_GEMV)
    def q8_0_gemv1_q8(raw, xu, xd, table, out):
        q8_0_quads(0, Q8_0_GEO, 1, 0, raw.shape[0], 0, raw, xu, xd, xd, table, out)


@compiled(LEGACY_GEMV)
def q4_0_gemv1_q8(raw, xq, xd, table, out):
    row_group(_q4_group, Q4_0_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def q4_0_gemv_q8(raw, xq, xd, table, out):
    row_groups(row_group, _q4_group, Q4_0_GEO, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV)
def q5_0_gemv1_q8(raw, xq, xd, table, out):
    row_group(_q5_group, Q5_0_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def q5_0_gemv_q8(raw, xq, xd, table, out):
    row_groups(row_group, _q5_group, Q5_0_GEO, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV)
def iq4_nl_gemv1_q8(raw, xq, xd, table, out):
    row_group(_iq4_group, IQ4_NL_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def iq4_nl_gemv_q8(raw, xq, xd, table, out):
    row_groups(row_group, _iq4_group, IQ4_NL_GEO, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV)
def iq4_xs_gemv1_q8(raw, xq, xd, table, out):
    row_group(_iq4_group, IQ4_XS_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xd, table, out)


@compiled(LEGACY_GEMV_ROWS)
def iq4_xs_gemv_q8(raw, xq, xd, table, out):
    row_groups(row_group, _iq4_group, IQ4_XS_GEO, raw, xq, xd, xd, table, out)


@compiled(MIN_GEMV)
def q4_1_gemv1_q8(raw, xq, xd, xsum, table, out):
    row_group(_q4_group, Q4_1_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xsum, table, out)


@compiled(MIN_GEMV_ROWS)
def q4_1_gemv_q8(raw, xq, xd, xsum, table, out):
    row_groups(row_group, _q4_group, Q4_1_GEO, raw, xq, xd, xsum, table, out)


@compiled(MIN_GEMV)
def q5_1_gemv1_q8(raw, xq, xd, xsum, table, out):
    row_group(_q5_group, Q5_1_GEO, 1, 0, raw.shape[0], 0, raw, xq, xd, xsum, table, out)


@compiled(MIN_GEMV_ROWS)
def q5_1_gemv_q8(raw, xq, xd, xsum, table, out):
    row_groups(row_group, _q5_group, Q5_1_GEO, raw, xq, xd, xsum, table, out)


q8_cfunc = declared_cfunc(Q8_ROW_PRODUCT)
# What quads_product and pairs_product read.
QUADS_SLOTS, PAIRS_SLOTS = slots(Q, XU, D, D8, B32), (slots(Q, D) if MADDUBS else slots(Q, Q16, D))


if VNNI:
    @inline
    def quads_product(gemv1, gemv, dtype, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out,
                      out_stride):
        """A :data:`.q8_act.Q8_ROW_PRODUCT` of a quads kernel (raw viewed as ``dtype``; :meth:`QuadsKernel.forms`):
        ``q``, ``d`` and ``b32`` for one row, ``xu`` and ``d8`` for several."""
        w, _, t, o = product_arrays(raw, rows, row_bytes, n, sums, 0, table, out, out_stride)
        q, xu, _, d, d8, b32 = form_arrays(forms, first, n, cols)
        if n == 1:
            gemv1(w.view(dtype), q, d, b32, t, o)
        else:
            gemv(w.view(dtype), xu, d8, t, o)
else:
    @inline
    def quads_product(gemv1, gemv, dtype, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out,
                      out_stride):
        """Without VNNI (Q8_0 only): ``xu`` and ``d`` for one row, ``xu`` and ``d8`` for several."""
        w, _, t, o = product_arrays(raw, rows, row_bytes, n, sums, 0, table, out, out_stride)
        _, xu, _, d, d8, _ = form_arrays(forms, first, n, cols)
        if n == 1:
            gemv1(w.view(dtype), xu, d, t, o)
        else:
            gemv(w.view(dtype), xu, d8, t, o)


@inline
def pairs_product(gemv1, gemv, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out,
                  out_stride):
    """A :data:`.q8_act.Q8_ROW_PRODUCT` of a pairs kernel: ``q`` and ``d`` for one row; for several, ``q`` with
    :data:`MADDUBS` (int8 into ``pmaddubsw``), else ``q16`` (widened once per product; :meth:`Int8Kernel.forms`).
    numba prunes the branch on the constant, so each CPU compiles one of the two."""
    w, _, t, o = product_arrays(raw, rows, row_bytes, n, sums, 0, table, out, out_stride)
    q, _, q16, d, _, _ = form_arrays(forms, first, n, cols)
    if n == 1:
        gemv1(w, q, d, t, o)
    elif MADDUBS:
        gemv(w, q, d, t, o)
    else:
        gemv(w, q16, d, t, o)


@inline
def pairs_sums_product(gemv1, gemv, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out,
                       out_stride):
    """:func:`pairs_product` of a kernel that also takes the float activation sums (per 32 or 16)."""
    w, s, t, o = product_arrays(raw, rows, row_bytes, n, sums, sums_cols, table, out, out_stride)
    q, _, q16, d, _, _ = form_arrays(forms, first, n, cols)
    if n == 1:
        gemv1(w, q, d, s, t, o)
    elif MADDUBS:
        gemv(w, q, d, s, t, o)
    else:
        gemv(w, q16, d, s, t, o)


@q8_cfunc
def q8_0_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    quads_product(q8_0_gemv1_q8, q8_0_gemv_q8, np.int8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                  table, out, out_stride)


if VNNI:
    @q8_cfunc
    def q4_0_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
        quads_product(q4_0_gemv1_vnni, q4_0_gemv_vnni, np.uint8, raw, rows, row_bytes, forms, first, n, cols, sums,
                      sums_cols, table, out, out_stride)

    @q8_cfunc
    def q5_0_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
        quads_product(q5_0_gemv1_vnni, q5_0_gemv_vnni, np.uint8, raw, rows, row_bytes, forms, first, n, cols, sums,
                      sums_cols, table, out, out_stride)
else:
    @q8_cfunc
    def q4_0_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
        pairs_product(q4_0_gemv1_q8, q4_0_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table,
                      out, out_stride)

    @q8_cfunc
    def q5_0_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
        pairs_product(q5_0_gemv1_q8, q5_0_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table,
                      out, out_stride)


@q8_cfunc
def iq4_nl_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_product(iq4_nl_gemv1_q8, iq4_nl_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table,
                  out, out_stride)


@q8_cfunc
def iq4_xs_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_product(iq4_xs_gemv1_q8, iq4_xs_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table,
                  out, out_stride)


@q8_cfunc
def q4_1_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_sums_product(q4_1_gemv1_q8, q4_1_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                       table, out, out_stride)


@q8_cfunc
def q5_1_q8_rows(raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols, table, out, out_stride):
    pairs_sums_product(q5_1_gemv1_q8, q5_1_gemv_q8, raw, rows, row_bytes, forms, first, n, cols, sums, sums_cols,
                       table, out, out_stride)


class Prepared(tuple):
    """:meth:`Int8Kernel.prepare` of more than ``direct_rows`` rows for :meth:`Int8Kernel.product`: the activations
    alone, and in ``exact`` the float kernel's preparation of them (no 8-bit forms: the exact kernel multiplies)."""

    exact: object


class Int8Kernel(JitKernel):
    """A matrix with 8-bit activations: up to ``direct_rows`` rows (and every row inside ``Workspace.rowwise``) by
    integer dot products (``gemv1_q8``/``gemv_q8``), more rows exactly as the type's float kernel (``exact``)."""

    block = Q8_ACT_BLOCK
    constants = (F16_TABLE,)
    # Products of up to this many rows by the integer kernels, more by the float kernel's tile and BLAS: on AVX2
    # without AVX-512 (:data:`MADDUBS`) the integer groups kept their rate per row up to 48 rows against a float
    # tile's SGEMM there; with AVX-512 the crossover was 8-16 rows (docs/performance.md).
    direct_rows = 32 if MADDUBS else 8
    exact: type[JitKernel]  # the type's float kernel, whose decoder prefill uses
    # The type's Q8_ROW_PRODUCT (called by address from the compiled decode step) and the slots of the forms table it
    # reads (:mod:`.q8_act`); ``sums_width``: the float activation sums it also takes (0: none).
    q8_row_product: object = None
    q8_slots = PAIRS_SLOTS

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "exact" in vars(cls):  # the stored type is its float kernel's
            cls.qtype = cls.exact.qtype

    def __init__(self, raw: np.ndarray) -> None:
        super().__init__(raw)
        self.exact_kernel = self.exact(raw)
        self.decode = self.exact_kernel.decode

    def prepare(self, x: np.ndarray, rowwise: bool = False) -> tuple:
        """The 8-bit activations, for the integer products (:meth:`product` of up to :attr:`direct_rows` rows, and
        ``rowwise`` :meth:`product_rows` of any); for :meth:`product` of more rows only the float kernel's own
        preparation of ``x`` (:class:`Prepared`), once per product rather than once per tile (its sums are
        per-row Python and numpy work, holding the GIL: prepared per tile, a prefill with ``q8`` ran slower than the
        exact one, thousands of preparations instead of one per product)."""
        if len(x) <= self.direct_rows or rowwise:
            x = self.checked(x)  # not aligned as the float row kernels' (read here only to quantize it)
            return (x, *self.activations(x))
        prepared = Prepared((x,))
        prepared.exact = self.exact_kernel.prepare(x)
        return prepared

    def product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        """Up to :attr:`direct_rows` rows by the integer dot products, more as the float kernel multiplies them
        (its own row kernels up to its ``direct_rows``, then a decoded tile and BLAS)."""
        if len(xk[0]) <= self.direct_rows:
            super().product(r0, r1, xk, out, scratch)
            return
        self.exact_kernel.product(r0, r1, xk.exact, out, scratch)

    def tile(self, r0: int, r1: int, scratch: Scratch) -> np.ndarray:
        """The float kernel's decoded tile (from its view of the stored rows)."""
        return self.exact_kernel.tile(r0, r1, scratch)

    @property
    def segments_exact(self) -> bool:
        """A product of more than :attr:`direct_rows` rows is the float kernel's; it decodes a tile for BLAS (as
        :meth:`product_segments` does) only where it takes no more rows by its own row kernels."""
        return self.direct_rows >= self.exact_kernel.direct_rows

    def activations(self, x: np.ndarray) -> tuple:
        """:func:`quantize_rows`'s ``q`` and ``d`` in the forms the kernels read (:meth:`forms`)."""
        q = np.empty(x.shape, np.int8)
        d = np.empty((len(x), x.shape[1] // Q8_ACT_BLOCK), np.float32)
        quantize_rows(x, q, d)
        return self.forms(q, d)

    def forms(self, q: np.ndarray, d: np.ndarray) -> tuple:
        """(the activations and their scales as the one-row kernel reads them, the activations and scales as
        the multi-row kernel does): int8, and int16 for more than one row (no widening per row and block) unless
        the kernels take int8 for all (:data:`MADDUBS`)."""
        return q, d, (q.astype(np.int16) if len(q) > 1 and not MADDUBS else q), d

    def _rows(self, raw: np.ndarray, x: np.ndarray, extra: list, out: np.ndarray) -> None:
        q, d, q_rows, d_rows, *rest = extra
        if len(x) == 1:
            self.gemv1_q8(raw, q, d, *rest, *self.constants, out)
        else:
            self.gemv_q8(raw, q_rows, d_rows, *rest, *self.constants, out)


class QuadsKernel(Int8Kernel):
    """A type multiplied by pairs of blocks (:func:`quads_group`): one row from ``q``, ``d`` and the start values
    ``b32`` where the CPU has AVX-512 VNNI (``xu`` and ``d`` elsewhere), several rows from ``xu`` and ``d8``."""

    q8_slots = QUADS_SLOTS

    def forms(self, q: np.ndarray, d: np.ndarray) -> tuple:
        """(q, d, xu, d8, b32): the activations, their scales, the activations plus 128 as uint8, each scale 8
        times (for several rows; one row's kernel reads ``d``), -32 times each sum of 4 activations (where the
        one-row kernel starts from them, :data:`VNNI`; else no columns): what each kernel reads, :meth:`_rows`."""
        xu = q.view(np.uint8) ^ np.uint8(128)
        d8 = np.repeat(d, PAIRS // 2, axis=1) if len(q) > 1 else d
        return q, d, xu, d8, start_values(q) if VNNI else np.empty((len(q), 0), np.int32)

    def _rows(self, raw: np.ndarray, x: np.ndarray, extra: list, out: np.ndarray) -> None:
        q, d, xu, d8, b32 = extra
        if len(x) == 1 and VNNI:
            self.gemv1_q8(raw, q, d, b32, *self.constants, out)
        elif len(x) == 1:
            self.gemv1_q8(raw, xu, d, *self.constants, out)
        else:
            self.gemv_q8(raw, xu, d8, *self.constants, out)


class Q8_0Int8Kernel(QuadsKernel):
    type_size, exact = Q8_0_BYTES, Q8_0JitKernel
    gemv1_q8, gemv_q8 = staticmethod(q8_0_gemv1_q8), staticmethod(q8_0_gemv_q8)
    q8_row_product = q8_0_q8_rows

    def stored(self, raw: np.ndarray) -> np.ndarray:
        return raw.view(np.int8)


if VNNI:
    class Q4_0Int8Kernel(QuadsKernel):
        """Q4_0 with AVX-512 VNNI: by pairs of blocks as Q8_0 (:func:`quads_group`, the nibbles as they are
        against ``q`` for one row, minus 8 against ``xu`` for several)."""

        type_size, exact = Q4_0_GEO[0], Q4_0JitKernel
        gemv1_q8, gemv_q8 = staticmethod(q4_0_gemv1_vnni), staticmethod(q4_0_gemv_vnni)
        q8_row_product = q4_0_q8_rows

    class Q5_0Int8Kernel(QuadsKernel):
        """Q5_0 with AVX-512 VNNI: as Q4_0, bit 4 from ``qh``."""

        type_size, exact = Q5_0_GEO[0], Q5_0JitKernel
        gemv1_q8, gemv_q8 = staticmethod(q5_0_gemv1_vnni), staticmethod(q5_0_gemv_vnni)
        q8_row_product = q5_0_q8_rows
else:
    class Q4_0Int8Kernel(Int8Kernel):
        """Q4_0 without VNNI: :func:`row_group`'s pairs."""

        type_size, exact = Q4_0_GEO[0], Q4_0JitKernel
        gemv1_q8, gemv_q8 = staticmethod(q4_0_gemv1_q8), staticmethod(q4_0_gemv_q8)
        q8_row_product = q4_0_q8_rows

    class Q5_0Int8Kernel(Int8Kernel):
        """Q5_0 without VNNI: :func:`row_group`'s pairs."""

        type_size, exact = Q5_0_GEO[0], Q5_0JitKernel
        gemv1_q8, gemv_q8 = staticmethod(q5_0_gemv1_q8), staticmethod(q5_0_gemv_q8)
        q8_row_product = q5_0_q8_rows


class IQ4_NLInt8Kernel(Int8Kernel):
    type_size, exact = IQ4_NL_GEO[0], IQ4_NLJitKernel
    gemv1_q8, gemv_q8 = staticmethod(iq4_nl_gemv1_q8), staticmethod(iq4_nl_gemv_q8)
    q8_row_product = iq4_nl_q8_rows


class IQ4_XSInt8Kernel(Int8Kernel):
    block, type_size, exact = IQ4_XS().block_size, IQ4_XS_GEO[0], IQ4_XSJitKernel
    gemv1_q8, gemv_q8 = staticmethod(iq4_xs_gemv1_q8), staticmethod(iq4_xs_gemv_q8)
    q8_row_product = iq4_xs_q8_rows


class Q4_1Int8Kernel(Int8Kernel):
    """Q4_1: ``d * q + m``, the minimums against the float32 activation sums per 32 (as Q4_K's)."""

    type_size, exact = Q4_1_GEO[0], Q4_1JitKernel
    gemv1_q8, gemv_q8 = staticmethod(q4_1_gemv1_q8), staticmethod(q4_1_gemv_q8)
    q8_row_product, sums_width = q4_1_q8_rows, Q8_ACT_BLOCK

    def activations(self, x: np.ndarray) -> tuple:
        return (*super().activations(x), sums_of(x, self.sums_width))


class Q5_1Int8Kernel(Q4_1Int8Kernel):
    type_size, exact = Q5_1_GEO[0], Q5_1JitKernel
    gemv1_q8, gemv_q8 = staticmethod(q5_1_gemv1_q8), staticmethod(q5_1_gemv_q8)
    q8_row_product = q5_1_q8_rows


class IQ4_XSAmxKernel(KQuantAmxPrompts, IQ4_XSInt8Kernel):
    """IQ4_XS with 8-bit activations in every product (``activations="q8"``); prompts on AMX tiles with q8_K
    activations (:mod:`.amx_k`)."""


class Q8_0AmxKernel(Q8_0AmxPrompts, Q8_0Int8Kernel):
    """Q8_0 with 8-bit activations in every product (``activations="q8"``); prompts on AMX tiles (:mod:`.amx`)."""


class Q4_0AmxKernel(Q4_0AmxPrompts, Q4_0Int8Kernel):
    """Q4_0 with 8-bit activations in every product (``activations="q8"``); prompts on AMX tiles
    (:mod:`.amx_blocks`)."""


class Q4_1AmxKernel(Q4_1AmxPrompts, Q4_1Int8Kernel):
    """Q4_1 with 8-bit activations in every product (``activations="q8"``); prompts on AMX tiles with q8_1
    activations (:mod:`.amx_blocks`)."""


class Q5_0AmxKernel(Q5_0AmxPrompts, Q5_0Int8Kernel):
    """Q5_0 with 8-bit activations in every product (``activations="q8"``); prompts on AMX tiles
    (:mod:`.amx_blocks`)."""


class Q5_1AmxKernel(Q5_1AmxPrompts, Q5_1Int8Kernel):
    """Q5_1 with 8-bit activations in every product (``activations="q8"``); prompts on AMX tiles with q8_1
    activations (:mod:`.amx_blocks`)."""


class IQ4_NLAmxKernel(IQ4_NLAmxPrompts, IQ4_NLInt8Kernel):
    """IQ4_NL with 8-bit activations in every product (``activations="q8"``); prompts on AMX tiles
    (:mod:`.amx_blocks`)."""


# This family's 8-bit kernels (:func:`.kernel_table`).
KERNELS = (Q8_0AmxKernel, Q4_0AmxKernel, Q4_1AmxKernel, Q5_0AmxKernel, Q5_1AmxKernel, IQ4_NLAmxKernel, IQ4_XSAmxKernel)
