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
"""

from __future__ import annotations

import bisect
import json
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import QwenError
from .tokenizer import Tokenizer

WHITESPACE_RUN = 8  # bytes of whitespace allowed between JSON tokens (pretty printing, not endless)
ANY_DEPTH = 3  # nesting of a JSON value whose schema says nothing (json_object: an object of such values)
REF_DEPTH = 4  # expansions of one $ref inside itself (recursive schemas)
IGNORED_KEYWORDS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                              "$defs", "definitions", "strict", "name", "additionalProperties", "deprecated",
                              "readOnly", "writeOnly"})
HANDLED_KEYWORDS = frozenset({"type", "properties", "required", "items", "minItems", "maxItems", "minLength",
                              "maxLength", "enum", "const", "anyOf", "oneOf", "$ref"})


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


class Nfa:
    """States with byte edges (a 256-bit mask each) and epsilon edges; built by the ``_json`` functions."""

    def __init__(self) -> None:
        self.edges: list[list[tuple[int, int]]] = []
        self.eps: list[list[int]] = []

    def new(self) -> int:
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def byte(self, src: int, mask: int) -> int:
        dst = self.new()
        self.edges[src].append((mask, dst))
        return dst

    def literal(self, src: int, text: bytes) -> int:
        for b in text:
            src = self.byte(src, 1 << b)
        return src

    def link(self, src: int, dst: int) -> None:
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

    def value(self, schema: Any, src: int, where: str, depth: int = 0) -> int:
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
            return self.alternatives([lambda s, k=k: self.typed(k, schema, s, where, depth) for k in kind], src)
        return self.typed(kind, schema, src, where, depth)

    def any_of(self, schema: dict[str, Any], key: str, src: int, where: str, depth: int) -> int:
        """One of the options, each merged with the rest of ``schema``."""
        options = schema[key]
        if not isinstance(options, list) or not options or not all(isinstance(o, dict) for o in options):
            raise SchemaError(f"{where}.{key}: expected a non-empty list of schemas")
        base = {k: v for k, v in schema.items() if k != key}
        return self.alternatives([lambda s, o=o, i=i: self.value({**base, **o}, s, f"{where}.{key}[{i}]", depth)
                                  for i, o in enumerate(options)], src)

    def typed(self, kind: str, schema: dict[str, Any], src: int, where: str, depth: int) -> int:
        nfa = self.nfa
        if kind == "string":
            return self.string(src, _count(schema, "minLength", 0, where), _count(schema, "maxLength", None, where))
        if kind == "integer":
            return self.integer(src)
        if kind == "number":
            return self.number(src)
        if kind == "boolean":
            return self.alternatives([lambda s: nfa.literal(s, b"true"), lambda s: nfa.literal(s, b"false")], src)
        if kind == "null":
            return nfa.literal(src, b"null")
        if kind == "array":
            return self.array(schema.get("items", True), src, where, depth, _count(schema, "minItems", 0, where),
                              _count(schema, "maxItems", None, where))
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
        for lead, tail in ((_mask(range(0xC2, 0xE0)), 1), (_mask(range(0xE1, 0xED)), 2), (_mask(range(0xEE, 0xF0)), 2),
                           (_mask(range(0xF1, 0xF4)), 3)):
            s = nfa.byte(src, lead)
            for _ in range(tail):
                s = nfa.byte(s, CONT)
            nfa.link(s, end)
        s = nfa.byte(nfa.byte(src, 1 << 0xE0), _mask(range(0xA0, 0xC0)))  # no overlong 3-byte forms
        nfa.link(nfa.byte(s, CONT), end)
        s = nfa.byte(nfa.byte(src, 1 << 0xED), _mask(range(0x80, 0xA0)))  # no surrogates
        nfa.link(nfa.byte(s, CONT), end)
        s = nfa.byte(nfa.byte(src, 1 << 0xEF), CONT)
        nfa.link(nfa.byte(s, CONT), end)
        s = nfa.byte(nfa.byte(src, 1 << 0xF0), _mask(range(0x90, 0xC0)))
        nfa.link(nfa.byte(nfa.byte(s, CONT), CONT), end)
        s = nfa.byte(nfa.byte(src, 1 << 0xF4), _mask(range(0x80, 0x90)))
        nfa.link(nfa.byte(nfa.byte(s, CONT), CONT), end)
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


def _count(schema: dict[str, Any], key: str, default: int | None, where: str) -> int | None:
    value = schema.get(key, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise SchemaError(f"{where}.{key}: expected an integer >= 0")
    return value


class Vocabulary:
    """The tokenizer's ordinary tokens as bytes, sorted (added and special tokens are never part of JSON)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        size = min(vocab_size, tokenizer.backend.get_vocab_size(with_added_tokens=True))
        pairs = sorted((tokenizer.token_bytes(i), i) for i in range(size) if i not in tokenizer.added)
        pairs = [(b, i) for b, i in pairs if b]
        self.texts = [b for b, _ in pairs]
        self.ids = np.asarray([i for _, i in pairs], np.int64)
        self.size = vocab_size


