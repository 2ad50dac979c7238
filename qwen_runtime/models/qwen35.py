"""Qwen3.5's two token mixers: gated softmax attention and Gated DeltaNet linear attention (docs §3.3-3.4).

Both are registered for the ``qwen35`` architecture by layer type, so the shared decoder skeleton picks one
per layer from ``config.layer_types``.  Weights are the canonical GGUF tensors (norms already carry the +1
of Qwen3.5's zero-centred RMSNorm, ``ssm_a = -exp(A_log)``, conv kernel ``[C, K]``); the value-head order of
the linear-attention tensors is ``config.v_head_order``.

Shapes: B batch, T new tokens, H hidden size, nh/nkv/hd attention heads, C conv channels, K conv kernel,
Hk/Hv key/value heads and dk/dv their dims in linear attention.
"""

from __future__ import annotations

import numpy as np
from gguf import MODEL_TENSOR

from ..archs import FULL_ATTENTION, LINEAR_ATTENTION, QWEN35
from ..cache import BatchState, KVCache
from ..config import ModelConfig
from ..ops import apply_rope, rms_norm, sigmoid
from ..weights import matmul_many
from . import gated_delta as gd
from .attention import attend, merge_heads, split_heads
from .base import WeightStore, register_mixer


@register_mixer(FULL_ATTENTION, QWEN35)
class GatedAttention:
    """Softmax attention whose output is gated per channel by σ(gate), gate coming from ``attn_q``.

    ``attn_q`` rows are ``[query_h | gate_h]`` per head (interleaved, not two halves of the whole output).
    q/k RMSNorm per head uses the stored (already +1) weights; RoPE covers the first ``rotary_dim`` dims.
    """

    def __init__(self, config: ModelConfig, layer: int, store: WeightStore) -> None:
        self.config = config
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.ws = store.workspace
        self.wq, self.wk = store.matrix(MODEL_TENSOR.ATTN_Q, layer), store.matrix(MODEL_TENSOR.ATTN_K, layer)
        self.wv, self.wo = store.matrix(MODEL_TENSOR.ATTN_V, layer), store.matrix(MODEL_TENSOR.ATTN_OUT, layer)
        self.q_norm = store.vector(MODEL_TENSOR.ATTN_Q_NORM, layer)
        self.k_norm = store.vector(MODEL_TENSOR.ATTN_K_NORM, layer)

    def make_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(batch, self.n_kv, max_len, self.head_dim)

    def __call__(self, x: np.ndarray, cache: KVCache, state: BatchState) -> np.ndarray:
        b, t, h = x.shape
        eps, hd = self.config.rms_norm_eps, self.head_dim
        q_gate, k, v = matmul_many([self.wq, self.wk, self.wv], x.reshape(b * t, h))
        q_gate = q_gate.reshape(b, t, self.n_heads, 2 * hd)  # [B, T, nh, 2hd]
        q = rms_norm(q_gate[..., :hd], self.q_norm, eps).transpose(0, 2, 1, 3)  # [B, nh, T, hd]
        gate = q_gate[..., hd:].reshape(b * t, self.n_heads * hd)  # [B*T, nh*hd]
        k = rms_norm(split_heads(k, b, self.n_kv, hd), self.k_norm, eps)  # [B, nkv, T, hd]
        v = split_heads(v, b, self.n_kv, hd)  # [B, nkv, T, hd]
        cos, sin = state.rotary(self.config.rotary_dim, self.config.rope_theta)  # [B, T, r/2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = cache.update(k, v, state)  # [B, nkv, S, hd]
        out = merge_heads(attend(q, keys, values, state, self.ws)) * sigmoid(gate)  # [B*T, nh*hd]
        return self.wo.matmul(out).reshape(b, t, h)


