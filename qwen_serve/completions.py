"""``POST /v1/completions``: text (or token) prompts, one job each, answered as OpenAI's text completions."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .channel import JobChannel, collect, sse, submit, usage
from .engine import Delta, Done, Finished
from .handling import ServerState, check_context, check_model, encode_within_context, token_text
from .protocol import APIError, CompletionRequest, bad, completion_request

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

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

