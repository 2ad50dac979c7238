"""Compiled (numba) twins of :mod:`.ops` for the small operations of a decode step, and the scalar helpers the
other compiled kernels share (``exp32``, ``sigmoid32``, ``silu32``, sums).

Imported only when a workspace runs with ``kernels="numba"``; :mod:`.ops` stays the reference.  Shapes as
there; every kernel takes and writes float32.

**Error model** (u = 2^-24, the float32 unit roundoff):

* ``exp32`` is a Cody-Waite reduction x = n·ln2 + r (|r| ≤ ln2/2, ln2 split in two constants so n·ln2 is
  exact) and the degree-7 polynomial of Cephes' ``expf``; the polynomial's own error is below u and its
  evaluation ends with three roundings, so the result is within 2 ulp (relative 2^-22) of exp(x).  Inputs are
  clamped to [-87.3, 127.5·ln2]: the result is never subnormal nor infinite (exp of -inf is e^-87.3 = 1.04·FLT_MIN,
  not 0; callers that need an exact 0 say so).  Written without calls, so loops over it vectorise; numba's own
  ``math.exp`` calls libm's scalar ``expf``, which keeps the loops scalar.
* Sums of D terms (:func:`dot`, :func:`sum_squares`, :func:`total`) are the only code compiled with a fast-math
  flag, ``reassoc``, so that LLVM sums them in vertical float32 lanes; numpy sums in pairwise blocks.  Each is
  within (D-1)·u·Σ|terms| of the exact sum, so the two differ by at most 2(D-1)·u·Σ|terms|.  No FMA contraction:
  everything else rounds in the same order as the numpy reference.
* The lanes' order depends only on D and on the compiled loop, which numba specialises per array layout (a
  strided row is summed in another order than a contiguous one).  The wrappers hand the kernels C-contiguous
  arrays (a copy only for a caller's strided view), so a row gives the same bits alone and in a batch.
* ``rms_norm``: the mean square differs by the sum bound, which reaches the output halved through the square root,
  plus the reference's and the twin's own five roundings: |twin - ref| ≤ (D + 10)·u·|ref| per element.

Batch rows are computed one by one by the same code, so a row's result does not depend on the rows around it.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .jit_setup import prepare_numba

prepare_numba()  # before the first compile or cache load of the compiled ops

# error_model="numpy": IEEE division as numpy's (x/0 = inf), not Python's ZeroDivisionError check, which kept a
# SiLU loop scalar
JIT = {"nogil": True, "cache": True, "error_model": "numpy"}
SUMS = {"reassoc"}  # fast-math flags of the functions that only sum: their terms may be regrouped, nothing else

F32 = np.float32
ONE, HALF, ZERO = F32(1.0), F32(0.5), F32(0.0)
LOG2E = F32(1.4426950408889634)
LN2_HI, LN2_LO = F32(0.693359375), F32(-2.12194440e-4)  # ln 2 = LN2_HI + LN2_LO; n·LN2_HI is exact for |n| < 2^9
EXP_MIN = F32(-87.3)  # just above ln(FLT_MIN) = -87.34: exp32 is never subnormal
EXP_MAX = F32(88.3762626647949)  # 127.5·ln 2: n ≤ 127, never infinite
EXP_POLY = tuple(F32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                  1.6666665459e-1, 5.0000001201e-1))
P0, P1, P2, P3, P4, P5 = EXP_POLY


@intrinsic
def _pow2(typingctx, n):  # noqa: ARG001 (numba's signature)
    """2^n for an integer-valued float32 n in [-126, 127], from its exponent bits (a bit cast numba lacks)."""
    if n != types.float32:
        return None

    def codegen(context, builder, signature, args):  # noqa: ARG001
        bits = builder.add(builder.fptosi(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 127))
        return builder.bitcast(builder.shl(bits, ir.Constant(ir.IntType(32), 23)), ir.FloatType())

    return types.float32(types.float32), codegen


@njit(**JIT)
def exp32(x: float) -> float:
    """exp of a float32 within 2 ulp, its input clamped to [-87.3, 127.5·ln2] (see the module docstring)."""
    x = min(max(x, EXP_MIN), EXP_MAX)
    n = np.floor(x * LOG2E + HALF)
    r = x - n * LN2_HI
    r = r - n * LN2_LO
    p = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5
    return (p * (r * r) + r + ONE) * _pow2(n)


@njit(**JIT)
def sigmoid32(x: float) -> float:
    """1 / (1 + e^-x), as :func:`.ops.sigmoid`."""
    return ONE / (ONE + exp32(-x))


@njit(**JIT)
def silu32(x: float) -> float:
    """x / (1 + e^-x), as :func:`.ops.silu` (for x ≪ 0 a tiny negative number where numpy gives -0)."""
    return x / (ONE + exp32(-x))


@njit(fastmath=SUMS, **JIT)
def dot(a: np.ndarray, b: np.ndarray) -> float:
    """Σ a·b, vectorised in vertical lanes.  # [D], [D] -> float32 (C-contiguous: see the module docstring)"""
    s = ZERO
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


