"""Compiled (numba) twins of a Gated DeltaNet decode step outside its products: the causal conv1d step and, in
one pass per value head, q/k l2 norms, gates, the recurrent delta rule and the gated RMSNorm.  The references
are :mod:`.gated_delta`'s numpy functions; letters as there (B, T, C, K, Hk, Hv, dk, dv).

**Error model** (u = 2^-24, see :mod:`..ops_jit`):

* conv: the K taps are summed in the reference's order, so the sums are bit-identical; SiLU's exp32 is within
  2 ulp where numpy's exp is within 1, so the outputs differ by a few ulp.
* delta rule: the l2 norms' and q·k's sums of dk terms differ from numpy's pairwise ones by 2·dk·u·Σ|terms|;
  the reads Sᵀq and Sᵀk (dk terms each) are summed in row order where BLAS uses its own, so they differ by
  2·dk·u·Σ_i |q_i S_id|; the update and the output round in the reference's order.  Gates use libm's exp and
  log1p (numpy's float32 ``logaddexp``: the same formula); the gated norm is ``ops_jit.rms_norm``'s bound and
  exp32's in SiLU.  The state after a step thus differs from the reference's by those few ulp of its terms, and
  step after step the two evolve like any two float32 runs of the same recurrence.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..backend.ops_jit import F32, JIT, ONE, ZERO, dot, norm_row, silu32, sum_squares
from .gated_delta import L2_EPS, LOG_DECAY_FLOOR

L2_EPS32 = F32(L2_EPS)


@njit(**JIT)
def conv_step(x: np.ndarray, taps: np.ndarray, state: np.ndarray, valid: np.ndarray) -> None:
    """x ← SiLU(causal depthwise conv) token by token, carrying ``state``; padding: 0 out, state untouched.

    x [B, T, C] (raw projections, overwritten); taps [K, C] (the kernel transposed; tap K-1 multiplies the
    current token); state [B, K-1, C] (the last K-1 raw inputs, advanced); valid bool [B, T].
    """
    batch, length, channels = x.shape
    kernel = taps.shape[0]
    acc = np.empty(channels, np.float32)
    for b in range(batch):
        for t in range(length):
            current = x[b, t]
            if not valid[b, t]:
                current[:] = ZERO
                continue
            for c in range(channels):
                acc[c] = state[b, 0, c] * taps[0, c]
            for j in range(1, kernel - 1):
                for c in range(channels):
                    acc[c] += state[b, j, c] * taps[j, c]
            for c in range(channels):
                acc[c] += current[c] * taps[kernel - 1, c]
            for j in range(kernel - 2):
                state[b, j] = state[b, j + 1]
            state[b, kernel - 2] = current
            for c in range(channels):  # a loop of its own, so that it vectorises
                current[c] = silu32(acc[c])


@njit(**JIT)
def _l2_normalize(x: np.ndarray, scale: float, out: np.ndarray) -> None:
    """out ← x / sqrt(Σx² + eps) · scale, rounded as :func:`.gated_delta.l2_normalize` then the scale.  # [d]"""
    norm = np.sqrt(sum_squares(x) + L2_EPS32)
    for i in range(x.shape[0]):
        out[i] = x[i] / norm * scale


@njit(**JIT)
def _softplus(x: float) -> float:
    """log(1 + eˣ) as numpy's float32 ``logaddexp(0, x)``."""
    if x > ZERO:
        return x + F32(math.log1p(math.exp(-x)))
    return F32(math.log1p(math.exp(x)))


