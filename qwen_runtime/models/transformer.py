"""The decoder skeleton shared by every family: embedding, pre-norm blocks, final norm, LM head.

Block (docs §3.5): ``h = h + mixer(norm1(h)); h = h + mlp(norm2(h))``.  The mixer of each layer comes
from the registry in :mod:`.base` by ``config.layer_types``; the second norm is ``ffn_norm`` for qwen2 /
qwen3 and ``post_attention_norm`` for qwen35 (llama.cpp's naming).  Shapes: B batch, T new tokens,
H hidden size, I intermediate size, V vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import MODEL_TENSOR

from ..backend.cache import BatchState, Cache, CacheSize, LayerCache, LayeredCache
from ..backend.limits import MemoryPlan, check_memory
from ..backend.pool import STEP_TOKENS
from ..backend.weights import TiledWeight, gated_matmul
from ..formats import ModelFiles
from ..formats.config import ModelConfig
from .base import Mixer, WeightStore, make_mixer
from .decode_step import DecodeStep

log = logging.getLogger(__name__)


class MLP:
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, layer: int, store: WeightStore) -> None:
        self.gate, self.up = store.matrix(MODEL_TENSOR.FFN_GATE, layer), store.matrix(MODEL_TENSOR.FFN_UP, layer)
        self.down = store.matrix(MODEL_TENSOR.FFN_DOWN, layer)

    def __call__(self, x: np.ndarray) -> np.ndarray:  # [N, H] -> [N, H]
        return self.down.matmul(gated_matmul(self.gate, self.up, x))  # [N, I] in between


class Block:
    """One pre-norm decoder layer around a mixer."""

    def __init__(self, config: ModelConfig, layer: int, store: WeightStore) -> None:
        self.eps = config.rms_norm_eps
        self.ws = store.workspace
        self.mixer: Mixer = make_mixer(config, layer, store)
        self.mixer_norm = store.vector(MODEL_TENSOR.ATTN_NORM, layer)
        self.mlp_norm = store.vector(config.spec.mlp_norm, layer)
        self.mlp = MLP(layer, store)

    def __call__(self, h: np.ndarray, cache: LayerCache, state: BatchState) -> np.ndarray:
        b, t, d = h.shape
        h, x = self.mix(h, cache, state)
        return h + self.mlp(x.reshape(b * t, d)).reshape(b, t, d)

    def mix(self, h: np.ndarray, cache: LayerCache, state: BatchState) -> tuple[np.ndarray, np.ndarray]:
        """The residual stream after the mixer and its second norm, the MLP's input.  # [B, T, H] -> both [B, T, H]"""
        ops = self.ws.ops
        return ops.add_rms_norm(h, self.mixer(ops.rms_norm(h, self.mixer_norm, self.eps), cache, state),
                                self.mlp_norm, self.eps)


