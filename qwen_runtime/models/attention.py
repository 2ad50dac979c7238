"""Softmax attention of Qwen2 / Qwen2.5 / DeepSeek-R1-Distill (q/k/v biases) and Qwen3 (per-head q/k RMSNorm).

Math (docs/qwen-architectures.md §3.3): q/k/v projections (+ bias for Qwen2), split into heads, Qwen3's
RMSNorm over each head's ``head_dim`` (one weight shared by all heads) *before* RoPE, rotate-half RoPE,
GQA (query head h reads kv head ``h // (nh / nkv)``), causal softmax over every cached slot with
padding slots masked, then ``o_proj`` (no bias).  The pieces are module functions so other attention
variants (Qwen3.5's gated attention) can reuse them.
"""

from __future__ import annotations

import functools
from functools import partial
from types import ModuleType

import numpy as np
from gguf import MODEL_TENSOR

from ..backend.cache import BatchState, CacheSize, KVCache, stored_type
from ..backend.ops import apply_rope, rms_norm
from ..backend.pool import Workspace
from ..backend.weights import matmul_many
from ..formats.archs import FULL_ATTENTION, QWEN2, QWEN3
from ..formats.config import ModelConfig
from .base import StepParts, WeightStore, register_mixer

# Query rows (new tokens x the query heads of a kv head) of one tile of the numpy path's attention, and the score
# elements a tile holds at once per batch row and kv head: its blocks of cached slots are cut to fit, so what a
# prefill holds does not grow with the prompt (a decode step's few rows take every slot of a 16k-token cache in one
# block, as before).  The blocks depend on the rows alone, so pooled heads sum as the serial ones do.
QUERY_ROWS = 256
SCORE_ELEMENTS = 1 << 20
# Query rows per kv head up to which scores and outputs are one matrix-vector product per query (decode):
# BLAS reads the cached keys/values at full bandwidth there, while a [S, hd] x [hd, 2] GEMM ran much slower.
GEMV_ROWS = 4
# Attention of several new tokens with at least this many multiply-adds (scores x head_dim) splits its kv heads
# over the pool (prefill).  A decode step stays on the calling thread: its matrix-vector products are bound by
# memory bandwidth, and the pool's wake-up and GIL hand-offs cost more than a second core gives (measured
# at 2,048 cached tokens too).
POOL_WORK = 1 << 21
# New tokens per row up to which a workspace with ``kernels="numba"`` runs a step's attention outside the products
# in compiled code (:mod:`.attention_jit`); longer passes (prefills) run the compiled tiles of :mod:`.prefill_jit`.
JIT_TOKENS = 4


@functools.cache
def jit() -> ModuleType:
    """:mod:`.attention_jit`, imported (numba with it) on first use."""
    from . import attention_jit
    return attention_jit


@functools.cache
def prefill_jit() -> ModuleType:
    """:mod:`.prefill_jit`, imported (numba with it) on first use."""
    from . import prefill_jit
    return prefill_jit


def compiled(ws: Workspace | None, tokens: int) -> bool:
    """Whether a step of ``tokens`` new tokens per row runs :mod:`.attention_jit`'s kernels (up to :data:`JIT_TOKENS`,
    more inside ``Workspace.rowwise``: :meth:`~qwen_runtime.backend.pool.Workspace.compiled_step`)."""
    return ws is not None and ws.compiled_step(tokens, JIT_TOKENS)


