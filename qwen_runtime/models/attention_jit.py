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
in the reference.  The slots are taken in blocks of :data:`BLOCK` (an online softmax: each block's scores
exponentiated against its own maximum, the blocks' sums rescaled by exp(top_j - top) when merged), which adds
exp32's 2 ulp per block weight and the merge's sum over the blocks (2·(S/BLOCK)·u of the output, relative).

**Cache types.**  The KV cache arrays are float32, float16 passed as their bits (uint16: numba has no float16
arrays) or records of integers (bf16, q8_0, q4_0: :class:`..cache.CacheType`); :func:`widen_row` decodes one head's
row of a slot to float32 (with F16C ``vcvtph2ps`` for float16 and the block scales) and :func:`store_row` encodes
one on a write, exactly as the numpy path's encoder (ggml's rounding and quantizers), so every sum runs in float32
on exactly the values the numpy path decodes from the same cache.  On float32 arrays both are the identity: the
f32 cache's values are unchanged.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload
from numba.np.numpy_support import from_dtype

from ..backend.cache import CACHE_TYPE, stored_type
from ..backend.kernels.dense import bf16_to_f32
from ..backend.ops_jit import F32, JIT, ONE, ZERO, dot, exp32, norm_row, sigmoid32, total

MASKED = F32(-np.inf)
F16_BITS = types.uint16  # how a float16 cache array reaches the kernels
BLOCK = 256  # cache slots of one unit of decode attention (:func:`attend_block`): its scores stay in L1
_RECORDS = {name: from_dtype(CACHE_TYPE[name].dtype) for name in ("bf16", "q8_0", "q4_0")}


@intrinsic
def half_to_f32(typingctx, bits):  # noqa: ARG001 (numba's intrinsic protocol)
    """The float16 whose bits are ``bits`` (uint16) as float32 (exact; ``vcvtph2ps`` with F16C)."""
    if bits != F16_BITS:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def f32_to_half(typingctx, x):  # noqa: ARG001
    """Float32 ``x`` rounded to nearest-even float16, as its bits (``vcvtps2ph``; numpy's ``astype``, ggml's
    ``GGML_FP32_TO_FP16``)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return F16_BITS(x), codegen


@intrinsic
def f32_bits(typingctx, x):  # noqa: ARG001
    """The bits of float32 ``x`` as uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


def widen_row(row: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """One head's cached keys or values as float32: a float32 row itself, any other type decoded into ``tmp``
    (returned).  # [hd / block] cache type, [hd] float32 -> [hd] float32

    Row types as the kernels take them (:func:`.attention.kernel_view`): float32, float16 as uint16 bits, and the
    records of bf16 (the high half of a float32), q8_0 (d·q) and q4_0 (d·(q - 8), value j < 16 from the low nibble
    of byte j, j ≥ 16 from the high nibble of byte j - 16).  This body is the numpy reference; compiled code runs
    the type's specialisation below.
    """
    if row.dtype == np.float32:
        return row
    tmp[:] = row.view(np.float16) if row.dtype == np.uint16 else stored_type(row).decode(row[None])[0]
    return tmp


def store_row(x: np.ndarray, dst: np.ndarray) -> None:
    """Float32 values ``x`` [hd] into one head's cache row ``dst`` [hd / block] of its type (kernel view, as
    :func:`widen_row`), rounded or quantized exactly as ggml does (the numpy reference; compiled code runs the
    type's specialisation below)."""
    if dst.dtype == np.uint16:
        dst[:] = x.astype(np.float16).view(np.uint16)
    else:
        dst[:] = stored_type(dst).encode(x[None])[0]


@overload(widen_row, jit_options=JIT)
def _widen_row(row, tmp):  # noqa: ARG001
    kind = row.dtype
    if kind == types.float32:
        return lambda row, tmp: row
    if kind == F16_BITS:
        def f16(row, tmp):
            for i in range(row.shape[0]):
                tmp[i] = half_to_f32(row[i])
            return tmp
        return f16
    if kind == _RECORDS["bf16"]:
        def bf16(row, tmp):
            for i in range(row.shape[0]):
                tmp[i] = bf16_to_f32(row[i].bits)
            return tmp
        return bf16
    if kind == _RECORDS["q8_0"]:
        def q8_0(row, tmp):
            for b in range(row.shape[0]):
                d, qs = half_to_f32(row[b].d), row[b].qs
                for i in range(32):
                    tmp[32 * b + i] = d * F32(qs[i])
            return tmp
        return q8_0
    if kind == _RECORDS["q4_0"]:
        def q4_0(row, tmp):
            for b in range(row.shape[0]):
                d, qs = half_to_f32(row[b].d), row[b].qs
                for i in range(16):
                    tmp[32 * b + i] = d * F32(np.int32(qs[i] & 15) - 8)
                    tmp[32 * b + 16 + i] = d * F32(np.int32(qs[i] >> 4) - 8)
            return tmp
        return q4_0
    return None


@overload(store_row, jit_options=JIT)
def _store_row(x, dst):  # noqa: ARG001
    kind = dst.dtype
    if kind == types.float32:
        def f32(x, dst):
            for i in range(dst.shape[0]):
                dst[i] = x[i]
        return f32
    if kind == F16_BITS:
        def f16(x, dst):
            for i in range(dst.shape[0]):
                dst[i] = f32_to_half(x[i])
        return f16
    if kind == _RECORDS["bf16"]:
        def bf16(x, dst):  # ggml_compute_fp32_to_bf16: NaN kept quiet, otherwise round to nearest even
            for i in range(dst.shape[0]):
                u = f32_bits(x[i])
                if u & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000):
                    dst[i].bits = np.uint16((u >> np.uint32(16)) | np.uint32(64))
                else:
                    dst[i].bits = np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))))
                                            >> np.uint32(16))
        return bf16
    if kind == _RECORDS["q8_0"]:
        def q8_0(x, dst):  # quantize_row_q8_0_ref
            for b in range(dst.shape[0]):
                amax = ZERO
                for i in range(32):
                    amax = max(amax, abs(x[32 * b + i]))
                d = amax / F32(127)
                inverse = ONE / d if d != ZERO else ZERO
                dst[b].d = f32_to_half(d)
                qs = dst[b].qs
                for i in range(32):
                    qs[i] = np.int8(round_half_away(x[32 * b + i] * inverse))
        return q8_0
    if kind == _RECORDS["q4_0"]:
        def q4_0(x, dst):  # quantize_row_q4_0_ref
            for b in range(dst.shape[0]):
                amax, top = ZERO, ZERO
                for i in range(32):
                    if amax < abs(x[32 * b + i]):
                        amax, top = abs(x[32 * b + i]), x[32 * b + i]
                d = top / F32(-8)
                inverse = ONE / d if d != ZERO else ZERO
                dst[b].d = f32_to_half(d)
                qs = dst[b].qs
                for i in range(16):
                    low = min(15, np.int32(x[32 * b + i] * inverse + F32(8.5)))
                    high = min(15, np.int32(x[32 * b + 16 + i] * inverse + F32(8.5)))
                    qs[i] = np.uint8(low | (high << 4))
        return q4_0
    return None


