"""The HTTP face of the engine: OpenAI's chat and text completion endpoints as a Starlette (ASGI) app.

    app = create_app("qwen2.5-0.5b-q8_0.gguf", max_batch=8)     # any ASGI server runs it (uvicorn, Ray Serve)

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``,
``POST /tokenize``, ``POST /detokenize``.  Requests are checked (:mod:`.protocol`), rendered with the model's
own chat template, handed to the :class:`~qwen_serve.engine.Engine` (which runs on a thread of its own) and
answered as one JSON object or as server-sent events in OpenAI's chunk format.  Every error, including
unknown routes and bugs, is OpenAI's ``{"error": {...}}`` shape; none stops the engine.

This module makes the app (the engine, the routes, the banner); each endpoint lives in a module of its own:
:mod:`.chat`, :mod:`.completions` and :mod:`.info` (models, health, metrics, tokenize), on :mod:`.channel` (a
request's jobs and their events) and :mod:`.handling` (state, request checks, errors).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route

import qwen_runtime
from qwen_runtime.backend.cache import DEFAULT_CACHE_TYPE
from qwen_runtime.backend.limits import default_memory_limit, format_bytes
from qwen_runtime.cli_support import cache_note
from qwen_runtime.errors import ResourceLimitError
from qwen_runtime.formats import hub
from qwen_runtime.formats.rope import RopeScaling
from qwen_runtime.generation.structured import GrammarCache
from qwen_runtime.models import Model
from qwen_runtime.text.chat import chat_format
from qwen_runtime.text.tokenizer import Tokenizer

from .chat import chat_completions
from .completions import completions
from .engine import Engine
from .handling import ServerState, http_error, internal_error, wrap
from .info import detokenize, health, list_models, metrics_text, tokenize
from .metrics import Metrics
from .outputs import THINK_CLOSE, THINK_OPEN, TOOL_CLOSE, TOOL_OPEN
from .protocol import MAX_BODY_BYTES, READ_TIMEOUT

NFC_CHARS_PER_BYTE = 2
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model: Model) -> dict[str, float]:
    """Sampling defaults from the model's ``generation_config.json`` (what its authors recommend)."""
    config = model.files.read_json("generation_config.json") or {}
    return {k: float(v) for k, v in config.items()
            if k in SAMPLING_DEFAULT_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)}


def max_prompt_chars(context: int, tokenizer: Tokenizer) -> int:
    """Characters a prompt of ``context`` tokens can have at most: no token covers more than the
    vocabulary's longest token, and NFC composition (a letter and its marks become one character) at most
    doubles the characters per UTF-8 byte.  Longer texts are refused before any tokenizing."""
    return context * NFC_CHARS_PER_BYTE * tokenizer.longest_token_bytes