class Grammar:
    """A compiled schema over a vocabulary: DFA states made on demand, each with its token mask.

    ``schema`` None is any JSON object; ``tools`` (OpenAI's function tools) make it one call of one of them
    instead, in Qwen's JSON form (``{"name": ..., "arguments": {...}}``) or, with ``xml``, Qwen3.5's
    ``<function=NAME>`` form with JSON parameter values; tools' schemas are enforced as far as supported.
    """

    def __init__(self, schema: dict[str, Any] | None, vocab: Vocabulary,
                 tools: Sequence[dict[str, Any]] | None = None, xml: bool = False) -> None:
        self.nfa = nfa = Nfa()
        start = nfa.new()
        body = nfa.whitespace(start)
        if tools is not None:
            compiler = _Compiler(nfa, {}, strict=False)
            end = nfa.whitespace(_xml_calls(compiler, tools, body) if xml else
                                 compiler.value(_call_schema(tools), body, "tools"))
        else:
            compiler = _Compiler(nfa, schema or {})
            end = compiler.value(schema, body, "schema") if schema is not None else compiler.map(True, body, "", 0)
        self.accept = nfa.new()
        nfa.link(end, self.accept)
        self.vocab = vocab
        self.distance = self._distances()
        self._ids: dict[frozenset[int], int] = {}
        self._members: list[frozenset[int]] = []
        self._distance: list[int] = []  # per DFA state: the fewest bytes to the end of a valid text
        self._steps: list[dict[int, int]] = []
        self._masks: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.start = self._state(self._closure([start]))
        self.min_tokens = self.state_distance(self.start)  # bytes, hence at most this many tokens

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
            self._ids[members] = len(self._members)
            self._members.append(members)
            self._distance.append(int(min(self.distance[s] for s in members)))
            self._steps.append({})
        return self._ids[members]

    def step(self, state: int, byte: int) -> int:
        """The DFA state after ``byte`` (-1: no valid text goes on this way)."""
        steps = self._steps[state]
        if byte not in steps:
            targets = [dst for s in self._members[state] for mask, dst in self.nfa.edges[s] if mask >> byte & 1]
            steps[byte] = self._state(self._closure(targets)) if targets else -1
        return steps[byte]

    def accepting(self, state: int) -> bool:
        return self.accept in self._members[state]

    def state_distance(self, state: int) -> int:
        return self._distance[state]

    def mask(self, state: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tokens allowed in ``state``: their ids, the states they lead to and those states' distances."""
        if state not in self._masks:
            ids, ends = self._scan(state)
            dist = np.asarray([self._distance[e] for e in ends], np.int64)
            self._masks[state] = (self.vocab.ids[ids], np.asarray(ends, np.int64), dist)
        return self._masks[state]

    def _scan(self, state: int) -> tuple[list[int], list[int]]:
        """Walk the sorted vocabulary from ``state``, sharing prefixes; a dead prefix skips its tokens."""
        texts = self.vocab.texts
        ids, ends = [], []
        path = [state]  # path[k]: the state after k bytes of the current token
        prev = b""
        i = 0
        while i < len(texts):
            text = texts[i]
            k = 0
            limit = min(len(prev), len(text), len(path) - 1)
            while k < limit and prev[k] == text[k]:
                k += 1
            del path[k + 1:]
            current = path[k]
            while k < len(text):
                current = self.step(current, text[k])
                if current < 0:
                    break
                k += 1
                path.append(current)
            prev = text
            if current < 0:  # every token starting with text[:k + 1] is dead too
                dead = text[:k + 1]
                i = bisect.bisect_left(texts, _after_prefix(dead), i + 1) if dead[-1] < 255 else i + 1
                continue
            ids.append(i)
            ends.append(current)
            i += 1
        return ids, ends


def _after_prefix(prefix: bytes) -> bytes:
    """The smallest byte string greater than every string starting with ``prefix`` (its last byte < 255)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class JsonConstraint:
    """One row's position in a :class:`Grammar` (the :class:`~qwen_runtime.stepper.Constraint` of a row).

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
    """Compiled grammars of one vocabulary, the most recently used ``size`` kept (with their masks)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, size: int = 16) -> None:
        self.tokenizer, self.vocab_size, self.size = tokenizer, vocab_size, size
        self._vocab: Vocabulary | None = None
        self._grammars: dict[str, Grammar] = {}
        self._lock = threading.Lock()

    def get(self, schema: dict[str, Any] | None, tools: Sequence[dict[str, Any]] | None = None,
            xml: bool = False) -> Grammar:
        """:class:`Grammar` ``(schema, vocabulary, tools, xml)``; raises :class:`SchemaError`."""
        key = json.dumps([schema, tools, xml], sort_keys=True)
        with self._lock:
            grammar = self._grammars.pop(key, None)
            if grammar is None:
                if self._vocab is None:
                    self._vocab = Vocabulary(self.tokenizer, self.vocab_size)
                grammar = Grammar(schema, self._vocab, tools, xml)
            self._grammars[key] = grammar
            while len(self._grammars) > self.size:
                self._grammars.pop(next(iter(self._grammars)))
            return grammar


__all__ = ["Grammar", "GrammarCache", "JsonConstraint", "SchemaError", "Vocabulary"]
