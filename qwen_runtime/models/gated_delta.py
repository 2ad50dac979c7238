"""Gated DeltaNet kernels of Qwen3.5's linear-attention layers, in plain numpy (docs §3.4).

Every function works on a whole batch at once and documents its shapes with the letters

    B batch, T tokens, C conv channels (2·Hk·dk + Hv·dv), K conv kernel,
    Hk key heads, Hv value heads, dk key head dim, dv value head dim, N chunks, L chunk length.

Padding is described by ``valid`` (bool ``[B, T]``, False on padding).  Padded positions contribute
nothing: the conv skips them (zero input, conv state untouched) and the delta rule sees g = 0, β = 0 there,
so the recurrent state passes through unchanged.  All arithmetic is float32.

The recurrent state of one value head is ``S ∈ ℝ^(dk×dv)`` (HF's layout ``[B, Hv, dk, dv]``); one step is

    S̄ = exp(g) S;   u = β (v − S̄ᵀk);   S ← S̄ + k uᵀ;   o = Sᵀq

(decay before the read, output read after the update).  :func:`chunked_delta_rule` computes the same thing
64 tokens at a time with matrix products (the "UT transform" of the DeltaNet papers).
"""

from __future__ import annotations

import numpy as np

from ..backend.ops import rms_norm, sigmoid, silu
from ..backend.pool import single_threaded_blas
from ..quants.scratch import Scratch

L2_EPS = 1e-6  # HF/FLA l2norm epsilon, inside the square root
CHUNK = 64  # chunk length of the chunked form (HF's and FLA's)
RECURRENT_MAX_TOKENS = 4  # up to this many tokens the per-token recurrence is cheaper than one chunk
# Chunks per pass of the chunked form: its intra-chunk work runs for this many chunks at once, in scratch buffers
# whose size this bounds (a 128-token pass of 8 heads of 128 x 128: 5.2 MB), whatever the prompt length; one chunk
# per pass took more CPU.
PASS_CHUNKS = 2
# The scratch buffer the conv and the chunked rule carve their arrays from (they never run in the same task).
WORK_BUFFER = "gated delta"
# The inverse of a chunk's unit lower-triangular system is built from diagonal blocks of this size solved row by
# row, then merged pairwise into blocks twice as large (one batched product per level).
INVERSE_BLOCK = 16
# Decays below e^-60 (1e-26) are flushed to exactly 0: they are negligible next to the O(1) terms they are added
# to, and left alone they become float32 subnormals, on which every later product runs far slower.  Strong
# decays (g of -10 per token summed over a chunk) produce them all the time.
LOG_DECAY_FLOOR = np.float32(-60.0)


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + eˣ) without overflow."""
    return np.logaddexp(np.float32(0.0), x).astype(np.float32, copy=False)


def decay_exp(log_decay: np.ndarray) -> np.ndarray:
    """exp of log-decays (≤ 0) into a fresh array, with values under e^LOG_DECAY_FLOOR flushed to 0."""
    out = np.exp(log_decay, dtype=np.float32)
    out[log_decay < LOG_DECAY_FLOOR] = 0.0
    return out


def silu_into(x: np.ndarray, tmp: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out ← x · σ(x) using ``tmp`` (same shape as ``x``) as scratch; no other allocation (``out`` may be ``x``)."""
    np.negative(x, out=tmp)
    with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0 gives x / inf = -0, the right limit
        np.exp(tmp, out=tmp)
    tmp += np.float32(1.0)
    return np.divide(x, tmp, out=out)


# --- convolution -------------------------------------------------------------------------------------------


def left_pad_counts(valid: np.ndarray | None, batch: int, length: int) -> np.ndarray:
    """Padding tokens at the start of each row: int ``[B]``; raises ValueError unless padding is leading."""
    if valid is None:
        return np.zeros(batch, dtype=np.intp)
    valid = np.asarray(valid, dtype=bool)
    if valid.shape != (batch, length):
        raise ValueError(f"valid mask has shape {valid.shape}, expected {(batch, length)}")
    pads = length - valid.sum(axis=1)
    # left padding means each row is False * pads then True * (T - pads)
    if not np.array_equal(valid, np.arange(length)[None, :] >= pads[:, None]):
        raise ValueError("valid mask must describe left padding (False only before the first True of a row)")
    return pads.astype(np.intp)


def causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray,
                  valid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv over time followed by SiLU, carrying the last K−1 raw inputs.

    Args:
        x: raw projections ``[B, T, C]`` (pre-conv).
        weight: depthwise kernel ``[C, K]``; tap K−1 multiplies the current token.
        state: the K−1 raw inputs before ``x`` ``[B, K−1, C]`` (zeros at sequence start).
        valid: bool ``[B, T]`` with left padding only (None = all valid).

    Returns:
        (SiLU(conv) ``[B, T, C]`` with zeros on padding, new state ``[B, K−1, C]``).
    """
    out, new_state = np.array(x, np.float32), np.array(state, np.float32)
    causal_conv1d_inplace(out, weight, new_state, valid, Scratch())
    return out, new_state


def causal_conv1d_inplace(x: np.ndarray, weight: np.ndarray, state: np.ndarray, valid: np.ndarray | None,
                          scratch: Scratch) -> None:
    """:func:`causal_conv1d` overwriting its arguments: ``x`` ``[B, T, C]`` ← SiLU(conv), ``state`` ← new state.

    Both may be strided views (a column block of a projection, of a cache); the inputs are staged in
    ``scratch``.  Works on any subset of the channels, so a prefill's conv is split into blocks of channels
    over the pool.
    """
    batch, length, channels = x.shape
    kernel = weight.shape[1]
    pads = left_pad_counts(valid, batch, length)
    # ext[b] = [zeros for padding | state[b] | valid inputs of row b]: the state sits right before the first
    # valid token, so padding is skipped exactly.
    ext, acc, tmp = scratch.arrays(WORK_BUFFER, [(batch, kernel - 1 + length, channels),  # [B, K-1+T, C]
                                                 (batch, length, channels), (batch, length, channels)])
    ext[:, kernel - 1:] = x
    if pads.any():
        ext[np.arange(kernel - 1 + length)[None, :] < (kernel - 1 + pads)[:, None]] = 0.0
    rows = np.arange(batch)[:, None]
    ext[rows, pads[:, None] + np.arange(kernel - 1)[None, :]] = state
    state[...] = ext[:, length:]
    taps = np.ascontiguousarray(weight.T, dtype=np.float32)  # [K, C]
    # sums and products in contiguous buffers (numpy's loops over a column block of a wider array ran slower)
    np.multiply(ext[:, 0:length], taps[0], out=acc)
    for tap in range(1, kernel):
        acc += np.multiply(ext[:, tap:tap + length], taps[tap], out=tmp)
    silu_into(acc, tmp, out=x)
    if pads.any():
        x[np.arange(length)[None, :] < pads[:, None]] = 0.0


# --- per-head preparation ------------------------------------------------------------------------------------


def l2_normalize(x: np.ndarray, eps: float = L2_EPS) -> np.ndarray:
    """x / sqrt(Σx² + eps) over the last axis (HF/FLA ``l2norm``)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def key_head_index(n_key_heads: int, n_value_heads: int, perm: np.ndarray | None = None) -> np.ndarray:
    """The key head each value head reads: int ``[Hv]``.

    Value head h reads key head h // (Hv/Hk); ``perm`` (int ``[Hv]``, None: in order) is the head each of the
    value heads at hand is, when they come permuted.
    """
    heads = np.arange(n_value_heads) if perm is None else np.asarray(perm)
    return heads // (n_value_heads // n_key_heads)


def expand_key_heads(x: np.ndarray, n_value_heads: int, perm: np.ndarray | None = None) -> np.ndarray:
    """Map key heads onto value heads: ``[B, T, Hk, d] -> [B, T, Hv, d]`` (see :func:`key_head_index`)."""
    if n_value_heads == x.shape[2]:
        return x
    return x[:, :, key_head_index(x.shape[2], n_value_heads, perm)]


