"""The per-sub-block scale searches of llama.cpp's K-quant and IQ4 quantizers, compiled with numba.

Each kernel walks all sub-blocks (or super-blocks) of a chunk of rows and repeats, in float32 and in the
same order, the operations of the llama.cpp function it is named after (``ggml/src/ggml-quants.c``), so the
integers and float32 scales it returns are the ones llama.cpp computes:

* every operation is one IEEE float32 operation.  The ``libggml-base.so`` that llama-cpp-python 0.3.36
  builds (and ``llama-quantize`` links) holds no fused multiply-add at all (``objdump -d`` finds no ``vfmadd``:
  ggml-base is compiled for baseline x86-64 even with ``GGML_NATIVE=ON``, only ggml-cpu gets ``-march``), and
  numba without ``fastmath`` neither contracts ``a * b + c`` nor reorders sums, so no FMA is emulated;
* a float division by zero gives C's infinity or NaN (``error_model="numpy"``), never a Python exception;
  the kernels release the GIL (``nogil``), so threads may encode parts of a chunk at once;
* integers meet floats as C converts them: ``w * l`` is ``w * (float)l``, promoted by hand here because numba
  would widen ``float32 * int`` to float64;
* :func:`nearest_int` is ggml's magic-number rounding (``fval + 12582912.f``, then the low 23 bits of the
  sum), half-to-even, with the same wrapped result for out-of-range, infinite and NaN inputs (tiny sub-blocks
  make ``iscale`` infinite).

The packing of the integers into blocks and the float16 rounding of the block scales are vectorised numpy in
:mod:`qwen_convert.kquant_encode` and :mod:`qwen_convert.iq4_encode`.  Shapes: ``x`` is float32 ``[S, n]`` (S
sub-blocks of n values) or ``[B, 256]`` (super-blocks); ``L`` outputs are uint8 of the same shape.  An
importance matrix ``qw`` holds the weights of one row's (sub-)blocks, ``[S_row, n]``: (sub-)block ``s`` of
``x`` uses ``qw[s % len(qw)]``, as llama.cpp restarts ``quant_weights`` at every row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from qwen_runtime.backend.jit_setup import prepare_numba

prepare_numba(Path(__file__).parent)  # numba as the runtime sets it up; this package's code filed and stamped alike

F32 = np.float32
MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding it leaves round(f) in the low mantissa bits
GROUP_MAX_EPS = np.float32(1e-15)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)


@intrinsic
def _float32_bits(typingctx, value):  # noqa: ARG001 (numba's intrinsic signature)
    """The bits of a float32 as an int32 (a register move, as C's ``memcpy``)."""
    signature = types.int32(types.float32)

    def codegen(context, builder, sig, args):  # noqa: ARG001
        return builder.bitcast(args[0], ir.IntType(32))

    return signature, codegen


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def nearest_int(f: float) -> int:
    """ggml's ``nearest_int`` of a float32: the low 23 bits of ``f + 1.5 * 2**23``, minus 2**22 (round half to
    even for |f| <= 4194303; the same wrapped values beyond, and for infinities and NaN)."""
    return (_float32_bits(F32(f) + MAGIC) & 0x7FFFFF) - 0x400000


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def signed_absmax(x: np.ndarray) -> tuple[float, float]:
    """(max |x|, the value of x where it is first reached), as llama.cpp's searches find them (first wins ties)."""
    amax, vmax = ZERO, ZERO
    for i in range(len(x)):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            vmax = x[i]
    return amax, vmax


@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def best_index_int8(values: np.ndarray, x: float) -> int:
    """Index of the level of ``values`` (16 sorted int8) nearest to float32 ``x`` (llama.cpp's bisection)."""
    n = len(values)
    if x <= F32(values[0]):
        return 0
    if x >= F32(values[n - 1]):
        return n - 1
    lo, hi = 0, n - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < F32(values[mid]):
            hi = mid
        else:
            lo = mid
    return hi - 1 if x - F32(values[hi - 1]) < F32(values[hi]) - x else hi


@njit(cache=True, error_model="numpy", nogil=True)
def make_qkx2_quants(x: np.ndarray, w: np.ndarray, L: np.ndarray, Laux: np.ndarray, nmax: int, rmin: float,
                     rdelta: float, nstep: int, use_mad: bool) -> tuple[float, float]:
    """llama.cpp's ``make_qkx2_quants`` (and ``make_qkx3_quants``, the same search given its weights) on one
    sub-block ``x`` [n] with weights ``w`` [n]: fills ``L`` (0..nmax), returns (scale, the_min)."""
    n = len(x)
    fmax = F32(nmax)
    lo, hi = x[0], x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < lo:
            lo = x[i]
        if x[i] > hi:
            hi = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if lo > ZERO:
        lo = ZERO
    if not hi > lo:  # qkx2 tests max == min, qkx3 max <= min: the same once min <= max (NaN aside)
        L[:] = 0
        return ZERO, -lo
    iscale = fmax / (hi - lo)
    scale = ONE / iscale
    best_error = ZERO
    for i in range(n):
        q = min(nmax, max(0, nearest_int(iscale * (x[i] - lo))))
        L[i] = q
        diff = scale * F32(q) + lo - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += w[i] * diff
    for step in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + fmax) / (hi - lo)
        sum_l, sum_l2, sum_xl = ZERO, ZERO, ZERO
        for i in range(n):
            q = min(nmax, max(0, nearest_int(iscale * (x[i] - lo))))
            Laux[i] = q
            fq = F32(q)
            sum_l += w[i] * fq
            sum_l2 += w[i] * fq * fq
            sum_xl += w[i] * fq * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > ZERO:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > ZERO:
                this_min = ZERO
                this_scale = sum_xl / sum_l2
            cur_error = ZERO
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += w[i] * diff
            if cur_error < best_error:
                L[:] = Laux
                best_error = cur_error
                scale = this_scale
                lo = this_min
    return scale, -lo