@njit(**JIT)
def round_half_away(x: float) -> float:
    """C's ``roundf``: to nearest, halves away from zero (``x - floor|x|`` is exact, so is the carry)."""
    a = abs(x)
    whole = np.floor(a)
    r = whole + np.floor(F32(2) * (a - whole))
    return r if x >= ZERO else -r


def row_values(row: np.ndarray) -> int:
    """How many values one head's cache row (kernel view, as :func:`widen_row`) holds: its elements, times the
    block of the block types."""
    return row.shape[0] * (1 if row.dtype == np.uint16 else stored_type(row).block)


@overload(row_values, jit_options=JIT)
def _row_values(row):
    block = CACHE_TYPE["q8_0"].block if row.dtype in (_RECORDS["q8_0"], _RECORDS["q4_0"]) else 1
    return lambda row: row.shape[0] * block


@njit(**JIT)
def prepare_heads(y: np.ndarray, bias: np.ndarray | None, norm: np.ndarray | None, eps: float,
                  cos: np.ndarray | None, sin: np.ndarray | None, slots: np.ndarray | None, out: np.ndarray) -> None:
    """out[b, h, slot] ← rope(rms_norm(y[b, t, h, :hd] + bias[h])) for each new token's slot.

    y [B, T, heads, width ≥ hd] (a projection's rows; Qwen3.5's q heads carry their gate after hd values);
    bias [heads·hd] or None; norm [hd] or None; cos/sin [B, T, r/2] or None (no rotation); slots int [B, T]
    (None: slot t); out [B, heads, S, hd / block] (q's own array, or the cache's keys or values, in their cache
    type: :func:`store_row`).  Bias, norm and rotation round as :func:`..ops.rms_norm` and :func:`..ops.apply_rope`.
    """
    batch, length, heads, _ = y.shape
    hd = row_values(out[0, 0, 0])
    row = np.empty(hd, np.float32)
    rotated = np.empty(hd, np.float32)
    for b in range(batch):
        for t in range(length):
            slot = t if slots is None else slots[b, t]
            for h in range(heads):
                for i in range(hd):
                    row[i] = y[b, t, h, i] if bias is None else y[b, t, h, i] + bias[h * hd + i]
                if norm is not None:
                    norm_row(row, norm, eps, row)
                if cos is None or sin is None:
                    store_row(row, out[b, h, slot])
                    continue
                half = cos.shape[2]
                for i in range(half):
                    c, s = cos[b, t, i], sin[b, t, i]
                    x1, x2 = row[i], row[half + i]
                    rotated[i] = x1 * c - x2 * s
                    rotated[half + i] = x2 * c + x1 * s
                for i in range(2 * half, hd):
                    rotated[i] = row[i]
                store_row(rotated, out[b, h, slot])


