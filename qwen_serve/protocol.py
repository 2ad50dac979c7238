"""OpenAI's request fields, checked: every field this server reads has a type and a range; others are ignored.

A bad request is an :class:`APIError`, which the HTTP layer turns into OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` with its status.  JSON booleans are never accepted as
numbers (``"n": true`` is wrong) and integers are accepted where a number is expected.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qwen_runtime.generation.sampling import SamplingParams

INVALID = "invalid_request_error"
MAX_STOP_STRINGS = 16
MAX_N = 128
MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused with 413 (qwen-serve --max-body)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a lone surrogate gets into valid JSON
READ_TIMEOUT = 30.0  # seconds for a request's headers, and then for its body (qwen-serve --read-timeout)
# Request bodies nested deeper are refused: deep enough that a response_format schema reaches its own, more
# precise check (qwen_runtime.generation.structured.MAX_SCHEMA_DEPTH names what it allows), shallow enough that nothing
# recursing over a body (the parser, the template's tojson) meets the interpreter's recursion limit of 1000.
MAX_JSON_DEPTH = 640
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
RESERVED_TEMPLATE_KEYS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class APIError(Exception):
    """A request the server refuses, in OpenAI's terms."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = INVALID, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param, code)


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object (strict: UTF-8, no NaN/Infinity, no lone surrogates, at most
    :data:`MAX_JSON_DEPTH` levels deep): every way a body can be malformed is a 400, never an error later on
    (a lone surrogate breaks encoding a prompt; deep nesting breaks the recursive code that reads it)."""

    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    try:
        value = json.loads(body.decode("utf-8"), parse_constant=no_constants)
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", None,
                       "invalid_json") from None
    if not isinstance(value, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
    check_json_value(value, body)
    return value


def check_json_value(value: Any, raw: bytes) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` and strings with lone surrogates (``"\\ud800"`` is
    valid JSON but no UTF-8 text), walking the value without recursion; a body with few brackets and no
    surrogate escape (``raw`` says) needs no walk, so a long list of token ids costs nothing here."""
    surrogates = SURROGATE_ESCAPE.search(raw) is not None
    if not surrogates and raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", None,
                           "invalid_json")
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in children:
            if surrogates:
                for text in (key, child):
                    if isinstance(text, str) and not text.isascii():
                        try:
                            text.encode("utf-8")
                        except UnicodeEncodeError as exc:
                            raise APIError(400, "the request body is not valid JSON: a string has a lone "
                                           f"surrogate (\\u{ord(text[exc.start]):04x})", None,
                                           "invalid_json") from None
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))


# --- typed getters ---------------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _typed(body: dict, name: str, accepts: Callable[[object], bool], expected: str) -> object | None:
    """``body[name]``, or None when absent or null; a value of another type is a 400 naming the field."""
    v = body.get(name)
    if v is not None and not accepts(v):
        raise bad(name, f"expected {expected}, got {json.dumps(v)[:40]}", "invalid_type")
    return v


def get_int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = _typed(body, name, _is_int, "an integer")
    if v is None:
        return default
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(name, f"{v} is out of range [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]")
    return v


def get_number(body: dict, name: str, default: float | None, check: Callable[[float], bool] = lambda v: True,
               expected: str = "") -> float | None:
    v = _typed(body, name, _is_number, "a number")
    if v is None:
        return default
    if not check(float(v)):
        raise bad(name, f"{v} is out of range: must be {expected}")
    return float(v)


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = _typed(body, name, lambda v: isinstance(v, bool), "true or false")
    return default if v is None else v


def get_str(body: dict, name: str, default: str | None = None) -> str | None:
    v = _typed(body, name, lambda v: isinstance(v, str), "a string")
    return default if v is None else v


def get_object(body: dict, name: str) -> dict | None:
    return _typed(body, name, lambda v: isinstance(v, dict), "an object")


# --- the shared generation fields -------------------------------------------------------------------------


