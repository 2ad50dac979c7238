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

from ..archs import V_HEAD_GROUPED, V_HEAD_TILED
from ..ops import sigmoid, silu
from ..pool import single_threaded_blas

L2_EPS = 1e-6  # HF/FLA l2norm epsilon, inside the square root
CHUNK = 64  # chunk length of the chunked form (HF's and FLA's)
RECURRENT_MAX_TOKENS = 4  # up to this many tokens the per-token recurrence is cheaper than one chunk
# Decays below e^-60 (1e-26) are flushed to exactly 0: they are negligible next to the O(1) terms they are added
# to, and left alone they become float32 subnormals, on which every later product runs ~100x slower.  Strong
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


def silu_inplace(x: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """x ← x · σ(x) using ``tmp`` (same shape) as scratch; no other allocation."""
    np.negative(x, out=tmp)
    with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0 gives x / inf = -0, the right limit
        np.exp(tmp, out=tmp)
    tmp += np.float32(1.0)
    return np.divide(x, tmp, out=x)


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
    batch, length, channels = x.shape
    kernel = weight.shape[1]
    pads = left_pad_counts(valid, batch, length)
    # ext[b] = [zeros for padding | state[b] | valid inputs of row b]: the state sits right before the first
    # valid token, so padding is skipped exactly.
    ext = np.zeros((batch, kernel - 1 + length, channels), dtype=np.float32)  # [B, K-1+T, C]
    ext[:, kernel - 1:] = x
    if pads.any():
        ext[np.arange(kernel - 1 + length)[None, :] < (kernel - 1 + pads)[:, None]] = 0.0
    rows = np.arange(batch)[:, None]
    ext[rows, pads[:, None] + np.arange(kernel - 1)[None, :]] = state
    taps = np.ascontiguousarray(weight.T, dtype=np.float32)  # [K, C]
    # in-place arithmetic: fresh temporaries of this size cost page faults that outweigh the arithmetic
    out = np.multiply(ext[:, 0:length], taps[0])  # [B, T, C]
    tmp = np.empty_like(out)
    for tap in range(1, kernel):
        out += np.multiply(ext[:, tap:tap + length], taps[tap], out=tmp)
    silu_inplace(out, tmp)
    if pads.any():
        out[np.arange(length)[None, :] < pads[:, None]] = 0.0
    return out, ext[:, length:].copy()


# --- per-head preparation ------------------------------------------------------------------------------------


def l2_normalize(x: np.ndarray, eps: float = L2_EPS) -> np.ndarray:
    """x / sqrt(Σx² + eps) over the last axis (HF/FLA ``l2norm``)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def expand_key_heads(x: np.ndarray, n_value_heads: int, order: str) -> np.ndarray:
    """Map key heads onto value heads: ``[B, T, Hk, d] -> [B, T, Hv, d]``.

    ``grouped`` (HF): value head j uses key head j // (Hv/Hk); ``tiled`` (llama.cpp): key head j % Hk.
    """
    ratio = n_value_heads // x.shape[2]
    if ratio == 1:
        return x
    if order == V_HEAD_GROUPED:
        return np.repeat(x, ratio, axis=2)
    if order == V_HEAD_TILED:
        return np.tile(x, (1, 1, ratio, 1))
    raise ValueError(f"unknown value-head order {order!r}")


def split_qkv(mixed: np.ndarray, n_key_heads: int, key_dim: int, value_dim: int,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split conv output ``[B, T, C]`` into q, k ``[B, T, Hk, dk]`` and v ``[B, T, Hv, dv]``."""
    batch, length, _ = mixed.shape
    key_width = n_key_heads * key_dim
    q = mixed[..., :key_width].reshape(batch, length, n_key_heads, key_dim)
    k = mixed[..., key_width:2 * key_width].reshape(batch, length, n_key_heads, key_dim)
    v = mixed[..., 2 * key_width:].reshape(batch, length, -1, value_dim)
    return q, k, v


def prepare_qk(q: np.ndarray, k: np.ndarray, n_value_heads: int, order: str) -> tuple[np.ndarray, np.ndarray]:
    """L2-normalise q and k, scale q by dk^-½ and map them to value heads: ``[B, T, Hk, dk] -> [B, T, Hv, dk]``."""
    scale = np.float32(q.shape[-1] ** -0.5)
    q = l2_normalize(q) * scale
    k = l2_normalize(k)
    return expand_key_heads(q, n_value_heads, order), expand_key_heads(k, n_value_heads, order)


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
                         state: np.ndarray) -> np.ndarray:
    """Token-by-token gated delta rule, updating ``state`` in place (the decode path).

    Args:
        q, k: normalised (q also scaled) ``[B, T, H, dk]``; v ``[B, T, H, dv]``; g, beta ``[B, T, H]``.
        state: float32 ``[B, H, dk, dv]``, updated in place.

    Returns:
        o ``[B, T, H, dv]``.

    Both reads use the pre-decay state: with S̄ = e^g S, S̄ᵀk = e^g (Sᵀk) and the output after the update is
    Sₙᵀq = e^g (Sᵀq) + (k·q) u, so one pass reads S and two in-place passes update it.
    """
    batch, length, heads, _ = q.shape
    out = np.empty(v.shape, dtype=np.float32)  # [B, T, H, dv]
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


