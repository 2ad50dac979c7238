"""qwen_runtime: run Qwen2 / Qwen2.5 / DeepSeek-R1-Distill-Qwen / Qwen3 / Qwen3.5 with numpy alone.

    from qwen_runtime import SamplingParams, generate, load
    model = load("path/to/model")                  # HF dir, npy dir, GGUF file or Hub id; weights memory-mapped
    logits = model.logits(ids)                     # int [B, T] -> float32 [B, T, V] (reference path)
    [result] = generate(model, "Hello", chat=True, max_new_tokens=32,
                        sampling=SamplingParams(temperature=0.7, top_p=0.8), seed=0)
    for texts in stream(model, ["a", "b"]): ...    # per-step new text of every row

``model.forward(ids, cache, valid)`` is the cached path (``cache = model.make_cache(batch, max_len)``);
``chat_format(model)`` holds the tokenizer, chat template and stop ids (loaded on first use).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .backend.cache import DEFAULT_CACHE_TYPE, EXACT_CACHE_TYPE
from .backend.weights import TILE_ELEMENTS
from .formats import open_model_files
from .formats.hub import resolve_model
from .formats.rope import RopeScaling
from .generation.generate import Generation, GenerationConfig, GenerationResult, GenerationStats
from .generation.sampling import SamplingParams
from .models import Model, build_model
from .text.chat import ChatFormat, chat_format

__all__ = ["EXACT_CACHE", "ChatFormat", "Generation", "GenerationConfig", "GenerationResult", "GenerationStats",
           "Model", "SamplingParams", "chat_format", "encode_prompts", "generate", "load", "stream"]

Prompts = str | Sequence[str] | Sequence[Sequence[int]]
GREEDY = SamplingParams()
# load(path, **EXACT_CACHE): a float32 KV cache, float32 arithmetic's numbers (a reference, a measurement of a file)
EXACT_CACHE = {"cache_type_k": EXACT_CACHE_TYPE, "cache_type_v": EXACT_CACHE_TYPE}


def load(path: str | Path, tile_elements: int = TILE_ELEMENTS, *, threads: int | None = None,
         kernels: str | None = None, activations: str = "float", cache_type_k: str = DEFAULT_CACHE_TYPE,
         cache_type_v: str = DEFAULT_CACHE_TYPE, rope_scaling: RopeScaling | None = None) -> Model:
    """Open a model (HF directory, npy directory or GGUF file, or a Hugging Face Hub id
    ``ORG/NAME[:QUANT][@REVISION]``: :func:`qwen_runtime.formats.hub.resolve_model`) for inference.

    Weights are memory-mapped and used in their stored type; ``tile_elements`` sets how many weights of a
    non-F32 matrix (any type of :mod:`qwen_runtime.quants`) a pool task multiplies.  ``threads``: the pool's
    threads (and BLAS's for float32 models; default: the cores).  ``kernels``: ``"auto"`` (compiled kernels when
    numba imports), ``"numba"`` or ``"numpy"`` (the reference path); default: the ``QWEN_KERNELS`` environment
    variable, else ``auto``.  ``model.workspace.kernels`` says which run.  ``activations``: ``"float"`` (exact
    float32 products), ``"q8-prompts"`` (prompts of Q8_0, Q4_K and Q6_K weights with 8-bit activations on AMX tiles
    where the CPU has them: several times faster, not exact; decode steps stay exact), ``"q8"`` (every product of a
    type with an integer-dot kernel, as llama.cpp does) or ``"auto"`` (the command lines' default: with the
    compiled kernels ``q8-prompts``, or ``q8`` on a CPU where only AVX2 multiplies);
    ``model.workspace.activations`` says which (:mod:`qwen_runtime.backend.pool`).
    ``cache_type_k``/``cache_type_v``: what the KV cache stores keys and
    values in (:data:`qwen_runtime.backend.cache.CACHE_TYPES`: ``"f32"``, exact; ``"f16"`` (the default, as
    llama.cpp's) or ``"bf16"``, half the memory; ``"q8_0"`` or ``"q4_0"``, llama.cpp's blocks of 32 values along a
    head; llama.cpp's ``-ctk/-ctv``); ``model.cache_types`` says which.  Every pass through a cache reads the
    stored keys and values, :meth:`Model.logits` too: pass ``"f32"`` for both to get float32 arithmetic's numbers.
    ``rope_scaling`` (:class:`qwen_runtime.formats.rope.RopeScaling`) replaces the file's RoPE scaling for this run, the
    file unchanged (llama.cpp's ``--rope-scaling``); the model then runs up to the scaled window.
    """
    files = open_model_files(resolve_model(path))
    if rope_scaling is not None:
        files.config = files.config.replace(rope_scaling=rope_scaling)
    return build_model(files, tile_elements, threads, kernels, activations, cache_type_k, cache_type_v)


def encode_prompts(model: Model, prompts: Prompts, chat: bool = False, system: str | None = None,
                   enable_thinking: bool | None = None) -> list[list[int]]:
    """Token ids of each prompt: raw text, a user message through the chat template, or ids as given."""
    items = [prompts] if isinstance(prompts, str) else list(prompts)
    if items and not isinstance(items[0], str):
        return [[int(t) for t in p] for p in items]
    fmt = chat_format(model)
    if not chat:
        return [fmt.encode_prompt(p) for p in items]
    head = [{"role": "system", "content": system}] if system is not None else []
    return [fmt.encode_chat([*head, {"role": "user", "content": p}], enable_thinking=enable_thinking)
            for p in items]


def stream(model: Model, prompts: Prompts, *, chat: bool = False, system: str | None = None,
           enable_thinking: bool | None = None, max_new_tokens: int = 256,
           sampling: SamplingParams | Sequence[SamplingParams] = GREEDY, seed: int | None = None,
           prefill_chunk: int = 256, use_tokenizer: bool | None = None,
           max_memory: int | None = None, draft_tokens: int = 0) -> Generation:
    """Start generating: iterate the result for each step's new text per row, then read ``.results``.

    With ``use_tokenizer`` (default: when the prompts are text) the model's tokenizer streams text and its
    stop ids end rows; for id prompts without it, rows run to ``max_new_tokens`` and text stays empty.
    ``max_memory`` bounds the bytes of cache and activations (default: 80 % of MemAvailable); a batch or
    context that would exceed it raises :class:`~qwen_runtime.errors.ResourceLimitError` before allocating.
    ``draft_tokens``: speculative decoding by prompt lookup (:class:`GenerationConfig`).
    """
    ids = encode_prompts(model, prompts, chat, system, enable_thinking)
    if use_tokenizer is None:
        use_tokenizer = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(list(prompts)[0], str))
    fmt = chat_format(model) if use_tokenizer else None
    stop_ids = fmt.stop_ids if fmt is not None else frozenset()
    params = sampling if isinstance(sampling, SamplingParams) else tuple(sampling)
    config = GenerationConfig(max_new_tokens, params, stop_ids, seed, prefill_chunk, max_memory, draft_tokens)
    return Generation(model, ids, config, fmt.tokenizer if fmt is not None else None)


def generate(model: Model, prompts: Prompts, **options) -> list[GenerationResult]:
    """Generate to the end (same options as :func:`stream`); one result per prompt."""
    return stream(model, prompts, **options).run()