@dataclass
class GenerationFields:
    """What both completion endpoints share."""

    model: str | None
    max_tokens: int | None
    sampling: SamplingParams
    n: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def sampling_fields(body: dict, defaults: dict[str, float]) -> SamplingParams:
    """Sampling parameters from the request, the model's generation defaults filling what it leaves out."""
    temperature = get_number(body, "temperature", defaults.get("temperature", 1.0), lambda v: 0 <= v <= 2, "in [0, 2]")
    top_p = get_number(body, "top_p", defaults.get("top_p", 1.0), lambda v: 0 < v <= 1, "in (0, 1]")
    top_k = get_int(body, "top_k", int(defaults.get("top_k", 0)), -1)
    min_p = get_number(body, "min_p", defaults.get("min_p", 0.0), lambda v: 0 <= v <= 1, "in [0, 1]")
    repetition = get_number(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0),
                            lambda v: 0 < v <= 10, "in (0, 10]")
    presence = get_number(body, "presence_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]")
    frequency = get_number(body, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]")
    return SamplingParams(temperature, max(top_k, 0), top_p, min_p, repetition, presence, frequency)


def generation_fields(body: dict, defaults: dict[str, float], max_n: int, max_tokens_names: tuple[str, ...]
                      ) -> GenerationFields:
    model = get_str(body, "model")
    max_tokens = None
    for name in max_tokens_names:
        max_tokens = get_int(body, name, max_tokens, 1)
    n = get_int(body, "n", 1, 1, max_n)
    seed = get_int(body, "seed", None, -(2**63), 2**64 - 1)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        stops = tuple(stop)
    else:
        raise bad("stop", "expected a string or a list of strings", "invalid_type")
    stream = get_bool(body, "stream", False)
    options = get_object(body, "stream_options")
    include_usage = get_bool(options, "include_usage", False) if options else False
    if options is not None and not stream:
        raise bad("stream_options", "only allowed when stream is true")
    return GenerationFields(model, max_tokens, sampling_fields(body, defaults), n, seed, stops, stream,
                            include_usage)


# --- chat ---------------------------------------------------------------------------------------------------


@dataclass
class ChatRequest:
    fields: GenerationFields
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # as the template takes them (None: no tools offered)
    logprobs: int | None  # None: off; else the number of alternatives per token
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    forced_tool: str | None = None  # tool_choice "required" (""), or the named tool's name: a call is forced
    json_output: bool = False  # response_format json_object or json_schema: the answer is constrained JSON
    json_schema: dict[str, Any] | None = None  # json_schema's schema (None with json_object: any object)


def _content_text(value: Any, param: str) -> str | None:
    """A message's content: a string, null, or a list of text parts (joined)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{param}[{i}]", "only text content parts ({\"type\": \"text\", \"text\": ...}) are "
                          "supported")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(param, "expected a string, null or a list of content parts", "invalid_type")


def _tool_call_for_template(call: Any, param: str) -> dict[str, Any]:
    """An assistant message's tool call, with JSON-string arguments parsed (templates expect a mapping)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict) or \
            not isinstance(call["function"].get("name"), str):
        raise bad(param, "expected {\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": ...}}",
                  "invalid_type")
    arguments = call["function"].get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # if it is not JSON, the template shows the string as it is
            arguments = json.loads(arguments) if arguments.strip() else {}
    return {**call, "function": {**call["function"], "arguments": arguments}}


def chat_messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty list of messages", "invalid_type" if messages else "missing")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(param, "expected an object", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{param}.role", f"expected one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)[:40]}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content_text(m.get("content"), f"{param}.content")}
        if role == "assistant" and m.get("tool_calls") is not None:
            if not isinstance(m["tool_calls"], list):
                raise bad(f"{param}.tool_calls", "expected a list", "invalid_type")
            msg["tool_calls"] = [_tool_call_for_template(c, f"{param}.tool_calls[{j}]")
                                 for j, c in enumerate(m["tool_calls"])]
            msg["content"] = msg["content"] or ""  # templates test the content as text
        elif msg["content"] is None:
            raise bad(f"{param}.content", "required for this role", "missing")
        if m.get("reasoning_content") is not None:
            msg["reasoning_content"] = _content_text(m["reasoning_content"], f"{param}.reasoning_content")
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad(f"{param}.{key}", "expected a string", "invalid_type")
                msg[key] = m[key]
        out.append(msg)
    return out