@njit(cache=True, error_model="numpy", nogil=True)
def make_qx_quants(x: np.ndarray, L: np.ndarray, nmax: int, w: np.ndarray) -> float:
    """llama.cpp's ``make_qx_quants`` with ``rmse_type`` 1 and weights ``w`` [n] (its ``qw``, or x*x when that
    is NULL): fills ``L`` with l + nmax (0..2 nmax - 1), returns the scale."""
    n = len(x)
    amax, vmax = signed_absmax(x)
    if amax < GROUP_MAX_EPS:
        L[:] = 0
        return ZERO
    fmax = F32(nmax)
    iscale = F32(-nmax) / vmax
    sumlx, suml2 = ZERO, ZERO
    for i in range(n):
        q = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = q + nmax
        fq = F32(q)
        sumlx += w[i] * x[i] * fq
        suml2 += w[i] * fq * fq
    scale = sumlx / suml2 if suml2 != ZERO else ZERO
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fmax + F32(0.1) * F32(step)) / vmax
        sumlx, suml2 = ZERO, ZERO
        for i in range(n):
            fq = F32(max(-nmax, min(nmax - 1, nearest_int(iscale * x[i]))))
            sumlx += w[i] * x[i] * fq
            suml2 += w[i] * fq * fq
        if suml2 > ZERO and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(cache=True, error_model="numpy", nogil=True)
