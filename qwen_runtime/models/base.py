"""The seams every layer kind plugs into: weight access, the mixer interface and the mixer registry.

**Mixer interface.**  A mixer is the token-mixing half of a decoder block (softmax attention, gated
attention, Gated DeltaNet).  It is built once per layer by a factory registered for its layer type::

    @register_mixer("full_attention", QWEN2, QWEN3)
    class Attention:
        def __init__(self, config: ModelConfig, layer: int, store: WeightStore) -> None: ...
        @property
        def cache_size(self) -> CacheSize: ...  # what its cache holds per row and per token
        def make_cache(self, batch: int, max_len: int) -> LayerCache: ...
        def __call__(self, x, cache, state: BatchState) -> np.ndarray: ...  # [B, T, H] -> [B, T, H]

A mixer the compiled decode step can run (:mod:`.decode_step`) also describes its parts for it:
``step_parts(config) -> StepParts | str`` (a :class:`StepParts`, or why this layer cannot take the step); a mixer
without the method keeps its model on the per-operation path, which the model says once (``Model.step_refusal``).

``x`` is the already-normalised hidden state (``attn_norm`` is applied by the block), ``cache`` is the
object this mixer's ``make_cache`` returned (it must implement ``select(rows)`` and ``nbytes``, and hold
``cache_size.nbytes(batch, max_len)`` bytes: every memory estimate adds these reports), and
``state`` (:class:`~qwen_runtime.backend.cache.BatchState`) carries per-row rotary positions ``[B, T]``, the
validity mask ``[B, T]`` (False on left padding: a recurrent mixer must leave its state untouched there),
the first slot of the new tokens and the validity of every slot so far; what every layer derives from
these (rotary cos/sin, the slots hidden from each new token) it computes once per forward pass.
The factory is looked up by ``(config.arch, config.layer_types[i])`` and falls back to ``(None, type)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np
from gguf import MODEL_TENSOR

from ..backend.cache import EXACT_CACHE_TYPE, BatchState, CacheSize, LayerCache, cache_type
from ..backend.compile_events import listen
from ..backend.pool import Workspace, resolve_activations, resolve_kernels
from ..backend.weights import TILE_ELEMENTS, Weight, load_vector, make_weight
from ..errors import FormatError
from ..formats import ModelFiles
from ..formats.config import ModelConfig
from ..formats.naming import tensor_name
from ..formats.tensors import QType


class WeightStore:
    """Hands out a model's weights by canonical kind: matrices as :class:`Weight`, small tensors as float32."""

    def __init__(self, files: ModelFiles, tile_elements: int = TILE_ELEMENTS, threads: int | None = None,
                 kernels: str | None = None, activations: str = "float", cache_type_k: str = EXACT_CACHE_TYPE,
                 cache_type_v: str = EXACT_CACHE_TYPE) -> None:
        self.files = files
        for name in (cache_type_k, cache_type_v):  # an unknown type, or blocks that do not divide the heads, fail
            cache_type(name).width(files.config.head_dim)  # before anything is built
        self.cache_types = (cache_type_k, cache_type_v)  # what attention layers store keys and values in
        kernels = resolve_kernels(kernels)
        if kernels == "numba":
            listen()  # a command then says when numba compiles (compile_events)
        self.workspace = Workspace(threads, blas_products=kernels == "numpy" and all_float32(files), kernels=kernels,
                                   activations=resolve_activations(activations, kernels))
        self.tile_elements = tile_elements
        self._matrices: dict[str, Weight] = {}

    def name(self, kind: MODEL_TENSOR, layer: int | None = None, suffix: str = ".weight") -> str:
        return tensor_name(kind, layer, suffix)

    def matrix(self, kind: MODEL_TENSOR, layer: int | None = None) -> Weight:
        """A ``[out, in]`` weight used in its stored type (the same object for the same name)."""
        name = tensor_name(kind, layer)
        if name not in self._matrices:
            self._matrices[name] = make_weight(self.files.tensor(name), self.workspace, self.tile_elements)
        return self._matrices[name]

    def matrices(self) -> list[Weight]:
        """Every matrix handed out so far."""
        return list(self._matrices.values())

    def vector(self, kind: MODEL_TENSOR, layer: int | None = None, suffix: str = ".weight") -> np.ndarray:
        """A small tensor (norm, bias, per-head scalars, conv kernel) widened once to float32, logical shape."""
        return load_vector(self.files.tensor(tensor_name(kind, layer, suffix)))


def all_float32(files: ModelFiles) -> bool:
    """Whether every matrix of the model is stored as float32: with the numpy kernels its products then run as
    whole-matrix BLAS calls with BLAS's own threads, no tile pool (the per-model threading policy of
    :mod:`..pool`); the compiled kernels run it on the pool, as every other type."""
    return all(t.qtype == QType.F32 for t in files.tensors.values() if len(t.shape) == 2)


class Mixer(Protocol):
    """Token mixer of one decoder layer (see the module docstring)."""

    @property
    def cache_size(self) -> CacheSize: ...

    def make_cache(self, batch: int, max_len: int) -> LayerCache: ...

    def __call__(self, x: np.ndarray, cache: LayerCache, state: BatchState) -> np.ndarray: ...


class StepParts(NamedTuple):
    """What a layer's mixer gives the compiled decode step (:mod:`.decode_step`): its ``kind`` (``"attention"`` or
    ``"linear"``), its 5 matrices (q, k, v, gate, out for attention; qkv, z, beta, alpha, out for Gated DeltaNet; None
    where absent) with the shape each must have, and its 5 vectors (biases and norms, or the recurrence's)."""

    kind: str
    matrices: list[Weight | None]
    shapes: list[tuple[int, int] | None]
    vectors: list[np.ndarray | None]


MixerFactory = Callable[[ModelConfig, int, WeightStore], Mixer]
MIXERS: dict[tuple[str | None, str], MixerFactory] = {}


def register_mixer(layer_type: str, *archs: str) -> Callable[[MixerFactory], MixerFactory]:
    """Register a mixer factory for a layer type, for the given architectures (all when none given)."""

    def register(factory: MixerFactory) -> MixerFactory:
        for arch in archs or (None,):
            MIXERS[(arch, layer_type)] = factory
        return factory

    return register


def make_mixer(config: ModelConfig, layer: int, store: WeightStore) -> Mixer:
    """Build the mixer of layer ``layer`` from its ``config.layer_types`` entry."""
    layer_type = config.layer_types[layer]
    factory = MIXERS.get((config.arch, layer_type)) or MIXERS.get((None, layer_type))
    if factory is None:
        raise FormatError(f"{store.files.path}: no mixer for layer type {layer_type!r} of architecture "
                          f"{config.arch} (layer {layer})")
    return factory(config, layer, store)
