"""Compiled integer-dot kernels with 8-bit activations (``activations="q8"``, numba): Q8_0 weights times
activations quantized per 32-block (:mod:`.q8_act`, the plain reference).

A product first quantizes its activation rows once (:func:`quantize_rows`, the same float32 operations as
:func:`.q8_act.quantize_activations`, bit for bit).  Row ``r`` then keeps 16 float32 lanes; per block ``b``
the 32 weight bytes and the 32 activation bytes are sign-extended to int16, multiplied in pairs and the pairs
added in int32 (``<16 x i32>``, exact: one ``vpmaddwd``), converted to float32 (exact: below 2^24) and fused
into the lanes, ``lanes = fma(pairs, d_w * d_x, lanes)`` (:func:`pairs_fma`); the lanes are summed once at
the end.  Every row goes through the same operations whatever the other rows (the server's batch invariance).

Assembly (numba 0.68, this Xeon with AVX-512; ``inspect_asm``): per block two ``vpmovsxbw`` (one per operand,
straight from memory), ``vpmaddwd``, ``vcvtdq2ps`` and ``vfmadd...ps`` on 512-bit registers (or their 256-bit
pairs), against the float kernel's four conversions, multiplications and FMAs per 8 weights.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import carray, config, types
from numba.core import cgutils
from numba.extending import intrinsic

from .jit_base import (
    ACC_FLOATS,
    F16_TABLE,
    F32_1D,
    F32_2D,
    F32_2D_C,
    GEMV_ROWS,
    I8_2D,
    LANES,
    JitKernel,
    compiled,
    stack_f32,
)
from .q8_0 import Q8_0_BLOCK, Q8_0_BYTES
from .q8_act import Q8_ACT_BLOCK, Q8_ACT_MAX

PAIRS = Q8_ACT_BLOCK // 2  # int32 lanes of a block's products (pairs of adjacent products)
I8_2D_W = types.int8[:, ::1]  # quantized activations (written by quantize_rows)
I16, I32, F32 = ir.IntType(16), ir.IntType(32), ir.FloatType()
V32_I8, V32_I16 = ir.VectorType(ir.IntType(8), Q8_ACT_BLOCK), ir.VectorType(I16, Q8_ACT_BLOCK)
V16_I16, V16_I32, V16_F32 = ir.VectorType(I16, PAIRS), ir.VectorType(I32, PAIRS), ir.VectorType(F32, PAIRS)
V8_I32, I8P = ir.VectorType(I32, PAIRS // 2), ir.IntType(8).as_pointer()
# How far ahead of the block being multiplied the weights are prefetched.  One row, one thread, out of cache,
# ms of CPU per million Q8_0 weights (loaded machine): none 0.157, 512 bytes 0.131, 1024 0.124, 2048 0.098-0.107,
# 4096 0.098-0.099, 8192 0.107: the hardware prefetchers alone leave the loop waiting for memory.
PREFETCH_BYTES = 2048


def _pointer(context, builder: ir.IRBuilder, array_type: types.Array, array: ir.Value, at: ir.Value,
             vector: ir.VectorType) -> ir.Value:
    """``&array[at]`` (flat element index) as a pointer to ``vector``."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [at]), vector.as_pointer())


def _target_features() -> frozenset[str]:
    """The CPU features numba compiles for (its own choice: ``NUMBA_CPU_FEATURES``, else the host's), which
    also key its on-disk cache, so a kernel cached for one CPU is never loaded on another."""
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else llvm.get_host_cpu_features().flatten()
    return frozenset(f[1:] for f in features.split(",") if f.startswith("+"))


FEATURES = _target_features()


def _pairs(builder: ir.IRBuilder, w: ir.Value, x: ir.Value) -> ir.Value:
    """``<16 x i32>``: ``w[2j] * x[2j] + w[2j+1] * x[2j+1]`` for two ``<32 x i8>``, exact: ``pmaddwd`` on the
    int16 widening (LLVM does not match the generic form, which it narrows to int16 products, to it), in
    one 512-bit instruction with AVX-512BW, two 256-bit ones with AVX2, the generic IR elsewhere."""
    w16, x16 = builder.sext(w, V32_I16), builder.sext(x, V32_I16)
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


def _prefetch(builder: ir.IRBuilder, at: ir.Value) -> None:
    """Ask for the weight bytes :data:`PREFETCH_BYTES` ahead of ``at`` (a hint: never faults, even past the
    end of the rows)."""
    prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [I8P, I32, I32, I32]),
                                              "llvm.prefetch.p0i8")
    ahead = builder.gep(builder.bitcast(at, I8P), [ir.Constant(ir.IntType(64), PREFETCH_BYTES)])
    builder.call(prefetch, [ahead, I32(0), I32(3), I32(1)])  # read, keep in all cache levels, data


