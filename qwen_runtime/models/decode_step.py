"""The compiled decode step's plan and its call: :class:`DecodeStep` gathers, once per model, what
:func:`.step_jit.decode_layers` needs (addresses of the stored rows and vectors, the chunks of each product) and
runs it on every pool thread for each eligible step (one new token per row, see :meth:`DecodeStep.runs`).

Offered for models whose every layer is softmax attention (:class:`.attention.Attention`: Qwen2, Qwen2.5, Qwen3,
DeepSeek-R1-Distill-Qwen) with compiled float kernels for every matrix; Qwen3.5's hybrid layers and 8-bit
activations keep the per-operation path.  :mod:`.step_jit` explains why and how, and why the numbers are the
per-operation path's, bit for bit.
"""

from __future__ import annotations

import functools
from functools import partial
from types import ModuleType

import numpy as np
from gguf import MODEL_TENSOR

from ..cache import BatchState, Cache, KVCache
from ..config import ModelConfig
from ..pool import Scratch, Workspace
from ..weights import DIRECT_ROW_ALIGN, TiledWeight
from .attention import Attention

# Bytes of stored rows per chunk a worker claims (rounded to DIRECT_ROW_ALIGN rows): small enough that the two
# threads finish a product within a chunk of each other, large enough that the claims (one atomic add each) cost
# nothing.
CHUNK_BYTES = 64 << 10
GUIDED = True
# How long a pool thread waits for the next product before it leaves the rest of the step to the caller: longer
# than any operation between two products (attention over a long cache), shorter than a stalled step.
WAIT_US = 50_000
# A pool thread whose chunk or poll took this long lost its CPU to another thread (a busy machine; a chunk takes
# ~10 us): it leaves the rest of the step to the caller rather than hold a chunk the caller would wait for again.
LOST_US = 1_000
ALIGN_FLOATS = 16  # buffers start on 64-byte boundaries (the row kernels' aligned loads)
MATRICES = (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V, MODEL_TENSOR.ATTN_OUT,
            MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP, MODEL_TENSOR.FFN_DOWN)


@functools.cache
def jit() -> ModuleType:
    """:mod:`.step_jit`, imported (numba with it) on first use."""
    from . import step_jit
    return step_jit


