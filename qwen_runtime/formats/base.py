"""What every reader returns: config, canonical tensors and where the tokenizer lives."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ModelConfig
from ..errors import FormatError
from ..tensors import StoredTensor

# Files copied next to the weights and read for the tokenizer, chat template and stop tokens.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json", "special_tokens_map.json")


@dataclass
class ModelFiles:
    """An opened model: its config, its tensors under canonical GGUF names, and its tokenizer sources.

    ``tensors`` holds weights in the canonical form of llama.cpp's converter (Qwen3.5 norms with +1 baked
    in, ``ssm_a = -exp(A_log)``, squeezed conv); ``config.v_head_order`` says how Qwen3.5 value heads are
    ordered.  ``directory`` is set for HF and npy directories (tokenizer files live there); ``metadata``
    holds GGUF key/values (or the npy manifest).
    """

    path: Path
    format: str
    config: ModelConfig
    tensors: dict[str, StoredTensor]
    directory: Path | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    hf_config: dict[str, Any] | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # source tensor -> why it was not used

    def tensor(self, name: str) -> StoredTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: tensor {name!r} is missing") from None

    def read_json(self, name: str) -> dict[str, Any] | None:
        """A JSON file of the model directory (None when absent or when the model is a GGUF file)."""
        if self.directory is None:
            return None
        return read_json_file(self.directory / name, required=False)


def read_json_file(path: Path, required: bool = True, limit: int = 64 << 20) -> dict[str, Any] | None:
    """Parse a JSON object file, raising :class:`FormatError` naming the file on any problem."""
    if not path.is_file():
        if required:
            raise FormatError(f"{path}: file not found")
        return None
    if path.stat().st_size > limit:
        raise FormatError(f"{path}: {path.stat().st_size} bytes is larger than the {limit}-byte limit")
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def contained_path(root: Path, relative: str, what: str) -> Path:
    """``root / relative``, refusing absolute paths, ``..`` and symlinks that leave ``root``."""
    if not isinstance(relative, str) or not relative or os.path.isabs(relative) or "\\" in relative:
        raise FormatError(f"{root}: {what} names an invalid path {relative!r}")
    target = (root / relative).resolve()
    base = root.resolve()
    if base != target and base not in target.parents:
        raise FormatError(f"{root}: {what} path {relative!r} leaves the model directory")
    return target
