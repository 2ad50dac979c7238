"""What every handler shares: the server's state, reading and checking a request, and OpenAI's error shape.

Every error, including unknown routes and bugs, is answered as OpenAI's ``{"error": {...}}`` (:func:`error_response`);
a handler raises :class:`~qwen_serve.protocol.APIError` and :func:`wrap` answers it and counts the request.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qwen_runtime.generation.structured import GrammarCache
from qwen_runtime.text.chat import ChatFormat

from .engine import Engine
from .metrics import Metrics
from .protocol import READ_TIMEOUT, APIError, parse_json

log = logging.getLogger("qwen_serve")

DEFAULT_MAX_TOKENS = 4096  # chat requests without max_tokens: at most this many (and what the context leaves)

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


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def http_error(request: Request, exc: HTTPException) -> Response:
    codes = {404: "not_found", 405: "method_not_allowed"}
    return error_response(APIError(exc.status_code, str(exc.detail), None, codes.get(exc.status_code)))


async def internal_error(request: Request, exc: Exception) -> Response:
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


def wrap(state: ServerState, handler: Handler, has_body: bool = True, auth: bool = True):
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
            response = await internal_error(request, exc)
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

def token_text(state: ServerState, token_id: int) -> tuple[str, list[int]]:
    raw = state.fmt.tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


