"""The HTTP face of the engine: OpenAI's chat and text completion endpoints as a Starlette (ASGI) app.

    app = create_app("qwen2.5-0.5b-q8_0.gguf", max_batch=8)     # any ASGI server runs it (uvicorn, Ray Serve)

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``,
``POST /tokenize``, ``POST /detokenize``.  Requests are checked (:mod:`.protocol`), rendered with the model's
own chat template, handed to the :class:`~qwen_serve.engine.Engine` (which runs on a thread of its own) and
answered as one JSON object or as server-sent events in OpenAI's chunk format.  Every error, including
unknown routes and bugs, is OpenAI's ``{"error": {...}}`` shape; none stops the engine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import qwen_runtime
from qwen_runtime.backend.cache import DEFAULT_CACHE_TYPE
from qwen_runtime.backend.limits import default_memory_limit, format_bytes
from qwen_runtime.cli_support import cache_note
from qwen_runtime.errors import ResourceLimitError, TemplateError
from qwen_runtime.formats import hub
from qwen_runtime.formats.rope import RopeScaling
from qwen_runtime.generation.stepper import Constraint, FinishReason
from qwen_runtime.generation.structured import GrammarCache, JsonConstraint, SchemaError, SchemaLimitError
from qwen_runtime.models import Model
from qwen_runtime.text.chat import ChatFormat, chat_format
from qwen_runtime.text.tokenizer import Tokenizer

from .engine import (
    Delta,
    Done,
    Engine,
    EngineStoppedError,
    Event,
    Failed,
    Finished,
    Job,
    QueueFullError,
    RequestTooLargeError,
)
from .metrics import CONTENT_TYPE, Metrics
from .outputs import (
    FORCED_CALL_START,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CLOSE,
    TOOL_OPEN,
    XML_CALLS,
    MessageParser,
    ToolCall,
    ToolCallStream,
    prompt_opens_thinking,
)
from .protocol import (
    MAX_BODY_BYTES,
    READ_TIMEOUT,
    APIError,
    ChatRequest,
    CompletionRequest,
    GenerationFields,
    bad,
    chat_messages,
    chat_request,
    chat_tools,
    completion_request,
    get_bool,
    parse_json,
    template_kwargs,
)

log = logging.getLogger("qwen_serve")

DEFAULT_MAX_TOKENS = 4096  # chat requests without max_tokens: at most this many (and what the context leaves)
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
RETRY_AFTER_SECONDS = 2
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


@dataclass
class ServerState:
    """What every handler needs: the engine, the model's text side and the server's settings."""

    engine: Engine
    fmt: ChatFormat
    model_name: str
    defaults: dict[str, float]
    api_key: str | None
    max_body_bytes: int
    created: int
    max_prompt_chars: int  # longer prompts are refused before tokenizing (max_prompt_chars())
    metrics: Metrics
    grammars: GrammarCache  # response_format's compiled schemas and their token masks
    read_timeout: float = READ_TIMEOUT  # seconds a request body may take to arrive (then 408)

    @property
    def context(self) -> int:
        return self.engine.context


def create_app(model: str | Path | Model, *, model_name: str | None = None, max_batch: int = 8,
               max_queue: int = 64, max_memory: int | None = None, api_key: str | None = None,
               prefill_chunk: int = 128, max_context: int | None = None,
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
        Route("/v1/chat/completions", _handler(state, chat_completions), methods=["POST"]),
        Route("/v1/completions", _handler(state, completions), methods=["POST"]),
        Route("/v1/models", _handler(state, list_models, has_body=False), methods=["GET"]),
        Route("/health", _handler(state, health, has_body=False, auth=False), methods=["GET"]),
        Route("/metrics", _handler(state, metrics_text, has_body=False), methods=["GET"]),
        Route("/tokenize", _handler(state, tokenize), methods=["POST"]),
        Route("/detokenize", _handler(state, detokenize), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
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


def startup_banner(app: Starlette, url: str) -> str:
    """What a server runs, with which limits, and where: printed once it listens."""
    state: ServerState = app.state.server
    engine, ws = state.engine, state.engine.model.workspace
    model = engine.model
    products = "BLAS products" if ws.blas_products else "tile kernels on the thread pool"
    return "\n".join([
        f"qwen-serve: {state.model_name}: {model.config.arch} ({model.files.format}, {weight_types(model)}) "
        f"from {model.path}",
        f"  context {engine.context} tokens per request, {engine.max_batch} rows, {engine.max_queue} queued at most, "
        f"prefill chunks of {engine.prefill_chunk} tokens",
        f"  memory budget {format_bytes(engine.memory_limit)} for cache and activations "
        f"({format_bytes(engine.activations)} of activations; prefix cache up to "
        f"{format_bytes(engine.prefix.capacity) if engine.prefix else 'off'}"
        f"{', with turns' if engine.prefix and engine.prefix.turns else ''}), and "
        f"{format_bytes(state.grammars.reserve())} for structured output" + disk_note(engine),
        f"  {engine.plan.summary()}",
        f"  kernels: {ws.kernels} ({products}), {ws.threads} threads"
        + (", 8-bit activations" if ws.activations == "q8" else ""),
        f"  {cache_note(model)}",
        *([f"  speculative decoding: up to {engine.draft_tokens} prompt-lookup drafts per step for greedy requests"
           if engine.draft_tokens else "  speculative decoding: off (--draft needs the compiled kernels)"]
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


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    codes = {404: "not_found", 405: "method_not_allowed"}
    return error_response(APIError(exc.status_code, str(exc.detail), None, codes.get(exc.status_code)))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error")
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error",
                                   "server_error"))


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (checked while reading, not only the header)
    and with 408, closing the connection, when it takes more than ``timeout`` seconds to arrive: a client
    trickling its body would otherwise hold a connection and a task for as long as it likes."""
    declared = request.headers.get("content-length")
    too_large = APIError(413, f"the request body is larger than {limit} bytes", None, "request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} seconds (--read-timeout)", None,
                       "request_timeout", headers={"Connection": "close"}) from None
    return b"".join(chunks)


