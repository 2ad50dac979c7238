"""Compiled (numba) twins of a decode step's attention outside its products: the per-head preparation of q, k
and v (bias, q/k RMSNorm, RoPE, the write into the KV cache) in one pass, attention of a few new tokens over the
cache, and Qwen3.5's sigmoid gate.  The references are :mod:`.attention`'s and :mod:`..ops`' numpy functions.

Shapes: B batch, T new tokens, nh/nkv query/kv heads, hd head dim, S cache slots, r rotary dims.

**Error model** (u = 2^-24, see :mod:`..ops_jit`): the preparation rounds like the reference except for the
RMSNorm's sum (``ops_jit.rms_norm``'s bound, (hd + 10)·u relative), which RoPE carries on unchanged (its
products and sums are the reference's, element for element).  Attention: each score is a dot product of hd
terms summed in lanes (``ops_jit.dot``; BLAS sums in its own order): the two differ by 2·hd·u·Σ|q·k| (q already
scaled as the reference scales it); the softmax takes exp32's 2 ulp where numpy's exp has its own 2.5; the
weighted sum of S values is within 2·S·u·Σ p|v| of the reference's.  Masked slots get a weight of exactly 0, as
in the reference.

**Cache types.**  The KV cache arrays are float32, or float16 passed as their bits (uint16: numba has no float16
arrays); :func:`widen` decodes a loaded value to float32 (one ``vcvtph2ps`` with F16C) and :func:`stored` rounds
one to the array's type on a write (``vcvtps2ph``, round to nearest even as numpy's ``astype``), so every sum runs in
float32 on exactly the values the numpy path reads back from its float16 cache.  On float32 arrays both are the
identity: the f32 cache's numbers are unchanged.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ..backend.ops_jit import F32, JIT, SUMS, ZERO, exp32, norm_row, sigmoid32, total

MASKED = F32(-np.inf)
F16_BITS = types.uint16  # how a float16 cache array reaches the kernels


@intrinsic
def widen(typingctx, x):  # noqa: ARG001 (numba's intrinsic protocol)
    """A cached value as float32: float16 bits (uint16) decoded, float32 as it is."""
    if x not in (F16_BITS, types.float32):
        return None

    def codegen(context, builder, signature, args):
        if x == types.float32:
            return args[0]
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(x), codegen


@intrinsic
def stored(typingctx, value, array):  # noqa: ARG001
    """Float32 ``value`` in ``array``'s element type: float16 bits (uint16, rounded to nearest even) or float32."""
    if not isinstance(array, types.Array) or array.dtype not in (F16_BITS, types.float32):
        return None

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.float32)
        if array.dtype == types.float32:
            return v
        return builder.bitcast(builder.fptrunc(v, ir.HalfType()), ir.IntType(16))

    return array.dtype(value, array), codegen


@njit(fastmath=SUMS, **JIT)
def dot_cached(q: np.ndarray, k: np.ndarray) -> float:
    """Σ q·widen(k), summed as :func:`..ops_jit.dot` sums.  # [D] float32, [D] cache type -> float32"""
    s = ZERO
    for i in range(q.shape[0]):
        s += q[i] * widen(k[i])
    return s


@njit(**JIT)
def prepare_heads(y: np.ndarray, bias: np.ndarray | None, norm: np.ndarray | None, eps: float,
                  cos: np.ndarray | None, sin: np.ndarray | None, slots: np.ndarray | None, out: np.ndarray) -> None:
    """out[b, h, slot] ← rope(rms_norm(y[b, t, h, :hd] + bias[h])) for each new token's slot.

    y [B, T, heads, width ≥ hd] (a projection's rows; Qwen3.5's q heads carry their gate after hd values);
    bias [heads·hd] or None; norm [hd] or None; cos/sin [B, T, r/2] or None (no rotation); slots int [B, T]
    (None: slot t); out [B, heads, S, hd] (q's own array, or the cache's keys or values, in their cache type).
    Bias, norm and rotation round as :func:`..ops.rms_norm` and :func:`..ops.apply_rope`.
    """
    batch, length, heads, _ = y.shape
    hd = out.shape[3]
    row = np.empty(hd, np.float32)
    for b in range(batch):
        for t in range(length):
            slot = t if slots is None else slots[b, t]
            for h in range(heads):
                for i in range(hd):
                    row[i] = y[b, t, h, i] if bias is None else y[b, t, h, i] + bias[h * hd + i]
                if norm is not None:
                    norm_row(row, norm, eps, row)
                dst = out[b, h, slot]
                if cos is None or sin is None:
                    for i in range(hd):
                        dst[i] = stored(row[i], dst)
                    continue
                half = cos.shape[2]
                for i in range(half):
                    c, s = cos[b, t, i], sin[b, t, i]
                    x1, x2 = row[i], row[half + i]
                    dst[i] = stored(x1 * c - x2 * s, dst)
                    dst[half + i] = stored(x2 * c + x1 * s, dst)
                for i in range(2 * half, hd):
                    dst[i] = stored(row[i], dst)