@intrinsic
def pairs_fma(typingctx, w, w_at, x, x_at, scale, acc):  # noqa: ARG001 (numba's intrinsic protocol)
    """``acc[j] = fma(f32(pairs[j]), scale, acc[j])`` for the 16 pair sums of the 32 int8 weights at ``w[w_at]``
    and the 32 int8 activations at ``x[x_at]`` (flat indices of C-contiguous arrays; ``acc``: 16 float32)."""

    def codegen(context, builder, signature, args):
        wa, wat, xa, xat, d, lanes = args
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16_F32, [V16_F32] * 3), "llvm.fma.v16f32")
        wp = _pointer(context, builder, signature.args[0], wa, wat, V32_I8)
        _prefetch(builder, wp)
        qw = builder.load(wp, align=1)
        qx = builder.load(_pointer(context, builder, signature.args[2], xa, xat, V32_I8), align=1)
        pairs = builder.sitofp(_pairs(builder, qw, qx), V16_F32)
        at = _pointer(context, builder, signature.args[5], lanes, ir.Constant(ir.IntType(64), 0), V16_F32)
        splat = builder.insert_element(ir.Constant(V16_F32, ir.Undefined), d, I32(0))
        splat = builder.shuffle_vector(splat, ir.Constant(V16_F32, ir.Undefined), ir.Constant(V16_I32, [0] * PAIRS))
        builder.store(builder.call(fma, [pairs, splat, builder.load(at, align=4)]), at, align=4)
        return context.get_dummy_value()

    return types.void(w, w_at, x, x_at, scale, acc), codegen


@compiled(types.void(F32_2D_C, I8_2D_W, F32_2D_C), contract=False)
def quantize_rows(x, q, d):
    """``q``, ``d`` = :func:`.q8_act.quantize_activations` of ``x`` [N, nb * 32] (the same float32 operations)."""
    nb = d.shape[1]
    for i in range(x.shape[0]):
        for b in range(nb):
            xs = x[i, b * 32: b * 32 + 32]
            amax = np.float32(0)
            for k in range(32):
                amax = max(amax, abs(xs[k]))
            scale = amax / Q8_ACT_MAX
            inverse = np.float32(1) / scale if scale > 0 else np.float32(0)
            d[i, b] = scale
            for k in range(32):
                q[i, b * 32 + k] = np.int8(np.rint(xs[k] * inverse))


@compiled(types.void(I8_2D, I8_2D, F32_2D_C, F32_1D, F32_2D))
def q8_0_gemv_q8(raw, xq, xd, table, out):
    """``out[i, r] = sum_b d_w[r, b] * d_x[i, b] * (W[r, b] . q[i, b])`` for Q8_0 rows ``raw`` [R, nb * 34] and
    1..GEMV_ROWS quantized activation rows ``xq`` [N, nb * 32], ``xd`` [N, nb]."""
    n, nb = xq.shape[0], xd.shape[1]
    acc = carray(stack_f32(ACC_FLOATS), (GEMV_ROWS, LANES))
    for r in range(raw.shape[0]):
        blocks = raw[r]
        for i in range(n):
            for k in range(PAIRS):
                acc[i, k] = 0
        for b in range(nb):
            d = table[np.int64(np.uint8(blocks[b * 34])) | (np.int64(np.uint8(blocks[b * 34 + 1])) << 8)]
            for i in range(n):
                pairs_fma(blocks, b * 34 + 2, xq[i], b * 32, d * xd[i, b], acc[i])
        for i in range(n):
            s = np.float32(0)
            for k in range(PAIRS):
                s += acc[i, k]
            out[i, r] = s


@compiled(types.void(I8_2D, I8_2D, F32_2D_C, F32_1D, F32_2D))
def q8_0_gemv1_q8(raw, xq, xd, table, out):
    """:func:`q8_0_gemv_q8` for one activation row (the same operations, its lanes kept in registers)."""
    nb = xd.shape[1]
    acc = carray(stack_f32(PAIRS), (PAIRS,))
    xr, dr = xq[0], xd[0]
    for r in range(raw.shape[0]):
        blocks = raw[r]
        for k in range(PAIRS):
            acc[k] = 0
        for b in range(nb):
            d = table[np.int64(np.uint8(blocks[b * 34])) | (np.int64(np.uint8(blocks[b * 34 + 1])) << 8)]
            pairs_fma(blocks, b * 34 + 2, xr, b * 32, d * dr[b], acc)
        s = np.float32(0)
        for k in range(PAIRS):
            s += acc[k]
        out[0, r] = s


class Q8_0Int8Kernel(JitKernel):
    """Q8_0 with 8-bit activations: rows up to ``direct_rows`` (and every row inside ``Workspace.rowwise``) by
    integer dot products, more rows exactly as :class:`.jit_q8_0.Q8_0JitKernel` (decoded tile, BLAS)."""

    block, type_size = Q8_0_BLOCK, Q8_0_BYTES
    constants = (F16_TABLE,)

    def __init__(self, raw: np.ndarray) -> None:
        super().__init__(raw)
        from .jit_q8_0 import q8_0_decode

        self.decode = q8_0_decode

    def stored(self, raw: np.ndarray) -> np.ndarray:
        return raw.view(np.int8)

    def activations(self, x: np.ndarray) -> tuple:
        q = np.empty(x.shape, np.int8)
        d = np.empty((len(x), x.shape[1] // Q8_ACT_BLOCK), np.float32)
        quantize_rows(x, q, d)
        return q, d

    def gemv(self, raw, x, q, d, table, out) -> None:  # noqa: ANN001 (the compiled call's arguments)
        (q8_0_gemv1_q8 if len(q) == 1 else q8_0_gemv_q8)(raw, q, d, table, out)