def has_api_key(state: ServerState, request: Request) -> bool:
    """Whether the request may see what the key guards (always, without a key)."""
    try:
        check_api_key(state, request)
    except APIError:
        return False
    return True


def check_api_key(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
        message = "missing API key (send Authorization: Bearer KEY)" if not header else "incorrect API key provided"
        raise APIError(401, message, None, "invalid_api_key")


Handler = Callable[[ServerState, Request, dict[str, Any]], Any]


def _handler(state: ServerState, handler: Handler, has_body: bool = True, auth: bool = True):
    async def endpoint(request: Request) -> Response:
        try:
            if auth:
                check_api_key(state, request)
            body = parse_json(await read_body(request, state.max_body_bytes, state.read_timeout)) \
                if has_body else {}
            response = await handler(state, request, body)
        except APIError as err:
            response = error_response(err)
        except Exception as exc:  # answered and logged here, once (Starlette's handler would log it again)
            response = await _internal_error(request, exc)
        state.metrics.requests.inc(1, request.url.path, str(response.status_code))
        return response

    return endpoint


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                       "model", "model_not_found")


def context_exceeded(state: ServerState, prompt: str, max_tokens: int | None, param: str) -> APIError:
    """The prompt alone has more tokens than the context (how many more is not counted: that would cost as
    much as tokenizing a prompt of any size)."""
    asked = f", before the {max_tokens} max_tokens" if max_tokens is not None else ""
    return APIError(400, f"the maximum context length is {state.context} tokens; the prompt alone has more than "
                    f"{state.context} tokens ({len(prompt)} characters){asked}", param, "context_length_exceeded")