def make_q3_quants(x: np.ndarray, L: np.ndarray, nmax: int, ls: np.ndarray) -> float:
    """llama.cpp's ``make_q3_quants`` with ``do_rmse``: fills ``L`` with l + nmax, returns the scale (``ls``:
    int32 scratch [n] for the signed integers)."""
    n = len(x)
    amax, vmax = signed_absmax(x)
    if amax < GROUP_MAX_EPS:
        L[:] = 0
        return ZERO
    iscale = F32(-nmax) / vmax
    sumlx, suml2 = ZERO, ZERO
    for i in range(n):
        q = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        ls[i] = q
        w = x[i] * x[i]
        fq = F32(q)
        sumlx += w * x[i] * fq
        suml2 += w * fq * fq
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = x[i] * x[i]
            fl = F32(ls[i])
            slx = sumlx - w * x[i] * fl
            if slx > ZERO:
                sl2 = suml2 - w * fl * fl
                new_l = max(-nmax, min(nmax - 1, nearest_int(x[i] * sl2 / slx)))
                if new_l != ls[i]:
                    fn = F32(new_l)
                    slx += w * x[i] * fn
                    sl2 += w * fn * fn
                    if sl2 > ZERO and slx * slx * suml2 > sumlx * sumlx * sl2:
                        ls[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(n):
        L[i] = ls[i] + nmax
    return sumlx / suml2 if suml2 > ZERO else ZERO


@njit(cache=True, error_model="numpy", nogil=True)
def make_qp_quants(x: np.ndarray, L: np.ndarray, nmax: int, qw: np.ndarray, ls: np.ndarray) -> float:
    """llama.cpp's ``make_qp_quants``: non-negative ``x`` [n] (scales or minimums) to ``L`` (stored as C's
    uint8 would hold them) with weights ``qw``; returns the scale (``ls``: int32 scratch [n])."""
    n = len(x)
    vmax = ZERO
    for i in range(n):
        vmax = max(vmax, x[i])  # C's MAX(max, x[i]): keeps max when the comparison is false
    if vmax < GROUP_MAX_EPS:
        L[:] = 0
        return ZERO
    fmax = F32(nmax)
    iscale = fmax / vmax
    for i in range(n):
        ls[i] = nearest_int(iscale * x[i]) & 255  # L is uint8_t
    scale = ONE / iscale
    best_mse = ZERO
    for i in range(n):
        diff = x[i] - scale * F32(ls[i])
        best_mse += qw[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F32(0.1) * F32(step) + fmax) / vmax
        scale_is = ONE / iscale_is
        mse = ZERO
        for i in range(n):
            q = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * F32(q)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx, suml2 = ZERO, ZERO
    for i in range(n):
        q = min(nmax, nearest_int(iscale * x[i]))
        ls[i] = q & 255
        fq = F32(q)  # the int, not its uint8 copy
        sumlx += qw[i] * x[i] * fq
        suml2 += qw[i] * fq * fq
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = qw[i]
            fl = F32(ls[i])
            slx = sumlx - w * x[i] * fl
            sl2 = suml2 - w * fl * fl
            if slx > ZERO and sl2 > ZERO:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != ls[i]:
                    fn = F32(new_l)
                    slx += w * x[i] * fn
                    sl2 += w * fn * fn
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        ls[i] = new_l & 255
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(n):
        L[i] = ls[i]
    return sumlx / suml2 if suml2 > ZERO else ZERO


# ------------------------------------------------------------------------ without an importance matrix

@njit(cache=True, error_model="numpy", nogil=True)
def qkx2_subblocks(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, mad: bool,
                   rms_weights: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q2_K/Q4_K/Q5_K reference search of every sub-block of ``x`` [S, n]: weights ``|x|`` (Q2_K) or
    ``sqrt(sum x^2 / n) + |x|`` (``rms_weights``, Q4_K/Q5_K); returns scales [S], mins [S], L [S, n]."""
    count, n = x.shape
    scales = np.empty(count, np.float32)
    mins = np.empty(count, np.float32)
    L = np.empty((count, n), np.uint8)
    w = np.empty(n, np.float32)
    Laux = np.empty(n, np.uint8)
    for s in range(count):
        xs = x[s]
        av_x = ZERO
        if rms_weights:
            sum_x2 = ZERO
            for i in range(n):
                sum_x2 += xs[i] * xs[i]
            av_x = F32(np.sqrt(sum_x2 / F32(n)))
        for i in range(n):
            w[i] = av_x + abs(xs[i]) if rms_weights else abs(xs[i])
        scales[s], mins[s] = make_qkx2_quants(xs, w, L[s], Laux, nmax, rmin, rdelta, nstep, mad)
    return scales, mins, L


@njit(cache=True, error_model="numpy", nogil=True)
def qx_subblocks(x: np.ndarray, qw: np.ndarray, use_qw: bool, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K search (``make_qx_quants`` rmse 1) of every sub-block of ``x`` [S, n], weights ``qw`` [S, n] or
    x*x; returns scales [S] and L [S, n] (l + nmax)."""
    count, n = x.shape
    scales = np.empty(count, np.float32)
    L = np.empty((count, n), np.uint8)
    w = np.empty(n, np.float32)
    for s in range(count):
        xs = x[s]
        if use_qw:
            w[:] = qw[s % len(qw)]
        else:
            for i in range(n):
                w[i] = xs[i] * xs[i]
        scales[s] = make_qx_quants(xs, L[s], nmax, w)
    return scales, L


@njit(cache=True, error_model="numpy", nogil=True)
def q3_subblocks(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q3_K reference search (``make_q3_quants``) of every sub-block of ``x`` [S, n]: scales [S], L [S, n]."""
    count, n = x.shape
    scales = np.empty(count, np.float32)
    L = np.empty((count, n), np.uint8)
    ls = np.empty(n, np.int32)
    for s in range(count):
        scales[s] = make_q3_quants(x[s], L[s], nmax, ls)
    return scales, L


@njit(cache=True, error_model="numpy", nogil=True)
def requantize(x: np.ndarray, L: np.ndarray, d: np.ndarray, m: np.ndarray, use_m: bool, lo: int, hi: int
               ) -> None:
    """The K-quants' last step, in place on ``L`` [S, n]: ``clamp(nearest_int((x + m) / d), lo, hi) - lo`` for
    every sub-block of ``x`` [S, n] whose decoded scale ``d`` [S] is non-zero (``m`` [S]: decoded minimums,
    added when ``use_m``); llama.cpp keeps the search's integers where ``d`` is 0."""
    count, n = x.shape
    for s in range(count):
        ds = d[s]
        if ds == ZERO:
            continue
        ms = m[s] if use_m else ZERO
        for i in range(n):
            v = x[s, i] + ms if use_m else x[s, i]
            L[s, i] = min(hi, max(lo, nearest_int(v / ds))) - lo


# --------------------------------------------------------------------------- with an importance matrix

@njit(cache=True, error_model="numpy", nogil=True, inline="always")
def sum_squares(x: np.ndarray) -> float:
    total = ZERO
    for i in range(len(x)):
        total += x[i] * x[i]
    return total


@njit(cache=True, error_model="numpy", nogil=True)
def kx3_superblocks(x: np.ndarray, qw: np.ndarray, sub: int, nmax: int, scale_max: int, half_sigma: bool
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``quantize_row_q{2,4,5}_K_impl`` up to the block scales, for super-blocks ``x`` [B, 256] with
    importance ``qw`` [B, 256]: weights ``qw * sqrt(sigma2 + x^2)`` (sigma2 = sum x^2 / 256, doubled unless
    ``half_sigma``, Q2_K), ``make_qkx3_quants`` per sub-block of ``sub``, ``make_qp_quants`` of the scales and
    minimums.  Returns Ls, Lm [B, 256 // sub], d, m [B] (float32, before float16) and L [B, 256]."""
    count, n = x.shape
    nsub = n // sub
    Ls = np.empty((count, nsub), np.uint8)
    Lm = np.empty((count, nsub), np.uint8)
    d = np.empty(count, np.float32)
    m = np.empty(count, np.float32)
    L = np.empty((count, n), np.uint8)
    w = np.empty(sub, np.float32)
    Laux = np.empty(sub, np.uint8)
    scales = np.empty(nsub, np.float32)
    mins = np.empty(nsub, np.float32)
    sw = np.empty(nsub, np.float32)
    ls = np.empty(nsub, np.int32)
    for b in range(count):
        xb, qb = x[b], qw[b % len(qw)]
        sum_x2 = sum_squares(xb)
        sigma2 = sum_x2 / F32(n) if half_sigma else F32(2.0) * sum_x2 / F32(n)
        for j in range(nsub):
            xs = xb[j * sub:(j + 1) * sub]
            total = ZERO
            for i in range(sub):
                w[i] = qb[j * sub + i] * F32(np.sqrt(sigma2 + xs[i] * xs[i]))
                total += w[i]
            sw[j] = total
            scales[j], mins[j] = make_qkx2_quants(xs, w, L[b, j * sub:(j + 1) * sub], Laux, nmax, -0.9, 0.05, 36,
                                                  False)
        d[b] = make_qp_quants(scales, Ls[b], scale_max, sw, ls)
        m[b] = make_qp_quants(mins, Lm[b], scale_max, sw, ls)
    return Ls, Lm, d, m, L


@njit(cache=True, error_model="numpy", nogil=True)
def q3k_superblocks(x: np.ndarray, qw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quantize_row_q3_K_impl`` up to the block scales, for ``x`` and importance ``qw`` [B, 256]: returns
    Ls [B, 16] (6-bit, l + 32), d [B] (float32) and L [B, 256] (l + 4)."""
    count, n = x.shape
    Ls = np.empty((count, 16), np.uint8)
    d = np.empty(count, np.float32)
    L = np.empty((count, n), np.uint8)
    w = np.empty(16, np.float32)
    scales = np.empty(16, np.float32)
    sw = np.empty(16, np.float32)
    for b in range(count):
        xb, qb = x[b], qw[b % len(qw)]
        sigma2 = F32(2.0) * sum_squares(xb) / F32(n)
        for j in range(16):
            xs = xb[16 * j:16 * j + 16]
            total = ZERO
            for i in range(16):
                w[i] = qb[16 * j + i] * F32(np.sqrt(sigma2 + xs[i] * xs[i]))
                total += w[i]
            sw[j] = total
            scales[j] = make_qx_quants(xs, L[b, 16 * j:16 * j + 16], 4, w)
        d[b] = make_qx_quants(scales, Ls[b], 32, sw)
    return Ls, d, L


@njit(cache=True, error_model="numpy", nogil=True)
def legacy_weighted_rows(x: np.ndarray, qw: np.ndarray, nmax: int, offset: bool
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quantize_row_q{4,5}_{0,1}_impl`` (an importance matrix given) of rows ``x`` [R, n] with importance
    ``qw`` [n // 32, 32]: weights ``qw * sqrt(sigma2 + x^2)`` with sigma2 the row's mean square, then per block
    of 32 ``make_qx_quants`` (nmax 8 or 16; Q4_0, Q5_0) or, with ``offset``, ``make_qkx3_quants`` (nmax 15 or
    31, Q4_1, Q5_1).  Returns d, m [R * n // 32] (float32, before float16; m = -the_min, 0 without offset) and
    L [R * n // 32, 32] (stored integers)."""
    rows, n = x.shape
    nb = n // 32
    d = np.empty(rows * nb, np.float32)
    m = np.zeros(rows * nb, np.float32)
    L = np.empty((rows * nb, 32), np.uint8)
    w = np.empty(32, np.float32)
    Laux = np.empty(32, np.uint8)
    for r in range(rows):
        xr = x[r]
        sigma2 = sum_squares(xr) / F32(n)
        for ib in range(nb):
            xb = xr[32 * ib:32 * ib + 32]
            for j in range(32):
                w[j] = qw[ib, j] * F32(np.sqrt(sigma2 + xb[j] * xb[j]))
            k = r * nb + ib
            if offset:
                d[k], the_min = make_qkx2_quants(xb, w, L[k], Laux, nmax, -0.9, 0.05, 36, False)
                m[k] = -the_min
            else:
                d[k] = make_qx_quants(xb, L[k], nmax, w)
    return d, m, L


# ------------------------------------------------------------------------------------------------ IQ4

@njit(cache=True, error_model="numpy", nogil=True)
def iq4_superblocks(x: np.ndarray, qw: np.ndarray, use_qw: bool, values: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quantize_row_iq4_nl_impl`` (ntry 7, blocks of 32) for super-blocks ``x`` [B, n] (n = 32: IQ4_NL,
    256: IQ4_XS), importance ``qw`` [B, n] when ``use_qw`` (else weights x^2).  Returns d [B] (float32, before
    float16), the 6-bit sub-block scales ls [B, n // 32] (l + 32; IQ4_XS only) and L [B, n] (level indices)."""
    count, n = x.shape
    nsub = n // 32
    ntry = 7
    d_out = np.empty(count, np.float32)
    ls_out = np.zeros((count, nsub), np.uint8)
    L = np.empty((count, n), np.uint8)
    w = np.empty(32, np.float32)
    scales = np.empty(nsub, np.float32)
    v0 = F32(values[0])
    for b in range(count):
        xb = x[b]
        sigma2 = sum_squares(xb) * (F32(2.0) / F32(n))
        max_scale, amax_scale = ZERO, ZERO
        for ib in range(nsub):
            xs = xb[32 * ib:32 * ib + 32]
            for j in range(32):
                w[j] = qw[b % len(qw), 32 * ib + j] * F32(np.sqrt(sigma2 + xs[j] * xs[j])) if use_qw else xs[j] * xs[j]
            amax, vmax = signed_absmax(xs)
            if amax < GROUP_MAX_EPS:
                scales[ib] = ZERO
                continue
            d = -vmax / v0
            inv = ONE / d
            sumqx, sumq2 = ZERO, ZERO
            for j in range(32):
                k = best_index_int8(values, inv * xs[j])
                L[b, 32 * ib + j] = k
                q = F32(values[k])
                sumqx += w[j] * q * xs[j]
                sumq2 += w[j] * q * q
            d = sumqx / sumq2 if sumq2 > ZERO else ZERO
            best = d * sumqx
            for itry in range(-ntry, ntry + 1):
                inv = (F32(itry) + v0) / vmax
                sumqx, sumq2 = ZERO, ZERO
                for j in range(32):
                    q = F32(values[best_index_int8(values, inv * xs[j])])
                    sumqx += w[j] * q * xs[j]
                    sumq2 += w[j] * q * q
                if sumq2 > ZERO and sumqx * sumqx > best * sumq2:
                    d = sumqx / sumq2
                    best = d * sumqx
            scales[ib] = d
            if abs(d) > amax_scale:
                amax_scale = abs(d)
                max_scale = d
        if nsub > 1:
            d = -max_scale / F32(32.0)
            d_out[b] = d
            inv = ONE / d if d != ZERO else ZERO
            for ib in range(nsub):
                q = max(-32, min(31, nearest_int(inv * scales[ib])))
                dl = d * F32(q)
                idl = ONE / dl if dl != ZERO else ZERO
                for j in range(32):
                    L[b, 32 * ib + j] = best_index_int8(values, idl * xb[32 * ib + j])
                ls_out[b, ib] = q + 32
        else:
            d_out[b] = scales[0]
            inv = ONE / scales[0] if scales[0] != ZERO else ZERO
            for j in range(n):
                L[b, j] = best_index_int8(values, inv * xb[j])
    return d_out, ls_out, L