@njit(**JIT)
def delta_step(mixed: np.ndarray, z: np.ndarray, b_gate: np.ndarray, a_gate: np.ndarray, key_heads: np.ndarray,
               ssm_a: np.ndarray, dt_bias: np.ndarray, norm: np.ndarray, eps: float, valid: np.ndarray,
               state: np.ndarray, out: np.ndarray) -> None:
    """The value heads of a few tokens: q/k l2 norms (q scaled by dk^-½), β = σ(b), g = a_ssm·softplus(a + dt),
    the delta rule on each head's state, then out ← rms_norm(o)·norm·SiLU(z).

    mixed [B, T, C] (conv output: q and k of Hk key heads of dk, then v of Hv heads of dv); z [B, T, Hv, dv];
    b_gate, a_gate [B, T, Hv]; key_heads int [Hv] (the key head of each value head); ssm_a, dt_bias [Hv];
    norm [dv]; valid bool [B, T] (padding: β = g = 0, the state passes unchanged); state [B, Hv, dk, dv]
    (updated); out [B, T, Hv, dv].  One step (docs §3.4): S̄ = e^g S, u = β(v − S̄ᵀk), S ← S̄ + k uᵀ,
    o = Sᵀq = e^g (Sᵀq) + (q·k) u, both reads from the state before the step.
    """
    delta_heads(mixed, z, b_gate, a_gate, key_heads, ssm_a, dt_bias, norm, eps, valid, state, 0, mixed.shape[0], 0,
                state.shape[1], out)


@njit(**JIT)
def delta_heads(mixed: np.ndarray, z: np.ndarray, b_gate: np.ndarray, a_gate: np.ndarray, key_heads: np.ndarray,
                ssm_a: np.ndarray, dt_bias: np.ndarray, norm: np.ndarray, eps: float, valid: np.ndarray,
                state: np.ndarray, b0: int, b1: int, h0: int, h1: int, out: np.ndarray) -> None:
    """:func:`delta_step` of batch rows ``b0:b1``'s value heads ``h0:h1`` (arguments as there): each (row, head)
    is :func:`delta_head`, so a pass's heads can be shared among threads with the same numbers."""
    for b in range(b0, b1):
        for h in range(h0, h1):
            delta_head(mixed, z, b_gate, a_gate, key_heads, ssm_a, dt_bias, norm, eps, valid, state, b, h, out)


@njit(**JIT)
def delta_head(mixed: np.ndarray, z: np.ndarray, b_gate: np.ndarray, a_gate: np.ndarray, key_heads: np.ndarray,
               ssm_a: np.ndarray, dt_bias: np.ndarray, norm: np.ndarray, eps: float, valid: np.ndarray,
               state: np.ndarray, b: int, h: int, out: np.ndarray) -> None:
    """:func:`delta_step` of batch row ``b``'s value head ``h`` (arguments as there): the compiled decode step hands
    the heads to its threads one at a time."""
    length = mixed.shape[1]
    value_heads, dk, dv = state.shape[1], state.shape[2], state.shape[3]
    key_width = mixed.shape[2] - value_heads * dv  # 2·Hk·dk
    scale = F32(dk ** -0.5)
    qn, kn = np.empty(dk, np.float32), np.empty(dk, np.float32)
    reads_q, reads_k, u = np.empty(dv, np.float32), np.empty(dv, np.float32), np.empty(dv, np.float32)
    s = state[b, h]  # [dk, dv]
    q0 = key_heads[h] * dk
    for t in range(length):
        _l2_normalize(mixed[b, t, q0:q0 + dk], scale, qn)
        _l2_normalize(mixed[b, t, key_width // 2 + q0:key_width // 2 + q0 + dk], ONE, kn)
        v = mixed[b, t, key_width + h * dv:key_width + (h + 1) * dv]
        beta, decay = ZERO, ONE
        if valid[b, t]:
            beta = ONE / (ONE + F32(math.exp(-b_gate[b, t, h])))
            g = ssm_a[h] * _softplus(a_gate[b, t, h] + dt_bias[h])
            decay = ZERO if g < LOG_DECAY_FLOOR else F32(math.exp(g))
        reads_q[:] = ZERO
        reads_k[:] = ZERO
        for i in range(dk):
            qi, ki = qn[i], kn[i]
            for d in range(dv):
                reads_q[d] += qi * s[i, d]
                reads_k[d] += ki * s[i, d]
        qk = dot(qn, kn)
        o = out[b, t, h]
        for d in range(dv):
            u[d] = beta * (v[d] - decay * reads_k[d])
            o[d] = decay * reads_q[d] + qk * u[d]
        for i in range(dk):
            ki = kn[i]
            for d in range(dv):
                s[i, d] = s[i, d] * decay + ki * u[d]
        norm_row(o, norm, eps, o)
        zt = z[b, t, h]
        for d in range(dv):
            o[d] = o[d] * silu32(zt[d])