def create_app(model: str | Path | Model, *, model_name: str | None = None, max_batch: int = 8,
               max_queue: int = 64, max_memory: int | None = None, api_key: str | None = None,
               prefill_chunk: int = 128, prefill_budget: int | None = None, max_context: int | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, cache_memory: int | None = None, threads: int | None = None,
               kernels: str | None = None, draft_tokens: int = 0, cache_dir: str | Path | None = None,
               activations: str = "float", cache_turns: bool = False,
               read_timeout: float = READ_TIMEOUT, cache_type_k: str = DEFAULT_CACHE_TYPE,
               cache_type_v: str = DEFAULT_CACHE_TYPE, rope_scaling: RopeScaling | None = None) -> Starlette:
    """An ASGI app serving ``model`` (a path or a loaded :class:`Model`); its engine starts with the app.

    ``model_name`` is the name clients pass as ``model`` (default: the file or directory name); a request body
    that takes more than ``read_timeout`` seconds to arrive is refused with 408; ``threads``,
    ``kernels``, ``activations``, the cache types and ``rope_scaling`` are :func:`qwen_runtime.load`'s (for a path);
    the other options are
    :class:`~qwen_serve.engine.Engine`'s.
    """
    if not isinstance(model, Model):
        model = qwen_runtime.load(model, threads=threads, kernels=kernels, activations=activations,
                                  cache_type_k=cache_type_k, cache_type_v=cache_type_v, rope_scaling=rope_scaling)
    fmt = chat_format(model)
    text_ids = frozenset(i for t in (THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE)
                         if (i := fmt.tokenizer.token_id(t)) is not None)
    metrics = Metrics()
    grammars = GrammarCache(fmt.tokenizer, model.config.vocab_size)
    engine = Engine(model, fmt.tokenizer, fmt.stop_ids, max_batch=max_batch, max_queue=max_queue,
                    max_memory=engine_memory(max_memory, grammars), prefill_chunk=prefill_chunk,
                    prefill_budget=prefill_budget,
                    max_context=max_context, text_ids=text_ids, metrics=metrics, cache_memory=cache_memory,
                    draft_tokens=draft_tokens, cache_dir=cache_dir, cache_turns=cache_turns)
    engine_gauges(metrics, engine)
    name = model_name or hub.model_name(model.path)
    state = ServerState(engine, fmt, name, generation_defaults(model), api_key, max_body_bytes, int(time.time()),
                        max_prompt_chars(engine.context, fmt.tokenizer), metrics,
                        grammars, read_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    routes = [
        Route("/v1/chat/completions", wrap(state, chat_completions), methods=["POST"]),
        Route("/v1/completions", wrap(state, completions), methods=["POST"]),
        Route("/v1/models", wrap(state, list_models, has_body=False), methods=["GET"]),
        Route("/health", wrap(state, health, has_body=False, auth=False), methods=["GET"]),
        Route("/metrics", wrap(state, metrics_text, has_body=False), methods=["GET"]),
        Route("/tokenize", wrap(state, tokenize), methods=["POST"]),
        Route("/detokenize", wrap(state, detokenize), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: internal_error})
    app.state.server = state
    return app


def engine_memory(max_memory: int | None, grammars: GrammarCache) -> int:
    """The engine's share of ``--max-memory`` (default :func:`~qwen_runtime.backend.limits.default_memory_limit`):
    what structured output may hold (:meth:`~qwen_runtime.generation.structured.GrammarCache.reserve`) is set aside
    first,
    so compiled schemas and their token masks can never push the server past the limit."""
    limit = default_memory_limit() if max_memory is None else max_memory
    if limit <= grammars.reserve():
        raise ResourceLimitError(f"--max-memory {format_bytes(limit)} leaves nothing for the cache once structured "
                                 f"output's {format_bytes(grammars.reserve())} is set aside")
    return limit - grammars.reserve()


def weight_types(model: Model) -> str:
    """The stored types of the model's tensors, most weights first: ``"Q8_0 96%, F32 4%"``."""
    counts: collections.Counter[str] = collections.Counter()
    for tensor in model.files.tensors.values():
        counts[tensor.qtype.name] += tensor.n_elements
    total = sum(counts.values()) or 1
    return ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in counts.most_common())


def disk_note(engine: Engine) -> str:
    """The banner's words on the prefix cache's directory (empty without one)."""
    disk = engine.prefix.disk.status() if engine.prefix and engine.prefix.disk else None
    if disk is None:
        return ""
    return (f"\n  prefix cache on disk in {disk['directory']}: {disk['loaded']} blocks restored"
            + (f", {disk['skipped']} unusable files skipped" if disk["skipped"] else ""))


def context_note(engine: Engine) -> str:
    """Why a request's context is below the model's window: the memory budget (no --ctx asked for more)."""
    window = engine.model.config.context_window
    return f" (the memory budget's; the model's is {window})" if engine.context < window else ""