def encode_within_context(state: ServerState, text: str, max_tokens: int | None, param: str) -> list[int]:
    """The prompt's ids, refused with ``context_length_exceeded`` without tokenizing more than the context
    can hold: a text longer than :attr:`ServerState.max_prompt_chars` is refused at once, others are encoded
    in pieces that stop once past the context (run it off the event loop: each piece releases the GIL).  A
    prompt that fits the context is counted in full, so that :func:`check_context` names its real length."""
    fits = len(text) <= state.max_prompt_chars
    ids = state.fmt.encode_prompt_within(text, state.context) if fits else None
    if ids is None:
        raise context_exceeded(state, text, max_tokens, param)
    return ids


def check_context(state: ServerState, prompt_tokens: int, max_tokens: int | None, param: str) -> int:
    """``max_tokens`` (defaulted from what the context leaves), or 400 ``context_length_exceeded``."""
    room = state.context - prompt_tokens
    if max_tokens is None and room >= 1:
        return min(room, DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        raise APIError(400, f"the maximum context length is {state.context} tokens; the request has "
                       f"{prompt_tokens} prompt tokens, which leave no room for a completion", param,
                       "context_length_exceeded")
    if prompt_tokens + max_tokens > state.context:
        raise APIError(400, f"the maximum context length is {state.context} tokens; the request has "
                       f"{prompt_tokens} prompt tokens + {max_tokens} max_tokens = {prompt_tokens + max_tokens}",
                       param, "context_length_exceeded")
    return max_tokens


class JobChannel:
    """The events of a request's jobs (one per prompt), moved from the engine thread to the event loop.

    Job ``i``'s choices are numbered after those of the jobs before it; the jobs' :class:`Done` events are
    summed into one, sent after the last.  The time to the first token and to the end, from ``started`` (the
    request's arrival), go to ``metrics``.
    """

    def __init__(self, jobs: int, metrics: Metrics, started: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.jobs: list[Job] = []
        self.pending = jobs
        self.metrics, self.started, self.first_token = metrics, started, True

    def emitter(self, offset: int) -> Callable[[Event], None]:
        def emit(event: Event) -> None:  # engine thread
            if offset and isinstance(event, (Delta, Finished)):
                event = dataclasses.replace(event, choice=event.choice + offset)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
                self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

        return emit

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()

    async def events(self) -> AsyncIterator[Event]:
        """Every event up to the summed :class:`Done`; raises APIError on :class:`Failed`."""
        prompt_tokens = completion_tokens = 0
        while True:
            event = await self.queue.get()
            if isinstance(event, Failed):
                self.cancel()
                raise APIError(500, event.message, None, "internal_error", "server_error")
            if not isinstance(event, Done):
                if self.first_token and isinstance(event, Delta):
                    self.first_token = False
                    self.metrics.ttft.observe(time.monotonic() - self.started)
                yield event
                continue
            prompt_tokens += event.prompt_tokens
            completion_tokens += event.completion_tokens
            self.pending -= 1
            if self.pending == 0:
                self.metrics.latency.observe(time.monotonic() - self.started)
                yield Done(prompt_tokens, completion_tokens)
                return


def submit(state: ServerState, prompts: list[list[int]], fields: GenerationFields, max_tokens: list[int],
           logprobs: int | None, started: float, constraint: Callable[[], Constraint] | None = None) -> JobChannel:
    """One job per prompt, all or none (a refused job cancels those already queued)."""
    channel = JobChannel(len(prompts), state.metrics, started)
    try:
        for i, (ids, limit) in enumerate(zip(prompts, max_tokens, strict=True)):
            job = Job(ids, limit, fields.sampling, channel.emitter(i * fields.n), n=fields.n, seed=fields.seed,
                      stop=fields.stop, logprobs=logprobs, constraint=constraint)
            state.engine.submit(job)
            channel.jobs.append(job)
    except QueueFullError as exc:
        channel.cancel()
        raise APIError(503, f"the server is busy ({exc}); retry later", None, "server_overloaded", "server_error",
                       {"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except EngineStoppedError as exc:
        channel.cancel()
        raise APIError(503, str(exc), None, "engine_stopped", "server_error") from None
    except RequestTooLargeError as exc:
        channel.cancel()
        raise APIError(400, str(exc), "n" if "n=" in str(exc) else "max_tokens", "request_too_large") from None
    return channel


async def until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only a disconnect can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, channel: JobChannel) -> list[Event]:
    """All events of a non-streamed request; cancels its jobs if the client disconnects first."""

    async def gather() -> list[Event]:
        return [event async for event in channel.events()]

    work = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            channel.cancel()
            work.cancel()
    if work.cancelled():
        raise APIError(499, "client disconnected", None, "client_disconnected")
    return work.result()


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def usage(done: Done) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def token_text(state: ServerState, token_id: int) -> tuple[str, list[int]]:
    raw = state.fmt.tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(state: ServerState, delta: Delta) -> list[dict[str, Any]]:
    items = []
    for lp in delta.logprobs:
        text, raw = token_text(state, lp.token_id)
        top = []
        for token_id, value in lp.top:
            t, b = token_text(state, token_id)
            top.append({"token": t, "logprob": value, "bytes": b})
        items.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return items


# --- chat -------------------------------------------------------------------------------------------------


def render_chat(state: ServerState, req: ChatRequest) -> tuple[list[int], str, str]:
    """The prompt's ids and text, and the start of a forced tool call it ends with (""; on a worker thread:
    rendering and tokenizing a large request take a while)."""
    kwargs = dict(req.template_kwargs)
    enable_thinking = kwargs.pop("enable_thinking", None)
    if req.tools is not None:
        kwargs["tools"] = req.tools
    try:
        text = state.fmt.render(req.messages, True, enable_thinking, **kwargs)
    except TemplateError as exc:
        raise APIError(400, f"the chat template failed on these messages: {exc}", "messages",
                       "template_error") from None
    call = ""
    if req.forced_tool is not None:
        text += f"{THINK_CLOSE}\n\n" if prompt_opens_thinking(text) else ""
        call = FORCED_CALL_START
        text += call
    return encode_within_context(state, text, req.fields.max_tokens, "messages"), text, call


def json_constraint(state: ServerState, req: ChatRequest, prompt: str, reasoning: bool,
                    max_tokens: int) -> Callable[[], Constraint]:
    """What makes each choice's :class:`JsonConstraint`: a call of the offered tools when ``tool_choice`` forces
    one (the prompt ends in its start), else ``response_format``'s JSON (on a worker thread: the first schema
    compiles and reads the vocabulary)."""
    forced = req.forced_tool is not None
    template = state.fmt.template.source if state.fmt.template else ""
    try:
        grammar = state.grammars.get(None, req.tools, XML_CALLS in template) if forced else \
            state.grammars.get(req.json_schema)
    except SchemaLimitError as exc:
        where = "tools" if forced else "response_format"
        raise APIError(400, f"{where}: {exc}", where, "schema_too_large") from None
    except SchemaError as exc:
        raise APIError(400, f"response_format: {exc}", "response_format", "unsupported_schema") from None
    what = "tool call" if forced else "JSON this response_format allows"
    if grammar.min_tokens > max_tokens:
        raise APIError(400, f"max_tokens: the shortest {what} takes up to {grammar.min_tokens} tokens, more than "
                       f"max_tokens ({max_tokens})", "max_tokens", "invalid_value")
    tok = state.fmt.tokenizer
    if forced:
        close = tok.token_id(TOOL_CLOSE)
        return lambda: JsonConstraint(grammar, state.fmt.stop_ids, end_ids=frozenset({close} - {None}))
    think = (tok.token_id(THINK_OPEN), tok.token_id(THINK_CLOSE))
    think = think if None not in think else None
    in_think = prompt_opens_thinking(prompt)
    may_think = reasoning and not in_think and not prompt.rstrip().endswith(THINK_CLOSE)
    return lambda: JsonConstraint(grammar, state.fmt.stop_ids, think, in_think, may_think)


class ChatChoice:
    """One choice's message as it is produced."""

    def __init__(self, prompt: str, tools: bool, reasoning: bool) -> None:
        self.parser = MessageParser(reasoning, prompt_opens_thinking(prompt), tools)
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.tool_calls: list[ToolCall] = []
        self.finish: str | None = None
        self.calls = ToolCallStream()

    def call_deltas(self) -> list[dict[str, Any]]:
        """Streamed ``tool_calls`` deltas of the calls being written (after :meth:`push`)."""
        return self.calls.update(self.parser.tool_text) if self.parser.tool_text else []

    def push(self, text: str) -> tuple[str, str]:
        r, c = self.parser.push(text)
        self.reasoning.append(r)
        self.content.append(c)
        return r, c

    def end(self, reason: str) -> tuple[str, str]:
        r, c, calls = self.parser.finish()
        self.reasoning.append(r)
        self.content.append(c)
        self.tool_calls = calls
        self.finish = FinishReason.TOOL_CALLS if calls and reason == FinishReason.STOP else reason
        return r, c

    def message(self) -> dict[str, Any]:
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": content or (None if self.tool_calls else "")}
        reasoning = "".join(self.reasoning)
        if reasoning:
            msg["reasoning_content"] = reasoning
        if self.tool_calls:
            msg["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        return msg


async def chat_completions(state: ServerState, request: Request, body: dict[str, Any]) -> Response:
    started = time.monotonic()
    req = chat_request(body, state.defaults, state.engine.max_batch)
    check_model(state, req.fields.model)
    prompt_ids, prompt, call = await asyncio.to_thread(render_chat, state, req)
    max_tokens = check_context(state, len(prompt_ids), req.fields.max_tokens, "messages")
    reasoning = THINK_OPEN in prompt or THINK_OPEN in (state.fmt.template.source if state.fmt.template else "")
    constraint = await asyncio.to_thread(json_constraint, state, req, prompt, reasoning, max_tokens) \
        if req.json_output or call else None
    channel = submit(state, [prompt_ids], req.fields, [max_tokens], req.logprobs, started, constraint)
    choices = [ChatChoice(prompt[:len(prompt) - len(call)], req.tools is not None, reasoning)
               for _ in range(req.fields.n)]
    for c in choices:
        c.push(call)  # the forced start of a call is part of the answer (held back until the call parses)
    head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": state.model_name}
    if req.fields.stream:
        return StreamingResponse(stream_chat(state, req, channel, choices, head), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    done = None
    for event in await collect(request, channel):
        if isinstance(event, Delta):
            choices[event.choice].push(event.text)
            if req.logprobs is not None:
                choices[event.choice].logprobs.extend(chat_logprobs(state, event))
        elif isinstance(event, Finished):
            choices[event.choice].end(event.reason)
        elif isinstance(event, Done):
            done = event
    out = [{"index": i, "message": c.message(),
            "logprobs": {"content": c.logprobs} if req.logprobs is not None else None,
            "finish_reason": c.finish} for i, c in enumerate(choices)]
    return JSONResponse({**head, "object": "chat.completion", "choices": out, "usage": usage(done),
                         "system_fingerprint": None})


async def stream_chat(state: ServerState, req: ChatRequest, channel: JobChannel, choices: list[ChatChoice],
                      head: dict[str, Any]) -> AsyncIterator[bytes]:
    usage_field = {"usage": None} if req.fields.include_usage else {}  # null in every chunk but the last

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        return sse({**head, "object": "chat.completion.chunk", "system_fingerprint": None, **usage_field,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

    def parts(reasoning: str, content: str) -> dict[str, Any]:
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return delta

    try:
        for i in range(len(choices)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for event in channel.events():
            if isinstance(event, Delta):
                c = choices[event.choice]
                delta = parts(*c.push(event.text))
                calls = c.call_deltas()
                if calls:
                    delta["tool_calls"] = calls
                logprobs = {"content": chat_logprobs(state, event)} if req.logprobs is not None else None
                if delta or logprobs:
                    yield chunk(event.choice, delta, logprobs=logprobs)
            elif isinstance(event, Finished):
                c = choices[event.choice]
                delta = parts(*c.end(event.reason))
                calls = c.calls.finish(c.tool_calls)
                if calls:
                    delta["tool_calls"] = calls
                yield chunk(event.choice, delta, c.finish)
            elif isinstance(event, Done) and req.fields.include_usage:
                yield sse({**head, "object": "chat.completion.chunk", "system_fingerprint": None, "choices": [],
                           "usage": usage(event)})
        yield sse("[DONE]")
    except APIError as err:
        yield sse(err.body())
        yield sse("[DONE]")
    finally:
        channel.cancel()  # a no-op when it ended; frees its rows when the client went away


# --- completions ------------------------------------------------------------------------------------------


def completion_logprobs(state: ServerState, deltas: list[Delta], offset: int = 0) -> dict[str, Any]:
    """The legacy logprobs object; ``text_offset`` counts from ``offset`` (where a streamed chunk starts)."""
    tokens, values, tops, offsets = [], [], [], []
    for delta in deltas:
        for lp in delta.logprobs:
            text = token_text(state, lp.token_id)[0]
            tokens.append(text)
            values.append(lp.logprob)
            tops.append({token_text(state, t)[0]: v for t, v in lp.top} if lp.top else None)
            offsets.append(offset)
            offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


async def completions(state: ServerState, request: Request, body: dict[str, Any]) -> Response:
    started = time.monotonic()
    req: CompletionRequest = completion_request(body, state.defaults, state.engine.max_batch,
                                                state.engine.model.config.vocab_size)
    check_model(state, req.fields.model)
    asked = req.fields.max_tokens or COMPLETION_MAX_TOKENS
    prompts = [p if isinstance(p, list) else await asyncio.to_thread(encode_within_context, state, p, asked, "prompt")
               for p in req.prompts]
    if not all(prompts):
        raise bad("prompt", "a prompt has no tokens")
    limits = [check_context(state, len(ids), asked, "prompt") for ids in prompts]
    channel = submit(state, prompts, req.fields, limits, req.logprobs, started)
    head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name}
    if req.fields.stream:
        return StreamingResponse(stream_completion(state, req, channel, head), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    count = len(prompts) * req.fields.n
    texts, deltas = [[] for _ in range(count)], [[] for _ in range(count)]
    finish: list[str | None] = [None] * count
    done = None
    for event in await collect(request, channel):
        if isinstance(event, Delta):
            texts[event.choice].append(event.text)
            deltas[event.choice].append(event)
        elif isinstance(event, Finished):
            finish[event.choice] = event.reason
        elif isinstance(event, Done):
            done = event
    out = [{"index": i, "text": "".join(texts[i]),
            "logprobs": completion_logprobs(state, deltas[i]) if req.logprobs is not None else None,
            "finish_reason": finish[i]} for i in range(count)]
    return JSONResponse({**head, "choices": out, "usage": usage(done), "system_fingerprint": None})


async def stream_completion(state: ServerState, req: CompletionRequest, channel: JobChannel,
                            head: dict[str, Any]) -> AsyncIterator[bytes]:
    if req.fields.include_usage:  # OpenAI sends "usage": null in every chunk but the last
        head = {**head, "usage": None}
    offsets: dict[int, int] = {}  # choice -> text_offset of its next token
    try:
        async for event in channel.events():
            if isinstance(event, Delta):
                logprobs = None
                if req.logprobs is not None:
                    start = offsets.get(event.choice, 0)
                    logprobs = completion_logprobs(state, [event], start)
                    offsets[event.choice] = start + sum(len(t) for t in logprobs["tokens"])
                yield sse({**head, "choices": [{"index": event.choice, "text": event.text, "logprobs": logprobs,
                                                "finish_reason": None}]})
            elif isinstance(event, Finished):
                yield sse({**head, "choices": [{"index": event.choice, "text": "", "logprobs": None,
                                                "finish_reason": event.reason}]})
            elif isinstance(event, Done) and req.fields.include_usage:
                yield sse({**head, "choices": [], "usage": usage(event)})
        yield sse("[DONE]")
    except APIError as err:
        yield sse(err.body())
        yield sse("[DONE]")
    finally:
        channel.cancel()


# --- the small endpoints ----------------------------------------------------------------------------------


async def list_models(state: ServerState, request: Request, body: dict[str, Any]) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "qwen-numpy",
         "max_model_len": state.context}]})


async def health(state: ServerState, request: Request, body: dict[str, Any]) -> Response:
    """``{"status": "ok"}`` (200) or ``{"status": "error"}`` (503) for probes; the details (the engine's
    state and last error, the model, the cache) only with the API key when one is set: they tell a stranger
    what runs here and what went wrong."""
    engine = state.engine
    status = 200 if engine.error is None else 503  # the loop died too often in a row; submit() refuses as well
    if not has_api_key(state, request):
        return JSONResponse({"status": "ok" if status == 200 else "error"}, status_code=status)
    if engine.error is not None:
        return JSONResponse({"status": "error", "error": engine.error, **engine.status()}, status_code=503)
    ws = engine.model.workspace
    return JSONResponse({"status": "ok", "model": state.model_name, "kernels": ws.kernels, "threads": ws.threads,
                         **engine.status()})


async def metrics_text(state: ServerState, request: Request, body: dict[str, Any]) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def tokenize(state: ServerState, request: Request, body: dict[str, Any]) -> Response:
    check_model(state, body.get("model") if isinstance(body.get("model"), str) else None)
    ids = await asyncio.to_thread(tokenize_body, state, body)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.context})


def tokenize_body(state: ServerState, body: dict[str, Any]) -> list[int]:
    """/tokenize's ids (on a worker thread; a body has at most as many tokens as bytes)."""
    if "messages" in body:
        kwargs = template_kwargs(body)
        enable_thinking = kwargs.pop("enable_thinking", None)
        tools = chat_tools(body)
        if tools is not None:
            kwargs["tools"] = tools
        try:
            text = state.fmt.render(chat_messages(body), get_bool(body, "add_generation_prompt", True),
                                    enable_thinking, **kwargs)
        except TemplateError as exc:
            raise APIError(400, f"the chat template failed on these messages: {exc}", "messages",
                           "template_error") from None
        return state.fmt.encode_prompt_within(text, len(text.encode()) + 1)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad("prompt", "expected a string (or send messages)", "missing" if prompt is None else "invalid_type")
    limit = len(prompt.encode()) + 1
    return state.fmt.encode_prompt_within(prompt, limit) if get_bool(body, "add_special_tokens", True) \
        else state.fmt.tokenizer.encode_within(prompt, limit)


async def detokenize(state: ServerState, request: Request, body: dict[str, Any]) -> Response:
    check_model(state, body.get("model") if isinstance(body.get("model"), str) else None)
    tokens = body.get("tokens")
    vocab = state.engine.model.config.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("tokens", "expected a list of token ids", "missing" if tokens is None else "invalid_type")
    if not all(0 <= t < vocab for t in tokens):
        raise bad("tokens", f"token ids must be in [0, {vocab})")
    return JSONResponse({"prompt": state.fmt.tokenizer.decode(tokens, skip_special=False)})
