"""The exceptions raised by qwen_runtime and qwen_convert.

Every problem with a file or its contents is a :class:`FormatError` (a ``ValueError``) whose message names
the file, the tensor or key, and what was expected.  CLIs catch :class:`QwenError`, print one line and
exit with the code in :data:`EXIT_CODES`.
"""

from __future__ import annotations


class QwenError(Exception):
    """Base class of every error this project raises on purpose."""


class UsageError(QwenError, ValueError):
    """Options that are invalid or do not fit together (the message names the flags); exit code 2, as argparse's
    own usage errors, so that a script sees one code for a bad command line whoever detects it."""


class FormatError(QwenError, ValueError):
    """A model file is missing, truncated, corrupt or inconsistent."""


class ModelNotFoundError(FormatError):
    """A model argument is neither an existing path nor a Hugging Face Hub id that resolves (the message says
    what was tried: the path, then the id)."""


class UnsupportedArchitectureError(FormatError):
    """The model's architecture is not one of the supported Qwen families."""


class UnsupportedTokenizerError(FormatError):
    """A tokenizer.json that no GGUF ``tokenizer.ggml.*`` keys reproduce (the message names the difference)."""


class ConfigError(FormatError):
    """A config file lacks a field or has one of the wrong type."""


class OutputExistsError(QwenError, FileExistsError):
    """An output already exists and overwriting it was not asked for."""


class OutputError(QwenError):
    """An output cannot be written (unwritable location, disk full, ...); the message names the file."""


class ResourceLimitError(QwenError, MemoryError):
    """A request would need more memory than the user allows."""


class TemplateError(QwenError, ValueError):
    """A chat template failed to render (or tried something the sandbox forbids)."""


class ContextOverflowError(QwenError, ValueError):
    """A prompt plus the requested new tokens does not fit the model's context length."""


class MissingExtraError(QwenError, ImportError):
    """An optional extra (``serve``, ``ray``, ...) that the requested feature needs is not installed."""


class KernelsError(QwenError, ValueError):
    """The kernels asked for cannot run: an unknown choice, or compiled kernels without an importable numba."""


class SchemaLimitError(QwenError, ValueError):
    """A JSON schema over one of the limits that bound what compiling and enforcing it costs (the message names
    the limit and its value: ``qwen_runtime.generation.structured.MAX_*``)."""


class VerificationError(QwenError):
    """A converted model does not match its source (the message names the first failing tensor or key)."""


# Exit codes shared by every CLI (documented in README.md).
EXIT_CODES: dict[type[QwenError], int] = {
    UnsupportedArchitectureError: 3,
    UnsupportedTokenizerError: 3,
    ConfigError: 4,
    FormatError: 2,
    UsageError: 2,
    OutputExistsError: 5,
    ResourceLimitError: 6,
    TemplateError: 7,
    ContextOverflowError: 8,
    VerificationError: 9,
    SchemaLimitError: 1,
    QwenError: 1,
}


def exit_code(err: QwenError) -> int:
    """The CLI exit code for ``err`` (most specific class wins)."""
    for cls in type(err).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 1
