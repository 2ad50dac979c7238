"""Compiled kernels of the dense types F32, F16 and BF16 (numba): the stored rows read in place (F32 as float32,
the 16-bit types as uint16).

Row ``i`` of the product keeps 32 float32 lanes ``acc[k] = fma(f32(w[c + k]), x[i, c + k], acc[k])`` over the
row's chunks of 32 columns ``c`` (a last partial chunk padded with zeros), summed once at the end (see
:mod:`.base`: the rows of a group share each widened chunk, their lanes held in registers).
F32 rows need no widening; the 16-bit ones are widened exactly: BF16 bits shifted into the high half of a uint32
and reinterpreted, F16 bits reinterpreted as LLVM ``half`` and extended (the hardware conversion; a signalling NaN
comes out quiet, its payload otherwise kept, where numpy keeps it signalling — still a NaN).

Assembly (numba 0.68, this Xeon with AVX-512 and F16C; ``inspect_asm``): per chunk F32 loads two zmm, F16 widens
with two packed ``vcvtph2ps`` to zmm, BF16 with ``vpmovzxwd`` + ``vpslld``; then per row of the group two
``vfmadd231ps`` with the activations as memory operands into accumulators held in zmm registers.

Why F32 has a kernel at all: BLAS multiplies float32 rows as they are, but a decode step of BLAS calls runs its
norms, attention and hand-offs from Python between the products; with a row kernel the compiled decode step
(:mod:`qwen_runtime.models.step_jit`) runs fp32 models too.  Prefill (more than ``direct_rows`` rows) still hands
the mapped rows to BLAS, with no copy.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from ...quants.base import QType
from ...quants.scratch import Scratch
from .base import (
    F32_2D,
    F32_2D_C,
    F32_2D_RO,
    GROUP_ROWS,
    HALF,
    I32,
    LANES,
    TILE_FLOATS,
    U16_2D,
    V16_F32,
    V16_I16,
    V16_I32,
    JitKernel,
    buffer_fma,
    compiled,
    deposit,
    gemv1_rows,
    gemv_groups,
    inline,
    lanes_sum,
    prefetch,
    prefetch_f32,
    product_arrays,
    row_cfunc,
    rows_fma,
    stack_f32,
    zero_lanes,
)


@intrinsic
def f16_to_f32(typingctx, bits):  # noqa: ARG001 (numba's intrinsic protocol)
    """The float16 whose bits are the uint16 ``bits``, as float32 (exact)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def bf16_to_f32(typingctx, bits):  # noqa: ARG001
    """The bfloat16 whose bits are the uint16 ``bits``, as float32 (exact: the high half of its bits)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.IntType(32)(16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(types.uint16), codegen


@inline
def same_f32(value):
    """F32's "widening": the value itself."""
    return value


def _widen_fma(kind: str) -> object:
    """An intrinsic ``(w, c, x, i0, rows, acc)``: ``acc[i, k] = fma(f32(w[c + k]), x[i0 + i, c + k], acc[i, k])``
    for ``i < rows`` (a literal) and the 32 lanes: the row's 32 stored values from ``c`` in two loads, ``<16 x
    float>`` for ``kind`` "f32", else ``<16 x i16>`` widened ("bf16": shifted into the high half, "f16": LLVM
    ``half`` extended)."""

    @intrinsic
    def widen_fma(typingctx, w, c, x, i0, rows, acc):  # noqa: ARG001
        if not isinstance(rows, types.IntegerLiteral):
            return None
        count = rows.literal_value

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            at = builder.bitcast(builder.gep(data, [args[1]]), (V16_F32 if kind == "f32" else V16_I16).as_pointer())
            halves = []
            for h in range(2):
                bits = builder.load(builder.gep(at, [I32(h)]), align=2)
                if kind == "f32":
                    halves.append(bits)
                elif kind == "bf16":
                    wide = builder.shl(builder.zext(bits, V16_I32), ir.Constant(V16_I32, [16] * HALF))
                    halves.append(builder.bitcast(wide, V16_F32))
                else:
                    halves.append(builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), HALF)), V16_F32))
            rows_fma(context, builder, signature.args[2], args[2], args[3], args[1], count, args[5], halves)
            return context.get_dummy_value()

        return types.void(w, c, x, i0, rows, acc), codegen

    return widen_fma


f32_fma, f16_fma, bf16_fma = _widen_fma("f32"), _widen_fma("f16"), _widen_fma("bf16")


@inline
def dense_group(widen, widen_fma, fetch, rows, raw, r, x, i0, c0, c1, out, acc):
    """``out[i0 + i, r] (+)= x[i0 + i, c0:c1] @ W[r, c0:c1]`` for ``i < rows`` (a literal): the columns by 32 into
    the group's lanes (held in registers; ``fetch`` the type's prefetch), then a last partial 32 (in the last
    chunk; none in the others) as 32 padded with zeros (its products add +0 to the other lanes), then each row's
    lanes summed."""
    n = x.shape[1]
    full = n - n % LANES
    zero_lanes(acc, rows)
    w = raw[r]
    for c in range(c0, min(c1, full), LANES):
        fetch(w, c)
        widen_fma(w, c, x, i0, rows, acc)
    # The tail without a branch of its own (zeros, so +0, where there is none): inside `if full < c1`, it made
    # numba count references to raw, x and out around every row (three call pairs), which cost most on short rows
    # (docs/performance.md).
    tail = carray(stack_f32(TILE_FLOATS), (GROUP_ROWS + 1, LANES))
    for i in range(rows + 1):
        for k in range(LANES):
            tail[i, k] = 0
    for k in range(max(c1 - full, 0)):
        tail[0, k] = widen(w[full + k])
        for i in range(rows):
            tail[1 + i, k] = x[i0 + i, full + k]
    buffer_fma(tail, rows, acc)
    for i in range(rows):
        deposit(out, i0 + i, r, lanes_sum(acc, i), c0)