def split_qkv(mixed: np.ndarray, n_key_heads: int, key_dim: int, value_dim: int,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split conv output ``[B, T, C]`` into q, k ``[B, T, Hk, dk]`` and v ``[B, T, Hv, dv]``."""
    batch, length, _ = mixed.shape
    key_width = n_key_heads * key_dim
    q = mixed[..., :key_width].reshape(batch, length, n_key_heads, key_dim)
    k = mixed[..., key_width:2 * key_width].reshape(batch, length, n_key_heads, key_dim)
    v = mixed[..., 2 * key_width:].reshape(batch, length, -1, value_dim)
    return q, k, v


def prepare_qk(q: np.ndarray, k: np.ndarray, n_value_heads: int,
               perm: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """L2-normalise q and k, scale q by dk^-½ and map them to value heads: ``[B, T, Hk, dk] -> [B, T, Hv, dk]``."""
    scale = np.float32(q.shape[-1] ** -0.5)
    q = l2_normalize(q) * scale
    k = l2_normalize(k)
    return expand_key_heads(q, n_value_heads, perm), expand_key_heads(k, n_value_heads, perm)


def gates(b: np.ndarray, a: np.ndarray, ssm_a: np.ndarray, dt_bias: np.ndarray,
          valid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """β = σ(b) and log-decay g = ssm_a · softplus(a + dt_bias), both ``[B, T, Hv]``; 0 on padding.

    ``ssm_a`` is already −exp(A_log) (the canonical GGUF tensor), so g ≤ 0.
    """
    beta = sigmoid(b.astype(np.float32, copy=False))
    g = ssm_a.astype(np.float32) * softplus(a.astype(np.float32, copy=False) + dt_bias.astype(np.float32))
    if valid is not None:
        keep = np.asarray(valid, dtype=bool)[..., None]
        beta, g = np.where(keep, beta, np.float32(0)), np.where(keep, g, np.float32(0))
    return beta, g


# --- the delta rule ------------------------------------------------------------------------------------------


def recurrent_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                         state: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Token-by-token gated delta rule, updating ``state`` in place (the decode path).

    Args:
        q, k: normalised (q also scaled) ``[B, T, H, dk]``; v ``[B, T, H, dv]``; g, beta ``[B, T, H]``.
        state: float32 ``[B, H, dk, dv]``, updated in place.
        out: where to write o (any strides), or None for a new array.

    Returns:
        o ``[B, T, H, dv]``.

    Both reads use the pre-decay state: with S̄ = e^g S, S̄ᵀk = e^g (Sᵀk) and the output after the update is
    Sₙᵀq = e^g (Sᵀq) + (k·q) u, so one pass reads S and two in-place passes update it.
    """
    batch, length, heads, _ = q.shape
    out = np.empty(v.shape, dtype=np.float32) if out is None else out  # [B, T, H, dv]
    for t in range(length):
        qk = np.stack([q[:, t], k[:, t]], axis=2)  # [B, H, 2, dk]
        reads = np.matmul(qk, state)  # [B, H, 2, dv]
        decay = decay_exp(g[:, t])[..., None]  # [B, H, 1]
        u = beta[:, t, :, None] * (v[:, t] - decay * reads[:, :, 1])  # [B, H, dv]
        qdotk = np.sum(q[:, t] * k[:, t], axis=-1, keepdims=True)  # [B, H, 1]
        out[:, t] = decay * reads[:, :, 0] + qdotk * u
        state *= decay[..., None]
        state += k[:, t, :, :, None] * u[:, :, None, :]
    return out


def _chunk_layout(x: np.ndarray, chunk: int, out: np.ndarray) -> np.ndarray:
    """``x`` ``[B, T, H, ...]`` copied into ``out`` ``[B, H, N·L, ...]`` (zeros after T), viewed as
    ``[B, H, N, L, ...]``."""
    length = x.shape[1]
    out[:, :, :length] = np.moveaxis(x, 2, 1)
    out[:, :, length:] = 0.0
    return out.reshape(out.shape[0], out.shape[1], -1, chunk, *out.shape[3:])


def _diagonal_blocks(x: np.ndarray, size: int) -> np.ndarray:
    """Writable view of the ``size`` × ``size`` diagonal blocks of square matrices: ``[..., L, L] -> [..., L/size,
    size, size]``."""
    *lead, n, _ = x.shape
    row, col = x.strides[-2:]
    return np.lib.stride_tricks.as_strided(x, (*lead, n // size, size, size), (*x.strides[:-2], size * (row + col),
                                                                              row, col))


def invert_unit_lower(strict: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out`` ← (I + strict)⁻¹ for strictly lower-triangular ``strict`` ``[..., L, L]`` (float32, ``out`` alike).

    Diagonal blocks of :data:`INVERSE_BLOCK` rows are inverted by forward substitution, row by row for all of
    them at once; then blocks are merged pairwise, [[A, 0], [C, B]]⁻¹ = [[A⁻¹, 0], [−B⁻¹ C A⁻¹, B⁻¹]], one
    batched product per doubling (L = 64: 15 row steps and 2 merges instead of 63 row steps).
    """
    size = strict.shape[-1]
    base = INVERSE_BLOCK if size > INVERSE_BLOCK and size % INVERSE_BLOCK == 0 else size
    if (size // base) & (size // base - 1):  # not base · 2^m: solve the whole matrix row by row
        base = size
    out[...] = 0.0
    diag = np.arange(size)
    out[..., diag, diag] = 1.0
    inv, low = _diagonal_blocks(out, base), _diagonal_blocks(strict, base)
    for i in range(1, base):  # row i of each block: X[i, :i] = −A[i, :i] X[:i, :i]
        inv[..., i, :i] = np.matmul(low[..., i:i + 1, :i], inv[..., :i, :i])[..., 0, :]
        np.negative(inv[..., i, :i], out=inv[..., i, :i])
    block = 2 * base
    while block <= size:
        half = block // 2
        inv, low = _diagonal_blocks(out, block), _diagonal_blocks(strict, block)
        corner = inv[..., half:, :half]
        np.matmul(inv[..., half:, half:], np.matmul(low[..., half:, :half], inv[..., :half, :half]), out=corner)
        np.negative(corner, out=corner)
        block *= 2
    return out


def chunked_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                       state: np.ndarray, chunk: int = CHUNK, out: np.ndarray | None = None,
                       scratch: Scratch | None = None) -> np.ndarray:
    """The gated delta rule over a whole sequence, ``chunk`` tokens at a time (the prefill path).

    Same arguments and result as :func:`recurrent_delta_rule` (``state`` ``[B, H, dk, dv]`` updated in place);
    ``out`` ``[B, T, H, dv]`` (any strides) receives the result when given, ``scratch`` holds the work buffers.
    Per chunk with incoming state S (docs §3.4): Vn = U − W S; O = (Q̂ ⊙ e^γ) S + (Q̂K̂ᵀ ⊙ D) Vn;
    S ← e^(γ_last) S + (K̂ ⊙ e^(γ_last − γ))ᵀ Vn, with [U | W] = T [Ṽ | K̃ ⊙ e^γ] and
    T = (I + strict_lower(K̃K̂ᵀ ⊙ D))⁻¹.  The sequence is taken :data:`PASS_CHUNKS` chunks at a time.
    """
    length = q.shape[1]
    out = np.empty(v.shape, np.float32) if out is None else out
    scratch = Scratch() if scratch is None else scratch
    span = chunk * PASS_CHUNKS
    zero_state = not state.any()  # a new sequence: the first chunk reads nothing from the state
    for t0 in range(0, length, span):
        t1 = min(length, t0 + span)
        _chunked_pass(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], g[:, t0:t1], beta[:, t0:t1], state, chunk,
                      out[:, t0:t1], scratch, zero_state and t0 == 0)
    return out


def _chunked_pass(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray,
                  chunk: int, out: np.ndarray, scratch: Scratch, zero_state: bool) -> None:
    """:func:`chunked_delta_rule` on a few chunks, their intra-chunk work batched; ``zero_state``: S is all 0."""
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    padded = -(-length // chunk) * chunk
    n_chunks = padded // chunk
    squares, steps = (batch, heads, n_chunks, chunk, chunk), (batch, heads, chunk, dv)
    (qc, kc, rhs, uw, decay, scores, inverse, reads, o, v_new, update) = scratch.arrays(WORK_BUFFER, [
        (batch, heads, padded, dk), (batch, heads, padded, dk),  # q, k in chunks
        (batch, heads, padded, dv + dk), (batch, heads, n_chunks, chunk, dv + dk),  # [Ṽ | K̃ ⊙ e^γ], [U | W]
        squares, squares, squares,  # D, the scores, T
        steps, steps, steps, state.shape])  # per chunk: S reads, output, Vn; the state update
    qc = _chunk_layout(q, chunk, qc)  # [B, H, N, L, dk]
    kc = _chunk_layout(k, chunk, kc)
    gc = _chunk_layout(g, chunk, np.empty((batch, heads, padded), np.float32))  # [B, H, N, L]
    bc = _chunk_layout(beta, chunk, np.empty((batch, heads, padded), np.float32))
    gamma = np.cumsum(gc, axis=-1)  # [B, H, N, L]
    np.subtract(gamma[..., :, None], gamma[..., None, :], out=decay)
    np.copyto(decay, -np.inf, where=np.triu(np.ones((chunk, chunk), bool), 1))  # before exp: γi − γj > 0 there
    decay[decay < LOG_DECAY_FLOOR] = -np.inf
    np.exp(decay, out=decay)  # D_ij = exp(γi − γj) for i ≥ j, else 0
    exp_gamma = decay_exp(gamma)[..., None]  # [B, H, N, L, 1]
    # right-hand sides [Ṽ | K̃ ⊙ e^γ] (Ṽ = β ⊙ V, K̃ = β ⊙ K̂)
    _chunk_layout(v, chunk, rhs[..., :dv])
    rhs = rhs.reshape(batch, heads, n_chunks, chunk, dv + dk)
    rhs[..., :dv] *= bc[..., None]
    k_beta = np.multiply(kc, bc[..., None], out=rhs[..., dv:])
    np.matmul(k_beta, np.swapaxes(kc, -1, -2), out=scores)
    scores *= decay
    diag = np.arange(chunk)
    scores[..., diag, diag] = 0.0
    k_beta *= exp_gamma
    np.matmul(invert_unit_lower(scores, inverse), rhs, out=uw)  # [U | W]
    attn = np.matmul(qc, np.swapaxes(kc, -1, -2), out=scores)  # Q̂K̂ᵀ ⊙ D
    attn *= decay
    qc *= exp_gamma
    kc *= decay_exp(gamma[..., -1:] - gamma)[..., None]
    chunk_decay = decay_exp(gamma[..., -1])  # [B, H, N]
    for n in range(n_chunks):
        u, w = uw[:, :, n, :, :dv], uw[:, :, n, :, dv:]
        if zero_state and n == 0:
            new_values = u
            np.matmul(attn[:, :, n], new_values, out=o)
        else:
            new_values = np.subtract(u, np.matmul(w, state, out=reads), out=v_new)
            np.matmul(attn[:, :, n], new_values, out=o)
            o += np.matmul(qc[:, :, n], state, out=reads)
        t0 = n * chunk
        out[:, t0:t0 + chunk] = np.swapaxes(o[:, :, :min(chunk, length - t0)], 1, 2)
        state *= chunk_decay[:, :, n, None, None]
        state += np.matmul(np.swapaxes(kc[:, :, n], -1, -2), new_values, out=update)


def delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
               state: np.ndarray, chunk: int = CHUNK, out: np.ndarray | None = None,
               scratch: Scratch | None = None) -> np.ndarray:
    """Recurrent form for a few tokens (decode), chunked form for longer inputs (prefill).

    Inputs shorter than ``chunk`` use the smallest power-of-two chunk that holds them, not a padded 64.
    ``out`` and ``scratch`` as in :func:`chunked_delta_rule`.
    """
    length = q.shape[1]
    with single_threaded_blas():
        if length <= RECURRENT_MAX_TOKENS:
            return recurrent_delta_rule(q, k, v, g, beta, state, out)
        return chunked_delta_rule(q, k, v, g, beta, state, min(chunk, 1 << (length - 1).bit_length()), out,
                                  scratch)


# --- output norm ---------------------------------------------------------------------------------------------


def gated_rms_norm(o: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float,
                   out: np.ndarray | None = None) -> np.ndarray:
    """norm(o) ⊙ w ⊙ SiLU(z) per head (no +1): ``[B, T, Hv, dv]`` -> ``[B, T, Hv, dv]`` (``out`` may be ``o``)."""
    out = rms_norm(o, weight.astype(np.float32, copy=False), eps, out=out)
    out *= silu(z.astype(np.float32, copy=False))
    return out
