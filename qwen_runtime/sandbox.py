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

Every violation is a :class:`~qwen_runtime.errors.TemplateError`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Sized
from typing import Any

from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Concat
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import TemplateError

MAX_STEPS = 200_000  # blocks entered per render; real chat templates need a few thousand
MAX_LENGTH = 1 << 20  # characters/items of any value a template builds, and the largest integer argument
MAX_OUTPUT = 4 << 20  # characters of rendered text
MAX_RANGE = 10_000
MAX_POWER_BITS = 4096
# A width or precision of 7+ digits inside a %-format or str.format field.
HUGE_FORMAT_WIDTH = re.compile(r"%[^a-zA-Z%]*\d{7,}|\{[^{}]*\d{7,}[^{}]*\}")


class _BudgetCodeGenerator(CodeGenerator):
    """Emits ``environment.step()`` at the start of every block and a length check around ``~``."""

    def blockvisit(self, nodes: Any, frame: Frame) -> None:
        self.writeline("environment.step()")
        super().blockvisit(nodes, frame)

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.bounded(")
        super().visit_Concat(node, frame)
        self.write(")")


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
        super().__init__(**options)
        self.steps_left = MAX_STEPS
        self.globals["range"] = self._range
        self.filters = {name: self.bounded_callable(f) for name, f in self.filters.items()}
        self.filters["format"] = self.bounded_callable(_checked_format(self.filters["format"]))

    def step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise _refuse(f"more than {MAX_STEPS} steps (a loop that does not end?)")

    def bounded(self, value: Any) -> Any:
        if _too_big(value):
            raise _refuse(f"a value longer than {MAX_LENGTH}")
        return value

    def bounded_callable(self, func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)  # keeps jinja's pass_context/pass_eval_context markers
        def checked(*args: Any, **kwargs: Any) -> Any:
            self._check_arguments(args, kwargs)
            return self.bounded(func(*args, **kwargs))
        return checked

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
        if operator_ == "%" and isinstance(left, str) and HUGE_FORMAT_WIDTH.search(left):
            raise _refuse("a format width of 7 or more digits")
        return self.bounded(super().call_binop(context, operator_, left, right))

    def render_bounded(self, render: Callable[[], Iterator[str]]) -> str:
        """Join the chunks of ``render()`` (``template.generate``), refusing more than MAX_OUTPUT chars."""
        self.steps_left = MAX_STEPS
        parts, size = [], 0
        for part in render():
            size += len(part)
            if size > MAX_OUTPUT:
                raise _refuse(f"output longer than {MAX_OUTPUT} characters")
            parts.append(part)
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