@njit(**JIT)
def attend_slots(q: np.ndarray, keys: np.ndarray, values: np.ndarray, query_slots: np.ndarray,
                 key_valid: np.ndarray, out: np.ndarray) -> None:
    """Softmax attention of each new token over the slots up to its own, GQA, masked slots weighted 0.

    q [B, nh, T, hd] (unscaled); keys/values [B, nkv, ≥S, hd / block] (only slots up to a token's own are read);
    query_slots int [B, T]: the slot of each new token; key_valid bool [B, ≥S]: which slots hold real tokens (a
    token always sees its own); out [B, nh, T, hd].  Query head h reads kv head h // (nh / nkv).  Each (row, kv
    head) pair's slots are cut into blocks of :data:`BLOCK` (:func:`attend_block`, which the compiled decode step
    hands to its threads one block at a time), merged by :func:`merge_blocks`.
    """
    batch, heads, length, hd = q.shape
    kv_heads = keys.shape[1]
    rows = heads // kv_heads * length
    for b in range(batch):
        blocks = block_count(query_slots, b)
        top, weight, acc = np.empty((blocks, rows), np.float32), np.empty((blocks, rows), np.float32), \
            np.empty((blocks, rows, hd), np.float32)
        for kv in range(kv_heads):
            for j in range(blocks):
                attend_block(q, keys, values, query_slots, key_valid, b, kv, j, top[j], weight[j], acc[j])
            merge_blocks(top, weight, acc, blocks, b, kv, out)


@njit(**JIT)
def block_count(query_slots: np.ndarray, b: int) -> int:
    """Blocks of :data:`BLOCK` slots row ``b``'s new tokens attend over (up to the last token's own slot)."""
    return query_slots[b].max() // BLOCK + 1


@njit(**JIT)
def attend_block(q: np.ndarray, keys: np.ndarray, values: np.ndarray, query_slots: np.ndarray,
                 key_valid: np.ndarray, b: int, kv: int, j: int, top: np.ndarray, weight: np.ndarray,
                 acc: np.ndarray) -> None:
    """Block ``j`` (slots ``j·BLOCK ..``) of row ``b``'s attention by the query heads of kv head ``kv``, as an
    online softmax's partial: per query row r = t·group + g, the block's largest score ``top[r]``, its weights'
    sum ``weight[r]`` = Σ e_s and ``acc[r]`` = Σ e_s·v_s, e_s = exp(score_s - top[r]) (masked slots 0; a row
    that sees no slot of the block: top -inf, weight and acc 0).  # [rows], [rows], [rows, hd] (arguments of
    :func:`attend_slots`)

    The keys' part (:func:`block_scores`) and the values' (:func:`block_values`) are separate functions, so the
    compiled decode step specialises each on one cache type (5 + 5 variants rather than 5 x 5).
    """
    scores = block_scores(q, keys, query_slots, key_valid, b, kv, j, top, weight)
    block_values(scores, values, b, kv, j, acc)


