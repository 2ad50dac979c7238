"""Decoder models.  Importing a mixer module registers its layer types (see :mod:`.base`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..backend.cache import EXACT_CACHE_TYPE
from ..backend.jit_setup import release_compiler_pages
from ..backend.weights import TILE_ELEMENTS, populate
from ..formats import ModelFiles, open_model_files
from . import attention, qwen35  # noqa: F401  (register the mixers of each layer type)
from .base import MIXERS, BatchState, Mixer, WeightStore, register_mixer
from .transformer import Block, Model

__all__ = ["MIXERS", "BatchState", "Block", "Mixer", "Model", "WeightStore", "build_model", "register_mixer"]


def build_model(source: str | Path | ModelFiles, tile_elements: int = TILE_ELEMENTS, threads: int | None = None,
                kernels: str | None = None, activations: str = "float", cache_type_k: str = EXACT_CACHE_TYPE,
                cache_type_v: str = EXACT_CACHE_TYPE) -> Model:
    """Open a model path (HF dir, npy dir or GGUF file) or wrap already-opened files; ``threads``, ``kernels``,
    ``activations`` and the cache types are :func:`qwen_runtime.load`'s."""
    files = source if isinstance(source, ModelFiles) else open_model_files(source)
    model = Model(files, WeightStore(files, tile_elements, threads, kernels, activations, cache_type_k, cache_type_v))
    if model.workspace.kernels == "numba":
        warm_up(model)
    return model


def warm_up(model: Model) -> None:
    """Decode steps of one token and a short prefill, thrown away: the compiled ops of a decode step (by the compiled
    step and op by op, as a prompt runs them) and a prefill's attention tiles (:mod:`.prefill_jit`) are loaded from
    numba's cache (or compiled, the first time on a machine) while the model loads, not inside the first prompt, as
    llama.cpp warms up too.  The products' kernels are already compiled when their weights are built, so the passes
    skip them (``Workspace.dry_run``: the weights are not read), and LLVM's code pages are released before the
    weights are mapped in (:func:`..jit_setup.release_compiler_pages`, then :func:`..weights.populate`): the peak
    resident memory does not hold both."""
    step = model.step
    prefill = attention.JIT_TOKENS + 1  # the fewest new tokens that take the prefill's tiles
    try:
        with model.workspace.dry_run():
            for path in dict.fromkeys((step, None)):  # the compiled step (when offered), then op by op
                model.step = path
                model.forward(np.zeros((1, 1), np.int64), model.make_cache(1, 1), last_only=True)
            model.forward(np.zeros((1, prefill), np.int64), model.make_cache(1, prefill), last_only=True)
    finally:
        model.step = step
    release_compiler_pages()
    populate(model.matrices)