@njit(**JIT)
def attend_slots(q: np.ndarray, keys: np.ndarray, values: np.ndarray, query_slots: np.ndarray,
                 key_valid: np.ndarray, out: np.ndarray) -> None:
    """Softmax attention of each new token over the slots up to its own, GQA, masked slots weighted 0.

    q [B, nh, T, hd] (unscaled); keys/values [B, nkv, ≥S, hd] (only slots up to a token's own are read);
    query_slots int [B, T]: the slot of each new token; key_valid bool [B, ≥S]: which slots hold real tokens (a
    token always sees its own); out [B, nh, T, hd].  Query head h reads kv head h // (nh / nkv).  Each (row, kv
    head) pair is :func:`attend_pair`, which the compiled decode step hands to its threads one pair at a time.
    """
    for b in range(q.shape[0]):
        for kv in range(keys.shape[1]):
            attend_pair(q, keys, values, query_slots, key_valid, b, kv, out)


@njit(**JIT)
def attend_pair(q: np.ndarray, keys: np.ndarray, values: np.ndarray, query_slots: np.ndarray,
                key_valid: np.ndarray, b: int, kv: int, out: np.ndarray) -> None:
    """:func:`attend_slots` of batch row ``b``'s query heads of kv head ``kv`` (arguments as there).

    Each cached key is read once for all query heads of its kv head (dot products in lanes over hd); the weighted
    sum of values runs in lanes over hd (:func:`_weighted_sum`).  (Scores from a transposed tile of keys, a lane
    per slot, ran slower: numba keeps such accumulators in memory.)
    """
    heads, length, hd = q.shape[1], q.shape[2], q.shape[3]
    group = heads // keys.shape[1]
    scale = F32(1.0 / np.sqrt(hd))  # as the reference scales q
    scores = np.empty((group, query_slots[b].max() + 1), np.float32)
    qs = np.empty((group, hd), np.float32)  # the scaled queries of the kv head
    kb, vb = keys[b, kv], values[b, kv]  # [S, hd]
    for t in range(length):
        own = query_slots[b, t]
        seen = own + 1
        for g in range(group):
            for i in range(hd):
                qs[g, i] = q[b, kv * group + g, t, i] * scale
        for s in range(seen):
            k = kb[s]
            visible = key_valid[b, s] or s == own
            for g in range(group):
                scores[g, s] = dot_cached(qs[g], k) if visible else MASKED
        for g in range(group):
            _softmax_masked(scores, g, seen)
            _weighted_sum(scores, g, seen, vb, out[b, kv * group + g, t])


@njit(**JIT)
def _weighted_sum(p: np.ndarray, row: int, n: int, values: np.ndarray, o: np.ndarray) -> None:
    """o ← Σ_s p[row, s]·values[s] over s < n, four slots per update of o (o stays in memory: a quarter of the
    loads and stores), each group of four summed pairwise.  # [R, ≥n], [≥n, hd] (cache type) -> [hd]"""
    o[:] = ZERO
    body = n - n % 4
    for s in range(0, body, 4):
        p0, p1, p2, p3 = p[row, s], p[row, s + 1], p[row, s + 2], p[row, s + 3]
        v0, v1, v2, v3 = values[s], values[s + 1], values[s + 2], values[s + 3]
        for i in range(o.shape[0]):
            o[i] += (p0 * widen(v0[i]) + p1 * widen(v1[i])) + (p2 * widen(v2[i]) + p3 * widen(v3[i]))
    for s in range(body, n):
        ps, vs = p[row, s], values[s]
        for i in range(o.shape[0]):
            o[i] += ps * widen(vs[i])


