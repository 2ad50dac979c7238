"""Float32 building blocks of the decoder: RMSNorm, rotary embedding, SiLU, softmax.

Every function takes and returns float32 arrays; shapes are written as ``[B, T, ...]`` (batch, time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..formats.rope import RopeScaling


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, into ``out`` if given (which may be ``x``).

    # [..., D] -> [..., D]

    The weight is used as stored: Qwen3.5's (1 + w) norms already have the +1 baked into the canonical
    tensors (see ``naming.py``).  The mean is float32 ``sum / D`` like ``np.mean``'s (whose float64 division
    rounds to the same float32); without ``out`` the result reuses the array of squares.
    """
    squares = np.square(x)  # [..., D]
    var = np.add.reduce(squares, axis=-1, keepdims=True)  # [..., 1]
    var /= np.float32(x.shape[-1])
    var += np.float32(eps)
    out = np.multiply(x, np.float32(1.0) / np.sqrt(var), out=squares if out is None else out)
    out *= weight
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``, computed without overflow warnings for large negative x."""
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``silu(gate) * up`` (SwiGLU) with one temporary; ``out`` may be ``gate``.  # [..., I] -> [..., I]"""
    denom = np.negative(gate)
    with np.errstate(over="ignore"):
        np.exp(denom, out=denom)
    denom += np.float32(1.0)
    out = np.divide(gate, denom, out=out)
    return np.multiply(out, up, out=out)


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1, out: np.ndarray | None = None) -> np.ndarray:
    """Numerically stable softmax (rows of ``-inf`` entries must keep at least one finite value); ``out`` may be
    ``x`` (in place)."""
    out = np.subtract(x, np.maximum.reduce(x, axis=axis, keepdims=True), out=out)  # np.max without its wrapper
    np.exp(out, out=out)
    out /= np.add.reduce(out, axis=axis, keepdims=True)
    return out


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """``theta ** (-2j / r)`` for ``j < r / 2`` (scaled by ``scaling``: :mod:`.rope`), float64 for accurate
    angles.  # [r/2]"""
    if scaling is not None:
        return scaling.inv_freq(rotary_dim, theta)
    return 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def rope_cos_sin(positions: np.ndarray, rotary_dim: int, theta: float,
                 scaling: RopeScaling | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of ``position * inv_freq``, times YaRN's attention scale when ``scaling`` has one (as
    transformers scales them).  # [B, T] -> 2 x [B, T, r/2] float32"""
    angles = positions[..., None].astype(np.float64) * rope_inv_freq(rotary_dim, theta, scaling)  # [B, T, r/2]
    cos, sin = np.cos(angles), np.sin(angles)  # [B, T, r/2]
    scale = 1.0 if scaling is None else scaling.attention_scale
    if scale != 1.0:
        cos *= scale
        sin *= scale
    return cos.astype(np.float32), sin.astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half (GGML NEOX) rotary embedding on the first ``2 * cos.shape[-1]`` dims of each head.

    Pairs are ``(j, j + r/2)`` inside the rotary slice; dims ``[r, head_dim)`` pass through (partial
    rotary, Qwen3.5).  ``x``: [B, heads, T, hd]; ``cos``/``sin``: [B, T, r/2].
    """
    half = cos.shape[-1]
    c, s = cos[:, None], sin[:, None]  # [B, 1, T, r/2]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    out = np.empty_like(x)
    lo, hi = out[..., :half], out[..., half:2 * half]
    np.multiply(x1, c, out=lo)
    lo -= x2 * s
    np.multiply(x2, c, out=hi)
    hi += x1 * s
    out[..., 2 * half:] = x[..., 2 * half:]
    return out


def add_rms_norm(h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``(h + delta, rms_norm(h + delta))``: a block's residual add and its next norm.
    # 2 x [..., D] -> 2 x [..., D]"""
    summed = h + delta
    return summed, rms_norm(summed, weight, eps)


class Ops(NamedTuple):
    """The norms a model's blocks call, chosen once for its kernels (:func:`resolve`): numpy's, or their compiled
    twins in :mod:`.ops_jit` (one pass over the rows, the residual add fused into the norm)."""

    rms_norm: Callable[..., np.ndarray]
    add_rms_norm: Callable[..., tuple[np.ndarray, np.ndarray]]


def resolve(kernels: str) -> Ops:
    """The :class:`Ops` of ``kernels`` (``"numba"`` or ``"numpy"``); numba is imported only for the former."""
    if kernels == "numba":
        from . import ops_jit

        return Ops(ops_jit.rms_norm, ops_jit.add_rms_norm)
    return Ops(rms_norm, add_rms_norm)