def chat_tools(body: dict) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", "expected a list of tools", "invalid_type")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise bad(f"tools[{i}]", "expected {\"type\": \"function\", \"function\": {\"name\": ...}}",
                      "invalid_type")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"tools[{i}].function.parameters", "expected a JSON schema object", "invalid_type")
    choice = body.get("tool_choice", "auto")
    if choice in (None, "auto", "required"):
        return tools or None
    if choice == "none":
        return None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict) and \
            isinstance(choice["function"].get("name"), str):
        named = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
        if not named:
            raise bad("tool_choice", f"no tool named {choice['function']['name']!r} in tools")
        return named
    raise bad("tool_choice", "expected \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
              "\"function\": {\"name\": ...}}", "invalid_type")


def forced_tool(body: dict, tools: list[dict[str, Any]] | None) -> str | None:
    """What ``tool_choice`` forces: None (nothing), "" (a call of any tool: "required") or a tool's name."""
    choice = body.get("tool_choice")
    if tools is None or choice in (None, "auto", "none"):
        return None
    return "" if choice == "required" else tools[0]["function"]["name"]  # chat_tools kept only the named one


def response_format(body: dict) -> tuple[bool, dict[str, Any] | None]:
    """Whether the answer must be JSON, and the schema it must follow (None: any JSON object)."""
    fmt = get_object(body, "response_format")
    kind = fmt.get("type") if fmt is not None else "text"
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad("response_format.json_schema", "expected {\"name\": ..., \"schema\": {...}}", "invalid_type")
        return True, spec["schema"]
    raise bad("response_format.type", "expected \"text\", \"json_object\" or \"json_schema\"")


def template_kwargs(body: dict) -> dict[str, Any]:
    kwargs = get_object(body, "chat_template_kwargs") or {}
    reserved = sorted(RESERVED_TEMPLATE_KEYS & kwargs.keys())
    if reserved:
        raise bad("chat_template_kwargs", f"{', '.join(reserved)} cannot be set here")
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise bad("chat_template_kwargs.enable_thinking", "expected true or false", "invalid_type")
    return dict(kwargs)


def chat_request(body: dict, defaults: dict[str, float], max_n: int) -> ChatRequest:
    fields = generation_fields(body, defaults, max_n, ("max_tokens", "max_completion_tokens"))
    want = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, 0, 20)
    if top is not None and not want:
        raise bad("top_logprobs", "requires logprobs to be true")
    tools = chat_tools(body)
    return ChatRequest(fields, chat_messages(body), tools, (top or 0) if want else None, template_kwargs(body),
                       forced_tool(body, tools), *response_format(body))


# --- completions --------------------------------------------------------------------------------------------


@dataclass
class CompletionRequest:
    fields: GenerationFields
    prompts: list[str | list[int]]  # each runs with n choices; choice i of prompt p is number p * n + i
    logprobs: int | None


MAX_PROMPTS = 64


def _one_prompt(prompt: Any, param: str, vocab_size: int) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise bad(param, f"token ids must be in [0, {vocab_size})")
        return prompt
    raise bad(param, "expected a string or a non-empty list of token ids", "invalid_type")


def completion_request(body: dict, defaults: dict[str, float], max_n: int, vocab_size: int) -> CompletionRequest:
    fields = generation_fields(body, defaults, max_n, ("max_tokens",))
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "required", "missing")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        prompts = [_one_prompt(p, f"prompt[{i}]", vocab_size) for i, p in enumerate(prompt)]
    else:
        prompts = [_one_prompt(prompt, "prompt", vocab_size)]
    if get_bool(body, "echo", False):
        raise bad("echo", "echoing the prompt is not supported")
    if body.get("suffix") is not None:
        raise bad("suffix", "insertion with a suffix is not supported")
    return CompletionRequest(fields, prompts, get_int(body, "logprobs", None, 0, 5))