def split_heads(x: np.ndarray, batch: int, heads: int, head_dim: int) -> np.ndarray:
    """[B * T, heads * hd] -> [B, heads, T, hd]"""
    return x.reshape(batch, -1, heads, head_dim).transpose(0, 2, 1, 3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """[B, heads, T, hd] -> [B * T, heads * hd]"""
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b * t, h * d)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, state: BatchState,
           ws: Workspace | None = None) -> np.ndarray:
    """Scaled dot-product attention with GQA and the batch mask, in tiles of query rows over blocks of cached slots
    with an online softmax; the kv heads split over the pool when it pays.

    q: [B, nh, T, hd]; keys/values: [B, nkv, S, hd / block] -> [B, nh, T, hd]

    Query tokens see the slots :meth:`BatchState.hidden` does not hide.  A ragged batch (``state.lengths``) is
    attended row by row, each over exactly its own slots, so a row's result is bit-identical whatever the other
    rows hold or how many there are.  With compiled kernels keys/values may be whole cache buffers: only the slots
    :meth:`BatchState.slots` names are read, by :mod:`.attention_jit` for a few new tokens (:func:`compiled`) and by
    :mod:`.prefill_jit`'s tiles for more.
    """
    b, nh, t, hd = q.shape
    if compiled(ws, t):
        return jit().attend(q, keys, values, *state.slots())
    if ws is not None and ws.kernels == "numba":
        return prefill_jit().attend(q, keys, values, *state.slots(), ws)
    nkv = keys.shape[1]
    q = q.reshape(b, nkv, nh // nkv, t, hd) * np.float32(1.0 / np.sqrt(hd))  # [B, nkv, g, T, hd]
    out = np.empty(q.shape, np.float32)
    if state.lengths is None:
        _attend_rows(q, keys, values, state, out, ws)
    else:
        for row, own in enumerate(state.rows):
            rows = slice(row, row + 1)
            _attend_rows(q[rows], keys[rows, :, :own.end], values[rows, :, :own.end], own, out[rows], ws)
    return out.reshape(b, nh, t, hd)


def _attend_rows(q: np.ndarray, keys: np.ndarray, values: np.ndarray, state: BatchState, out: np.ndarray,
                 ws: Workspace | None) -> None:
    """Rows of one slot layout, their kv heads split over the pool when it pays.

    q (scaled)/out: [B, nkv, g, T, hd]; keys/values: [B, nkv, S, hd / block]
    """
    b, nkv, group, t, hd = q.shape
    if ws is None or not ws.pooled or nkv == 1 or t == 1 or b * nkv * group * t * keys.shape[2] * hd < POOL_WORK:
        _attend_heads(q, keys, values, state, out, None)  # too little work to pay for the pool
    else:
        step = -(-nkv // ws.threads)
        ws.run([partial(_attend_heads, q[:, h:h + step], keys[:, h:h + step], values[:, h:h + step], state,
                        out[:, h:h + step]) for h in range(0, nkv, step)])


def _attend_heads(q: np.ndarray, keys: np.ndarray, values: np.ndarray, state: BatchState, out: np.ndarray,
                  scratch: object) -> None:
    """Some kv heads and their query heads, a tile of :data:`QUERY_ROWS` query rows at a time (a pool task, or all
    heads on one thread).

    q/out: [B, kv, g, T, hd]; keys/values: [B, kv, S, hd / block]
    """
    b, kv, group, t, hd = q.shape
    tokens = max(1, QUERY_ROWS // group)
    for q0 in range(0, t, tokens):
        q1 = min(q0 + tokens, t)
        qs = q[:, :, :, q0:q1].reshape(b, kv, group * (q1 - q0), hd)  # all query heads of a kv head: one matmul
        out[:, :, :, q0:q1] = _attend_tile(qs, keys, values, state, q0, q1).reshape(b, kv, group, q1 - q0, hd)


def _attend_tile(qs: np.ndarray, keys: np.ndarray, values: np.ndarray, state: BatchState, q0: int, q1: int,
                 ) -> np.ndarray:
    """The attention of new tokens ``q0:q1`` (their rows (query head, token) of each kv head), over blocks of cached
    slots up to the last token's own: an online softmax keeps each row's running maximum ``top``, sum ``weight`` and
    output ``acc``, rescaled by exp(old top - new top) as each block comes, so a tile holds one block's scores
    (:data:`SCORE_ELEMENTS` per batch row and kv head) whatever the cache's length.

    qs (scaled): [B, kv, R, hd]; keys/values: [B, kv, S, hd / block] -> [B, kv, R, hd]
    """
    b, kv, rows, hd = qs.shape
    few = rows <= GEMV_ROWS
    end = state.start + q1  # blocks after the last token's own slot are hidden from every row (causal)
    block = max(1, SCORE_ELEMENTS // rows)
    top = np.full((b, kv, rows, 1), -np.inf, np.float32)
    weight = np.zeros((b, kv, rows, 1), np.float32)
    acc = np.zeros((b, kv, rows, hd), np.float32)
    for s0 in range(0, end, block):
        s1 = min(s0 + block, end)
        k, v = widen(keys[:, :, s0:s1]), widen(values[:, :, s0:s1])  # the block's slots decoded: [B, kv, n, hd]
        scores = np.matmul(k[:, :, None], qs[..., None])[..., 0] if few else qs @ k.transpose(0, 1, 3, 2)  # [.., R, n]
        hidden = state.hidden(q0, q1, s0, s1)  # [B, 1, 1, Tq, n] or None
        if hidden is not None:
            np.copyto(scores.reshape(b, kv, -1, q1 - q0, s1 - s0, copy=False), np.float32(-np.inf), where=hidden)
        best = np.maximum(top, scores.max(axis=-1, keepdims=True))
        shift = np.where(best == -np.inf, np.float32(0), best)  # a row that sees nothing yet keeps weight 0
        probs = np.exp(np.subtract(scores, shift, out=scores), out=scores)
        rescale = np.exp(top - shift)  # [B, kv, R, 1]
        weight = weight * rescale + probs.sum(axis=-1, keepdims=True)
        acc *= rescale
        acc += np.matmul(probs[..., None, :], v[:, :, None])[..., 0, :] if few else probs @ v
        top = best
    return acc / weight


def widen(x: np.ndarray) -> np.ndarray:
    """Cached keys or values decoded to float32 (the array itself when they are stored so).
    # [..., hd / block] -> [..., hd]"""
    return stored_type(x).decode(x)


def kernel_view(x: np.ndarray) -> np.ndarray:
    """A cache array as the compiled kernels take it: float16 as its bits (uint16; numba has no float16 arrays,
    :func:`.attention_jit.widen` decodes them), the other types as they are (float32, or records of integers)."""
    return x.view(np.uint16) if x.dtype == np.float16 else x


@register_mixer(FULL_ATTENTION, QWEN2, QWEN3)
class Attention:
    """Qwen2/Qwen3 self-attention with a preallocated KV cache."""

    def __init__(self, config: ModelConfig, layer: int, store: WeightStore) -> None:
        self.config = config
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.ws = store.workspace
        self.cache_types = store.cache_types
        self.wq, self.wk = store.matrix(MODEL_TENSOR.ATTN_Q, layer), store.matrix(MODEL_TENSOR.ATTN_K, layer)
        self.wv, self.wo = store.matrix(MODEL_TENSOR.ATTN_V, layer), store.matrix(MODEL_TENSOR.ATTN_OUT, layer)
        bias = config.spec.attention_bias
        self.bq = store.vector(MODEL_TENSOR.ATTN_Q, layer, ".bias") if bias else None
        self.bk = store.vector(MODEL_TENSOR.ATTN_K, layer, ".bias") if bias else None
        self.bv = store.vector(MODEL_TENSOR.ATTN_V, layer, ".bias") if bias else None
        self.q_norm = store.vector(MODEL_TENSOR.ATTN_Q_NORM, layer) if config.spec.qk_norm else None
        self.k_norm = store.vector(MODEL_TENSOR.ATTN_K_NORM, layer) if config.spec.qk_norm else None

    @property
    def cache_size(self) -> CacheSize:
        return KVCache.size(self.n_kv, self.head_dim, *self.cache_types)

    def make_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(batch, self.n_kv, max_len, self.head_dim, *self.cache_types)

    def step_parts(self, config: ModelConfig) -> StepParts | str:
        """This layer for the compiled decode step (:class:`.base.StepParts`): q/k/v/out, biases and q/k norms."""
        if self.bq is not None and self.q_norm is not None:
            return "attention with both q/k/v biases and q/k norms (no such Qwen) has no compiled step"
        q, kv, h = self.n_heads * self.head_dim, self.n_kv * self.head_dim, config.hidden_size
        return StepParts("attention", [self.wq, self.wk, self.wv, None, self.wo],
                         [(q, h), (kv, h), (kv, h), None, (h, q)],
                         [self.bq, self.bk, self.bv, self.q_norm, self.k_norm])

    def _heads(self, y: np.ndarray, bias: np.ndarray | None, heads: int, batch: int) -> np.ndarray:
        """A projection plus its bias, split into heads.  # [B * T, heads * hd] -> [B, heads, T, hd]"""
        if bias is not None:
            y += bias  # y is the projection's own fresh array
        return split_heads(y, batch, heads, self.head_dim)

    def __call__(self, x: np.ndarray, cache: KVCache, state: BatchState) -> np.ndarray:
        b, t, h = x.shape
        yq, yk, yv = matmul_many([self.wq, self.wk, self.wv], x.reshape(b * t, h))  # tiles of all three at once
        if compiled(self.ws, t):
            return self.wo.matmul(merge_heads(self._compiled(yq, yk, yv, cache, state))).reshape(b, t, h)
        q = self._heads(yq, self.bq, self.n_heads, b)  # [B, nh, T, hd]
        k = self._heads(yk, self.bk, self.n_kv, b)  # [B, nkv, T, hd]
        v = self._heads(yv, self.bv, self.n_kv, b)  # [B, nkv, T, hd]
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.config.rms_norm_eps)
            k = rms_norm(k, self.k_norm, self.config.rms_norm_eps)
        c = self.config
        cos, sin = state.rotary(c.rotary_dim, c.rope_theta, c.rope_scaling)  # [B, T, r/2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = cache.update(k, v, state)  # [B, nkv, S, hd]
        out = attend(q, keys, values, state, self.ws)  # [B, nh, T, hd]
        return self.wo.matmul(merge_heads(out)).reshape(b, t, h)

    def _compiled(self, yq: np.ndarray, yk: np.ndarray, yv: np.ndarray, cache: KVCache, state: BatchState,
                  ) -> np.ndarray:
        """Biases, q/k norms, RoPE, the cache writes and attention in one compiled call (a few new tokens).

        yq [B*T, nh*hd], yk/yv [B*T, nkv*hd] -> [B, nh, T, hd]
        """
        c, hd = self.config, self.head_dim
        b, t = state.batch, state.length
        cos, sin = state.rotary(c.rotary_dim, c.rope_theta, c.rope_scaling)  # [B, T, r/2]
        return jit().attention_step(yq.reshape(b, t, self.n_heads, hd), yk.reshape(b, t, self.n_kv, hd),
                                    yv.reshape(b, t, self.n_kv, hd), self.bq, self.bk, self.bv, self.q_norm,
                                    self.k_norm, np.float32(c.rms_norm_eps), cos, sin, *state.slots(),
                                    kernel_view(cache.keys), kernel_view(cache.values))
