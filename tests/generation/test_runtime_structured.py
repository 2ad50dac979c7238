"""Constrained JSON: every text a random walk over the allowed tokens of a real Qwen vocabulary can write
within its budget parses and follows the schema; schemas that cannot be enforced are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from shared_data import tokenizer_json

from qwen_runtime.structured import Grammar, JsonConstraint, SchemaError, Vocabulary
from qwen_runtime.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = [
    {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                      "kind": {"enum": ["a", "b", None, 1.5]}},
     "required": ["id", "kind"]},
    {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 2, "items": {"type": "object", "properties": {
            "x": {"type": "number"}, "label": {"type": "string", "minLength": 1, "maxLength": 5}},
            "required": ["x"]}},
        "meta": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/point"}]}},
     "required": ["items", "meta"],
     "$defs": {"point": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}}},
    None,  # json_object: any object
]


@pytest.fixture(scope="module")
def vocab() -> tuple[Tokenizer, Vocabulary]:
    tok = Tokenizer.from_file(tokenizer_json("qwen2_qwen3"))
    return tok, Vocabulary(tok, 151936)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_random_walks_always_end_in_valid_json(vocab, index: int) -> None:
    tok, words = vocab
    schema = SCHEMAS[index]
    grammar = Grammar(schema, words)
    stop = tok.token_id("<|im_end|>")
    rng = np.random.default_rng(index)
    for budget in (grammar.min_tokens, grammar.min_tokens + 3, 40):
        for _ in range(3):
            constraint = JsonConstraint(grammar, frozenset({stop}))
            tokens = []
            for k in range(budget + 1):
                token = int(rng.choice(constraint.allowed(budget - k)))
                constraint.advance(token)
                if token == stop:
                    break
                tokens.append(token)
            assert len(tokens) <= budget
            value = json.loads(tok.decode(tokens, skip_special=False))
            assert isinstance(value, dict)
            if schema is not None:
                jsonschema.validate(value, schema)


def test_thinking_ends_in_time_and_stop_waits_for_the_json(vocab) -> None:
    tok, words = vocab
    grammar = Grammar(SCHEMAS[0], words)
    think = (tok.token_id("<think>"), tok.token_id("</think>"))
    stop = tok.token_id("<|im_end|>")
    constraint = JsonConstraint(grammar, frozenset({stop}), think, in_think=True)
    budget = grammar.min_tokens + 10
    assert stop not in constraint.allowed(budget)  # while thinking, never a stop
    for k in range(9):
        constraint.advance(int(constraint.allowed(budget - k)[5]))
    assert constraint.allowed(budget - 9).tolist() == [think[1]]  # only the JSON's length is left
    constraint.advance(think[1])
    assert stop not in constraint.allowed(budget - 10) and not constraint.thinking


@pytest.mark.parametrize(("schema", "words"), [
    ({"type": "string", "pattern": "a+"}, "pattern"), ({"type": "integer", "minimum": 0}, "minimum"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "b not in properties"),
    ({"$ref": "https://example.com/s.json"}, "local"), ({"type": "thing"}, "unknown type"),
])
def test_unenforceable_schemas_are_refused(vocab, schema: dict, words: str) -> None:
    with pytest.raises(SchemaError, match=words):
        Grammar(schema, vocab[1])


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "minimum": 0},
                                              "note": {"type": "string", "maxLength": 6}}, "required": ["a", "b"]}}},
         {"type": "function", "function": {"name": "now"}}]


@pytest.mark.parametrize("xml", [False, True])
def test_forced_tool_calls_parse_in_either_form(vocab, xml: bool) -> None:
    """A call of one of the tools, Qwen's JSON form or Qwen3.5's <function=...> form, with arguments following
    the tool's schema (keywords the grammar cannot enforce, like minimum, are left out, not refused)."""
    from qwen_serve.outputs import parse_tool_call

    tok, words = vocab
    grammar = Grammar(None, words, TOOLS, xml)
    stop, close = tok.token_id("<|im_end|>"), tok.token_id("</tool_call>")
    rng = np.random.default_rng(int(xml))
    names = set()
    for _ in range(12):
        constraint = JsonConstraint(grammar, frozenset({stop}), end_ids=frozenset({close}))
        tokens = []
        for k in range(61):
            token = int(rng.choice(constraint.allowed(60 - k)))
            constraint.advance(token)
            if token in (stop, close):
                break
            tokens.append(token)
        text = tok.decode(tokens, skip_special=False)
        assert text.lstrip().startswith("<function=" if xml else "{")
        call = parse_tool_call(text)
        names.add(call.name)
        arguments = json.loads(call.arguments)
        if call.name == "add":
            assert isinstance(arguments["a"], int) and isinstance(arguments["b"], int)
            assert set(arguments) <= {"a", "b", "note"}
    assert names <= {"add", "now"} and names
