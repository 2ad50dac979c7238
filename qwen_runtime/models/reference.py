"""A plain forward pass of every supported family, to read and to test the fast path against.

Qwen2 / Qwen2.5 / DeepSeek-R1-Distill-Qwen, Qwen3 and Qwen3.5 (Gated DeltaNet + gated attention) in float64
numpy: one sequence, the whole prompt at once, no cache, no tiles, no threads, one function per idea.  The math
is docs/qwen-architectures.md §3; the fast path (:mod:`qwen_runtime.models`) computes the same in float32 on
a cache, tile by tile.

    from qwen_runtime.formats import open_model_files
    from qwen_runtime.models.reference import forward
    logits = forward(open_model_files("qwen3-0.6b.gguf"), [9707, 11, 1879])   # float64 [T, V]

Weights come through the real readers, as canonical GGUF tensors with the converter's transforms applied
(docs §4.4): Qwen3.5's norms already hold 1 + w, ``ssm_a`` is −exp(A_log), the conv kernel is ``[C, K]`` and
value heads may be stored permuted (``files.v_head_perm``).  Each weight is widened to a float64 copy, so this
is for small models and short prompts.

Shapes: T tokens, H hidden size, V vocabulary, I MLP width, nh / nkv / hd attention heads and head dim;
linear attention: Hk / Hv key / value heads of dims dk / dv, C = 2·Hk·dk + Hv·dv conv channels, K kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

import numpy as np
from gguf import MODEL_TENSOR

from ..formats import ModelFiles
from ..formats.config import ModelConfig
from ..formats.naming import tensor_name
from ..formats.rope import RopeScaling

Weights = Callable[..., np.ndarray]  # (kind, layer=None, suffix=".weight") -> float64 array
L2_EPS = 1e-6  # inside the root of the q/k l2 norm of Gated DeltaNet (transformers' value)


def weights(files: ModelFiles) -> Weights:
    """``w(kind, layer, suffix)``: the named tensor widened to float64 (each read once)."""

    @cache
    def w(kind: MODEL_TENSOR, layer: int | None = None, suffix: str = ".weight") -> np.ndarray:
        return files.tensor(tensor_name(kind, layer, suffix)).to_float32().astype(np.float64)

    return w


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:  # [..., D] -> [..., D]
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def l2_norm(x: np.ndarray) -> np.ndarray:  # [..., D] -> [..., D]
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def softmax(x: np.ndarray) -> np.ndarray:  # over the last axis
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def rope(x: np.ndarray, rotary_dim: int, theta: float,
         scaling: RopeScaling | None = None) -> np.ndarray:  # [heads, T, hd] -> [heads, T, hd]
    """Rotate the first ``rotary_dim`` dims of each head, pairing dim j with j + rotary_dim/2 (docs §3.2); with
    ``scaling`` (:mod:`.rope`: linear or YaRN) its frequencies, and cos/sin times YaRN's attention scale."""
    half = rotary_dim // 2
    inv_freq = theta ** (-np.arange(half) * 2 / rotary_dim) if scaling is None else scaling.inv_freq(rotary_dim, theta)
    angles = np.arange(x.shape[1])[:, None] * inv_freq  # [T, r/2]
    scale = 1.0 if scaling is None else scaling.attention_scale
    cos, sin = scale * np.cos(angles), scale * np.sin(angles)  # [T, r/2]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]  # [heads, T, r/2 | r/2 | hd-r]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)  # [heads, T, hd]


def heads(y: np.ndarray, n: int) -> np.ndarray:  # [T, n*d] -> [n, T, d]
    return y.reshape(y.shape[0], n, -1).transpose(1, 0, 2)


def attention(x: np.ndarray, w: Weights, c: ModelConfig, i: int) -> np.ndarray:  # [T, H] -> [T, H]
    """Causal grouped-query softmax attention of layer ``i`` (docs §3.3), gated for Qwen3.5."""
    t, nh, nkv, hd = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q = x @ w(MODEL_TENSOR.ATTN_Q, i).T  # [T, nh*hd]; Qwen3.5: [T, nh*2hd], per head hd queries then hd gates
    k = x @ w(MODEL_TENSOR.ATTN_K, i).T  # [T, nkv*hd]
    v = x @ w(MODEL_TENSOR.ATTN_V, i).T  # [T, nkv*hd]
    if c.spec.attention_bias:  # Qwen2
        q = q + w(MODEL_TENSOR.ATTN_Q, i, ".bias")  # [T, nh*hd]
        k = k + w(MODEL_TENSOR.ATTN_K, i, ".bias")  # [T, nkv*hd]
        v = v + w(MODEL_TENSOR.ATTN_V, i, ".bias")  # [T, nkv*hd]
    if c.spec.gated_attention:  # Qwen3.5
        q, gate = np.split(q.reshape(t, nh, 2 * hd), 2, axis=-1)  # 2 x [T, nh, hd]
        q, gate = q.reshape(t, nh * hd), gate.reshape(t, nh * hd)  # 2 x [T, nh*hd]
    q, k, v = heads(q, nh), heads(k, nkv), heads(v, nkv)  # [nh, T, hd], [nkv, T, hd], [nkv, T, hd]
    if c.spec.qk_norm:  # Qwen3, Qwen3.5: one RMSNorm weight shared by all heads, before RoPE
        q = rms_norm(q, w(MODEL_TENSOR.ATTN_Q_NORM, i), c.rms_norm_eps)  # [nh, T, hd]
        k = rms_norm(k, w(MODEL_TENSOR.ATTN_K_NORM, i), c.rms_norm_eps)  # [nkv, T, hd]
    q, k = (rope(a, c.rotary_dim, c.rope_theta, c.rope_scaling) for a in (q, k))  # [nh | nkv, T, hd]
    group = nh // nkv  # query head h reads key-value head h // group
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # [nh, T, hd]
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)  # [nh, T, T]
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)  # [nh, T, T] causal
    out = (softmax(scores) @ v).transpose(1, 0, 2).reshape(t, nh * hd)  # [T, nh*hd]
    if c.spec.gated_attention:
        out = out * sigmoid(gate)  # [T, nh*hd]
    return out @ w(MODEL_TENSOR.ATTN_OUT, i).T  # [T, H]