class Model:
    """A loaded decoder.  ``logits`` is the plain full-sequence path; ``forward`` runs on a cache."""

    def __init__(self, files: ModelFiles, store: WeightStore) -> None:
        self.files = files
        self.config = config = files.config
        self.embed = store.matrix(MODEL_TENSOR.TOKEN_EMBD)
        self.blocks = [Block(config, i, store) for i in range(config.num_hidden_layers)]
        self.norm = store.vector(MODEL_TENSOR.OUTPUT_NORM)
        self.tied = config.tie_word_embeddings  # the reader decided it: no output.weight in the file
        self.lm_head = self.embed if self.tied else store.matrix(MODEL_TENSOR.OUTPUT)
        self.workspace = store.workspace
        self.cache_types = store.cache_types  # (keys, values): :data:`~qwen_runtime.backend.cache.CACHE_TYPES`
        self.matrices = store.matrices()
        self._row_kernels = all(not isinstance(w, TiledWeight) or w.compiled for w in self.matrices)
        # every layer of a decode step in one compiled call per thread, when the model qualifies; else why not
        offered = DecodeStep.offer(config, self.blocks, self.workspace)
        self.step = offered if isinstance(offered, DecodeStep) else None
        self.step_refusal = offered if isinstance(offered, str) else None
        if self.step_refusal is not None and self.workspace.kernels == "numba":
            log.info("%s: decode steps run op by op: %s", files.path, self.step_refusal)

    @property
    def path(self) -> Path:
        return self.files.path

    @property
    def cache_size(self) -> CacheSize:
        """What the layers' caches hold per row and per token, as their mixers report it."""
        return CacheSize.total(blk.mixer.cache_size for blk in self.blocks)

    def cache_bytes(self, batch: int, max_len: int) -> int:
        """Bytes of ``make_cache(batch, max_len)``: the layers' caches and the validity mask."""
        return (self.cache_size + Cache.MASK).nbytes(batch, max_len)

    def memory_plan(self, rows: int, tokens: int, activations: int, mask: bool = True) -> MemoryPlan:
        """The memory of ``rows`` rows at ``tokens`` tokens with ``activations`` bytes of scratch: the mapped
        weights, and the cache of :meth:`make_cache` (``mask``: with its validity mask, as a :class:`Cache` holds;
        without, as the server's slots hold their layers)."""
        cache = self.cache_bytes(rows, tokens) if mask else self.cache_size.nbytes(rows, tokens)
        return MemoryPlan(weights=sum(t.nbytes for t in self.files.tensors.values()), cache=cache,
                          activations=activations, rows=rows, tokens=tokens, cache_types=self.cache_types)

    def make_cache(self, batch: int, max_len: int, max_memory: int | None = None) -> Cache:
        """Empty per-layer caches for ``batch`` rows of up to ``max_len`` slots.

        Raises :class:`ResourceLimitError` first when they would exceed ``max_memory`` bytes (default: see
        :func:`qwen_runtime.backend.limits.default_memory_limit`).
        """
        check_memory(self.cache_bytes(batch, max_len), max_memory, f"a cache of {batch} rows x {max_len} tokens")
        return Cache([blk.mixer.make_cache(batch, max_len) for blk in self.blocks], batch, max_len)

    def forward(self, ids: np.ndarray, cache: Cache, valid: np.ndarray | None = None,
                last_only: bool = False) -> np.ndarray:
        """Feed ``T`` more tokens per row through the cache.

        ``ids``: int [B, T]; ``valid``: bool [B, T] (False on left padding, default all True).
        Returns float32 logits [B, T, V], or [B, V] for the last slot when ``last_only``.

        The workspace's scratch buffers are kept or dropped after the pass by the workspace's policy
        (:meth:`~qwen_runtime.backend.pool.Workspace.pass_done`,
        :meth:`~qwen_runtime.backend.pool.Workspace.keep_scratch`).
        """
        h = self._residual(ids, cache, valid)  # [B, T, H]
        b, t = h.shape[:2]
        if last_only:
            h = h[:, -1:]
        norm = self.workspace.ops.rms_norm
        h = norm(h, self.norm, self.config.rms_norm_eps)
        logits = self.lm_head.matmul(h.reshape(-1, h.shape[-1])).reshape(b, h.shape[1], -1)  # [B, T|1, V]
        self.workspace.pass_done(t)
        return logits[:, 0] if last_only else logits

    def prefill_many(self, chunks: Sequence[Sequence[int]], caches: Sequence[LayeredCache]) -> np.ndarray:
        """The next-token logits of K sequences, each fed its chunk of new tokens on a one-row cache of its own:
        row k is bit for bit ``forward([chunks[k]], caches[k], last_only=True)[0]``, while the MLPs read their
        weights once for all chunks (a server prefilling several prompts between two decode steps).

        Each chunk's mixers run alone, as in :meth:`forward`; the MLPs multiply every chunk's rows together inside
        ``Workspace.segmented`` (each segment's numbers are its own: :func:`~qwen_runtime.backend.weights.by_segments`)
        and the LM head takes the last rows row by row.  A chunk that :meth:`forward` runs through the compiled
        one-token step runs alone, and so does every chunk when the products cannot be segmented exactly
        (:attr:`segments_exact`).  -> float32 [K, V]
        """
        if len(chunks) != len(caches) or not chunks or not all(len(c) for c in chunks):
            raise ValueError(f"{len(chunks)} chunks (each of at least one token) for {len(caches)} caches")
        ids = [np.asarray(c, np.int64) for c in chunks]
        together = [k for k, c in enumerate(ids) if self.segments_exact
                    and not (self.step is not None and self.step.runs(1, len(c), caches[k]))]
        together = together if len(together) > 1 else []
        logits: list[np.ndarray] = [np.empty(0, np.float32)] * len(ids)
        for k in sorted(set(range(len(ids))) - set(together)):
            logits[k] = self.forward(ids[k][None], caches[k], last_only=True)[0]
        if together:
            for k, row in zip(together, self._prefill_together([ids[k] for k in together],
                                                               [caches[k] for k in together]), strict=True):
                logits[k] = row
        return np.stack(logits)

    def _prefill_together(self, ids: list[np.ndarray], caches: list[LayeredCache]) -> np.ndarray:
        """:meth:`prefill_many` of chunks that all run the per-operation path.  -> [K, V]"""
        if any(c.min() < 0 or c.max() >= self.config.vocab_size for c in ids):
            raise ValueError(f"token id out of range [0, {self.config.vocab_size})")
        lengths = [len(c) for c in ids]
        states = [cache.begin(np.ones((1, n), bool)) for cache, n in zip(caches, lengths, strict=True)]
        hs = [self.embed.rows(c).reshape(1, len(c), -1) for c in ids]  # K x [1, T_k, H]
        d = hs[0].shape[-1]
        for layer, blk in enumerate(self.blocks):
            mixed = [blk.mix(h, cache.layers[layer], state) for h, cache, state in zip(hs, caches, states, strict=True)]
            with self.workspace.segmented(lengths):
                y = blk.mlp(np.concatenate([x.reshape(-1, d) for _, x in mixed]))  # [sum T_k, H]
            ends = np.cumsum(lengths)
            hs = [h + y[end - n:end].reshape(1, n, d) for (h, _), end, n in zip(mixed, ends, lengths, strict=True)]
        for cache, state in zip(caches, states, strict=True):
            cache.commit(state)
        norm = self.workspace.ops.rms_norm
        last = norm(np.concatenate([h[:, -1:] for h in hs]), self.norm, self.config.rms_norm_eps)  # [K, 1, H]
        with self.workspace.rowwise():  # each row as a one-row product gives it
            logits = self.lm_head.matmul(last.reshape(len(ids), d))  # [K, V]
        self.workspace.pass_done(max(lengths))
        return logits

    @property
    def segments_exact(self) -> bool:
        """Whether :meth:`prefill_many` can run several chunks in one pass: compiled kernels for every matrix, the
        MLPs' of one ``direct_rows`` and each of whose products of more rows is the tile-and-BLAS one that
        ``product_segments`` splits (the float kernels; the 8-bit ones where their row kernels take as many rows
        as the float ones: ``segments_exact`` of each kernel)."""
        mlps = [w for blk in self.blocks for w in (blk.mlp.gate, blk.mlp.up, blk.mlp.down)]
        return (self.exact_steps
                and all(isinstance(w, TiledWeight) and getattr(w.kernel, "segments_exact", False) for w in mlps)
                and len({w.kernel.direct_rows for w in mlps if isinstance(w, TiledWeight)}) == 1)

    @property
    def exact_steps(self) -> bool:
        """Whether :meth:`verify` can run: compiled kernels for every op and product (any stored type has one,
        unless its rows are not one contiguous array).  The numpy path sums a pass of several tokens in other
        orders than one-token steps (BLAS GEMM against GEMV, batched attention), so it cannot."""
        return self.workspace.kernels == "numba" and self._row_kernels

    def verify(self, ids: np.ndarray, cache: Cache, valid: np.ndarray | None = None) -> np.ndarray:
        """Logits of ``T`` new tokens per row (T at most :data:`~qwen_runtime.backend.pool.STEP_TOKENS`), each bit for
        bit
        what feeding the tokens one step at a time gives: speculative decoding's verify pass.  ``valid`` (bool
        [B, T], a ragged cache only): each row's tokens are a prefix of its T, the rest padding whose products are
        skipped and whose logits are meaningless (they pass after the row's own tokens, which never see them).

        With :attr:`exact_steps`, one pass: every product runs row by row (``Workspace.rowwise``: a compiled row
        kernel gives a row the same numbers alone and among others, and F32's per-row BLAS call is a lone step's
        call), and attention, norms and Gated DeltaNet run the decode step's compiled kernels, which take the tokens
        one after the other by the operations of a one-token step.  Otherwise (the numpy path, or a matrix without a
        compiled kernel) the tokens are fed one step at a time, which is exact by construction and as slow as
        decoding them; the cache then counts the ``T`` steps as one pass (what :meth:`Cache.rollback` cuts back).
        int [B, T] -> float32 [B, T, V]
        """
        t = ids.shape[1]
        if not 1 <= t <= STEP_TOKENS:
            raise ValueError(f"a verify pass takes 1 to {STEP_TOKENS} tokens per row, got {t}")
        if not self.exact_steps:
            logits = [self.forward(ids[:, i:i + 1], cache, None if valid is None else np.asarray(valid)[:, i:i + 1])
                      for i in range(t)]  # T x [B, 1, V]
            cache.last_length = t
            return np.concatenate(logits, axis=1)
        rows = None if valid is None else np.asarray(valid, bool).reshape(-1)  # [B*T] the tokens' product rows
        with self.workspace.rowwise(rows):
            return self.forward(ids, cache, valid)

    def hidden_states(self, ids: np.ndarray) -> list[np.ndarray]:
        """Residual stream after the embedding and after every block, of whole sequences (no persistent cache).

        int [B, T] -> (L + 1) x float32 [B, T, H]; ``forward`` would go on with the final norm and the LM head.
        """
        ids = np.atleast_2d(np.asarray(ids, np.int64))
        states: list[np.ndarray] = []
        self._residual(ids, self.make_cache(ids.shape[0], max(ids.shape[1], 1)), None, states)
        self.workspace.pass_done(ids.shape[1])
        return states

    def _residual(self, ids: np.ndarray, cache: Cache, valid: np.ndarray | None,
                  states: list[np.ndarray] | None = None) -> np.ndarray:
        """Embedding and every block on the cache (appending each residual stream to ``states`` when given).

        int [B, T] -> float32 [B, T, H]
        """
        ids = np.asarray(ids, np.int64)
        if ids.ndim != 2:
            raise ValueError(f"token ids must be [batch, time], got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"token id out of range [0, {self.config.vocab_size})")
        valid = np.ones(ids.shape, bool) if valid is None else np.asarray(valid, bool)
        state = cache.begin(valid)
        b, t = ids.shape
        h = self.embed.rows(ids.reshape(-1)).reshape(b, t, -1)  # [B, T, H]
        if states is None and self.step is not None and self.step.runs(b, t, cache):
            self.step(h.reshape(b, -1), cache, state)  # h [B, 1, H] updated in place
            cache.commit(state)
            return h
        if states is not None:
            states.append(h)
        for blk, layer_cache in zip(self.blocks, cache.layers, strict=True):
            h = blk(h, layer_cache, state)
            if states is not None:
                states.append(h)
        cache.commit(state)
        return h

    def logits(self, ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """Logits of whole sequences in one pass (no persistent cache).  # int [B, T] -> float32 [B, T, V]

        ``attention_mask`` (1 = real token, 0 = left padding) follows the transformers convention.
        """
        ids = np.atleast_2d(np.asarray(ids, np.int64))
        cache = self.make_cache(ids.shape[0], max(ids.shape[1], 1))
        return self.forward(ids, cache, None if attention_mask is None else np.asarray(attention_mask, bool))