@njit(**JIT)
def block_scores(q: np.ndarray, keys: np.ndarray, query_slots: np.ndarray, key_valid: np.ndarray, b: int, kv: int,
                 j: int, top: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The weights e_s of block ``j`` (:func:`attend_block`), with ``top`` and ``weight`` filled.
    # -> [rows, slots of the block]

    Each cached key is decoded once (:func:`widen_row`) for all query heads of its kv head; a score is a dot
    product in lanes over hd.  (Scores from a transposed tile of keys, a lane per slot, ran slower: numba keeps
    such accumulators in memory.)
    """
    heads, length, hd = q.shape[1], q.shape[2], q.shape[3]
    group = heads // keys.shape[1]
    rows = group * length
    s0 = j * BLOCK
    s1 = min(s0 + BLOCK, query_slots[b].max() + 1)
    scale = F32(1.0 / np.sqrt(hd))  # as the reference scales q
    qs = np.empty((rows, hd), np.float32)
    for t in range(length):
        for g in range(group):
            for i in range(hd):
                qs[t * group + g, i] = q[b, kv * group + g, t, i] * scale
    scores = np.empty((rows, s1 - s0), np.float32)
    tmp = np.empty(hd, np.float32)
    kb = keys[b, kv]  # [S, hd / block]
    for s in range(s0, s1):  # every score first, the hidden ones masked after: no branch in this loop
        k = widen_row(kb[s], tmp)
        for r in range(rows):
            scores[r, s - s0] = dot(qs[r], k)
    for t in range(length):
        own = query_slots[b, t]
        for s in range(s0, s1):
            if not (s <= own and (key_valid[b, s] or s == own)):
                for g in range(group):
                    scores[t * group + g, s - s0] = MASKED
    for t in range(length):
        seen = max(0, min(s1, query_slots[b, t] + 1) - s0)  # a token's slots of the block: its sums are the same
        for g in range(group):  # whatever other tokens share the pass (a verify pass equals one-token steps)
            r = t * group + g
            top[r] = _exponentiate(scores, r, s1 - s0)
            weight[r] = total(scores[r, :seen])
    return scores


@njit(**JIT)
def block_values(scores: np.ndarray, values: np.ndarray, b: int, kv: int, j: int, acc: np.ndarray) -> None:
    """acc[r] ← Σ_s scores[r, s]·v_s over block ``j``'s slots, in lanes over hd: four value rows decoded at a time
    (:func:`widen_row`) and added to every query row's sum at once, ((p0·v0 + p1·v1) + (p2·v2 + p3·v3)) (a quarter
    of the loads and stores of the sums).  Slots past the block's last are weight 0, so the groups of four are the
    same whatever tokens share the pass (a verify pass equals one-token steps bit for bit).
    # [rows, n], [B, nkv, S, hd / block] -> [rows, hd]"""
    rows, n = scores.shape
    hd = acc.shape[1]
    tmp = np.zeros((4, hd), np.float32)
    vb = values[b, kv]
    acc[:] = ZERO
    s0 = j * BLOCK
    for s in range(0, n, 4):
        v0 = widen_row(vb[s0 + s], tmp[0])
        v1 = widen_row(vb[s0 + s + 1], tmp[1]) if s + 1 < n else tmp[1]
        v2 = widen_row(vb[s0 + s + 2], tmp[2]) if s + 2 < n else tmp[2]
        v3 = widen_row(vb[s0 + s + 3], tmp[3]) if s + 3 < n else tmp[3]
        for r in range(rows):
            p0 = scores[r, s]
            p1 = scores[r, s + 1] if s + 1 < n else ZERO
            p2 = scores[r, s + 2] if s + 2 < n else ZERO
            p3 = scores[r, s + 3] if s + 3 < n else ZERO
            o = acc[r]
            for i in range(hd):
                o[i] += (p0 * v0[i] + p1 * v1[i]) + (p2 * v2[i] + p3 * v3[i])


@njit(**JIT)
def _exponentiate(x: np.ndarray, row: int, n: int) -> float:
    """``x[row, :n]`` ← exp(x - max), entries of -inf (masked) exactly 0; returns the max (-inf when every entry
    is masked, all then 0).  # [R, ≥n]"""
    top = MASKED
    for s in range(n):
        top = max(top, x[row, s])
    for s in range(n):
        x[row, s] = ZERO if x[row, s] == MASKED else exp32(x[row, s] - top)
    return top


@njit(**JIT)
def merge_blocks(top: np.ndarray, weight: np.ndarray, acc: np.ndarray, blocks: int, b: int, kv: int,
                 out: np.ndarray) -> None:
    """The attention of row ``b``'s query heads of kv head ``kv`` from its blocks' partials (:func:`attend_block`):
    o = Σ_j acc_j·c_j / Σ_j weight_j·c_j with c_j = exp(top_j - max_j top_j).  top/weight [≥blocks, rows], acc
    [≥blocks, rows, hd]; out [B, nh, T, hd]."""
    length, hd = out.shape[2], out.shape[3]
    group = top.shape[1] // length
    for t in range(length):
        for g in range(group):
            r = t * group + g
            o = out[b, kv * group + g, t]
            best = MASKED
            for j in range(blocks):
                best = max(best, top[j, r])
            o[:] = ZERO
            norm = ZERO
            for j in range(blocks):
                if top[j, r] == MASKED:
                    continue
                c = exp32(top[j, r] - best)
                norm += weight[j, r] * c
                for i in range(hd):
                    o[i] += acc[j, r, i] * c
            inverse = ONE / norm
            for i in range(hd):
                o[i] *= inverse


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
    q = np.empty((batch, heads, length, row_values(keys[0, 0, 0])), np.float32)
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
    # (float16 as its bits, the other types as they are: .attention.kernel_view)
    attend_slots(contiguous(q), k, v, query_slots, key_valid, out)
    return out


def gate(o: np.ndarray, q_gate: np.ndarray) -> np.ndarray:
    """``merge_heads(o) * sigmoid(gate)``.  # [B, nh, T, hd], [B, T, nh, 2hd] -> [B·T, nh·hd]"""
    b, nh, t, hd = o.shape
    out = np.empty((b * t, nh * hd), np.float32)
    sigmoid_gate(o, q_gate, out)
    return out

