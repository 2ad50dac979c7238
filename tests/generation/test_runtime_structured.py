"""Constrained JSON: every text a random walk over the allowed tokens of a real Qwen vocabulary can write
within its budget parses and follows the schema; schemas that cannot be enforced are refused."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from shared_data import tokenizer_json

from qwen_runtime.errors import SchemaLimitError, exit_code
from qwen_runtime.generation.structured import Budget, Grammar, GrammarCache, JsonConstraint, SchemaError, Vocabulary
from qwen_runtime.text.tokenizer import Tokenizer

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


# --- bounded cost (issue 42): hostile schemas are refused before anything is compiled or cached ----------------

def fan_out(levels: int) -> dict:
    """The audit's schema: each $def refers twice to the next, so expanding it doubles per level."""
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(levels)}
    defs[f"d{levels}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


HOSTILE = [
    (fan_out(20), "MAX_REF_EXPANSIONS"),
    ({"type": "string", "maxLength": 100000}, "100000 is above the limit of 4096 .MAX_STRING_LENGTH"),
    ({"type": "string", "maxLength": 1000000000}, "MAX_STRING_LENGTH"),
    ({"type": "string", "minLength": 5000}, "MAX_STRING_LENGTH"),
    ({"type": "array", "maxItems": 100000}, "MAX_ITEMS"),
    (nested(600), "nested deeper than 64 levels .MAX_SCHEMA_DEPTH"),
    ({"enum": list(range(2000))}, "more than 1024 values .MAX_ENUM_VALUES"),
    ({"anyOf": [{"const": i} for i in range(300)]}, "MAX_ALTERNATIVES"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}, "MAX_PROPERTIES"),
    ({"type": "array", "maxItems": 200, "items": {"type": "string", "maxLength": 200}}, "MAX_NFA_STATES"),
    ({"description": "x" * 70000}, "above the limit of 65536 .MAX_SCHEMA_BYTES"),
]


@pytest.fixture(scope="module")
def grammars(vocab) -> GrammarCache:
    cache = GrammarCache(vocab[0], 151936)
    cache.vocabulary()
    return cache


@pytest.mark.parametrize("index", range(len(HOSTILE)))
def test_hostile_schemas_are_refused_quickly_naming_the_limit_and_not_cached(grammars, index: int) -> None:
    schema, words = HOSTILE[index]
    began = time.perf_counter()
    with pytest.raises(SchemaLimitError, match=words) as caught:
        grammars.get(schema)
    assert time.perf_counter() - began < 1.0
    assert "\n" not in str(caught.value) and exit_code(caught.value) == 1
    assert schema not in grammars


