"""Structured output: JSON (any object, or one that a JSON schema describes) by constrained sampling.

A schema is compiled into a byte-level automaton (:class:`Grammar`): an NFA built by Thompson's
construction, run as a DFA whose states (sets of NFA states) are made as they are reached.  For each DFA
state the tokens that keep the text inside the language are found once, by walking the sorted vocabulary
with shared prefixes (a dead prefix skips every token that starts with it), and kept with the state each
token leads to: the *token mask* of that state.  A row's :class:`JsonConstraint` then only looks masks up.

**Always finished.**  Every NFA state knows the fewest bytes that reach the end of a valid text; a token
is allowed only if what is left after it fits in the tokens left (each byte has a token of its own in a
byte-level vocabulary), so even random weights write a complete, valid text within ``max_tokens``.

**Thinking.**  When the row starts inside ``<think>`` (or may open it as its first token), the constraint
waits for ``</think>`` (never a stop token meanwhile) and forces it once only the JSON's own length is
left, so the answer after the reasoning is constrained, with thinking on or off.

Supported: ``type`` object (``properties`` in their order, ``required``; without properties any keys,
values of ``additionalProperties`` if it is a schema), array (``items``, ``minItems``, ``maxItems``), string
(``minLength``, ``maxLength``), number, integer, boolean, null, a list of types, ``enum``, ``const``,
``anyOf``/``oneOf``, local ``$ref``.  Keywords that constrain values in other ways (``pattern``,
``minimum``, ``format``, ...) are refused (:class:`SchemaError`) rather than silently not enforced.

**Bounded cost.**  A schema is a program: a few bytes can ask for an automaton of any size (``maxLength``
unrolls one sub-automaton per character, ``$ref`` fan-out doubles it per level).  Before anything is built
or cached, :func:`check_limits` bounds the document (bytes, depth) and a dry run of the compiler that only
counts states bounds the rest (the ``MAX_*`` limits, the NFA states, the time); a schema over any of them is
a :class:`~qwen_runtime.errors.SchemaLimitError` naming the limit.  Token masks are made lazily, one per
reached state, and kept in a bounded LRU (:class:`MaskCache`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import QwenError, SchemaLimitError
from ..text.tokenizer import Tokenizer

WHITESPACE_RUN = 8  # bytes of whitespace allowed between JSON tokens (pretty printing, not endless)
ANY_DEPTH = 3  # nesting of a JSON value whose schema says nothing (json_object: an object of such values)
REF_DEPTH = 4  # expansions of one $ref inside itself (recursive schemas)
IGNORED_KEYWORDS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                              "$defs", "definitions", "strict", "name", "additionalProperties", "deprecated",
                              "readOnly", "writeOnly"})
HANDLED_KEYWORDS = frozenset({"type", "properties", "required", "items", "minItems", "maxItems", "minLength",
                              "maxLength", "enum", "const", "anyOf", "oneOf", "$ref"})

# Limits on what one schema may cost, checked before anything is compiled or cached.  Each is far above what
# real schemas use (OpenAI-style tool and function schemas are a few KB, a handful of levels deep, with enums of
# tens to hundreds of values and lengths/counts in the tens), and low enough that the largest schema within them
# compiles in a fraction of a second into tens of MB at most: the cost of a schema grows with the automaton, and
# these are the keywords that multiply it.
MAX_SCHEMA_BYTES = 64 * 1024  # the schema (or the tools' list) as JSON
MAX_SCHEMA_DEPTH = 64  # nesting of the JSON document, and of the schemas the compiler expands inside each other
MAX_ENUM_VALUES = 1024  # values of one enum
MAX_ALTERNATIVES = 256  # options of one anyOf/oneOf, types of one type list, tools offered
MAX_PROPERTIES = 512  # properties of one object
MAX_STRING_LENGTH = 4096  # minLength/maxLength: the automaton has states for every character up to it
MAX_ITEMS = 256  # minItems/maxItems: the automaton repeats the items' schema that many times
MAX_REF_EXPANSIONS = 1024  # $ref expansions in one schema ($ref fan-out doubles the automaton per level)
MAX_NFA_STATES = 100_000  # states of the whole automaton: what every keyword above multiplies together
COMPILE_SECONDS = 2.0  # wall-clock budget of one compilation (its dry run included)
MASK_CACHE_BYTES = 64 * 1024 * 1024  # token masks kept, all schemas of a GrammarCache together (LRU)
# What a GrammarCache may hold besides its masks, so that a server can count it against --max-memory before it
# starts: the grammars it keeps (their automata's states together) and the compilations running at once (each
# up to MAX_NFA_STATES).  A state's edge lists cost at most NFA_STATE_BYTES (checked by a test with tracemalloc).
NFA_STATE_BYTES = 320
GRAMMAR_CACHE_STATES = 2 * MAX_NFA_STATES
COMPILE_SLOTS = 2


class SchemaError(QwenError, ValueError):
    """A JSON schema this module cannot enforce (the message names the keyword and where it is)."""


def _mask(chars: bytes | range) -> int:
    out = 0
    for b in chars:
        out |= 1 << b
    return out


WS = _mask(b" \t\n\r")
DIGIT, NONZERO = _mask(b"0123456789"), _mask(b"123456789")
HEX = _mask(b"0123456789abcdefABCDEF")
PLAIN = _mask(range(0x20, 0x80)) & ~_mask(b'"\\')  # ASCII a string may hold unescaped
CONT = _mask(range(0x80, 0xC0))
UTF8_2, UTF8_4 = _mask(range(0xC2, 0xE0)), _mask(range(0xF1, 0xF4))  # lead bytes any continuation may follow
UTF8_3 = _mask(range(0xE1, 0xED)) | _mask(range(0xEE, 0xF0))
UTF8_SPECIAL = ((1 << 0xE0, _mask(range(0xA0, 0xC0)), 1), (1 << 0xED, _mask(range(0x80, 0xA0)), 1),
                (1 << 0xF0, _mask(range(0x90, 0xC0)), 2), (1 << 0xF4, _mask(range(0x80, 0x90)), 2))


class Budget:
    """What one compilation may spend: ``states`` NFA states and ``seconds`` of wall-clock time."""

    def __init__(self, states: int = MAX_NFA_STATES, seconds: float = COMPILE_SECONDS) -> None:
        self.states, self.seconds = states, seconds
        self.deadline = time.monotonic() + seconds

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise SchemaLimitError(f"schema: compiling it takes longer than the budget of {self.seconds:g} s "
                                   f"(COMPILE_SECONDS)")


class Nfa:
    """States with byte edges (a 256-bit mask each) and epsilon edges; built by the ``_json`` functions.

    ``store`` False makes a dry run: states are counted against ``budget`` but no edge is kept, so a schema's
    size is known (and refused over budget) before its automaton takes any memory.
    """

    def __init__(self, budget: Budget | None = None, store: bool = True) -> None:
        self.edges: list[list[tuple[int, int]]] = []
        self.eps: list[list[int]] = []
        self.budget, self.store, self.size = budget or Budget(), store, 0

    def new(self) -> int:
        if self.size >= self.budget.states:
            raise SchemaLimitError(f"schema: its automaton needs more than {self.budget.states} states "
                                   f"(MAX_NFA_STATES)")
        if self.size % 1024 == 0:
            self.budget.check_time()
        if self.store:
            self.edges.append([])
            self.eps.append([])
        self.size += 1
        return self.size - 1

    def byte(self, src: int, mask: int) -> int:
        dst = self.new()
        self.edge(src, mask, dst)
        return dst

    def edge(self, src: int, mask: int, dst: int) -> None:
        if self.store:
            self.edges[src].append((mask, dst))

    def literal(self, src: int, text: bytes) -> int:
        for b in text:
            src = self.byte(src, 1 << b)
        return src

    def link(self, src: int, dst: int) -> None:
        if self.store:
            self.eps[src].append(dst)

    def whitespace(self, src: int) -> int:
        """Up to WHITESPACE_RUN whitespace bytes."""
        end = self.new()
        self.link(src, end)
        for _ in range(WHITESPACE_RUN):
            src = self.byte(src, WS)
            self.link(src, end)
        return end


class _Compiler:
    """JSON schema -> NFA fragment: ``value(schema, src)`` adds the states of one value after ``src`` and
    returns where it ends."""

    def __init__(self, nfa: Nfa, root: dict[str, Any], strict: bool = True) -> None:
        self.nfa, self.root, self.strict = nfa, root, strict  # not strict: other keywords are not enforced
        self.ref_depth: dict[str, int] = {}
        self.refs = 0  # $ref expansions so far
        self.nesting = 0  # values being compiled inside each other

    def value(self, schema: Any, src: int, where: str, depth: int = 0) -> int:
        if self.nesting >= MAX_SCHEMA_DEPTH:
            raise SchemaLimitError(f"{where}: schemas nested deeper than {MAX_SCHEMA_DEPTH} levels "
                                   f"(MAX_SCHEMA_DEPTH)")
        self.nesting += 1
        try:
            return self._value(schema, src, where, depth)
        finally:
            self.nesting -= 1

    def _value(self, schema: Any, src: int, where: str, depth: int) -> int:
        if schema is True or schema == {}:
            return self.any_value(src, depth)
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: expected a schema object, got {json.dumps(schema)[:40]}")
        unknown = sorted(set(schema) - HANDLED_KEYWORDS - IGNORED_KEYWORDS)
        if unknown and self.strict:
            raise SchemaError(f"{where}: {', '.join(unknown)} cannot be enforced (supported: "
                              f"{', '.join(sorted(HANDLED_KEYWORDS))})")
        if "$ref" in schema:
            return self.ref(schema["$ref"], src, where, depth)
        if "const" in schema:
            return self.choice([schema["const"]], src)
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise SchemaError(f"{where}.enum: expected a non-empty list")
            _at_most(len(schema["enum"]), MAX_ENUM_VALUES, f"{where}.enum", "values", "MAX_ENUM_VALUES")
            return self.choice(schema["enum"], src)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.any_of(schema, key, src, where, depth)
        kind = schema.get("type")
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if kind is None:
            return self.any_value(src, depth)
        if isinstance(kind, list):
            _at_most(len(kind), MAX_ALTERNATIVES, f"{where}.type", "types", "MAX_ALTERNATIVES")
            return self.alternatives([lambda s, k=k: self.typed(k, schema, s, where, depth) for k in kind], src)
        return self.typed(kind, schema, src, where, depth)

    def any_of(self, schema: dict[str, Any], key: str, src: int, where: str, depth: int) -> int:
        """One of the options, each merged with the rest of ``schema``."""
        options = schema[key]
        if not isinstance(options, list) or not options or not all(isinstance(o, dict) for o in options):
            raise SchemaError(f"{where}.{key}: expected a non-empty list of schemas")
        _at_most(len(options), MAX_ALTERNATIVES, f"{where}.{key}", "options", "MAX_ALTERNATIVES")
        base = {k: v for k, v in schema.items() if k != key}
        return self.alternatives([lambda s, o=o, i=i: self.value({**base, **o}, s, f"{where}.{key}[{i}]", depth)
                                  for i, o in enumerate(options)], src)

    def typed(self, kind: str, schema: dict[str, Any], src: int, where: str, depth: int) -> int:
        nfa = self.nfa
        if kind == "string":
            return self.string(src, _count(schema, "minLength", 0, where, MAX_STRING_LENGTH),
                               _count(schema, "maxLength", None, where, MAX_STRING_LENGTH))
        if kind == "integer":
            return self.integer(src)
        if kind == "number":
            return self.number(src)
        if kind == "boolean":
            return self.alternatives([lambda s: nfa.literal(s, b"true"), lambda s: nfa.literal(s, b"false")], src)
        if kind == "null":
            return nfa.literal(src, b"null")
        if kind == "array":
            return self.array(schema.get("items", True), src, where, depth,
                              _count(schema, "minItems", 0, where, MAX_ITEMS),
                              _count(schema, "maxItems", None, where, MAX_ITEMS))
        if kind == "object":
            if "properties" in schema:
                return self.object(schema, src, where, depth)
            extra = schema.get("additionalProperties", True)
            return self.map(extra if isinstance(extra, dict) else True, src, where, depth)
        raise SchemaError(f"{where}.type: unknown type {kind!r}")

    def alternatives(self, builders: Sequence[Any], src: int) -> int:
        end = self.nfa.new()
        for build in builders:
            start = self.nfa.new()
            self.nfa.link(src, start)
            self.nfa.link(build(start), end)
        return end

    def choice(self, values: list[Any], src: int) -> int:
        texts = sorted({json.dumps(v, ensure_ascii=False, separators=(",", ": ")).encode() for v in values})
        return self.alternatives([lambda s, t=t: self.nfa.literal(s, t) for t in texts], src)

    def string(self, src: int, least: int = 0, most: int | None = None) -> int:
        nfa = self.nfa
        src = nfa.literal(src, b'"')
        for _ in range(least):
            src = self.char(src)
        if most is None:
            loop = nfa.new()
            nfa.link(src, loop)
            nfa.link(self.char(loop), loop)
            return nfa.literal(loop, b'"')
        end = nfa.new()
        nfa.link(src, end)
        for _ in range(most - least):
            src = self.char(src)
            nfa.link(src, end)
        return nfa.literal(end, b'"')

    def char(self, src: int) -> int:
        """One character of a JSON string: plain ASCII, an escape, or a whole UTF-8 sequence."""
        nfa, end = self.nfa, self.nfa.new()
        nfa.link(nfa.byte(src, PLAIN), end)
        escape = nfa.byte(src, 1 << ord("\\"))
        nfa.link(nfa.byte(escape, _mask(b'"\\/bfnrt')), end)
        u = nfa.byte(escape, 1 << ord("u"))
        for _ in range(3):
            u = nfa.byte(u, HEX)
        nfa.link(nfa.byte(u, HEX), end)
        # states "k continuation bytes to go", shared by every lead byte (a few states per character, not 37)
        tails = [end]
        for _ in range(3):
            tails.append(nfa.new())
            nfa.edge(tails[-1], CONT, tails[-2])
        for lead, tail in ((UTF8_2, 1), (UTF8_3, 2), (UTF8_4, 3)):
            nfa.edge(src, lead, tails[tail])
        for lead, second, tail in UTF8_SPECIAL:  # no overlong forms, no surrogates, nothing past U+10FFFF
            nfa.edge(nfa.byte(src, lead), second, tails[tail])
        return end

    def digits(self, src: int) -> int:
        """One or more digits."""
        first = self.nfa.byte(src, DIGIT)
        self.nfa.link(self.nfa.byte(first, DIGIT), first)  # loop back: the end is ``first``
        return first

    def integer(self, src: int) -> int:
        nfa = self.nfa
        sign = nfa.new()
        nfa.link(src, sign)
        nfa.link(nfa.byte(src, 1 << ord("-")), sign)
        end = nfa.new()
        nfa.link(nfa.byte(sign, 1 << ord("0")), end)
        nonzero = nfa.byte(sign, NONZERO)
        nfa.link(nonzero, end)
        loop = nfa.byte(nonzero, DIGIT)
        nfa.link(loop, end)
        nfa.link(loop, nonzero)
        return end

    def number(self, src: int) -> int:
        nfa = self.nfa
        whole = self.integer(src)
        fraction = nfa.new()
        nfa.link(whole, fraction)
        nfa.link(self.digits(nfa.byte(whole, 1 << ord("."))), fraction)
        end = nfa.new()
        nfa.link(fraction, end)
        e = nfa.byte(fraction, _mask(b"eE"))
        sign = nfa.new()
        nfa.link(e, sign)
        nfa.link(nfa.byte(e, _mask(b"+-")), sign)
        nfa.link(self.digits(sign), end)
        return end

    def array(self, items: Any, src: int, where: str, depth: int, least: int, most: int | None) -> int:
        nfa = self.nfa
        src = nfa.whitespace(nfa.literal(src, b"["))
        close = nfa.new()
        if least == 0:
            nfa.link(src, close)

        def item(s: int) -> int:
            return nfa.whitespace(self.value(items, s, f"{where}.items", depth + 1))

        if most is None:  # least - 1 items, then a loop of one or more
            for _ in range(max(least, 1) - 1):
                src = nfa.whitespace(nfa.literal(item(src), b","))
            start = nfa.new()
            nfa.link(src, start)
            after = item(start)
            nfa.link(after, close)
            nfa.link(nfa.whitespace(nfa.literal(after, b",")), start)
            return nfa.literal(close, b"]")
        if least > most:
            raise SchemaError(f"{where}: minItems {least} > maxItems {most}")
        for k in range(most):
            src = item(nfa.whitespace(nfa.literal(src, b",")) if k else src)
            if k + 1 >= least:
                nfa.link(src, close)
        return nfa.literal(close, b"]")

    def object(self, schema: dict[str, Any], src: int, where: str, depth: int) -> int:
        """The declared properties in their order (the required ones always, the others maybe)."""
        nfa = self.nfa
        properties = schema["properties"]
        required = schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise SchemaError(f"{where}: properties must be an object and required a list")
        missing = sorted(set(required) - set(properties))
        if missing:
            raise SchemaError(f"{where}.required: {', '.join(missing)} not in properties")
        _at_most(len(properties), MAX_PROPERTIES, f"{where}.properties", "properties", "MAX_PROPERTIES")
        src = nfa.whitespace(nfa.literal(src, b"{"))
        close = nfa.new()
        after: dict[bool, int] = {True: close, False: close}  # state before property i: some written yet?
        for name, sub in reversed(list(properties.items())):
            key = nfa.new()
            end = self.value(sub, nfa.whitespace(nfa.literal(key, json.dumps(name, ensure_ascii=False).encode()
                                                             + b":")), f"{where}.properties.{name}", depth + 1)
            nfa.link(nfa.whitespace(end), after[True])
            with_comma, first = nfa.new(), nfa.new()
            nfa.link(nfa.whitespace(nfa.literal(with_comma, b",")), key)
            nfa.link(first, key)
            if name not in required:
                nfa.link(with_comma, after[True])
                nfa.link(first, after[False])
            after = {True: with_comma, False: first}
        nfa.link(src, after[False])
        return nfa.literal(close, b"}")

    def map(self, values: Any, src: int, where: str, depth: int) -> int:
        """An object of any keys whose values follow ``values``."""
        nfa = self.nfa
        src = nfa.whitespace(nfa.literal(src, b"{"))
        close = nfa.new()
        nfa.link(src, close)
        if depth < ANY_DEPTH or values is not True:
            start = nfa.new()
            nfa.link(src, start)
            key = nfa.whitespace(nfa.literal(nfa.whitespace(self.string(start)), b":"))
            after = nfa.whitespace(self.value(values, key, f"{where}.additionalProperties", depth + 1))
            nfa.link(after, close)
            nfa.link(nfa.whitespace(nfa.literal(after, b",")), start)
        return nfa.literal(close, b"}")

    def any_value(self, src: int, depth: int) -> int:
        builders = [self.string, self.number, lambda s: self.nfa.literal(s, b"true"),
                    lambda s: self.nfa.literal(s, b"false"), lambda s: self.nfa.literal(s, b"null")]
        if depth < ANY_DEPTH:
            builders += [lambda s: self.map(True, s, "", depth), lambda s: self.array(True, s, "", depth, 0, None)]
        return self.alternatives(builders, src)

    def ref(self, ref: Any, src: int, where: str, depth: int) -> int:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise SchemaError(f"{where}.$ref: only local references (#/...) are supported")
        target: Any = self.root
        for part in ref[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"{where}.$ref: {ref} does not exist")
            target = target[part]
        if self.ref_depth.get(ref, 0) >= REF_DEPTH:
            return self.nfa.literal(src, b"null") if depth else self.any_value(src, ANY_DEPTH)
        self.refs += 1
        _at_most(self.refs, MAX_REF_EXPANSIONS, f"{where}.$ref", "expansions", "MAX_REF_EXPANSIONS")
        self.ref_depth[ref] = self.ref_depth.get(ref, 0) + 1
        try:
            return self.value(target, src, ref, depth)
        finally:
            self.ref_depth[ref] -= 1


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def _call_schema(tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A call of one of ``tools`` in Qwen's JSON form, as a schema."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "arguments": _parameters(t)},
                       "required": ["name", "arguments"]} for t in tools]}


def _xml_calls(c: _Compiler, tools: Sequence[dict[str, Any]], src: int) -> int:
    """A call of one of ``tools`` in Qwen3.5's form: <function=NAME> then <parameter=P> blocks (values as JSON,
    declared parameters in order, the required ones always)."""

    def call(s: int, tool: dict[str, Any]) -> int:
        nfa, params = c.nfa, _parameters(tool)
        s = nfa.literal(s, f"<function={tool['function']['name']}>\n".encode())
        properties = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = params.get("required") if isinstance(params.get("required"), list) else []
        _at_most(len(properties), MAX_PROPERTIES, f"tools.{tool['function']['name']}.parameters.properties",
                 "properties", "MAX_PROPERTIES")
        close = nfa.new()
        after = close
        for name, sub in reversed(list(properties.items())):
            here = nfa.new()
            value = c.value(sub, nfa.literal(here, f"<parameter={name}>\n".encode()), f"tools.{name}", 1)
            nfa.link(nfa.literal(value, b"\n</parameter>\n"), after)
            if name not in required:
                nfa.link(here, after)
            after = here
        nfa.link(s, after)
        return nfa.literal(close, b"</function>")

    return c.alternatives([lambda s, t=t: call(s, t) for t in tools], src)


def _at_most(count: int, limit: int, where: str, what: str, name: str) -> None:
    if count > limit:
        raise SchemaLimitError(f"{where}: more than {limit} {what} ({name})")


def _count(schema: dict[str, Any], key: str, default: int | None, where: str, limit: int) -> int | None:
    value = schema.get(key, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise SchemaError(f"{where}.{key}: expected an integer >= 0")
    if value is not None and value > limit:
        raise SchemaLimitError(f"{where}.{key}: {value} is above the limit of {limit} ({_LIMIT_NAMES[key]})")
    return value


_LIMIT_NAMES = {"minLength": "MAX_STRING_LENGTH", "maxLength": "MAX_STRING_LENGTH", "minItems": "MAX_ITEMS",
                "maxItems": "MAX_ITEMS"}


def check_limits(schema: Any, tools: Sequence[dict[str, Any]] | None = None) -> str:
    """The cache key of ``(schema, tools)`` once the document is within MAX_SCHEMA_DEPTH and MAX_SCHEMA_BYTES
    (the depth first, without recursion, so no deep document reaches the JSON encoder); raises
    :class:`~qwen_runtime.errors.SchemaLimitError`."""
    todo: list[tuple[Any, int]] = [(schema, 1), (tools, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict | list):
            if depth > MAX_SCHEMA_DEPTH:
                raise SchemaLimitError(f"schema: nested deeper than {MAX_SCHEMA_DEPTH} levels (MAX_SCHEMA_DEPTH)")
            todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    if tools is not None:
        _at_most(len(tools), MAX_ALTERNATIVES, "tools", "tools", "MAX_ALTERNATIVES")
    key = json.dumps([schema, tools], sort_keys=True)
    if len(key.encode()) > MAX_SCHEMA_BYTES:
        raise SchemaLimitError(f"schema: {len(key.encode())} bytes as JSON, above the limit of {MAX_SCHEMA_BYTES} "
                               f"(MAX_SCHEMA_BYTES)")
    return key


class Vocabulary:
    """The tokenizer's ordinary tokens as bytes (added and special tokens are never part of JSON), longest
    first, stored by position: ``columns[k]`` holds byte ``k`` of every token longer than ``k`` (a prefix of
    the order), so a mask walks every token at once, one byte position at a time."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        size = min(vocab_size, tokenizer.backend.get_vocab_size(with_added_tokens=True))
        pairs = [(tokenizer.token_bytes(i), i) for i in range(size) if i not in tokenizer.added]
        pairs = sorted(((b, i) for b, i in pairs if b), key=lambda p: -len(p[0]))
        self.ids = np.asarray([i for _, i in pairs], np.int32)
        lengths = np.asarray([len(b) for b, _ in pairs], np.int64)
        flat = np.frombuffer(b"".join(b for b, _ in pairs), np.uint8)
        starts = np.cumsum(lengths) - lengths
        longer = [int(np.count_nonzero(lengths > k)) for k in range(int(lengths.max(initial=0)))]
        self.columns = [flat[starts[:m] + k] for k, m in enumerate(longer)]
        self.size = vocab_size


