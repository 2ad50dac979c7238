"""Turning a choice's generated text into OpenAI's message parts: reasoning, content and tool calls.

**Reasoning.**  Qwen3, Qwen3.5 and DeepSeek-R1-Distill think inside ``<think> ... </think>`` before they
answer.  The part inside is ``reasoning_content``, the rest ``content``.  A model whose prompt already ends
in an open ``<think>`` (R1-Distill's and Qwen3.5's templates write it) starts inside the block; otherwise a
block counts only at the very start of the output.  Text is released as soon as it cannot be part of a
marker, so reasoning streams as it is produced; whitespace around the markers is dropped.

**Tool calls.**  Qwen writes ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5,
Qwen3) or ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``
(Qwen3.5).  When the request offered tools, content from the first ``<tool_call>`` on is held back and parsed
when the choice ends; calls that parse become ``tool_calls`` (finish reason ``tool_calls``), anything that
does not parse is returned as content.  While a call is written, :class:`ToolCallStream` gives its name as
soon as it is known and its arguments one complete argument at a time, as OpenAI's streamed ``tool_calls``
deltas; they add up to the final call's arguments (``json.dumps`` of the parsed object).

**Forced calls.**  ``tool_choice: "required"`` or a named tool writes ``<tool_call>`` after the prompt
(:data:`FORCED_CALL_START`), closing an open ``<think>`` first, and the server constrains what follows to a
call of an offered tool in the template's own form (:mod:`qwen_runtime.generation.structured`), so the answer is a call.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FORCED_CALL_START = f"{TOOL_OPEN}\n"
XML_CALLS = "<function="  # a template that writes this asks for Qwen3.5's form of calls
TOOL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
JSON_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered chat prompt ends inside an unclosed ``<think>`` block."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _xml_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _json_arguments(text: str, i: int) -> tuple[list[tuple[str, Any]], bool] | None:
    """The complete members of the JSON object starting at ``text[i:]`` and whether it is closed; None if
    the value there is not an object.  A value counts once something follows it (``12`` may go on)."""
    decoder = json.JSONDecoder()

    def skip(j: int) -> int:
        while j < len(text) and text[j] in " \t\n\r":
            j += 1
        return j

    i = skip(i)
    if i >= len(text):
        return [], False
    if text[i] != "{":
        return None
    members: list[tuple[str, Any]] = []
    i += 1
    while True:
        i = skip(i)
        if i >= len(text):
            return members, False
        if text[i] == "}":
            return members, True
        if members:
            if text[i] != ",":
                return None
            i = skip(i + 1)
        try:
            key, i = decoder.raw_decode(text, i)
            i = skip(i)
            if i >= len(text):
                return members, False
            if text[i] != ":" or not isinstance(key, str):
                return None
            value, end = decoder.raw_decode(text, skip(i + 1))
        except ValueError:
            return members, False
        if skip(end) >= len(text):
            return members, False
        members.append((key, value))
        i = end


def call_progress(block: str) -> tuple[str, list[tuple[str, Any]], bool] | None:
    """What a ``<tool_call>`` block being written shows so far: the name, the complete arguments and whether
    they are closed (None until the name is known, or for arguments that cannot be streamed)."""
    head = JSON_CALL_HEAD.match(block)
    if head is not None:
        found = _json_arguments(block, head.end())
        return None if found is None else (json.loads(head.group(1)), *found)
    function = XML_FUNCTION.search(block)
    if function is None or block[:function.start()].strip() != "":
        return None
    body = function.group(2)
    members = [(name.strip(), _xml_value(raw)) for name, raw in XML_PARAMETER.findall(body)]
    return function.group(1).strip(), members, "</function>" in block[function.start():]


def arguments_text(members: list[tuple[str, Any]], closed: bool) -> str:
    """``json.dumps`` of the arguments object, as far as ``members`` go."""
    text = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                           for k, v in members)
    return text + "}" if closed else text


class ToolCallStream:
    """The streamed ``tool_calls`` deltas of one choice: :meth:`update` with the tool text so far."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []  # per call started: its id and the arguments sent

    def update(self, tool_text: str) -> list[dict[str, Any]]:
        deltas = []
        for k, match in enumerate(TOOL_BLOCK.finditer(tool_text)):
            progress = call_progress(match.group(1))
            if progress is None:
                break
            name, members, closed = progress
            text = arguments_text(members, closed)
            if k == len(self.sent):
                self.sent.append((f"call_{secrets.token_hex(12)}", text))
                deltas.append({"index": k, "id": self.sent[k][0], "type": "function",
                               "function": {"name": name, "arguments": text}})
            elif text.startswith(self.sent[k][1]) and len(text) > len(self.sent[k][1]):
                deltas.append({"index": k, "function": {"arguments": text[len(self.sent[k][1]):]}})
                self.sent[k] = (self.sent[k][0], text)
        return deltas

    def finish(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """What the final calls add to what was streamed (whole calls for those never started)."""
        deltas = []
        for k, call in enumerate(calls):
            if k >= len(self.sent):
                deltas.append(call.as_dict(k))
            elif call.arguments.startswith(self.sent[k][1]) and len(call.arguments) > len(self.sent[k][1]):
                deltas.append({"index": k, "function": {"arguments": call.arguments[len(self.sent[k][1]):]}})
        return deltas


def parse_tool_call(block: str) -> ToolCall | None:
    """One ``<tool_call>`` block's inside as a call (JSON or Qwen3.5's XML form), or None."""
    block = block.strip()
    call_id = f"call_{secrets.token_hex(12)}"
    try:
        value = json.loads(block)
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        arguments = value.get("arguments", value.get("parameters", {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(call_id, value["name"], text)
    match = XML_FUNCTION.search(block)
    if match is None:
        return None
    arguments = {name.strip(): _xml_value(raw) for name, raw in XML_PARAMETER.findall(match.group(2))}
    return ToolCall(call_id, match.group(1).strip(), json.dumps(arguments, ensure_ascii=False))


class MessageParser:
    """Splits one choice's streamed text into reasoning, content and tool calls.

    ``push(text)`` returns ``(reasoning, content)`` deltas ready to send; ``finish()`` returns the last deltas
    and the tool calls found.
    """

    def __init__(self, reasoning: bool, in_think: bool, tools: bool) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.state = "think" if (reasoning and in_think) else ("start" if reasoning else "content")
        self.buffer = ""  # text not yet classified (a marker may be starting)
        self.held_ws = ""  # whitespace at the end of the reasoning, sent only if more reasoning follows
        self.reasoning_started = False
        self.content_started = False
        self.tool_text: str | None = None  # content from the first <tool_call> on

    def push(self, text: str) -> tuple[str, str]:
        self.buffer += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self._drain(final=True)
        calls: list[ToolCall] = []
        if self.tool_text is not None:
            rest = self.tool_text
            for match in TOOL_BLOCK.finditer(self.tool_text):
                call = parse_tool_call(match.group(1))
                if call is None:
                    calls = []
                    break
                calls.append(call)
            if calls:
                rest = TOOL_BLOCK.sub("", self.tool_text).strip()
            content += self._content(rest) if rest else ""
        return reasoning, content, calls

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        while self.buffer:
            if self.state == "start":  # only whitespace so far: a <think> may still open
                stripped = self.buffer.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.buffer, self.state = stripped[len(THINK_OPEN):], "think"
                elif THINK_OPEN.startswith(stripped) and not final:
                    break
                else:
                    self.state = "content"
            elif self.state == "think":
                end = self.buffer.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += self._reasoning(self.buffer[:end], closing=True)
                    self.buffer, self.state = self.buffer[end + len(THINK_CLOSE):], "content"
                    continue
                keep = 0 if final else _partial_suffix(self.buffer, THINK_CLOSE)
                cut = len(self.buffer) - keep
                reasoning += self._reasoning(self.buffer[:cut], closing=final)
                self.buffer = self.buffer[cut:]
                break
            else:
                content += self._take_content(final)
                break
        return reasoning, content

    def _reasoning(self, text: str, closing: bool) -> str:
        """Reasoning text with its leading and (once the block ends) trailing whitespace dropped."""
        text = self.held_ws + text
        self.held_ws = ""
        if not self.reasoning_started:
            text = text.lstrip()
            self.reasoning_started = bool(text)
        if closing:
            return text.rstrip()
        body = text.rstrip()
        self.held_ws = text[len(body):]
        return body

    def _take_content(self, final: bool) -> str:
        text, self.buffer = self.buffer, ""
        if self.tool_text is not None:
            self.tool_text += text
            return ""
        if self.tools:
            start = text.find(TOOL_OPEN)
            if start >= 0:
                self.tool_text = text[start:]
                return self._content(text[:start])
            keep = 0 if final else _partial_suffix(text, TOOL_OPEN)
            text, self.buffer = text[:len(text) - keep], text[len(text) - keep:]
        return self._content(text)

    def _content(self, text: str) -> str:
        if not self.content_started:
            text = text.lstrip() if self.state == "content" and self.reasoning_started else text
            self.content_started = bool(text)
        return text