def causal_conv(m: np.ndarray, kernel: np.ndarray) -> np.ndarray:  # [T, C], [C, K] -> [T, C]
    """Depthwise causal convolution: the last tap meets the current token, inputs before the first are 0."""
    t, k = m.shape[0], kernel.shape[1]
    padded = np.concatenate([np.zeros((k - 1, m.shape[1])), m])  # [K-1+T, C]
    return sum(padded[j:j + t] * kernel[:, j] for j in range(k))  # [T, C]


def value_heads(x: np.ndarray, c: ModelConfig, perm: np.ndarray | None,
                ) -> np.ndarray:  # [T, Hk, d] -> [T, Hv, d]
    """The key head each value head uses: head j uses key head j // (Hv/Hk); ``perm`` says which head each
    stored value head is (None: stored in order)."""
    x = np.repeat(x, c.linear_num_value_heads // c.linear_num_key_heads, axis=1)  # [T, Hv, d]
    return x if perm is None else x[:, perm]


def gated_delta_net(x: np.ndarray, w: Weights, c: ModelConfig, i: int,
                    perm: np.ndarray | None = None) -> np.ndarray:  # [T, H] -> [T, H]
    """Qwen3.5's linear attention of layer ``i``, token by token (docs §3.4)."""
    t, hk, hv = x.shape[0], c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    m = x @ w(MODEL_TENSOR.ATTN_QKV, i).T  # [T, C]
    z = (x @ w(MODEL_TENSOR.ATTN_GATE, i).T).reshape(t, hv, dv)  # [T, Hv, dv]
    beta = sigmoid(x @ w(MODEL_TENSOR.SSM_BETA, i).T)  # [T, Hv] write strength
    a = x @ w(MODEL_TENSOR.SSM_ALPHA, i).T + w(MODEL_TENSOR.SSM_DT, i, ".bias")  # [T, Hv]
    g = w(MODEL_TENSOR.SSM_A, i, "") * softplus(a)  # [T, Hv] log-decay <= 0 (ssm_a = -exp(A_log))
    m = silu(causal_conv(m, w(MODEL_TENSOR.SSM_CONV1D, i)))  # [T, C]
    q, k, v = np.split(m, [hk * dk, 2 * hk * dk], axis=1)  # [T, Hk*dk], [T, Hk*dk], [T, Hv*dv]
    q = value_heads(l2_norm(q.reshape(t, hk, dk)) / np.sqrt(dk), c, perm)  # [T, Hv, dk]
    k = value_heads(l2_norm(k.reshape(t, hk, dk)), c, perm)  # [T, Hv, dk]
    v = v.reshape(t, hv, dv)  # [T, Hv, dv]
    state = np.zeros((hv, dk, dv))  # [Hv, dk, dv] one key -> value memory per value head
    out = np.empty((t, hv, dv))  # [T, Hv, dv]
    for s in range(t):
        state = state * np.exp(g[s])[:, None, None]  # [Hv, dk, dv] decay
        error = v[s] - np.einsum("hkv,hk->hv", state, k[s])  # [Hv, dv] what the memory gets wrong for k
        state = state + np.einsum("hk,hv->hkv", k[s], beta[s][:, None] * error)  # [Hv, dk, dv] delta rule
        out[s] = np.einsum("hkv,hk->hv", state, q[s])  # [Hv, dv] read with the updated state
    out = rms_norm(out, w(MODEL_TENSOR.SSM_NORM, i), c.rms_norm_eps) * silu(z)  # [T, Hv, dv] gated norm
    return out.reshape(t, hv * dv) @ w(MODEL_TENSOR.SSM_OUT, i).T  # [T, H]


def mlp(x: np.ndarray, w: Weights, i: int) -> np.ndarray:  # [T, H] -> [T, H]
    gate = silu(x @ w(MODEL_TENSOR.FFN_GATE, i).T)  # [T, I]
    return (gate * (x @ w(MODEL_TENSOR.FFN_UP, i).T)) @ w(MODEL_TENSOR.FFN_DOWN, i).T  # [T, I] -> [T, H]


def forward(files: ModelFiles, ids: Sequence[int]) -> np.ndarray:  # int [T] -> float64 [T, V]
    """Logits of every position of one sequence (docs §3.5)."""
    c, w, perm = files.config, weights(files), files.v_head_perm  # perm: which value head each stored one is
    x = w(MODEL_TENSOR.TOKEN_EMBD)[np.asarray(ids, np.int64)]  # [T, H]
    for i in range(c.num_hidden_layers):
        h = rms_norm(x, w(MODEL_TENSOR.ATTN_NORM, i), c.rms_norm_eps)  # [T, H]
        x = x + (gated_delta_net(h, w, c, i, perm) if c.is_linear(i) else attention(h, w, c, i))  # [T, H]
        x = x + mlp(rms_norm(x, w(c.spec.mlp_norm, i), c.rms_norm_eps), w, i)  # [T, H]
    x = rms_norm(x, w(MODEL_TENSOR.OUTPUT_NORM), c.rms_norm_eps)  # [T, H]
    return x @ w(MODEL_TENSOR.TOKEN_EMBD if c.tie_word_embeddings else MODEL_TENSOR.OUTPUT).T  # [T, V]