@njit(**JIT)
def _softmax_masked(x: np.ndarray, row: int, n: int) -> None:
    """Softmax of ``x[row, :n]`` in place, entries of -inf (masked) exactly 0; at least one is finite.  # [R, ≥n]"""
    top = MASKED
    for s in range(n):
        top = max(top, x[row, s])
    for s in range(n):
        e = exp32(x[row, s] - top)
        x[row, s] = ZERO if x[row, s] == MASKED else e
    weights = total(x[row, :n])
    for s in range(n):
        x[row, s] = x[row, s] / weights


@njit(**JIT)
def sigmoid_gate(o: np.ndarray, q_gate: np.ndarray, out: np.ndarray) -> None:
    """out[b·T + t, h·hd + i] ← o[b, h, t, i] · σ(gate): merge heads and apply Qwen3.5's output gate.

    o [B, nh, T, hd]; q_gate [B, T, nh, 2hd] (each head's gate after its query); out [B·T, nh·hd]
    """
    batch, heads, length, hd = o.shape
    for b in range(batch):
        for t in range(length):
            for h in range(heads):
                for i in range(hd):
                    out[b * length + t, h * hd + i] = o[b, h, t, i] * sigmoid32(q_gate[b, t, h, hd + i])


@njit(**JIT)
def attention_step(yq: np.ndarray, yk: np.ndarray, yv: np.ndarray, bq: np.ndarray | None, bk: np.ndarray | None,
                   bv: np.ndarray | None, q_norm: np.ndarray | None, k_norm: np.ndarray | None, eps: float,
                   cos: np.ndarray, sin: np.ndarray, slots: np.ndarray, key_valid: np.ndarray, keys: np.ndarray,
                   values: np.ndarray) -> np.ndarray:
    """A few new tokens' attention from their projections, in one call: :func:`prepare_attention` (q into its own
    array, k and v into the cache at ``slots``), then :func:`attend_slots`.

    yq [B, T, nh, ≥hd]; yk/yv [B, T, nkv, hd]; biases [heads·hd] or None; norms [hd] or None; cos/sin
    [B, T, r/2]; slots int [B, T] and key_valid bool [B, ≥S] (:meth:`BatchState.slots`); keys/values
    [B, nkv, S, hd] (the cache, written) -> [B, nh, T, hd]
    """
    batch, length, heads, _ = yq.shape
    q = np.empty((batch, heads, length, keys.shape[3]), np.float32)
    prepare_attention(yq, yk, yv, bq, bk, bv, q_norm, k_norm, eps, cos, sin, slots, keys, values, q)
    out = np.empty(q.shape, np.float32)
    attend_slots(q, keys, values, slots, key_valid, out)
    return out


@njit(**JIT)
def prepare_attention(yq: np.ndarray, yk: np.ndarray, yv: np.ndarray, bq: np.ndarray | None, bk: np.ndarray | None,
                      bv: np.ndarray | None, q_norm: np.ndarray | None, k_norm: np.ndarray | None, eps: float,
                      cos: np.ndarray, sin: np.ndarray, slots: np.ndarray, keys: np.ndarray, values: np.ndarray,
                      q: np.ndarray) -> None:
    """:func:`prepare_heads` of q into ``q`` [B, nh, T, hd], of k and v into the cache at ``slots`` (arguments as
    :func:`attention_step`'s)."""
    prepare_heads(yq, bq, q_norm, eps, cos, sin, None, q)
    prepare_heads(yk, bk, k_norm, eps, cos, sin, slots, keys)
    prepare_heads(yv, bv, None, eps, None, None, slots, values)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, query_slots: np.ndarray, key_valid: np.ndarray,
           ) -> np.ndarray:
    """Twin of :func:`.attention.attend` for a few new tokens (slots from :meth:`BatchState.slots`).

    q [B, nh, T, hd]; keys/values [B, nkv, ≥S, hd] -> [B, nh, T, hd]
    """
    out = np.empty(q.shape, np.float32)
    contiguous = np.ascontiguousarray  # the model's cache buffers are; a caller's slices are copied (ops_jit)
    k, v = (contiguous(a).view(np.uint16) if a.dtype == np.float16 else contiguous(a) for a in (keys, values))
    attend_slots(contiguous(q), k, v, query_slots, key_valid, out)
    return out


def gate(o: np.ndarray, q_gate: np.ndarray) -> np.ndarray:
    """``merge_heads(o) * sigmoid(gate)``.  # [B, nh, T, hd], [B, T, nh, 2hd] -> [B·T, nh·hd]"""
    b, nh, t, hd = o.shape
    out = np.empty((b * t, nh * hd), np.float32)
    sigmoid_gate(o, q_gate, out)
    return out

