"""The small endpoints: ``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``POST /tokenize`` and
``POST /detokenize``."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qwen_runtime.errors import TemplateError

from .handling import ServerState, check_model, has_api_key
from .metrics import CONTENT_TYPE
from .protocol import APIError, bad, chat_messages, chat_tools, get_bool, template_kwargs


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