def chunk_rows(row_bytes: int) -> int:
    """Rows per chunk of a matrix of ``row_bytes`` bytes per row: about :data:`CHUNK_BYTES`, a multiple of
    DIRECT_ROW_ALIGN."""
    return max(DIRECT_ROW_ALIGN, CHUNK_BYTES // row_bytes // DIRECT_ROW_ALIGN * DIRECT_ROW_ALIGN)


def split_rows(matrix: int, rows: int, step: int, threads: int = 1) -> list[tuple[int, int, int]]:
    """``(matrix, r0, r1)`` chunks covering ``rows``: with ``GUIDED``, each a share ``1 / (2 * threads)`` of the rows
    left (a multiple of DIRECT_ROW_ALIGN), at least ``step``; else ``step`` rows each."""
    out, r0 = [], 0
    while r0 < rows:
        share = (rows - r0) // (2 * threads) // DIRECT_ROW_ALIGN * DIRECT_ROW_ALIGN if GUIDED else 0
        r1 = min(r0 + max(step, share), rows)
        out.append((matrix, r0, r1))
        r0 = r1
    return out


class DecodeStep:
    """A model's compiled decode step (:func:`.step_jit.decode_layers`): built by :meth:`offer` when the model
    qualifies, called by the model for steps that :meth:`runs`."""

    def __init__(self, config: ModelConfig, blocks: list, ws: Workspace, weights: list[list[TiledWeight]]) -> None:
        c = self.config = config
        self.ws = ws
        self.weights = weights  # [L][7]: they keep the stored rows alive
        self.mats = np.array([[(w.kernel.row_product.address, w.kernel.raw.ctypes.data, w.out_features,
                                w.kernel.raw.shape[1] * w.kernel.raw.itemsize, w.kernel.sums_width) for w in layer]
                              for layer in weights], np.int64)  # [L, 7, 5]
        self.vectors = [[blk.mixer_norm, blk.mlp_norm, blk.mixer.bq, blk.mixer.bk, blk.mixer.bv, blk.mixer.q_norm,
                         blk.mixer.k_norm] for blk in blocks]
        self.vecs = np.array([[0 if v is None else v.ctypes.data for v in layer] for layer in self.vectors], np.int64)
        first = self.mats[0]
        n = ws.threads
        kinds = [[m for q in (0, 1, 2) for m in split_rows(q, int(first[q, 2]), chunk_rows(int(first[q, 3])), n)],
                 split_rows(3, int(first[3, 2]), chunk_rows(int(first[3, 3])), n),
                 split_rows(4, int(first[4, 2]), chunk_rows(int(first[4, 3] + first[5, 3])), n),
                 split_rows(6, int(first[6, 2]), chunk_rows(int(first[6, 3])), n)]
        self.chunks = np.array([chunk for kind in kinds for chunk in kind], np.int64)  # [C, 3]
        self.starts = np.cumsum([0] + [len(kind) for kind in kinds]).astype(np.int64)  # [5]
        self.gate_rows = max(r1 - r0 for _, r0, r1 in kinds[2])
        spec = c.spec
        self.flags = (jit().HAS_BIAS if spec.attention_bias else 0) | (jit().HAS_QK_NORM if spec.qk_norm else 0)
        self.shape = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size)
        self.eps = np.float32(c.rms_norm_eps)
        self.direct_rows = min(w.kernel.direct_rows for layer in weights for w in layer)
        self._work = np.empty(0, np.float32)

    @classmethod
    def offer(cls, config: ModelConfig, blocks: list, ws: Workspace) -> DecodeStep | None:
        """The compiled step of a model's ``blocks`` (:class:`.transformer.Block`), or None when the model does not
        qualify (see the module docstring)."""
        spec = config.spec
        if ws.kernels != "numba" or ws.activations != "float" or (spec.attention_bias and spec.qk_norm):
            return None
        if not all(type(blk.mixer) is Attention for blk in blocks):
            return None
        hidden, q, kv, inter = (config.hidden_size, config.num_attention_heads * config.head_dim,
                                config.num_key_value_heads * config.head_dim, config.intermediate_size)
        shapes = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden),
                  (hidden, inter)]
        weights = []
        for blk in blocks:
            layer = [blk.mixer.wq, blk.mixer.wk, blk.mixer.wv, blk.mixer.wo, blk.mlp.gate, blk.mlp.up, blk.mlp.down]
            if not all(isinstance(w, TiledWeight) and w.compiled and w.kernel.row_product is not None
                       and (w.out_features, w.in_features) == shape for w, shape in zip(layer, shapes, strict=True)):
                return None  # the compiled step reads every shape from the config, without bounds checks
            weights.append(layer)
        return cls(config, blocks, ws, weights)

    def runs(self, batch: int, tokens: int) -> bool:
        """Whether a pass of ``tokens`` new tokens for ``batch`` rows runs this step: one token per row, products the
        per-operation path also multiplies by the row kernels (up to ``direct_rows`` rows, or any inside
        ``Workspace.rowwise`` without a row subset), and the workspace still on the compiled float kernels (tests
        switch a loaded model's ``kernels``)."""
        ws = self.ws
        if tokens != 1 or ws.active_rows is not None or ws.kernels != "numba" or ws.activations != "float":
            return False
        return batch <= self.direct_rows or ws.row_invariant

    def __call__(self, h: np.ndarray, cache: Cache, state: BatchState) -> None:
        """Every layer for ``h`` [B, H] (the embedded new tokens, updated in place to the last block's output)."""
        layers: list[KVCache] = cache.layers
        b = h.shape[0]
        capacity = layers[0].keys.shape[2] if layers and isinstance(layers[0], KVCache) else 0
        shape = (b, self.config.num_key_value_heads, capacity, self.config.head_dim)
        if not all(isinstance(kv, KVCache) and kv.keys.shape == kv.values.shape == shape and kv.keys.flags.c_contiguous
                   and kv.values.flags.c_contiguous for kv in layers) or not h.flags.c_contiguous:
            raise ValueError("the compiled decode step needs contiguous activations and KV caches of the model's shape")
        c = self.config
        cos, sin = (np.ascontiguousarray(a) for a in state.rotary(c.rotary_dim, c.rope_theta))  # [B, 1, r/2]
        slots, key_valid = (np.ascontiguousarray(a) for a in state.slots())  # [B, 1], [B, S]
        kv = np.array([(layer.keys.ctypes.data, layer.values.ctypes.data) for layer in layers], np.int64)
        dims = np.array([b, *self.shape, capacity, self.flags], np.int64)
        work, offsets = self._buffers(b)
        step = jit()
        rate = step.cycles_per_us()
        sync = np.zeros(step.sync_size(len(layers)), np.int64)
        starts = np.zeros_like(self.starts) if self.ws.dry else self.starts  # Workspace.dry_run: no product
        args = (h, self.mats, self.vecs, self.chunks, starts, kv, dims, self.eps, cos, sin, slots, key_valid,
                work, offsets, step.F16_TABLE, sync, int(WAIT_US * rate), int(LOST_US * rate))
        workers = self.ws.threads if self.ws.pooled else 1
        self.ws.run([partial(_worker, w, args) for w in range(workers)])

    def _buffers(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """The step's activation buffers for ``batch`` rows in one float32 array (kept between steps, grown when a
        larger batch comes) and where each starts (:data:`.step_jit.X` ...)."""
        hidden, nh, nkv, hd, inter = self.shape
        widest = max(hidden, inter, nh * hd)
        sizes = [hidden, nh * hd, nkv * hd, nkv * hd, nh * hd, hidden, hidden, inter, hidden, widest // 16,
                 widest // 32] + [self.gate_rows] * (2 * self.ws.threads)
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-batch * size // ALIGN_FLOATS) * ALIGN_FLOATS
        if self._work.size < total + ALIGN_FLOATS:
            self._work = np.empty(total + ALIGN_FLOATS, np.float32)
        skip = (-self._work.ctypes.data % (4 * ALIGN_FLOATS)) // 4
        return self._work[skip:skip + total], np.array(offsets, np.int64)


def _worker(worker: int, args: tuple, scratch: Scratch) -> None:
    """A pool task: :func:`.step_jit.decode_layers` as ``worker``."""
    jit().decode_layers(worker, *args)