def startup_banner(app: Starlette, url: str) -> str:
    """What a server runs, with which limits, and where: printed once it listens."""
    state: ServerState = app.state.server
    engine, ws = state.engine, state.engine.model.workspace
    model = engine.model
    products = "BLAS products" if ws.blas_products else "tile kernels on the thread pool"
    return "\n".join([
        f"qwen-serve: {state.model_name}: {model.config.arch} ({model.files.format}, {weight_types(model)}) "
        f"from {model.path}",
        f"  context {engine.context} tokens per request{context_note(engine)}, {engine.max_batch} rows, "
        f"{engine.max_queue} queued at most, prefill chunks of {engine.prefill_chunk} tokens, "
        f"{engine.prefill_budget} between two decode steps",
        f"  memory budget {format_bytes(engine.memory_limit)} for cache and activations "
        f"({format_bytes(engine.activations)} of activations; prefix cache up to "
        f"{format_bytes(engine.prefix.capacity) if engine.prefix else 'off'}"
        f"{', with turns' if engine.prefix and engine.prefix.turns else ''}), and "
        f"{format_bytes(state.grammars.reserve())} for structured output" + disk_note(engine),
        f"  {engine.plan.summary()}",
        f"  kernels: {ws.kernels} ({products}), {ws.threads} threads"
        + ("" if ws.activations == "float" else f", activations {ws.activations}"),
        f"  {cache_note(model)}",
        *([f"  speculative decoding: up to {engine.draft_tokens} prompt-lookup drafts per step for greedy requests"
           if engine.draft_tokens else "  speculative decoding: off (on the compiled kernels only)"]
          if engine.draft_asked else []),
        f"  listening on {url}" + ("; API key required on /v1, /tokenize, /metrics and for /health's details"
                                   if state.api_key else ""),
    ])


def engine_gauges(metrics: Metrics, engine: Engine) -> None:
    """The engine's state as gauges read at each scrape."""
    metrics.gauge("waiting_requests", "requests queued for rows or memory", lambda: engine.status()["waiting"])
    metrics.gauge("running_rows", "rows (choices) decoding now", lambda: engine.status()["running_rows"])
    metrics.gauge("prefilling", "1 while a prompt is being prefilled", lambda: engine.status()["prefilling"])
    metrics.gauge("max_batch_rows", "rows the engine decodes together at most", lambda: engine.max_batch)
    metrics.gauge("reserved_bytes", "cache memory reserved by admitted requests",
                  lambda: engine.status()["reserved_bytes"])
    metrics.gauge("memory_limit_bytes", "the memory limit for cache and activations", lambda: engine.memory_limit)
    metrics.gauge("engine_restarts", "times the engine loop died and was restarted", lambda: engine.restarts)
    metrics.gauge("engine_up", "1 while the engine serves, 0 once it gave up", lambda: engine.error is None)
    if engine.prefix is not None:
        prefix = engine.prefix
        metrics.gauge("prefix_cache_lookups", "prompts looked up in the prefix cache", lambda: prefix.lookups)
        metrics.gauge("prefix_cache_hits", "prompts that found a cached prefix", lambda: prefix.hits)
        metrics.gauge("prefix_cache_hit_tokens", "prompt tokens restored instead of prefilled",
                      lambda: prefix.hit_tokens)
        metrics.gauge("prefix_cache_bytes", "memory held by cached blocks and tails", lambda: prefix.nbytes)
        metrics.gauge("prefix_cache_tails", "where requests stopped, kept for their next turn (--cache-turns)",
                      lambda: len(prefix.tails))
    if engine.prefix is not None and engine.prefix.disk is not None:
        disk = engine.prefix.disk
        for name, field, text in (("bytes", "bytes", "bytes of cached blocks on disk (--cache-dir)"),
                                  ("loaded_blocks", "loaded", "blocks restored from disk at start"),
                                  ("skipped_files", "skipped", "unusable block files skipped (and deleted)"),
                                  ("written_blocks", "written", "blocks written to disk")):
            metrics.gauge(f"prefix_cache_disk_{name}", text, lambda field=field: disk.status()[field])


# --- plumbing ---------------------------------------------------------------------------------------------