@njit(fastmath=SUMS, **JIT)
def sum_squares(x: np.ndarray) -> float:
    """Σ x², as :func:`dot` sums.  # [D] -> float32"""
    s = ZERO
    for i in range(x.shape[0]):
        s += x[i] * x[i]
    return s


@njit(fastmath=SUMS, **JIT)
def total(x: np.ndarray) -> float:
    """Σ x, as :func:`dot` sums.  # [D] -> float32"""
    s = ZERO
    for i in range(x.shape[0]):
        s += x[i]
    return s


@njit(**JIT)
def norm_row(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out ← x / sqrt(mean(x²) + eps) · weight, rounded as :func:`.ops.rms_norm`.  # [D], [D] -> [D]"""
    d = x.shape[0]
    var = sum_squares(x) / F32(d) + eps
    inv = ONE / np.sqrt(var)
    for i in range(d):
        out[i] = x[i] * inv * weight[i]


@njit(**JIT)
def rms_norm_rows(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """:func:`norm_row` of every row.  # [N, D], [D] -> [N, D] (``out`` may be ``x``)"""
    for r in range(x.shape[0]):
        norm_row(x[r], weight, eps, out[r])


@njit(**JIT)
def add_rms_norm_rows(h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float, total: np.ndarray,
                      out: np.ndarray) -> None:
    """total ← h + delta; out ← rms_norm(total): a residual add and the next norm in one pass.  # 4 x [N, D]"""
    for r in range(h.shape[0]):
        for i in range(h.shape[1]):
            total[r, i] = h[r, i] + delta[r, i]
        norm_row(total[r], weight, eps, out[r])


@njit(**JIT)
def silu_mul_rows(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """out ← SiLU(gate)·up, rounded as :func:`.ops.silu_mul` but for exp32.  # 3 x [N, I] (``out`` may be ``gate``;
    any row strides: elementwise, so the layout changes no result)"""
    for r in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            x = gate[r, i]
            out[r, i] = x / (ONE + exp32(-x)) * up[r, i]


def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Twin of :func:`.ops.silu_mul` (SwiGLU's activation; its caller, ``weights.gated_matmul``, picks it by the
    workspace's kernels).  # [N, I], [N, I] -> [N, I]"""
    out = np.empty(gate.shape, np.float32) if out is None else out
    silu_mul_rows(gate, up, out)
    return out


def rows2d(x: np.ndarray) -> np.ndarray:
    """``x`` [..., D] as C-contiguous rows [N, D] (a copy only when ``x`` is a strided view)."""
    return np.ascontiguousarray(x).reshape(-1, x.shape[-1])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """Twin of :func:`.ops.rms_norm`.  # [..., D] -> [..., D] (``out``, C-contiguous, may be ``x``)"""
    out = np.empty(x.shape, np.float32) if out is None else out
    if not out.flags.c_contiguous:
        raise ValueError("ops_jit.rms_norm writes C-contiguous arrays only")
    rms_norm_rows(rows2d(x), weight, F32(eps), out.reshape(-1, x.shape[-1]))
    return out


def add_rms_norm(h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``(h + delta, rms_norm(h + delta))``.  # 2 x [..., D] -> 2 x [..., D]"""
    summed, out = np.empty(h.shape, np.float32), np.empty(h.shape, np.float32)
    add_rms_norm_rows(rows2d(h), rows2d(delta), weight, F32(eps), rows2d(summed), rows2d(out))
    return summed, out