class MaskCache:
    """Token masks of every grammar that shares it, the most recently used kept up to ``max_bytes`` (a mask is
    made again if it is needed after its eviction)."""

    def __init__(self, max_bytes: int = MASK_CACHE_BYTES) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self._masks: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()
        self._serial = 0

    def serial(self) -> int:
        """A new grammar's number in the keys."""
        with self._lock:
            self._serial += 1
            return self._serial

    def get(self, key: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        with self._lock:
            mask = self._masks.get(key)
            if mask is not None:
                self._masks.move_to_end(key)
            return mask

    def put(self, key: tuple[int, int], mask: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        with self._lock:
            if key in self._masks:
                return
            self._masks[key] = mask
            self.bytes += sum(a.nbytes for a in mask)
            while self.bytes > self.max_bytes and len(self._masks) > 1:
                self.bytes -= sum(a.nbytes for a in self._masks.popitem(last=False)[1])

    def __len__(self) -> int:
        return len(self._masks)


class Grammar:
    """A compiled schema over a vocabulary: DFA states made on demand, each with its token mask.

    ``schema`` None is any JSON object; ``tools`` (OpenAI's function tools) make it one call of one of them
    instead, in Qwen's JSON form (``{"name": ..., "arguments": {...}}``) or, with ``xml``, Qwen3.5's
    ``<function=NAME>`` form with JSON parameter values; tools' schemas are enforced as far as supported.
    The schema is compiled twice within one :class:`Budget`: a dry run that only counts (refusing a schema over
    a limit before anything is kept), then for real.  ``masks`` is where token masks are kept (shared by a
    :class:`GrammarCache`'s grammars; default: one of this grammar's own).
    """

    def __init__(self, schema: dict[str, Any] | None, vocab: Vocabulary,
                 tools: Sequence[dict[str, Any]] | None = None, xml: bool = False,
                 masks: MaskCache | None = None, budget: Budget | None = None) -> None:
        budget = budget or Budget()
        for store in (False, True):
            nfa = Nfa(budget, store)
            start = nfa.new()
            body = nfa.whitespace(start)
            if tools is not None:
                compiler = _Compiler(nfa, {}, strict=False)
                end = nfa.whitespace(_xml_calls(compiler, tools, body) if xml else
                                     compiler.value(_call_schema(tools), body, "tools"))
            else:
                compiler = _Compiler(nfa, schema or {})
                end = compiler.value(schema, body, "schema") if schema is not None else \
                    compiler.map(True, body, "", 0)
            self.accept = nfa.new()
            nfa.link(end, self.accept)
        self.nfa = nfa
        self.vocab = vocab
        self.distance = self._distances()
        self._ids: dict[frozenset[int], int] = {}
        self._members: list[frozenset[int]] = []
        # row s + 1: the DFA state after each byte from state s, plus 1 (0: dead; -1: not worked out yet);
        # row 0 is the dead state's
        self._table = np.full((64, 256), -1, np.int32)
        self._table[0] = 0
        self._distance = np.zeros(64, np.int64)  # per DFA state: the fewest bytes to the end of a valid text
        self._masks = masks if masks is not None else MaskCache()
        self._serial = self._masks.serial()
        self._lock = threading.Lock()  # DFA states are made by the engine thread and by compiling threads
        self.start = self._state(self._closure([start]))
        self.min_tokens = self.state_distance(self.start)  # bytes, hence at most this many tokens
        budget.check_time()

    def _distances(self) -> list[float]:
        """Fewest bytes from each NFA state to the accepting one (0-1 BFS over reversed edges)."""
        nfa = self.nfa
        back: list[list[tuple[int, int]]] = [[] for _ in nfa.edges]
        for src, edges in enumerate(nfa.edges):
            for _, dst in edges:
                back[dst].append((src, 1))
            for dst in nfa.eps[src]:
                back[dst].append((src, 0))
        dist = [float("inf")] * len(nfa.edges)
        dist[self.accept] = 0
        queue = deque([self.accept])
        while queue:
            node = queue.popleft()
            for src, cost in back[node]:
                if dist[node] + cost < dist[src]:
                    dist[src] = dist[node] + cost
                    queue.appendleft(src) if cost == 0 else queue.append(src)
        return dist

    def _closure(self, states: Sequence[int]) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for nxt in self.nfa.eps[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    def _state(self, members: frozenset[int]) -> int:
        if members not in self._ids:
            state = len(self._members)
            if state + 1 >= len(self._table):
                grown = np.full((2 * len(self._table), 256), -1, np.int32)
                grown[:len(self._table)] = self._table
                self._table = grown
                self._distance = np.resize(self._distance, len(grown))
            self._distance[state] = int(min(self.distance[s] for s in members))
            self._members.append(members)
            self._ids[members] = state
        return self._ids[members]

    def step(self, state: int, byte: int) -> int:
        """The DFA state after ``byte`` (-1: no valid text goes on this way)."""
        nxt = int(self._table[state + 1, byte])
        if nxt < 0:
            with self._lock:
                targets = [dst for s in self._members[state] for mask, dst in self.nfa.edges[s] if mask >> byte & 1]
                nxt = self._state(self._closure(targets)) + 1 if targets else 0
                self._table[state + 1, byte] = nxt
        return nxt - 1

    def accepting(self, state: int) -> bool:
        return self.accept in self._members[state]

    def state_distance(self, state: int) -> int:
        return int(self._distance[state])

    def mask(self, state: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tokens allowed in ``state``: their ids, the states they lead to and those states' distances
        (made when first needed, kept in the :class:`MaskCache`)."""
        key = (self._serial, state)
        mask = self._masks.get(key)
        if mask is None:
            rows, ends = self._scan(state)
            mask = (self.vocab.ids[rows], ends, self._distance[ends].astype(np.int32))
            self._masks.put(key, mask)
        return mask

    def _scan(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """Every token from ``state`` at once, a byte position at a time, over the tokens still alive (dead ones
        drop out, so a state few tokens fit costs little); transitions not yet worked out are, once per (state,
        byte).  ``final`` holds each token's state after its last byte (+1, 0 dead)."""
        final = np.zeros(len(self.vocab.ids), np.int32)
        alive = np.arange(len(self.vocab.ids))
        states = np.full(len(alive), state + 1, np.int32)
        for column in self.vocab.columns:
            longer = int(np.searchsorted(alive, len(column)))  # alive tokens with a byte here (longest first)
            if not longer:
                break
            rows, here = alive[:longer], states[:longer]
            data = column[rows]
            nxt = self._table[here, data]
            missing = nxt < 0
            if missing.any():
                for pair in np.unique(here[missing].astype(np.int64) * 256 + data[missing]).tolist():
                    self.step(pair // 256 - 1, pair % 256)
                nxt = self._table[here, data]
            final[rows] = nxt
            keep = nxt > 0
            alive, states = rows[keep], nxt[keep]
        rows = np.flatnonzero(final).astype(np.int32)
        return rows, final[rows] - 1


class JsonConstraint:
    """One row's position in a :class:`Grammar` (the :class:`~qwen_runtime.generation.stepper.Constraint` of a row).

    ``in_think``: the row starts inside ``<think>``; ``may_think``: its first token may open one.  While
    thinking anything but a stop token goes, until ``</think>`` is forced when only the JSON's length is left.
    Once the text is complete, a stop token or one of ``end_ids`` (e.g. ``</tool_call>``) ends it, and only
    stop tokens follow.
    """

    def __init__(self, grammar: Grammar, stop_ids: frozenset[int], think: tuple[int, int] | None = None,
                 in_think: bool = False, may_think: bool = False, end_ids: frozenset[int] = frozenset()) -> None:
        self.grammar, self.think = grammar, think
        self.stop_ids = np.asarray(sorted(i for i in stop_ids if i < grammar.vocab.size), np.int64)
        self.end_ids = np.asarray(sorted(i for i in stop_ids | end_ids if i < grammar.vocab.size), np.int64)
        self.state = grammar.start
        self.thinking = bool(think) and in_think
        self.may_think = bool(think) and may_think and not in_think
        self.done = False
        self._not_stop: np.ndarray | None = None  # every id but the stop ids (while thinking)

    def allowed(self, remaining: int) -> np.ndarray | None:
        g = self.grammar
        if self.thinking:
            if remaining <= g.min_tokens + 1:
                return np.asarray([self.think[1]], np.int64)
            if self._not_stop is None:
                keep = np.ones(g.vocab.size, bool)
                keep[self.stop_ids] = False
                self._not_stop = np.flatnonzero(keep)
            return self._not_stop
        if self.done or remaining <= 0:
            return self.stop_ids
        ids, _, dist = g.mask(self.state)
        allowed = ids[dist <= remaining - 1]
        if g.accepting(self.state):
            allowed = np.concatenate([allowed, self.end_ids])
        if self.may_think:
            allowed = np.concatenate([allowed, [self.think[0]]])
        return allowed if allowed.size else self.stop_ids

    def advance(self, token: int) -> None:
        first, self.may_think = self.may_think, False
        if self.thinking or (first and token == self.think[0]):
            self.thinking = token != self.think[1]
            return
        if token in self.end_ids or self.done:
            self.done = True
            return
        ids, ends, _ = self.grammar.mask(self.state)
        where = np.flatnonzero(ids == token)
        if where.size == 0:
            raise ValueError(f"token {token} is not allowed by the grammar here")
        self.state = int(ends[where[0]])


class GrammarCache:
    """Compiled grammars of one vocabulary, the most recently used ``size`` kept (their automata within
    :data:`GRAMMAR_CACHE_STATES` states together), their token masks together within ``mask_bytes``.

    Only look-ups hold the lock: up to :data:`COMPILE_SLOTS` compilations run side by side (each within its own
    :class:`Budget`), so a slow schema never holds back another one, and a schema that fails is never stored.
    Its memory is bounded by :meth:`reserve`.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, size: int = 16,
                 mask_bytes: int = MASK_CACHE_BYTES) -> None:
        self.tokenizer, self.vocab_size, self.size = tokenizer, vocab_size, size
        self.masks = MaskCache(mask_bytes)
        self._vocab: Vocabulary | None = None
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._vocab_lock = threading.Lock()
        self._compiling = threading.BoundedSemaphore(COMPILE_SLOTS)

    def reserve(self) -> int:
        """Bytes this cache may hold at most: its masks, the automata of the grammars it keeps and of the
        compilations running (what a server counts against its memory budget; the vocabulary's own tables,
        made once, come on top)."""
        return self.masks.max_bytes + (GRAMMAR_CACHE_STATES + COMPILE_SLOTS * MAX_NFA_STATES) * NFA_STATE_BYTES

    def get(self, schema: dict[str, Any] | None, tools: Sequence[dict[str, Any]] | None = None,
            xml: bool = False) -> Grammar:
        """:class:`Grammar` ``(schema, vocabulary, tools, xml)`` with its start state's mask made (so the
        engine's first step does not make it); raises :class:`SchemaError` or
        :class:`~qwen_runtime.errors.SchemaLimitError`."""
        key = f"{check_limits(schema, tools)}{xml}"
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar
        vocabulary = self.vocabulary()
        with self._compiling:
            grammar = Grammar(schema, vocabulary, tools, xml, self.masks)
            grammar.mask(grammar.start)
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > 1 and (len(self._grammars) > self.size or sum(
                    g.nfa.size for g in self._grammars.values()) > GRAMMAR_CACHE_STATES):
                self._grammars.popitem(last=False)
        return grammar

    def __contains__(self, schema: dict[str, Any] | None) -> bool:
        """Whether ``schema`` (response_format's, no tools) is compiled and kept."""
        with self._lock:
            return f"{json.dumps([schema, None], sort_keys=True)}False" in self._grammars

    def vocabulary(self) -> Vocabulary:
        """The vocabulary, read on first use (once, whichever thread asks first)."""
        with self._vocab_lock:
            if self._vocab is None:
                self._vocab = Vocabulary(self.tokenizer, self.vocab_size)
            return self._vocab


__all__ = ["Budget", "Grammar", "GrammarCache", "JsonConstraint", "MaskCache", "SchemaError", "SchemaLimitError",
           "Vocabulary", "check_limits"]
