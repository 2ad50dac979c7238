"""What every command-line entry point shares: its parser (one-line usage errors, ``--version``), turning
failures into one line and an exit code, the options of the machine a model runs on (``-t/--threads``,
``--kernels``) and speculative decoding's ``--draft``."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TextIO

from .backend.cache import CACHE_TYPES, DEFAULT_CACHE_TYPE
from .backend.compile_events import on_compiling
from .backend.limits import format_bytes, parse_memory_size
from .backend.pool import ACTIVATION_CHOICES, KERNEL_CHOICES, KERNELS_VARIABLE, STEP_TOKENS
from .errors import (
    EXIT_CODES,
    ConfigError,
    MissingExtraError,
    QwenError,
    ResourceLimitError,
    UsageError,
    exit_code,
)
from .formats.rope import ROPE_SCALING_TYPES, RopeScaling

PACKAGE = "qwen-numpy"
USAGE_ERROR = EXIT_CODES[UsageError]  # an invalid option or value, whether argparse or the command finds it
INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT
# The reader of standard output went away (`qwen-inspect --json | head`): 128 + SIGPIPE, the status a shell
# reports for a program the signal ends (`yes | head`), so `set -o pipefail` sees the output was cut short.
BROKEN_PIPE = 141
MISSING_FILE = 2  # the same code as FormatError: an input file is missing
# Memory ran out: the code of a request over the allowed memory (ResourceLimitError is a MemoryError too).
# A chat template that exhausts memory is refused by the sandbox as a TemplateError (7) instead.
OUT_OF_MEMORY = EXIT_CODES[ResourceLimitError]
# What a command says when numba starts compiling a group of kernels during its run (their first use on a machine:
# the first model of a type waits for them with nothing else on the screen; `scripts/warm_kernels.py` compiles them
# all ahead), with
# what: compile_events.describe's name of the group.
COMPILING = ("numba is compiling {what} (once per machine and version, up to a few minutes; later runs load them "
             "from its cache)")


def run_guarded(prog: str, main: Callable[[], int | None]) -> int:
    """Run ``main`` and return its exit code; errors become one line on stderr, never a traceback.  When numba
    starts compiling kernels meanwhile (not loading them from its cache), one line on stderr per group of kernels
    says which."""
    on_compiling(lambda what: sys.stderr.write(f"{prog}: {COMPILING.format(what=what)}\n"))
    try:
        code = main() or 0
        sys.stdout.flush()  # a reader that went away is seen here, not at exit as a message from Python
        return code
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE
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
        on_compiling(None)


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's final flush of what is still buffered for a
    closed pipe does not fail again and print a message."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a file descriptor (a test's capture): nothing to flush
        pass


def package_version() -> str:
    """The installed version of this project (what ``--version`` prints)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class ArgumentParser(argparse.ArgumentParser):
    """The parser of every command: help from :class:`HelpFormatter`, ``--version``, and usage errors in one line
    (``prog: error: ...``, exit code :data:`USAGE_ERROR`) instead of argparse's usage block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=f"%(prog)s {package_version()} ({PACKAGE})",
                          help="print the version and exit")

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def clamp_context(prog: str, asked: int | None, limit: int, err: TextIO) -> int:
    """``-c/--ctx`` of qwen-run and qwen-serve: ``asked`` (default: the model's context length ``limit``), cut to
    ``limit`` with a note on ``err`` when it asks for more, so that one ``--ctx`` works with models of any size."""
    if asked is None:
        return limit
    if asked > limit:
        err.write(f"{prog}: note: --ctx {asked} is more than the model's context length of {limit}; using {limit}\n")
        return limit
    return asked


def require_extra(module: str, extra: str, feature: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` when ``module`` is not installed."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{feature} needs the {extra} extra, which is not installed "
                                f"(no module {module!r}): pip install 'qwen-numpy[{extra}]'")


def integer(text: str, least: int, what: str) -> int:
    """``text`` as an integer of at least ``least``, else an argparse error saying ``what`` was expected."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return integer(text, 1, "a positive integer")


def count(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return integer(text, 0, "an integer >= 0")


def add_draft_option(p: argparse.ArgumentParser, note: str = "") -> None:
    """``--draft N``: speculative decoding by prompt lookup (``GenerationConfig.draft_tokens``, the engine's
    ``draft_tokens``); ``note`` is added to the help."""
    p.add_argument("--draft", type=draft_tokens, default=0, metavar="N",
                   help="speculative decoding by prompt lookup: greedy replies (temperature 0) verify up to N "
                   "tokens copied from the prompt and reply in one pass, with output identical to plain decoding; "
                   "sampled replies decode plainly, and it needs the compiled kernels (numba: with --kernels "
                   f"numpy it is off){note}; 1..{STEP_TOKENS - 1}, helps replies that repeat the prompt "
                   "(default 0: off)")


def window(text: str) -> int:
    """An argparse type: a perplexity window of at least 2 tokens (one to condition on, one to score)."""
    return integer(text, 2, "a window of at least 2 tokens")


def memory_size(text: str) -> int:
    """An argparse type: a memory size such as ``512M`` or ``4G``
    (:func:`~qwen_runtime.backend.limits.parse_memory_size`),
    its error worded for the command line."""
    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def draft_tokens(text: str) -> int:
    """An argparse type: draft tokens per verify pass, 0 to ``STEP_TOKENS - 1``."""
    value = integer(text, 0, f"0 to {STEP_TOKENS - 1} draft tokens")
    if value >= STEP_TOKENS:
        raise argparse.ArgumentTypeError(f"expected 0 to {STEP_TOKENS - 1} draft tokens, got {text!r}")
    return value


def add_activations_option(p: argparse.ArgumentParser, default: str = "auto") -> None:
    """``--activations``: what the products multiply (:func:`qwen_runtime.load`'s ``activations``,
    :data:`~qwen_runtime.backend.pool.ACTIVATION_CHOICES`)."""
    p.add_argument("--activations", choices=ACTIVATION_CHOICES, default=default,
                   help="float: float32 activations, exact; q8-prompts: prompts of Q8_0, Q4_K and Q6_K weights "
                   "quantize their activations to 8 bits and multiply on the CPU's AMX int8 tiles where it has "
                   "them (several times faster, not exact; decode stays exact); q8: every product of a quantized "
                   "type in integers, as llama.cpp does; auto: q8-prompts with the compiled kernels (q8 on a CPU "
                   "with AVX2 but not AVX-512, where it decodes faster), else float (default: %(default)s)")


def add_cache_type_options(p: argparse.ArgumentParser) -> None:
    """``--cache-type-k/-ctk`` and ``--cache-type-v/-ctv`` (llama.cpp's names): what the KV cache stores keys and
    values in (:func:`qwen_runtime.load`'s ``cache_type_k``/``cache_type_v``; :func:`cache_types` reads them)."""
    for flag, short, what in (("--cache-type-k", "-ctk", "keys"), ("--cache-type-v", "-ctv", "values")):
        p.add_argument(flag, short, choices=CACHE_TYPES, default=DEFAULT_CACHE_TYPE,
                       help=f"type the KV cache stores {what} in (llama.cpp's): f32 (exact), f16 or bf16 (half the "
                       f"memory, each value rounded), q8_0 (0.27x, blocks of 32 with a scale) or q4_0 (0.14x); "
                       f"default {DEFAULT_CACHE_TYPE} (llama.cpp's)")


def cache_types(args: argparse.Namespace) -> dict[str, str]:
    """The :func:`qwen_runtime.load` keywords of :func:`add_cache_type_options`' flags."""
    return {"cache_type_k": args.cache_type_k, "cache_type_v": args.cache_type_v}


def cache_note(model: Any) -> str:
    """A loaded model's KV cache types and bytes per token (and per row of a recurrent state): what ``qwen-run
    --stats`` and the server's banner print."""
    size, (keys, values) = model.cache_size, model.cache_types
    row = f", {format_bytes(size.row)} per row (recurrent state)" if size.row else ""
    return f"kv cache: keys {keys}, values {values}, {size.token} bytes per token{row}"


def add_machine_options(p: argparse.ArgumentParser, kernels: bool = True) -> None:
    """``-t/--threads N`` (the pool's threads, BLAS's and the compiled kernels'; default: the cores) and, with
    ``kernels``, ``--kernels {auto,numba,numpy}`` (default: the QWEN_KERNELS environment variable, else auto)."""
    p.add_argument("-t", "--threads", type=positive_int, default=None, metavar="N",
                   help="threads that multiply (tile pool, BLAS, compiled kernels; default: the cores)")
    if kernels:
        p.add_argument("--kernels", choices=KERNEL_CHOICES, default=None,
                       help="matrix-product kernels: auto (compiled with numba when it imports), numba, or numpy "
                       f"(the reference path); default: ${KERNELS_VARIABLE}, else auto")


def add_rope_scaling_options(p: argparse.ArgumentParser) -> None:
    """llama.cpp's ``--rope-scaling {linear,yarn}``, ``--rope-scale F`` and ``--yarn-orig-ctx N``: RoPE scaling for
    this run (the model file is not changed; :func:`rope_scaling_arg` reads them)."""
    p.add_argument("--rope-scaling", choices=ROPE_SCALING_TYPES, default=None,
                   help="run with this RoPE scaling instead of the model's (yarn: Qwen's long-context extension); "
                   "needs --rope-scale (default: the model's own scaling, if any)")
    p.add_argument("--rope-scale", type=float, default=None, metavar="F",
                   help="context scaling factor of --rope-scaling (4 extends 32768 positions to 131072; no default)")
    p.add_argument("--yarn-orig-ctx", type=lambda text: integer(text, 0, "--yarn-orig-ctx"), default=0, metavar="N",
                   help="the context the model was trained on, which --rope-scale multiplies; default 0: the model's "
                   "context length")


def rope_scaling_arg(args: argparse.Namespace) -> RopeScaling | None:
    """The :func:`qwen_runtime.load` ``rope_scaling`` of :func:`add_rope_scaling_options`' flags (None: the file's)."""
    if args.rope_scaling is None:
        if args.rope_scale is not None:
            raise UsageError("--rope-scale needs --rope-scaling linear or yarn")
        return None
    if args.rope_scale is None:
        raise UsageError(f"--rope-scaling {args.rope_scaling} needs --rope-scale F")
    try:
        return RopeScaling(args.rope_scaling, args.rope_scale, args.yarn_orig_ctx)
    except ConfigError as exc:
        raise UsageError(f"--rope-scale: {exc}") from None
