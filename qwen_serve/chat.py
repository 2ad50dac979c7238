"""``POST /v1/chat/completions``: the messages rendered with the model's chat template, the answer parsed into
reasoning, content and tool calls (:mod:`.outputs`), structured output by a :class:`JsonConstraint`."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from qwen_runtime.errors import TemplateError
from qwen_runtime.generation.stepper import Constraint, FinishReason
from qwen_runtime.generation.structured import JsonConstraint, SchemaError, SchemaLimitError

from .channel import JobChannel, collect, sse, submit, usage
from .engine import Delta, Done, Finished
from .handling import ServerState, check_context, check_model, encode_within_context, token_text
from .outputs import (
    FORCED_CALL_START,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CLOSE,
    XML_CALLS,
    MessageParser,
    ToolCall,
    ToolCallStream,
    prompt_opens_thinking,
)
from .protocol import APIError, ChatRequest, chat_request


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