def test_realistic_schemas_are_within_the_limits(grammars) -> None:
    """What real tool and response schemas use passes: nested objects, an enum of hundreds of values, long
    strings, a recursive $ref, a hundred properties."""
    tool = {"type": "object", "properties": {
        "location": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 200}, "country": {"enum": [f"C{i:03d}" for i in range(300)]},
            "coordinates": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}},
            "required": ["city"]},
        "unit": {"enum": ["celsius", "fahrenheit"]}, "note": {"type": "string", "maxLength": 4096},
        "tree": {"$ref": "#/$defs/node"}, **{f"flag{i}": {"type": "boolean"} for i in range(100)}},
        "required": ["location"],
        "$defs": {"node": {"type": "object", "properties": {"name": {"type": "string"}, "children": {
            "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["name"]}}}
    grammar = grammars.get(tool)
    assert tool in grammars and grammar.min_tokens > 0


def test_time_budget_names_itself(vocab) -> None:
    with pytest.raises(SchemaLimitError, match="COMPILE_SECONDS"):
        Grammar(SCHEMAS[1], vocab[1], budget=Budget(seconds=0))


def test_a_slow_compilation_does_not_hold_back_another(grammars, monkeypatch) -> None:
    """Compilation runs outside the cache's lock: a benign schema is served while another one is still being
    compiled (held here mid-compilation)."""
    import qwen_runtime.generation.structured as structured

    entered, release = threading.Event(), threading.Event()
    real = structured.Grammar

    def held(schema, *args, **kwargs):
        if schema == {"type": "integer", "title": "held"}:
            entered.set()
            assert release.wait(30)
        return real(schema, *args, **kwargs)

    monkeypatch.setattr(structured, "Grammar", held)
    slow = threading.Thread(target=grammars.get, args=({"type": "integer", "title": "held"},))
    slow.start()
    try:
        assert entered.wait(30)
        began = time.perf_counter()
        grammars.get({"type": "boolean", "title": "benign"})
        assert time.perf_counter() - began < 5 and slow.is_alive()
    finally:
        release.set()
        slow.join()


def test_masks_are_made_lazily_and_kept_within_their_budget(vocab) -> None:
    """Only the start state's mask is made when a schema compiles; the masks of the states a row reaches are
    made as it reaches them and the least recently used dropped past the byte budget, with the output still
    valid (each inside-string mask here is ~1.8 MB)."""
    tok = vocab[0]
    cache = GrammarCache(tok, 151936, mask_bytes=4 << 20)
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 30, "maxLength": 40}},
              "required": ["text"]}
    grammar = cache.get(schema)
    assert len(cache.masks) == 1
    stop = tok.token_id("<|im_end|>")
    rng = np.random.default_rng(0)
    constraint, tokens = JsonConstraint(grammar, frozenset({stop})), []
    for k in range(61):
        token = int(rng.choice(constraint.allowed(60 - k)))
        constraint.advance(token)
        assert cache.masks.bytes <= 4 << 20
        if token == stop:
            break
        tokens.append(token)
    assert 30 <= len(json.loads(tok.decode(tokens, skip_special=False))["text"]) <= 40
    assert 1 < len(cache.masks) < len(grammar._members)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"text": {"type": "string", "maxLength": 4096}}},
    {"type": "array", "maxItems": 200, "items": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    {"enum": [f"value-{i}-abcdef" for i in range(1000)]},
])
def test_an_nfa_state_costs_at_most_its_reserved_bytes(schema) -> None:
    """GrammarCache.reserve counts NFA_STATE_BYTES per state of every automaton it may hold: measured here, with
    no compile-time budget (tracemalloc slows the compiler several times; the budget has its own tests)."""
    import tracemalloc

    from qwen_runtime.generation.structured import NFA_STATE_BYTES, Budget, Nfa, _Compiler

    tracemalloc.start()
    try:
        nfa = Nfa(Budget(seconds=float("inf")))
        _Compiler(nfa, schema).value(schema, nfa.whitespace(nfa.new()), "schema")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert nfa.size > 10_000 and peak <= NFA_STATE_BYTES * nfa.size


def test_the_cache_keeps_its_grammars_within_their_states(vocab, monkeypatch) -> None:
    import qwen_runtime.generation.structured as structured

    cache = GrammarCache(vocab[0], 151936)
    one = cache.get({"type": "string", "maxLength": 100, "title": "probe"}).nfa.size
    monkeypatch.setattr(structured, "GRAMMAR_CACHE_STATES", 3 * one)
    schemas = [{"type": "string", "maxLength": 100, "title": f"s{i}"} for i in range(6)]
    for schema in schemas:
        cache.get(schema)
        assert sum(g.nfa.size for g in cache._grammars.values()) <= 3 * one
    assert schemas[-1] in cache and schemas[0] not in cache


def test_no_more_than_the_compile_slots_compile_at_once(vocab, monkeypatch) -> None:
    """The memory GrammarCache.reserve sets aside for compilations holds: a third compilation waits."""
    import qwen_runtime.generation.structured as structured

    cache = GrammarCache(vocab[0], 151936)
    cache.vocabulary()
    running, peak, lock, release = [0], [0], threading.Lock(), threading.Event()
    real = structured.Grammar

    def counted(*args, **kwargs):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        release.wait(30)
        with lock:
            running[0] -= 1
        return real(*args, **kwargs)

    monkeypatch.setattr(structured, "Grammar", counted)
    threads = [threading.Thread(target=cache.get, args=({"type": "integer", "title": f"t{i}"},)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert peak[0] == structured.COMPILE_SLOTS
    release.set()
    for t in threads:
        t.join()
    assert peak[0] == structured.COMPILE_SLOTS
