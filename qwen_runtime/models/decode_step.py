"""The compiled decode step's plan and its call: :class:`DecodeStep` gathers, once per model, what
:func:`.step_jit.decode_layers` needs (addresses of the stored rows and vectors, the chunks of each product) and
runs it on every pool thread for each eligible step (one new token per row, see :meth:`DecodeStep.runs`).

Offered for models whose every layer is softmax attention (:class:`.attention.Attention`: Qwen2, Qwen2.5, Qwen3,
DeepSeek-R1-Distill-Qwen) or Qwen3.5's gated attention and Gated DeltaNet, with compiled kernels for every matrix,
float or (``activations="q8"``) integer-dot ones.  :mod:`.step_jit` explains why and how, and why the numbers are
the per-operation path's, bit for bit.
"""

from __future__ import annotations

import functools
from functools import partial
from types import ModuleType

import numpy as np

from ..backend.cache import CACHE_TYPES, BatchState, Cache, KVCache, stored_type
from ..backend.pool import Workspace
from ..backend.weights import DIRECT_ROW_ALIGN, TiledWeight
from ..formats.config import ModelConfig
from ..quants.scratch import Scratch
from .qwen35 import LinearAttentionCache

# Bytes of stored rows per chunk a worker claims at least (rounded to DIRECT_ROW_ALIGN rows); larger shares of the
# rows left first (:func:`split_rows`), so that the threads finish a product within a small chunk of each other.
CHUNK_BYTES = 32 << 10
# ... and at most this many (a 7B model's first share of a product would be 19 MB): a thread that loses its CPU in
# the middle of a chunk keeps the others waiting for that chunk only.
MAX_CHUNK_BYTES = 1 << 20
# How long a pool thread waits for the next product before it leaves the rest of the step to the caller: longer
# than any operation between two products (attention over a long cache), shorter than a stalled step.
WAIT_US = 50_000
# A pool thread that finds this long a gap between two of its polls for the next product lost its CPU to another
# thread (a busy machine): it leaves the rest of the step to the caller rather than claim chunks it may be
# descheduled in again.
LOST_US = 1_000
ALIGN_FLOATS = 16  # buffers start on 64-byte boundaries (the row kernels' aligned loads)
PHASE_MATRICES = ((0, 1, 2, 3), (4,), (5,), (7,))  # each product phase's matrices (gate/up: chunks of gate's rows)


@functools.cache
def jit() -> ModuleType:
    """:mod:`.step_jit`, imported (numba with it) on first use."""
    from . import step_jit
    return step_jit