@inline
def f32_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):  # noqa: ARG001
    dense_group(same_f32, f32_fma, prefetch_f32, rows, raw, r, x, i0, c0, c1, out, acc)


@inline
def f16_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):  # noqa: ARG001
    dense_group(f16_to_f32, f16_fma, prefetch, rows, raw, r, x, i0, c0, c1, out, acc)


@inline
def bf16_group(rows, stored, raw, r, x, i0, c0, c1, args, out, acc):  # noqa: ARG001
    dense_group(bf16_to_f32, bf16_fma, prefetch, rows, raw, r, x, i0, c0, c1, out, acc)


@inline
def decode_loop(widen, raw, tile):
    """``tile`` [R, n] = the rows widened to float32."""
    for r in range(raw.shape[0]):
        w, row = raw[r], tile[r]
        for k in range(raw.shape[1]):
            row[k] = widen(w[k])


GEMV = types.void(U16_2D, F32_2D_C, F32_2D)
DECODE = types.void(U16_2D, F32_2D_C)
F32_GEMV = types.void(F32_2D_RO, F32_2D_C, F32_2D)


@compiled(F32_GEMV)
def f32_gemv1(raw, x, out):
    gemv1_rows(f32_group, 1, raw, x, (), out, 0)


@compiled(F32_GEMV)
def f32_gemv(raw, x, out):
    gemv_groups(f32_group, raw, x, (), out, 0)


@compiled(GEMV)
def f16_gemv1(raw, x, out):
    gemv1_rows(f16_group, 1, raw, x, (), out, 0)


@compiled(GEMV)
def f16_gemv(raw, x, out):
    gemv_groups(f16_group, raw, x, (), out, 0)


@compiled(DECODE)
def f16_decode(raw, tile):
    decode_loop(f16_to_f32, raw, tile)


@compiled(GEMV)
def bf16_gemv1(raw, x, out):
    gemv1_rows(bf16_group, 1, raw, x, (), out, 0)


@compiled(GEMV)
def bf16_gemv(raw, x, out):
    gemv_groups(bf16_group, raw, x, (), out, 0)


@compiled(DECODE)
def bf16_decode(raw, tile):
    decode_loop(bf16_to_f32, raw, tile)


@inline
def dense_product(gemv1, gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride, dtype):
    """A :data:`~.base.ROW_PRODUCT` of a dense type (the stored rows viewed as ``dtype``, no sums, no table)."""
    w, xs, _, _, o = product_arrays(raw, rows, row_bytes, x, n, cols, sums, 0, table, out, out_stride)
    if n == 1:
        gemv1(w.view(dtype), xs, o)
    else:
        gemv(w.view(dtype), xs, o)


@row_cfunc
def f32_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    dense_product(f32_gemv1, f32_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride,
                  np.float32)


@row_cfunc
def f16_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    dense_product(f16_gemv1, f16_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride,
                  np.uint16)


@row_cfunc
def bf16_rows(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    dense_product(bf16_gemv1, bf16_gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride,
                  np.uint16)


class DenseJitKernel(JitKernel):
    """A dense matrix, stored rows viewed as ``dtype`` (one element per "block")."""

    block = 1
    dtype: type = np.uint16

    def stored_unit(self) -> int:
        return 1

    def stored(self, raw: np.ndarray) -> np.ndarray:
        return raw.view(self.dtype)


class F32JitKernel(DenseJitKernel):
    """Float32 rows: the row kernels read them in place, and BLAS multiplies the mapped rows themselves (no tile)."""
    qtype = QType.F32

    qtype, type_size, dtype = QType.F32, 4, np.float32
    gemv1, gemv = staticmethod(f32_gemv1), staticmethod(f32_gemv)
    row_product = f32_rows

    def tile(self, r0: int, r1: int, scratch: Scratch) -> np.ndarray:
        return self.raw[r0:r1]


class F16JitKernel(DenseJitKernel):
    qtype = QType.F16
    qtype, type_size = QType.F16, 2
    gemv1, gemv, decode = staticmethod(f16_gemv1), staticmethod(f16_gemv), staticmethod(f16_decode)
    row_product = f16_rows


class BF16JitKernel(DenseJitKernel):
    qtype = QType.BF16
    qtype, type_size = QType.BF16, 2
    gemv1, gemv, decode = staticmethod(bf16_gemv1), staticmethod(bf16_gemv), staticmethod(bf16_decode)
    row_product = bf16_rows


# This family's float kernels (:func:`.kernel_table`).
KERNELS = (F32JitKernel, F16JitKernel, BF16JitKernel)
