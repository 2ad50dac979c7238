"""A jinja2 environment for untrusted chat templates: sandboxed, and bounded in time and memory.

``ImmutableSandboxedEnvironment`` already refuses private attributes (``__class__``, ``__globals__``, ...),
unsafe callables and mutation of the caller's data, and there is no loader (no ``include``/``import`` of
files).  It does not bound work: nested loops, repeated string doubling or a huge ``'%999999999d'`` still run
for ever or allocate gigabytes.  This environment adds:

* a step budget: the compiled template calls :meth:`BoundedEnvironment.step` at the start of every block
  (each loop iteration, branch and macro call), so a render stops after :data:`MAX_STEPS` steps;
* a size cap of :data:`MAX_LENGTH` on strings/lists built by ``*``, ``+``, ``~``, calls and filters, on
  integer arguments (widths, counts) and on ``**``; ranges of at most :data:`MAX_RANGE` items;
* the rendered text capped at :data:`MAX_OUTPUT` characters.

A cap checked on the result comes too late where a small input makes a huge one: ``s|replace("x", "y" *
256)`` on a 1 MiB ``s``, ``s.replace("x", s)``, ``[s] * 1048576|join``, ``{{ [s] * 1048576 }}``.  So the
size of what these operations build is computed from their inputs first (:func:`text_size`, an upper bound
of ``len(str(value))`` that stops counting past the cap): replace, join, indent, wordwrap, translate,
expandtabs, ``%`` and ``format`` (filter and method), string/pprint/tojson conversions, ``~`` and printed
values; ``|sum`` over sequences, quadratic in time, is bounded by the items it would copy.  A MemoryError
while rendering is a refusal too.

Every violation is a :class:`~qwen_runtime.errors.TemplateError`.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

from jinja2.compiler import CodeGenerator, Frame
from jinja2.filters import make_attrgetter
from jinja2.nodes import Concat
from jinja2.runtime import Context, EvalContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, pass_environment, pass_eval_context

from ..errors import TemplateError

MAX_STEPS = 200_000  # blocks entered per render; real chat templates need a few thousand
MAX_LENGTH = 1 << 20  # characters/items of any value a template builds, and the largest integer argument
MAX_OUTPUT = 4 << 20  # characters of rendered text
MAX_RANGE = 10_000
MAX_POWER_BITS = 4096
# A width or precision of 7+ digits inside a %-format or str.format field.
HUGE_FORMAT_WIDTH = re.compile(r"%[^a-zA-Z%]*\d{7,}|\{[^{}]*\d{7,}[^{}]*\}")
# One %-format field: mapping key, flags, width, precision, length modifier, conversion.
PERCENT_FIELD = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.DOTALL)
NUMBER_TEXT = 330  # characters a formatted number may take (float('1e308') with '%f' has 309 digits)
MAX_SUM_COPIES = 1 << 26  # items copied by |sum over sequences, which copies the running total at each step


class _BudgetCodeGenerator(CodeGenerator):
    """Emits ``environment.step()`` at the start of every block and a length check around ``~``."""

    def blockvisit(self, nodes: Any, frame: Frame) -> None:
        self.writeline("environment.step()")
        super().blockvisit(nodes, frame)

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        """``a ~ b``: the operands' printed size is checked before jinja's join converts and joins them."""
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"environment.bounded({join}(environment.concat_operands((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))))")


def text_size(value: Any, limit: int = MAX_OUTPUT, as_repr: bool = False) -> int:
    """An upper bound of ``len(str(value))`` (``as_repr``: of ``len(repr(value))``) computed without building
    it; it stops counting once past ``limit``, so its cost is bounded by what it has counted."""
    if isinstance(value, str):
        if not as_repr:
            return len(value)
        if value.isprintable():  # escapes: a backslash each, and the quote character
            return len(value) + 2 + value.count("\\") + value.count("'")
        return 10 * len(value) + 2  # \U0001xxxx at most per character
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() * 30103 // 100000 + 2
    if isinstance(value, float):
        return 24
    if isinstance(value, (bytes, bytearray)):
        return 4 * len(value) + 14
    if isinstance(value, Namespace):
        return 12 + text_size(value._Namespace__attrs, limit, True)  # type: ignore[attr-defined]
    if isinstance(value, dict):
        pairs: Iterable[Any] = (item for pair in value.items() for item in pair)
    elif isinstance(value, (list, tuple, set, frozenset)):
        pairs = value
    else:
        return len(str(value))  # jinja's own objects (loop, cycler, macros, undefined) print a short text
    total = 2
    for item in pairs:
        total += text_size(item, limit - total, True) + 2
        if total > limit:
            break
    return total


def json_size(value: Any, indent: int | str | None = None, per_item: int = 3, depth: int = 1,
              limit: int = MAX_LENGTH) -> int:
    """An upper bound of ``len(json.dumps(value, indent=indent))`` computed without building it (``per_item``:
    the separators' characters per item)."""
    step = len(indent) if isinstance(indent, str) else max(indent or 0, 0)
    if isinstance(value, str):
        if value.isascii() and value.isprintable():
            return len(value) + 2 + value.count("\\") + value.count('"')
        return 12 * len(value) + 2  # a \uXXXX surrogate pair per character at most
    if isinstance(value, dict):
        items: Iterable[Any] = (item for pair in value.items() for item in pair)
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return text_size(value, limit, True) + 2
    total = 2 + step * (depth - 1)
    for item in items:
        total += json_size(item, indent, per_item, depth + 1, limit - total) + per_item + step * depth
        if total > limit:
            break
    return total


def _too_big(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) > MAX_LENGTH
    return isinstance(value, Sized) and not isinstance(value, dict) and len(value) > MAX_LENGTH


def _refuse(what: str) -> TemplateError:
    return TemplateError(f"chat template: {what} (limits protect against hostile templates)")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """An immutable sandbox whose renders are bounded in steps, value sizes and output length."""

    code_generator_class = _BudgetCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=self._printed, **options)
        self.steps_left = MAX_STEPS
        self.globals["range"] = self._range
        join, total = self.filters["join"], self.filters["sum"]
        self.filters = {name: self.bounded_callable(f, FILTER_SIZES.get(name), f"|{name}")
                        for name, f in self.filters.items()}
        self.filters["format"] = self.bounded_callable(_checked_format(self.filters["format"]), FILTER_SIZES["format"],
                                                       "|format")
        self.filters["join"] = self.bounded_callable(_checked_join(join))
        self.filters["sum"] = self.bounded_callable(_checked_sum(total))

    def step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise _refuse(f"more than {MAX_STEPS} steps (a loop that does not end?)")

    def bounded(self, value: Any) -> Any:
        if _too_big(value):
            raise _refuse(f"a value longer than {MAX_LENGTH}")
        return value

    def bounded_callable(self, func: Callable[..., Any], size: Callable[..., int] | None = None,
                         what: str = "a value") -> Callable[..., Any]:
        """``func`` with its integer arguments and result capped; ``size`` (called with the same arguments)
        bounds the result's length before ``func`` builds it."""
        @functools.wraps(func)  # keeps jinja's pass_context/pass_eval_context markers
        def checked(*args: Any, **kwargs: Any) -> Any:
            self._check_arguments(args, kwargs)
            if size is not None:
                self.presized(size(*args, **kwargs), what)
            return self.bounded(func(*args, **kwargs))
        return checked

    @staticmethod
    def presized(size: int, what: str = "a value") -> None:
        """Refuse an operation whose result would be longer than MAX_LENGTH, before it is built."""
        if size > MAX_LENGTH:
            raise _refuse(f"{what} of at least {size} characters (longer than {MAX_LENGTH})")

    def concat_operands(self, operands: tuple[Any, ...]) -> tuple[Any, ...]:
        """The operands of ``~``, refused when their printed sizes add up past MAX_LENGTH."""
        total = 0
        for operand in operands:
            total += text_size(operand, MAX_LENGTH - total)
            self.presized(total, "a ~ concatenation")
        return operands

    def _printed(self, value: Any) -> Any:
        """``finalize``: a value printed by ``{{ }}`` must print to at most MAX_OUTPUT characters."""
        if not isinstance(value, str) and text_size(value, MAX_OUTPUT) > MAX_OUTPUT:
            raise _refuse(f"a printed value longer than {MAX_OUTPUT} characters")
        return value

    def _check_arguments(self, args: tuple, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and _too_big(value):
                raise _refuse(f"integer argument {value} larger than {MAX_LENGTH}")

    @staticmethod
    def _range(*args: int) -> range:
        rng = range(*args)
        if len(rng) > MAX_RANGE:
            raise _refuse(f"range of {len(rng)} items (at most {MAX_RANGE})")
        return rng

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self._check_arguments(args, kwargs)
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format at attribute access
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(owner, str) and name in STR_METHOD_SIZES:
            if name == "join" and args:  # the items are counted as they are taken: they may be made lazily
                args = (_taken(args[0], lambda item: text_size(item, MAX_LENGTH) + len(owner)), *args[1:])
            __self.presized(STR_METHOD_SIZES[name](owner, *args, **kwargs), f"str.{name}")
        return __self.bounded(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("format", "format_map") and HUGE_FORMAT_WIDTH.search(obj):
            raise _refuse("a format width of 7 or more digits")
        return super().getattr(obj, attribute)

    def call_binop(self, context: Context, operator_: str, left: Any, right: Any) -> Any:
        if operator_ == "**" and isinstance(left, int) and isinstance(right, int) \
                and max(left.bit_length(), 1) * right > MAX_POWER_BITS:
            raise _refuse(f"{left} ** {right} is too large")
        if operator_ == "*" and _product_too_big(left, right):
            raise _refuse(f"a product longer than {MAX_LENGTH}")
        if operator_ == "%" and isinstance(left, str):
            if HUGE_FORMAT_WIDTH.search(left):
                raise _refuse("a format width of 7 or more digits")
            self.presized(percent_size(left, right), "a %-format")
        return self.bounded(super().call_binop(context, operator_, left, right))

    def render_bounded(self, render: Callable[[], Iterator[str]]) -> str:
        """Join the chunks of ``render()`` (``template.generate``), refusing more than MAX_OUTPUT chars."""
        self.steps_left = MAX_STEPS
        parts, size = [], 0
        try:
            for part in render():
                size += len(part)
                if size > MAX_OUTPUT:
                    raise _refuse(f"output longer than {MAX_OUTPUT} characters")
                parts.append(part)
        except MemoryError:
            parts.clear()
            raise _refuse("out of memory while rendering") from None
        return "".join(parts)


def _checked_format(format_filter: Callable[..., str]) -> Callable[..., str]:
    """The ``format`` filter (``fmt % args``), refusing huge widths in ``fmt``."""
    @functools.wraps(format_filter)
    def checked(value: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(value, str) and HUGE_FORMAT_WIDTH.search(value):
            raise _refuse("a format width of 7 or more digits")
        return format_filter(value, *args, **kwargs)
    return checked


def _product_too_big(left: Any, right: Any) -> bool:
    """Sequence repetition longer than MAX_LENGTH, or an integer product of more than MAX_POWER_BITS bits."""
    for seq, count in ((left, right), (right, left)):
        if isinstance(count, int) and isinstance(seq, (str, list, tuple)):
            return len(seq) * count > MAX_LENGTH
    if isinstance(left, int) and isinstance(right, int):
        return left.bit_length() + right.bit_length() > MAX_POWER_BITS
    return False



def _taken(items: Iterable[Any], size: Callable[[Any], int]) -> list[Any]:
    """``items`` as a list, refused as soon as their sizes add up past MAX_LENGTH (before a lazily made
    item past the cap is even made)."""
    taken, total = [], 0
    for item in items:
        total += size(item)
        if total > MAX_LENGTH:
            raise _refuse(f"a join of more than {MAX_LENGTH} characters")
        taken.append(item)
    return taken


def _checked_join(join: Callable[..., str]) -> Callable[..., str]:
    """The ``join`` filter, counting the printed size of each item (after ``attribute``) as it is taken."""
    @pass_eval_context
    def checked(eval_ctx: EvalContext, value: Iterable[Any], d: Any = "", attribute: str | int | None = None
                ) -> str:
        if attribute is not None:
            value = map(make_attrgetter(eval_ctx.environment, attribute), value)
        separator = text_size(d, MAX_LENGTH)
        return join(eval_ctx, _taken(value, lambda item: text_size(item, MAX_LENGTH) + separator), d)
    return checked


def _checked_sum(sum_filter: Callable[..., Any]) -> Callable[..., Any]:
    """The ``sum`` filter; over sequences (``start`` a list, tuple or string) each step copies the running
    total, so n items of total length L copy up to n·L items: refused past :data:`MAX_SUM_COPIES` (the copies, so the
    time, grow with the square of the items) or a result past MAX_LENGTH."""
    @pass_environment
    def checked(environment: Any, iterable: Iterable[Any], attribute: str | int | None = None, start: Any = 0
                ) -> Any:
        if attribute is not None:
            iterable = map(make_attrgetter(environment, attribute), iterable)
        if isinstance(start, (list, tuple, str)):
            items = _taken(iterable, lambda item: len(item) if isinstance(item, Sized) else 0)
            copies = len(items) * (len(start) + sum(len(i) for i in items if isinstance(i, Sized)))
            if copies > MAX_SUM_COPIES:
                raise _refuse(f"a |sum of {len(items)} sequences copying {copies} items (at most {MAX_SUM_COPIES})")
            iterable = items
        return sum_filter(environment, iterable, start=start)
    return checked


def _texts(*values: Any) -> list[str]:
    """``values`` as the strings a filter makes of them, each checked before it is converted."""
    for value in values:
        if not isinstance(value, str) and text_size(value, MAX_LENGTH) > MAX_LENGTH:
            raise _refuse(f"a value printing to more than {MAX_LENGTH} characters")
    return [value if isinstance(value, str) else str(value) for value in values]


def replace_size(s: Any, old: Any, new: Any, count: int | None = -1) -> int:
    """Length of ``str(s).replace(str(old), str(new), count)``, from counting the occurrences."""
    s, old, new = _texts(s, old, new)
    n = s.count(old) if old else len(s) + 1
    if count is not None and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


def percent_size(fmt: str, args: Any) -> int:
    """An upper bound of ``len(fmt % args)``: the format's text plus, per field, its width, its precision and
    its value's printed size (a mapping key may repeat a value; a tuple's values are each used once)."""
    positional = iter(args if isinstance(args, tuple) else (args,))
    total = len(fmt)
    for field in PERCENT_FIELD.finditer(fmt):
        key, width, precision, conversion = (group or "" for group in field.groups())
        if conversion == "%":
            continue
        for star in (width, precision):
            if star == "*":
                value = next(positional, 0)
                total += value if isinstance(value, int) else 0
        total += sum(int(n) for n in (width, precision) if n.isdigit())
        value = args.get(key) if key and isinstance(args, dict) else next(positional, None) if not key else None
        total += text_size(value, MAX_LENGTH, conversion in "ra") + NUMBER_TEXT
        if total > MAX_LENGTH:
            break
    return total


def format_size(fmt: str, *args: Any, **kwargs: Any) -> int:
    """An upper bound of ``len(fmt.format(*args, **kwargs))``: per field its value's printed size (a field may
    repeat a value), the numbers of its format spec, and a number's digits."""
    total, auto = 0, 0
    try:
        for literal, name, spec, conversion in string.Formatter().parse(fmt):
            total += len(literal)
            if name is None:
                continue
            head = re.split(r"[.\[]", name, maxsplit=1)[0]
            if head == "":
                head, auto = str(auto), auto + 1
            value = (args[int(head)] if int(head) < len(args) else None) if head.isdigit() else kwargs.get(head)
            total += text_size(value, MAX_LENGTH, conversion in ("r", "a")) + NUMBER_TEXT
            total += MAX_LENGTH + 1 if "{" in (spec or "") else sum(int(n) for n in re.findall(r"\d+", spec or ""))
            if total > MAX_LENGTH:
                break
    except ValueError:
        pass  # a malformed format: str.format raises the same error
    return total


def _join_size(separator: str, items: list[Any]) -> int:
    return sum(text_size(item, MAX_LENGTH) for item in items) + len(separator) * max(len(items) - 1, 0)


def _translate_size(s: str, table: Any) -> int:
    longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1) if isinstance(table, dict) else 1
    return len(s) * max(longest, 1)


# Result sizes of the str methods that can build far more than they are given (the others are bounded by
# their capped integer arguments), called with the string and the call's arguments.
STR_METHOD_SIZES: dict[str, Callable[..., int]] = {
    "replace": lambda s, old="", new="", count=-1: replace_size(s, old, new, count),
    "join": lambda s, items=(): _join_size(s, list(items)),
    "format": format_size,
    "format_map": lambda s, mapping=None: format_size(s, **(mapping if isinstance(mapping, dict) else {})),
    "translate": lambda s, table=None: _translate_size(s, table),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * max(tabsize if isinstance(tabsize, int) else 8, 0),
}


def _indent_size(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> int:
    text, pad = _texts(s, width if isinstance(width, str) else "")
    step = len(pad) if isinstance(width, str) else max(width, 0) if isinstance(width, int) else 0
    return len(text) + (text.count("\n") + 1) * step


def _wordwrap_size(environment: Any, s: Any, width: int = 79, break_long_words: bool = True,
                   wrapstring: str | None = None, break_on_hyphens: bool = True) -> int:
    text, wrap = _texts(s, wrapstring if wrapstring is not None else "\n")
    return len(text) + (len(text) + 1) * len(wrap)  # at most a line per character


# Result sizes of jinja's filters that can build far more than they are given, called with the filter's
# arguments (after jinja's context argument, where the filter takes one).
FILTER_SIZES: dict[str, Callable[..., int]] = {
    "replace": lambda eval_ctx, s, old, new, count=None: replace_size(s, old, new, count),
    "indent": _indent_size,
    "wordwrap": _wordwrap_size,
    "format": lambda value, *args, **kwargs: percent_size(value, kwargs or args) if isinstance(value, str) else 0,
    "string": lambda value: text_size(value, MAX_LENGTH),
    "pprint": lambda value: 2 * text_size(value, MAX_LENGTH, True),  # a line and indent per item at most
}