def chunk_rows(row_bytes: int, size: int = CHUNK_BYTES) -> int:
    """Rows per chunk of ``size`` bytes of a matrix of ``row_bytes`` bytes per row, a multiple of DIRECT_ROW_ALIGN
    (at least one)."""
    return max(DIRECT_ROW_ALIGN, size // row_bytes // DIRECT_ROW_ALIGN * DIRECT_ROW_ALIGN)


def split_rows(matrix: int, rows: int, row_bytes: int, threads: int) -> list[tuple[int, int, int]]:
    """``(matrix, r0, r1)`` chunks covering ``rows`` of ``row_bytes`` bytes, each ``1 / (2 * threads)`` of the rows
    left (a multiple of DIRECT_ROW_ALIGN) between :data:`CHUNK_BYTES` and :data:`MAX_CHUNK_BYTES`: large chunks
    first, small ones at the end of a product."""
    least, most = chunk_rows(row_bytes), chunk_rows(row_bytes, MAX_CHUNK_BYTES)
    out, r0 = [], 0
    while r0 < rows:
        share = (rows - r0) // (2 * threads) // DIRECT_ROW_ALIGN * DIRECT_ROW_ALIGN
        r1 = min(r0 + min(most, max(least, share)), rows)
        out.append((matrix, r0, r1))
        r0 = r1
    return out


def row_product(kernel: object) -> tuple[object, int]:
    """A compiled kernel's row product for the step and the slots of the forms table it reads: its
    :data:`~..backend.kernels.q8_act.Q8_ROW_PRODUCT` with 8-bit activations, else its float ROW_PRODUCT and 0 (None
    for a
    kernel without one)."""
    q8 = getattr(kernel, "q8_row_product", None)
    return (q8, kernel.q8_slots) if q8 is not None else (kernel.row_product, 0)


def matrix_entry(w: TiledWeight | None) -> tuple[int, int, int, int, int, int]:
    """A matrix's ``mats`` entry (:mod:`.step_jit`): its row product's address, its stored rows' address, rows,
    bytes per row, the width of the activation block sums it takes and the forms it reads; zeros for an absent
    matrix."""
    if w is None:
        return 0, 0, 0, 0, 0, 0
    k = w.kernel
    function, slots = row_product(k)
    return function.address, k.raw.ctypes.data, w.out_features, k.raw.shape[1] * k.raw.itemsize, k.sums_width, slots


def layer_parts(config: ModelConfig, blk: object) -> tuple[int, list, list, list[tuple[int, int] | None]] | str:
    """A block's layer kind (:data:`.step_jit.ATTENTION` or ``LINEAR``), its 8 matrices (None where absent), its 7
    vectors (the two norms, then the mixer's) and the shape each matrix must have, from its mixer's
    ``step_parts`` (:class:`.base.StepParts`); or why the compiled step cannot run the layer."""
    describe = getattr(blk.mixer, "step_parts", None)
    if describe is None:
        return f"its {type(blk.mixer).__name__} mixer does not describe itself to the compiled step (step_parts)"
    parts = describe(config)
    if isinstance(parts, str):
        return parts
    mlp, hidden, inter = blk.mlp, config.hidden_size, config.intermediate_size
    kind = {"attention": jit().ATTENTION, "linear": jit().LINEAR}[parts.kind]
    return (kind, [*parts.matrices, mlp.gate, mlp.up, mlp.down], [blk.mixer_norm, blk.mlp_norm, *parts.vectors],
            [*parts.shapes, (inter, hidden), (inter, hidden), (hidden, inter)])


def matrix_problem(w: object, shape: tuple[int, int] | None) -> str | None:
    """Why the compiled step cannot read matrix ``w`` of the expected ``shape`` (None: it can).  The step reads
    every shape from the config, without bounds checks, and each matrix through its kernel's row product."""
    if shape is None:
        return None if w is None else f"an unexpected matrix {w!r}"
    if not isinstance(w, TiledWeight) or not w.compiled or row_product(w.kernel)[0] is None:
        return f"{getattr(w, 'name', w)!r} has no compiled row kernel"
    if (w.out_features, w.in_features) != shape:
        return f"{w.name!r} is {w.out_features} x {w.in_features}, the config says {shape[0]} x {shape[1]}"
    return None


class DecodeStep:
    """A model's compiled decode step (:func:`.step_jit.decode_layers`): built by :meth:`offer` when the model
    qualifies, called by the model for steps that :meth:`runs`."""

    def __init__(self, config: ModelConfig, ws: Workspace, kinds: list[int], weights: list[list],
                 vectors: list[list]) -> None:
        c = self.config = config
        self.ws = ws
        self.weights, self.vectors = weights, vectors  # [L][8], [L][7]: they keep what the addresses point to alive
        self.layers = np.array(kinds, np.int64)  # [L]
        self.mats = np.array([[matrix_entry(w) for w in layer] for layer in weights], np.int64)  # [L, 8, 6]
        self.activations = ws.activations  # what the kernels were built for
        self.vecs = np.array([[0 if v is None else v.ctypes.data for v in layer] for layer in vectors], np.int64)
        chunks, starts, self.gate_rows = [], np.zeros((2, 5), np.int64), 0
        for kind in (jit().ATTENTION, jit().LINEAR):
            if kind not in kinds:
                starts[kind] = len(chunks)
                continue
            first = self.mats[kinds.index(kind)]  # chunk rows from the first layer of the kind (types may differ)
            for phase, matrices in enumerate(PHASE_MATRICES):
                starts[kind, phase] = len(chunks)
                for m in matrices:
                    rows, row_bytes = int(first[m, 2]), int(first[m, 3]) * (2 if phase == 2 else 1)
                    chunks += split_rows(m, rows, row_bytes, ws.threads) if rows else []
            starts[kind, 4] = len(chunks)
            self.gate_rows = max([self.gate_rows] + [r1 - r0 for _, r0, r1 in chunks[starts[kind, 2]:starts[kind, 3]]])
        self.chunks, self.starts = np.array(chunks, np.int64).reshape(-1, 3), starts  # [C, 3], [2, 5]
        spec = c.spec
        step = jit()
        self.flags = (step.HAS_BIAS if spec.attention_bias else 0) | (step.HAS_QK_NORM if spec.qk_norm else 0)
        # q's rows: nh·hd, or 2·nh·hd when each head's gate follows its query (Qwen3.5)
        q_rows = next((int(m[0, 2]) for m, k in zip(self.mats, kinds, strict=True) if k == step.ATTENTION), 0)
        self.dims = [c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size,
                     q_rows, c.linear_num_key_heads or 0, c.linear_key_head_dim or 0, c.linear_num_value_heads or 0,
                     c.linear_value_head_dim or 0, c.linear_conv_kernel_dim or 0, c.linear_conv_dim or 0]
        self.eps = np.float32(c.rms_norm_eps)
        self.direct_rows = min(w.kernel.direct_rows for layer in weights for w in layer if w is not None)
        self._work = np.empty(0, np.float32)
        self._partials = np.empty(0, np.float32)

    @classmethod
    def offer(cls, config: ModelConfig, blocks: list, ws: Workspace) -> DecodeStep | str:
        """The compiled step of a model's ``blocks`` (:class:`.transformer.Block`), or why the model does not
        qualify (see the module docstring), naming the layer and what it lacks."""
        if ws.kernels != "numba":
            return "the numpy kernels (the compiled step needs kernels=numba)"
        kinds, weights, vectors = [], [], []
        for layer, blk in enumerate(blocks):
            parts = layer_parts(config, blk)
            if isinstance(parts, str):
                return f"layer {layer}: {parts}"
            kind, matrices, vecs, shapes = parts
            problem = next(filter(None, (matrix_problem(w, shape) for w, shape in zip(matrices, shapes, strict=True))),
                           None)
            if problem is not None:
                return f"layer {layer}: {problem}"
            kinds.append(kind)
            weights.append(matrices)
            vectors.append(vecs)
        return cls(config, ws, kinds, weights, vectors)

    def runs(self, batch: int, tokens: int, cache: Cache) -> bool:
        """Whether a pass of ``tokens`` new tokens for ``batch`` rows runs this step: one token per row, products the
        per-operation path also multiplies by the row kernels (up to ``direct_rows`` rows, or any inside
        ``Workspace.rowwise`` without a row subset), the workspace still on the compiled float kernels (tests
        switch a loaded model's ``kernels``) with the activations its kernels were built for, and no Gated DeltaNet
        state checkpointed (such a pass records its inputs for a rollback, op by op)."""
        ws = self.ws
        if (tokens != 1 or ws.active_rows is not None or ws.kernels != "numba"
                or ws.activations != self.activations):
            return False
        if any(isinstance(layer, LinearAttentionCache) and layer.saved is not None for layer in cache.layers):
            return False
        return batch <= self.direct_rows or ws.row_invariant

    def __call__(self, h: np.ndarray, cache: Cache, state: BatchState) -> None:
        """Every layer for ``h`` [B, H] (the embedded new tokens, updated in place to the last block's output)."""
        c, b = self.config, h.shape[0]
        caches, capacity, kv_types = self._caches(cache.layers, b)
        if not h.flags.c_contiguous:
            raise ValueError("the compiled decode step needs contiguous activations")
        rotary = state.rotary(c.rotary_dim, c.rope_theta, c.rope_scaling)
        cos, sin = (np.ascontiguousarray(a) for a in rotary)  # [B, 1, r/2]
        slots, key_valid = (np.ascontiguousarray(a) for a in state.slots())  # [B, 1], [B, S]
        valid = np.ascontiguousarray(state.valid)  # [B, 1]
        step = jit()
        blocks = int(slots.max(initial=0)) // step.BLOCK + 1  # of slots (:func:`.attention_jit.attend_block`)
        dims = np.array([b, *self.dims[:5], capacity, self.flags, *self.dims[5:], *kv_types, blocks], np.int64)
        work, offsets, forms = self._buffers(b)
        partials = self._partial_sums(b, blocks)
        rate = step.cycles_per_us()
        sync = np.zeros(step.sync_size(len(self.layers)), np.int64)
        starts = np.zeros_like(self.starts) if self.ws.dry else self.starts  # Workspace.dry_run: no product
        args = (h, self.layers, self.mats, self.vecs, self.chunks, starts, caches, dims, self.eps, cos, sin, slots,
                key_valid, valid, work, offsets, forms, partials, step.F16_TABLE, sync, int(WAIT_US * rate),
                int(LOST_US * rate))
        workers = self.ws.threads if self.ws.pooled else 1
        self.ws.run([partial(_worker, w, args) for w in range(workers)])

    def _caches(self, layers: list, batch: int) -> tuple[np.ndarray, int, tuple[int, int]]:
        """The addresses of each layer's cache arrays [L, 2], the KV caches' slots and their types (indices of
        :data:`~..cache.CACHE_TYPES`: keys, values), every shape and type checked against the config and the first KV
        cache (the compiled code reads them without bounds checks)."""
        c, step = self.config, jit()
        first = next((layer for layer in layers if isinstance(layer, KVCache)), None)
        capacity = 0 if first is None else first.keys.shape[2]
        kv_types = (stored_type(np.empty(0, np.float32)),) * 2 if first is None else first.types
        kv_shapes = [(batch, c.num_key_value_heads, capacity, t.width(c.head_dim)) for t in kv_types]
        conv_shape, state_shape = ((batch, *shape) for shape in LinearAttentionCache.row_shapes(c)) \
            if c.linear_conv_dim else ((), ())
        arrays = []
        for kind, layer in zip(self.layers, layers, strict=True):
            pair = (layer.keys, layer.values) if kind == step.ATTENTION and isinstance(layer, KVCache) else \
                (layer.conv, layer.state) if isinstance(layer, LinearAttentionCache) else None
            shapes = kv_shapes if kind == step.ATTENTION else (conv_shape, state_shape)
            types = [t.dtype for t in kv_types] if kind == step.ATTENTION else (np.float32, np.float32)
            if pair is None or any(a.shape != s or not a.flags.c_contiguous or a.dtype != t
                                   for a, s, t in zip(pair, shapes, types, strict=True)):
                raise ValueError("the compiled decode step needs contiguous caches of the model's shapes, keys and "
                                 "values of one type each in every layer")
            arrays.append([a.ctypes.data for a in pair])
        return np.array(arrays, np.int64), capacity, tuple(CACHE_TYPES.index(t.name) for t in kv_types)

    def _partial_sums(self, batch: int, blocks: int) -> np.ndarray:
        """Room for attention's per-block partial sums (:func:`.step_jit.partial_views`), kept between steps and
        grown when a longer context or larger batch comes."""
        c = self.config
        size = batch * c.num_key_value_heads * blocks * c.num_attention_heads // c.num_key_value_heads \
            * (c.head_dim + 2)
        if self._partials.size < size:
            self._partials = np.empty(size, np.float32)
        return self._partials

    def _buffers(self, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's activation buffers for ``batch`` rows in one float32 array (kept between steps, grown when a
        larger batch comes), where each starts (:data:`.step_jit.X` ...) and, in the same array, the forms table of
        the products with 8-bit activations (:mod:`..backend.kernels.q8_act`; zeros without)."""
        from ..backend.kernels import q8_act as jit_q8_act
        hidden, nh, nkv, hd, inter, q_rows, _, _, hv, dv, _, channels = self.dims
        projections = [max(q_rows, channels), max(nkv * hd, hv * dv), max(nkv * hd, hv), hv]
        mixed = max(nh * hd, hv * dv)
        widest = max(hidden, inter, mixed)
        sizes = [hidden, *projections, mixed, hidden, hidden, inter, hidden, widest // 16, widest // 32, nh * hd,
                 nh * hd] + [self.gate_rows] * (2 * self.ws.threads)
        q8 = bool(self.mats[..., jit().FORMS].any())
        slots = [-(-size // 4) for size in jit_q8_act.forms_bytes(1, widest)] if q8 else []  # floats per row
        offsets, total = [], 0
        for size in sizes + slots:
            offsets.append(total)
            total += -(-batch * size // ALIGN_FLOATS) * ALIGN_FLOATS
        if self._work.size < total + ALIGN_FLOATS:  # zeros: a dry run (no products) reads no stale floats
            self._work = np.zeros(total + ALIGN_FLOATS, np.float32)
        skip = (-self._work.ctypes.data % (4 * ALIGN_FLOATS)) // 4
        work = self._work[skip:skip + total]
        forms = np.array([work.ctypes.data + 4 * at for at in offsets[len(sizes):]] or [0] * jit_q8_act.SLOTS,
                         np.int64)
        return work, np.array(offsets[:len(sizes)], np.int64), forms


def _worker(worker: int, args: tuple, scratch: Scratch) -> None:
    """A pool task: :func:`.step_jit.decode_layers` as ``worker``."""
    jit().decode_layers(worker, *args)