def _to_chunks(x: np.ndarray, length: int, chunk: int) -> np.ndarray:
    """A fresh ``[B, H, N, L, ...]`` float32 copy of ``[B, T, H, ...]``, zero-padded at the end."""
    batch, _, heads, *rest = x.shape
    n_chunks = -(-length // chunk)
    out = np.empty((batch, heads, n_chunks * chunk, *rest), dtype=np.float32)  # [B, H, N*L, ...]
    out[:, :, :length] = np.moveaxis(x, 2, 1)
    out[:, :, length:] = 0.0
    return out.reshape(batch, heads, n_chunks, chunk, *rest)


def solve_unit_lower(strict: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve (I + strict) X = rhs in place by forward substitution over rows (no explicit inverse).

    strict: strictly lower-triangular ``[..., L, L]``; rhs ``[..., L, D]`` float32, overwritten by X.
    """
    for i in range(1, strict.shape[-1]):
        rhs[..., i, :] -= np.matmul(strict[..., i:i + 1, :i], rhs[..., :i, :])[..., 0, :]
    return rhs


def _intra_chunk(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                 ) -> tuple[np.ndarray, ...]:
    """Everything that does not depend on the incoming state, for all chunks at once.

    Inputs are chunked copies (``q`` and ``k`` are overwritten): q, k ``[B, H, N, L, dk]``, v ``[B, H, N, L, dv]``,
    g, beta ``[B, H, N, L]``.  Returns U, W, the masked intra-chunk scores, Q̂ ⊙ e^γ, K̂ ⊙ e^(γ_last − γ) and
    e^(γ_last).  Work happens in place where possible: fresh temporaries of these sizes cost page faults.
    """
    chunk, dv = g.shape[-1], v.shape[-1]
    gamma = np.cumsum(g, axis=-1)  # [B, H, N, L]
    decay = gamma[..., :, None] - gamma[..., None, :]  # [B, H, N, L, L]
    upper_i, upper_j = np.triu_indices(chunk, 1)
    decay[..., upper_i, upper_j] = -np.inf  # masked before exp: γi − γj > 0 there could overflow
    decay[decay < LOG_DECAY_FLOOR] = -np.inf
    np.exp(decay, out=decay)  # D_ij = exp(γi − γj) for i ≥ j, else 0
    exp_gamma = decay_exp(gamma)[..., None]  # [B, H, N, L, 1]
    # right-hand sides [Ṽ | K̃ ⊙ e^γ] of U = T Ṽ and W = T (K̃ ⊙ e^γ), T = (I + strict_lower(K̃K̂ᵀ ⊙ D))⁻¹
    uw = np.empty((*v.shape[:-1], dv + k.shape[-1]), dtype=np.float32)  # [B, H, N, L, dv + dk]
    np.multiply(v, beta[..., None], out=uw[..., :dv])
    k_beta = np.multiply(k, beta[..., None], out=uw[..., dv:])
    strict = np.matmul(k_beta, np.swapaxes(k, -1, -2))  # [B, H, N, L, L]
    strict *= decay
    diag = np.arange(chunk)
    strict[..., diag, diag] = 0.0
    k_beta *= exp_gamma
    solve_unit_lower(strict, uw)
    attn = np.matmul(q, np.swapaxes(k, -1, -2))  # [B, H, N, L, L]
    attn *= decay
    q *= exp_gamma
    k *= decay_exp(gamma[..., -1:] - gamma)[..., None]
    chunk_decay = decay_exp(gamma[..., -1])[..., None, None]  # [B, H, N, 1, 1]
    return uw[..., :dv], uw[..., dv:], attn, q, k, chunk_decay


def chunked_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                       state: np.ndarray, chunk: int = CHUNK) -> np.ndarray:
    """The gated delta rule over a whole sequence, ``chunk`` tokens at a time (the prefill path).

    Same arguments and result as :func:`recurrent_delta_rule` (``state`` ``[B, H, dk, dv]`` updated in place).
    Per chunk with incoming state S (docs §3.4): Vn = U − W S; O = (Q̂ ⊙ e^γ) S + (Q̂K̂ᵀ ⊙ D) Vn;
    S ← e^(γ_last) S + (K̂ ⊙ e^(γ_last − γ))ᵀ Vn.
    """
    batch, length, heads, dv = v.shape
    qc, kc, vc = (_to_chunks(x, length, chunk) for x in (q, k, v))
    gc, bc = (_to_chunks(x, length, chunk) for x in (g, beta))
    u, w, attn, q_decayed, k_decayed, chunk_decay = _intra_chunk(qc, kc, vc, gc, bc)
    out = np.empty(u.shape, dtype=np.float32)  # [B, H, N, L, dv]
    s = state.astype(np.float32, copy=False)
    for n in range(u.shape[2]):
        v_new = u[:, :, n] - np.matmul(w[:, :, n], s)  # [B, H, L, dv]
        out[:, :, n] = np.matmul(q_decayed[:, :, n], s) + np.matmul(attn[:, :, n], v_new)
        s = s * chunk_decay[:, :, n] + np.matmul(np.swapaxes(k_decayed[:, :, n], -1, -2), v_new)
    state[...] = s
    out = out.reshape(batch, heads, -1, dv)[:, :, :length]
    return np.ascontiguousarray(np.moveaxis(out, 1, 2))  # [B, T, H, dv]


def delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
               state: np.ndarray, chunk: int = CHUNK) -> np.ndarray:
    """Recurrent form for a few tokens (decode), chunked form for longer inputs (prefill).

    Inputs shorter than ``chunk`` use the smallest power-of-two chunk that holds them, not a padded 64.
    """
    length = q.shape[1]
    with single_threaded_blas():
        if length <= RECURRENT_MAX_TOKENS:
            return recurrent_delta_rule(q, k, v, g, beta, state)
        return chunked_delta_rule(q, k, v, g, beta, state, min(chunk, 1 << (length - 1).bit_length()))


# --- output norm ---------------------------------------------------------------------------------------------


def gated_rms_norm(o: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """norm(o) ⊙ w ⊙ SiLU(z) per head (no +1): ``[B, T, Hv, dv]`` -> ``[B, T, Hv, dv]``."""
    inv = np.float32(1.0) / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + np.float32(eps))
    return o * inv * weight.astype(np.float32) * silu(z.astype(np.float32, copy=False))
