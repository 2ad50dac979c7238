"""Qwen3.5's two token mixers: gated softmax attention and Gated DeltaNet linear attention (docs §3.3-3.4).

Both are registered for the ``qwen35`` architecture by layer type, so the shared decoder skeleton picks one
per layer from ``config.layer_types``.  Weights are the canonical GGUF tensors (norms already carry the +1
of Qwen3.5's zero-centred RMSNorm, ``ssm_a = -exp(A_log)``, conv kernel ``[C, K]``); the value heads of
the linear-attention tensors may be stored permuted (the reader's ``ModelFiles.v_head_perm``).

Shapes: B batch, T new tokens, H hidden size, nh/nkv/hd attention heads, C conv channels, K conv kernel,
Hk/Hv key/value heads and dk/dv their dims in linear attention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import partial
from types import ModuleType

import numpy as np
from gguf import MODEL_TENSOR

from ..backend.cache import BatchState, CacheSize, KVCache
from ..backend.ops import apply_rope, rms_norm, sigmoid
from ..backend.weights import matmul_many
from ..formats.archs import FULL_ATTENTION, LINEAR_ATTENTION, QWEN35
from ..formats.config import ModelConfig
from ..quants.scratch import Scratch
from . import gated_delta as gd
from .attention import attend, compiled, jit, kernel_view, merge_heads, split_heads
from .base import StepParts, WeightStore, register_mixer

# Value heads per task of a prefill's delta rule (Qwen3.5-0.8B's 16: one task per pool thread).  The batched
# products of 8 heads cost what 16 heads' cost per head; smaller groups took more CPU.
HEAD_GROUP = 8
# Channels per task of a prefill's causal conv (its scratch buffers hold 3 x T x this many floats).
CONV_CHANNELS = 1024


@functools.cache
def gated_delta_jit() -> ModuleType:
    """:mod:`.gated_delta_jit`, imported (numba with it) on first use."""
    from . import gated_delta_jit as module
    return module


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
        self.cache_types = store.cache_types  # the recurrent layers' state stays float32: it does not grow
        self.wq, self.wk = store.matrix(MODEL_TENSOR.ATTN_Q, layer), store.matrix(MODEL_TENSOR.ATTN_K, layer)
        self.wv, self.wo = store.matrix(MODEL_TENSOR.ATTN_V, layer), store.matrix(MODEL_TENSOR.ATTN_OUT, layer)
        self.q_norm = store.vector(MODEL_TENSOR.ATTN_Q_NORM, layer)
        self.k_norm = store.vector(MODEL_TENSOR.ATTN_K_NORM, layer)

    @property
    def cache_size(self) -> CacheSize:
        return KVCache.size(self.n_kv, self.head_dim, *self.cache_types)

    def make_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(batch, self.n_kv, max_len, self.head_dim, *self.cache_types)

    def step_parts(self, config: ModelConfig) -> StepParts:
        """This layer for the compiled decode step (:class:`.base.StepParts`): q with its gate rows, k, v, out and
        the q/k norms."""
        q, kv, h = self.n_heads * self.head_dim, self.n_kv * self.head_dim, config.hidden_size
        return StepParts("attention", [self.wq, self.wk, self.wv, None, self.wo],
                         [(2 * q, h), (kv, h), (kv, h), None, (h, q)], [None, None, None, self.q_norm, self.k_norm])

    def __call__(self, x: np.ndarray, cache: KVCache, state: BatchState) -> np.ndarray:
        b, t, h = x.shape
        eps, hd = self.config.rms_norm_eps, self.head_dim
        q_gate, k, v = matmul_many([self.wq, self.wk, self.wv], x.reshape(b * t, h))
        q_gate = q_gate.reshape(b, t, self.n_heads, 2 * hd)  # [B, T, nh, 2hd]
        if compiled(self.ws, t):
            return self.wo.matmul(self._compiled(q_gate, k, v, cache, state)).reshape(b, t, h)
        q = rms_norm(q_gate[..., :hd], self.q_norm, eps).transpose(0, 2, 1, 3)  # [B, nh, T, hd]
        gate = q_gate[..., hd:].reshape(b * t, self.n_heads * hd)  # [B*T, nh*hd]
        k = rms_norm(split_heads(k, b, self.n_kv, hd), self.k_norm, eps)  # [B, nkv, T, hd]
        v = split_heads(v, b, self.n_kv, hd)  # [B, nkv, T, hd]
        c = self.config
        cos, sin = state.rotary(c.rotary_dim, c.rope_theta, c.rope_scaling)  # [B, T, r/2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = cache.update(k, v, state)  # [B, nkv, S, hd]
        out = merge_heads(attend(q, keys, values, state, self.ws)) * sigmoid(gate)  # [B*T, nh*hd]
        return self.wo.matmul(out).reshape(b, t, h)

    def _compiled(self, q_gate: np.ndarray, k: np.ndarray, v: np.ndarray, cache: KVCache, state: BatchState,
                  ) -> np.ndarray:
        """q/k norms, RoPE, the cache writes and attention in one compiled call, then the gate (a few new tokens).

        q_gate [B, T, nh, 2hd], k/v [B*T, nkv*hd] -> [B*T, nh*hd]
        """
        aj, c, hd = jit(), self.config, self.head_dim
        b, t = state.batch, state.length
        cos, sin = state.rotary(c.rotary_dim, c.rope_theta, c.rope_scaling)  # [B, T, r/2]
        out = aj.attention_step(q_gate, k.reshape(b, t, self.n_kv, hd), v.reshape(b, t, self.n_kv, hd), None, None,
                                None, self.q_norm, self.k_norm, np.float32(c.rms_norm_eps), cos, sin, *state.slots(),
                                kernel_view(cache.keys), kernel_view(cache.values))  # [B, nh, T, hd]
        return aj.gate(out, q_gate)


class LinearAttentionCache:
    """Per-row state of one Gated DeltaNet layer, preallocated: last K−1 raw conv inputs and the delta state.

    A state cannot be cut back to fewer tokens, so :meth:`checkpoint` copies the rows the passes after it may cut
    back and each such pass records its inputs (:meth:`record`: one compiled verify pass, or the numpy path's
    one-token passes); :meth:`rollback` restores the rows cut back and replays the tokens they keep, pass by pass,
    by the same step each pass took (every other token masked as padding, which leaves a state exactly as it was),
    so a state is bit for bit what feeding only the kept tokens gives.
    """

    def __init__(self, batch: int, config: ModelConfig) -> None:
        conv, state = self.row_shapes(config)
        self.conv = np.zeros((batch, *conv), np.float32)  # [B, K-1, C]
        self.state = np.zeros((batch, *state), np.float32)  # [B, Hv, dk, dv]
        self.saved: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # at checkpoint(): the rows copied
        # (int [R]) and their conv and state
        self.journal: list[tuple[np.ndarray, Callable[[np.ndarray], None]]] = []  # the passes since: each one's
        # validity [B, T] and the replay of its first n tokens' step on the state, for a validity mask [B, n]

    @staticmethod
    def row_shapes(config: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One row's conv inputs and delta state.  # [K-1, C], [Hv, dk, dv]"""
        c = config
        return ((c.linear_conv_kernel_dim - 1, c.linear_conv_dim),
                (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim))

    @staticmethod
    def size(config: ModelConfig) -> CacheSize:
        """What such a cache holds: float32 conv inputs and delta state per row, whatever its length."""
        elements = sum(int(np.prod(shape)) for shape in LinearAttentionCache.row_shapes(config))
        return CacheSize(row=elements * np.dtype(np.float32).itemsize)

    def checkpoint(self, rows: np.ndarray | None = None) -> None:
        index = np.arange(len(self.state)) if rows is None else np.flatnonzero(rows)
        self.saved, self.journal = (index, self.conv[index], self.state[index]), []  # copies

    def record(self, valid: np.ndarray, replay: Callable[[np.ndarray], None]) -> None:
        """Note a pass of ``valid`` [B, T] tokens after :meth:`checkpoint` and how to replay its first tokens."""
        if self.saved is not None:
            self.journal.append((valid, replay))

    def rollback(self, keep: np.ndarray) -> None:
        saved, journal = self.saved, self.journal
        self.saved, self.journal = None, []
        if saved is None or not journal:
            raise ValueError("a linear-attention state rolls back only the passes after checkpoint()")
        index, conv, state = saved
        keep = np.asarray(keep)
        cut = keep < sum(valid.sum(axis=1) for valid, _ in journal)  # [B] rows whose state went past what they keep
        if not cut.any():
            return
        restore = cut[index]  # [R] which copies to put back
        if restore.sum() != cut.sum():
            raise ValueError("a row is cut back that was not checkpointed")
        self.conv[index[restore]], self.state[index[restore]] = conv[restore], state[restore]
        start = 0
        for valid, replay in journal:  # each pass's kept tokens; other rows (and tokens after a row's own) masked
            n = np.clip(keep - start, 0, valid.shape[1])  # [B]
            kept = int(n[cut].max())
            if kept:
                replay((np.arange(kept)[None, :] < n[:, None]) & cut[:, None])  # [B, kept]
            start += valid.shape[1]

    def select(self, rows: np.ndarray) -> None:
        self.conv = self.conv[rows]
        self.state = self.state[rows]

    def view(self, rows: slice) -> LinearAttentionCache:
        out = LinearAttentionCache.__new__(LinearAttentionCache)
        out.conv, out.state = self.conv[rows], self.state[rows]
        out.saved, out.journal = None, []
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
    """Gated DeltaNet: conv + SiLU over [q | k | v], l2-normalised heads, the gated delta rule, gated norm.

    A prefill takes three pool runs: the projections; the causal conv by blocks of channels; then one task per
    batch row and group of value heads: their q/k preparation, gates, delta rule and gated norm
    (:meth:`~qwen_runtime.backend.pool.Workspace.run_grid`).  A decode step runs the projections through the pool and
    the rest on the calling thread, where a few tokens' work is too small to hand around.
    """

    def __init__(self, config: ModelConfig, layer: int, store: WeightStore) -> None:
        self.config = config
        self.ws = store.workspace
        self.w_qkv, self.w_z = store.matrix(MODEL_TENSOR.ATTN_QKV, layer), store.matrix(MODEL_TENSOR.ATTN_GATE, layer)
        self.w_beta = store.matrix(MODEL_TENSOR.SSM_BETA, layer)
        self.w_alpha = store.matrix(MODEL_TENSOR.SSM_ALPHA, layer)
        self.w_out = store.matrix(MODEL_TENSOR.SSM_OUT, layer)
        self.conv = store.vector(MODEL_TENSOR.SSM_CONV1D, layer)  # [C, K]
        self.dt_bias = store.vector(MODEL_TENSOR.SSM_DT, layer, ".bias")  # [Hv]
        self.ssm_a = store.vector(MODEL_TENSOR.SSM_A, layer, "")  # [Hv] = -exp(A_log)
        self.norm = store.vector(MODEL_TENSOR.SSM_NORM, layer)  # [dv]
        c = config
        self.key_heads = gd.key_head_index(c.linear_num_key_heads, c.linear_num_value_heads,
                                           store.files.v_head_perm)  # [Hv]
        self.conv_taps = np.ascontiguousarray(self.conv.T)  # [K, C], the compiled conv's layout

    @property
    def cache_size(self) -> CacheSize:
        return LinearAttentionCache.size(self.config)

    def make_cache(self, batch: int, max_len: int) -> LinearAttentionCache:
        return LinearAttentionCache(batch, self.config)

    def step_parts(self, config: ModelConfig) -> StepParts | str:
        """This layer for the compiled decode step (:class:`.base.StepParts`): the five projections and what the
        recurrence reads (conv taps, dt bias, A, the gated norm, each value head's key head)."""
        if self.conv_taps.shape[0] < 2:
            return f"a Gated DeltaNet convolution of {self.conv_taps.shape[0]} tap (the compiled conv needs 2 or more)"
        c, h = config, config.hidden_size
        hv, values = c.linear_num_value_heads, c.linear_num_value_heads * c.linear_value_head_dim
        return StepParts("linear", [self.w_qkv, self.w_z, self.w_beta, self.w_alpha, self.w_out],
                         [(c.linear_conv_dim, h), (values, h), (hv, h), (hv, h), (h, values)],
                         [self.conv_taps, self.dt_bias, self.ssm_a, self.norm, self.key_heads])

    def __call__(self, x: np.ndarray, cache: LinearAttentionCache, state: BatchState) -> np.ndarray:
        c = self.config
        b, t, h = x.shape
        hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        if self._compiled_step():
            return self.w_out.matmul(self._compiled(x.reshape(b * t, h), cache, state)).reshape(b, t, h)
        mixed, z, b_gate, a_gate = matmul_many([self.w_qkv, self.w_z, self.w_beta, self.w_alpha], x.reshape(b * t, h))
        if cache.saved is not None:  # a pass that may be rolled back: its inputs replay the tokens kept
            cache.record(state.valid, partial(self._replay, self._numpy_step, mixed.copy(), z, b_gate, a_gate, cache))
        o = self._numpy_step(mixed, z, b_gate, a_gate, cache, state.valid)  # [B, T, Hv, dv]
        return self.w_out.matmul(o.reshape(b * t, hv * dv)).reshape(b, t, h)

    def _numpy_step(self, mixed: np.ndarray, z: np.ndarray, b_gate: np.ndarray, a_gate: np.ndarray,
                    cache: LinearAttentionCache, valid: np.ndarray) -> np.ndarray:
        """The numpy path's conv + SiLU (in place in ``mixed``) and delta rule on ``valid`` [B, T]'s tokens and the
        cache's state.  # [B*T, C], [B*T, Hv*dv], 2 x [B*T, Hv] -> [B, T, Hv, dv]"""
        c = self.config
        b, t = valid.shape
        hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        mask = None if valid.all() else valid
        mixed = mixed.reshape(b, t, -1)  # [B, T, C]
        share = t > gd.RECURRENT_MAX_TOKENS  # a decode step's work is too small to hand around
        channels = mixed.shape[2]
        self.ws.run_grid(partial(self._conv, mixed, cache.conv, mask), [channels],
                         [self.ws.balanced(channels, CONV_CHANNELS)], share)  # conv + SiLU in place
        q, k, v = gd.split_qkv(mixed, c.linear_num_key_heads, c.linear_key_head_dim, dv)
        o = np.empty((b, t, hv, dv), np.float32)  # [B, T, Hv, dv]
        self.ws.run_grid(partial(self._heads, q, k, v, z.reshape(b, t, hv, dv), b_gate.reshape(b, t, hv),
                                 a_gate.reshape(b, t, hv), cache.state, mask, o), [b, hv], [1, HEAD_GROUP], share)
        return o

    def _compiled_step(self) -> bool:
        """Whether a pass runs :mod:`.gated_delta_jit`'s kernels: the recurrence token by token, its heads shared
        among the threads (the conv kernel needs K ≥ 2, Qwen3.5's is 4), with ``kernels="numba"`` whatever the
        length.  The numpy path's chunked form costs a fixed overhead of numpy
        calls per layer and pass, and more per token: the compiled recurrence was faster at every length measured,
        short passes most (docs/performance.md)."""
        return self.ws.kernels == "numba" and self.conv_taps.shape[0] >= 2

    def _compiled(self, x: np.ndarray, cache: LinearAttentionCache, state: BatchState) -> np.ndarray:
        """The projections, then the conv step and every value head's delta-rule step in compiled code.

        x [B*T, H] -> [B*T, Hv*dv]
        """
        c = self.config
        b, t = state.batch, state.length
        hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        mixed, z, b_gate, a_gate = matmul_many([self.w_qkv, self.w_z, self.w_beta, self.w_alpha], x)
        if cache.saved is not None:  # a pass that may be rolled back: its inputs replay the tokens kept
            cache.record(state.valid, partial(self._replay, self._step, mixed.copy(), z, b_gate, a_gate, cache))
        return self._step(mixed, z, b_gate, a_gate, cache, state.valid).reshape(b * t, hv * dv)

    @staticmethod
    def _replay(step: Callable[..., np.ndarray], mixed: np.ndarray, z: np.ndarray, b_gate: np.ndarray,
                a_gate: np.ndarray, cache: LinearAttentionCache, valid: np.ndarray) -> None:
        """``step`` (:meth:`_step` or :meth:`_numpy_step`, the one the pass took) of a recorded pass's first ``n``
        tokens per row (``valid`` [B, n]: the tokens kept; the tokens after them could not change the state before
        them).  # inputs [B*T, ...] of the whole pass"""
        b, n = valid.shape

        def first(x: np.ndarray) -> np.ndarray:  # [B*T, W] -> [B*n, W], C-ordered like a pass's own arrays
            return np.ascontiguousarray(x.reshape(b, -1, x.shape[1])[:, :n]).reshape(b * n, -1)

        step(first(mixed), first(z), first(b_gate), first(a_gate), cache, valid)

    def _step(self, mixed: np.ndarray, z: np.ndarray, b_gate: np.ndarray, a_gate: np.ndarray,
              cache: LinearAttentionCache, valid: np.ndarray) -> np.ndarray:
        """The compiled conv step, then the delta rule's (row, value head) pairs shared among the pool's threads
        (:func:`.gated_delta_jit.delta_heads`: the same numbers however they are shared), on ``valid`` [B, T]'s
        tokens and the cache's state (``mixed`` is overwritten).  # [B*T, C], [B*T, Hv*dv], 2 x [B*T, Hv] ->
        [B, T, Hv, dv]"""
        c = self.config
        b, t = valid.shape
        hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        kernels = gated_delta_jit()
        valid = np.ascontiguousarray(valid)  # a prefill chunk's columns of a ragged batch's mask: one type
        x = mixed.reshape(b, t, -1)  # [B, T, C]
        kernels.conv_step(x, self.conv_taps, cache.conv, valid)
        out = np.empty((b, t, hv, dv), np.float32)
        args = (x, z.reshape(b, t, hv, dv), b_gate.reshape(b, t, hv), a_gate.reshape(b, t, hv), self.key_heads,
                self.ssm_a, self.dt_bias, self.norm, np.float32(c.rms_norm_eps), valid, cache.state)

        def heads(rows: slice, group: slice, scratch: Scratch) -> None:
            kernels.delta_heads(*args, rows.start, rows.stop, group.start, group.stop, out)

        self.ws.run_grid(heads, [b, hv], [1, self.ws.balanced(hv, HEAD_GROUP)], t > gd.RECURRENT_MAX_TOKENS)
        return out

    def _conv(self, mixed: np.ndarray, conv_state: np.ndarray, valid: np.ndarray | None, channels: slice,
              scratch: Scratch) -> None:
        """Causal conv + SiLU of ``channels`` of ``mixed`` [B, T, C], in place (``conv_state`` [B, K-1, C] advanced).

        Convolving each projection tile in the task that computed it cost more CPU (A/B in one process): the
        tile product leaves the conv's buffers out of cache.
        """
        gd.causal_conv1d_inplace(mixed[..., channels], self.conv[channels], conv_state[..., channels], valid, scratch)

    def _heads(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, z: np.ndarray, b_gate: np.ndarray,
               a_gate: np.ndarray, delta_state: np.ndarray, valid: np.ndarray | None, out: np.ndarray,
               rows: slice, heads: slice, scratch: Scratch) -> None:
        """Batch rows ``rows``, value heads ``heads``: q/k of their key heads, gates, the delta rule on their part
        of the state and the gated norm into ``out[rows, :, heads]``.

        q, k [B, T, Hk, dk]; v, z [B, T, Hv, dv]; gates [B, T, Hv]; delta_state [B, Hv, dk, dv]; out [B, T, Hv, dv]
        """
        keys = self.key_heads[heads]
        qh, kh = gd.prepare_qk(q[rows][:, :, keys], k[rows][:, :, keys], len(keys))  # [b, T, h, dk]
        beta, g = gd.gates(b_gate[rows, :, heads], a_gate[rows, :, heads], self.ssm_a[heads], self.dt_bias[heads],
                           None if valid is None else valid[rows])  # [b, T, h]
        o = out[rows, :, heads]  # [b, T, h, dv]
        gd.delta_rule(qh, kh, v[rows, :, heads], g, beta, delta_state[rows, heads], out=o, scratch=scratch)
        gd.gated_rms_norm(o, z[rows, :, heads], self.norm, self.config.rms_norm_eps, out=o)