class LinearAttentionCache:
    """Per-row state of one Gated DeltaNet layer, preallocated: last K−1 raw conv inputs and the delta state."""

    def __init__(self, batch: int, config: ModelConfig) -> None:
        c = config
        self.conv = np.zeros((batch, c.linear_conv_kernel_dim - 1, c.linear_conv_dim), np.float32)  # [B, K-1, C]
        self.state = np.zeros((batch, c.linear_num_value_heads, c.linear_key_head_dim,
                               c.linear_value_head_dim), np.float32)  # [B, Hv, dk, dv]

    def select(self, rows: np.ndarray) -> None:
        self.conv = self.conv[rows]
        self.state = self.state[rows]

    def view(self, rows: slice) -> LinearAttentionCache:
        out = LinearAttentionCache.__new__(LinearAttentionCache)
        out.conv, out.state = self.conv[rows], self.state[rows]
        return out

    def copy_row(self, src: int, dst: int, length: int) -> None:
        self.conv[dst] = self.conv[src]
        self.state[dst] = self.state[src]

    def clear_row(self, row: int) -> None:
        self.conv[row] = 0.0
        self.state[row] = 0.0

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.state.nbytes


@register_mixer(LINEAR_ATTENTION, QWEN35)
class GatedDeltaNet:
    """Gated DeltaNet: conv + SiLU over [q | k | v], l2-normalised heads, the gated delta rule, gated norm."""

    def __init__(self, config: ModelConfig, layer: int, store: WeightStore) -> None:
        self.config = config
        self.w_qkv, self.w_z = store.matrix(MODEL_TENSOR.ATTN_QKV, layer), store.matrix(MODEL_TENSOR.ATTN_GATE, layer)
        self.w_beta = store.matrix(MODEL_TENSOR.SSM_BETA, layer)
        self.w_alpha = store.matrix(MODEL_TENSOR.SSM_ALPHA, layer)
        self.w_out = store.matrix(MODEL_TENSOR.SSM_OUT, layer)
        self.conv = store.vector(MODEL_TENSOR.SSM_CONV1D, layer)  # [C, K]
        self.dt_bias = store.vector(MODEL_TENSOR.SSM_DT, layer, ".bias")  # [Hv]
        self.ssm_a = store.vector(MODEL_TENSOR.SSM_A, layer, "")  # [Hv] = -exp(A_log)
        self.norm = store.vector(MODEL_TENSOR.SSM_NORM, layer)  # [dv]

    def make_cache(self, batch: int, max_len: int) -> LinearAttentionCache:
        return LinearAttentionCache(batch, self.config)

    def __call__(self, x: np.ndarray, cache: LinearAttentionCache, state: BatchState) -> np.ndarray:
        c = self.config
        b, t, h = x.shape
        hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        valid = None if state.valid.all() else state.valid  # [B, T]
        projections = matmul_many([self.w_qkv, self.w_z, self.w_beta, self.w_alpha], x.reshape(b * t, h))
        mixed, z, b_gate, a_gate = (p.reshape(b, t, -1) for p in projections)  # [B, T, C | Hv*dv | Hv | Hv]
        mixed, conv = gd.causal_conv1d(mixed, self.conv, cache.conv, valid)  # [B, T, C]
        cache.conv[...] = conv  # in place: the cache may be a view of a larger one
        q, k, v = gd.split_qkv(mixed, c.linear_num_key_heads, c.linear_key_head_dim, dv)
        q, k = gd.prepare_qk(q, k, hv, c.v_head_order)  # [B, T, Hv, dk]
        beta, g = gd.gates(b_gate, a_gate, self.ssm_a, self.dt_bias, valid)  # [B, T, Hv]
        o = gd.delta_rule(q, k, v, g, beta, cache.state)  # [B, T, Hv, dv]
        o = gd.gated_rms_norm(o, z.reshape(b, t, hv, dv), self.norm, c.rms_norm_eps)
        return self.w_out.matmul(o.reshape(b * t, hv * dv)).reshape(b, t, h)
