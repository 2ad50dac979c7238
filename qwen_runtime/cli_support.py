"""What every command-line entry point shares: turning failures into one line and an exit code, the options of
the machine a model runs on (``-t/--threads``, ``--kernels``) and speculative decoding's ``--draft``."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable

from .compile_events import on_first_compile
from .errors import EXIT_CODES, MissingExtraError, QwenError, ResourceLimitError, exit_code
from .pool import ACTIVATION_CHOICES, KERNEL_CHOICES, KERNELS_VARIABLE, STEP_TOKENS

USAGE_ERROR = 2  # an invalid option value (argparse uses the same code for bad usage)
INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT
MISSING_FILE = 2  # the same code as FormatError: an input file is missing
# Memory ran out: the code of a request over the allowed memory (ResourceLimitError is a MemoryError too).
# A chat template that exhausts memory is refused by the sandbox as a TemplateError (7) instead.
OUT_OF_MEMORY = EXIT_CODES[ResourceLimitError]
# What a command says when numba starts compiling kernels during its run (their first use on a machine: the first
# model of a type waits 30-60 s on 2 cores; `scripts/warm_kernels.py` compiles them all ahead).
COMPILING = ("numba is compiling kernels (once per machine and version: up to a few minutes; later runs load "
             "them from its cache)")


def run_guarded(prog: str, main: Callable[[], int | None]) -> int:
    """Run ``main`` and return its exit code; errors become one line on stderr, never a traceback.  When numba
    starts compiling kernels meanwhile (not loading them from its cache), one line on stderr says so."""
    on_first_compile(lambda: sys.stderr.write(f"{prog}: {COMPILING}\n"))
    try:
        return main() or 0
    except QwenError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return exit_code(exc)
    except MemoryError as exc:
        detail = f" ({exc})" if str(exc) else ""
        sys.stderr.write(f"{prog}: error: out of memory{detail}\n")
        return OUT_OF_MEMORY
    except KeyboardInterrupt:
        sys.stderr.write(f"\n{prog}: interrupted; no partial output was left\n")
        return INTERRUPTED
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        sys.stderr.write(f"{prog}: error: {where}{exc.strerror or exc}\n")
        return MISSING_FILE if isinstance(exc, FileNotFoundError) else 1
    except ValueError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return USAGE_ERROR
    except Exception as exc:  # a bug, not a user error: still one line, never a traceback
        sys.stderr.write(f"{prog}: internal error: {type(exc).__name__}: {exc}\n")
        return 1
    finally:
        on_first_compile(None)


class HelpFormatter(argparse.HelpFormatter):
    """Help that gives every option's default: ``(default: X)`` is appended to an option that takes a value
    when its help does not already say what the default is (defaults of None or [] are described by hand).
    Description and epilog are wrapped paragraph by paragraph (blank lines separate them)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(super(HelpFormatter, self)._fill_text(part, width, indent) for part in text.split("\n\n"))

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.option_strings and action.nargs != 0 and "default" not in text
                and action.default not in (None, [], argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


def require_extra(module: str, extra: str, feature: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` when ``module`` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{feature} needs the {extra} extra, which is not installed "
                                f"(no module {module!r}): pip install 'qwen-numpy[{extra}]'")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def add_draft_option(p: argparse.ArgumentParser, note: str = "") -> None:
    """``--draft N``: speculative decoding by prompt lookup (``GenerationConfig.draft_tokens``, the engine's
    ``draft_tokens``); ``note`` is added to the help."""
    p.add_argument("--draft", type=draft_tokens, default=0, metavar="N",
                   help="speculative decoding by prompt lookup: greedy replies (temperature 0) verify up to N "
                   "tokens copied from the prompt and reply in one pass, with output identical to plain decoding; "
                   "sampled replies decode plainly, and it needs the compiled kernels (numba: with --kernels "
                   f"numpy it is off){note}; 1..{STEP_TOKENS - 1}, helps replies that repeat the prompt "
                   "(default 0: off)")


def draft_tokens(text: str) -> int:
    """An argparse type: draft tokens per verify pass, 0 to ``STEP_TOKENS - 1``."""
    value = int(text)
    if not 0 <= value < STEP_TOKENS:
        raise argparse.ArgumentTypeError(f"expected 0 to {STEP_TOKENS - 1} draft tokens, got {text}")
    return value


def add_activations_option(p: argparse.ArgumentParser, note: str = "") -> None:
    """``--activations {float,q8}``: what the products multiply (:func:`qwen_runtime.load`'s ``activations``);
    ``note`` is added to the help."""
    p.add_argument("--activations", choices=ACTIVATION_CHOICES, default="float",
                   help="q8: quantize the activations of decode products to 8 bits and multiply every quantized "
                   "type's weights in integers, as llama.cpp does (faster, not exact; compiled kernels only)"
                   f"{note}; default float: float32 activations, exact")


def add_machine_options(p: argparse.ArgumentParser, kernels: bool = True) -> None:
    """``-t/--threads N`` (the pool's threads, BLAS's and the compiled kernels'; default: the cores) and, with
    ``kernels``, ``--kernels {auto,numba,numpy}`` (default: the QWEN_KERNELS environment variable, else auto)."""
    p.add_argument("-t", "--threads", type=positive_int, default=None, metavar="N",
                   help="threads that multiply (tile pool, BLAS, compiled kernels; default: the cores)")
    if kernels:
        p.add_argument("--kernels", choices=KERNEL_CHOICES, default=None,
                       help="matrix-product kernels: auto (compiled with numba when it imports), numba, or numpy "
                       f"(the reference path); default: ${KERNELS_VARIABLE}, else auto")
