"""Splitting generated text into reasoning, content and tool calls, in any chunking."""

from __future__ import annotations

import json

import pytest

outputs = pytest.importorskip("qwen_serve.outputs", reason="qwen_serve needs the serve extra")
MessageParser, parse_tool_call, prompt_opens_thinking = (outputs.MessageParser, outputs.parse_tool_call,
                                                         outputs.prompt_opens_thinking)


def split(text: str, step: int, **options) -> tuple[str, str, list]:
    parser = MessageParser(**options)
    reasoning = content = ""
    for i in range(0, len(text), step):
        r, c = parser.push(text[i:i + step])
        reasoning, content = reasoning + r, content + c
    r, c, calls = parser.finish()
    return reasoning + r, content + c, calls


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_any_chunking_gives_the_same_parts(step: int) -> None:
    text = "<think>\nFirst, think.\n\nThen more.\n</think>\n\nThe answer <thin> is 4.<tool_call>\n" \
           '{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>\n<tool_call>\n' \
           '{"name": "log", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    reasoning, content, calls = split(text, step, reasoning=True, in_think=False, tools=True)
    assert reasoning == "First, think.\n\nThen more."
    assert content == "The answer <thin> is 4."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 2}), ("log", {"x": 1})]
    assert len({c.id for c in calls}) == 2


def test_a_prompt_that_opens_thinking_starts_inside_the_block() -> None:
    prompt = "<|im_start|>assistant\n<think>\n"  # R1-Distill's and Qwen3.5's generation prompts
    assert prompt_opens_thinking(prompt)
    assert not prompt_opens_thinking(prompt + "\n</think>\n\n")
    assert split("Hmm.\n</think>\n\nYes.", 2, reasoning=True, in_think=True, tools=False)[:2] == ("Hmm.", "Yes.")
    # an unfinished block (max_tokens reached) is all reasoning
    assert split("Still thinking", 3, reasoning=True, in_think=True, tools=False)[:2] == ("Still thinking", "")


def test_without_reasoning_or_tools_text_is_content_unchanged() -> None:
    text = "  <think>x</think> <tool_call>{}</tool_call>"
    assert split(text, 4, reasoning=False, in_think=False, tools=False) == ("", text, [])


def test_qwen35_xml_tool_calls_and_broken_calls() -> None:
    call = parse_tool_call("\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                           "<parameter=days>\n3\n</parameter>\n</function>\n")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
    assert parse_tool_call("not a call") is None
    reasoning, content, calls = split("Sure.<tool_call>{broken json</tool_call>", 5, reasoning=False,
                                      in_think=False, tools=True)
    assert calls == [] and content == "Sure.<tool_call>{broken json</tool_call>"


@pytest.mark.parametrize("block", [
    '\n{"name": "add", "arguments": {"a": 12, "b": {"x": [1, "}"]}, "c": "hi \\" there"}}\n',
    '\n<function=add>\n<parameter=a>\n12\n</parameter>\n<parameter=b>\nsome text\n</parameter>\n</function>\n',
])
def test_tool_call_arguments_stream_one_argument_at_a_time(block: str) -> None:
    """Written a character at a time, a call streams its name first, then each argument once it is complete
    (a number only once something follows it); the pieces add up to the parsed call's arguments."""
    text = "<tool_call>" + block + "</tool_call>"
    stream, deltas, seen = outputs.ToolCallStream(), [], ""
    for ch in text:
        seen += ch
        deltas.extend(stream.update(seen))
    call = parse_tool_call(block)
    assert deltas[0]["function"]["name"] == "add" and deltas[0]["id"].startswith("call_")
    pieces = [d["function"]["arguments"] for d in deltas]
    assert "".join(pieces) == call.arguments and len([p for p in pieces if p]) >= 3
    assert not any('"a": 1}' in p or p.endswith('"a": 1') for p in pieces)  # 12 was never cut to 1
    assert stream.finish([call]) == []
