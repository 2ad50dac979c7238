"""What every reader returns: config, canonical tensors, the order of Qwen3.5's value heads and where the
tokenizer lives."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FormatError
from .config import ModelConfig
from .tensors import StoredTensor

# Value-head order of Qwen3.5's linear attention when value heads outnumber key heads: HF groups the value
# heads of one key head together; llama.cpp's converter tiles them so value head j uses key head j % Hk.
# A storage convention: readers turn it into a permutation (:func:`v_head_permutation`) for the models.
V_HEAD_GROUPED = "grouped"
V_HEAD_TILED = "tiled"
V_HEAD_ORDERS = (V_HEAD_GROUPED, V_HEAD_TILED)

# Files copied next to the weights and read for the tokenizer, chat template and stop tokens.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json", "special_tokens_map.json")


@dataclass
class ModelFiles:
    """An opened model: its config, its tensors under canonical GGUF names, and its tokenizer sources.

    ``tensors`` holds weights in the canonical form of llama.cpp's converter (Qwen3.5 norms with +1 baked
    in, ``ssm_a = -exp(A_log)``, squeezed conv); ``v_head_order`` names the order Qwen3.5's value heads
    are stored in, and :attr:`v_head_perm` is that order as the models use it.  ``directory`` is set for HF
    and npy directories (tokenizer files live there); ``metadata`` holds GGUF key/values (or the npy manifest).
    """

    path: Path
    format: str
    config: ModelConfig
    tensors: dict[str, StoredTensor]
    directory: Path | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    hf_config: dict[str, Any] | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # source tensor -> why it was not used
    v_head_order: str = V_HEAD_GROUPED

    @property
    def v_head_perm(self) -> np.ndarray | None:
        """Which of the model's value heads each stored one is, int ``[Hv]`` (None: stored in order)."""
        c = self.config
        if not c.has_linear_attention:
            return None
        return v_head_permutation(self.v_head_order, c.linear_num_key_heads, c.linear_num_value_heads)

    def tensor(self, name: str) -> StoredTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: tensor {name!r} is missing") from None

    def read_json(self, name: str) -> dict[str, Any] | None:
        """A JSON file of the model directory (None when absent or when the model is a GGUF file)."""
        if self.directory is None:
            return None
        return read_json_file(self.file(name), required=False)

    def file(self, name: str) -> Path:
        """A file of the model directory, refused when it (or a symlink) leads outside the directory."""
        if self.directory is None:
            raise FormatError(f"{self.path}: a {self.format} model has no directory of files")
        return contained_path(self.directory, name, "file")


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON and GGUF values both decode ``true`` as a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def v_head_permutation(order: str, n_key_heads: int, n_value_heads: int) -> np.ndarray | None:
    """The model's value head each stored value head is, int ``[Hv]``, for value heads stored in ``order``.

    The model's value head h reads key head h // (Hv/Hk) (HF's grouped order: None, nothing to permute, as
    when Hv = Hk).  Tiled (llama.cpp): stored head j is r·Hk + k for the model's head k·(Hv/Hk) + r.
    """
    if order not in V_HEAD_ORDERS:
        raise FormatError(f"unknown value-head order {order!r}; expected one of {list(V_HEAD_ORDERS)}")
    if order == V_HEAD_GROUPED or n_value_heads == n_key_heads:
        return None
    stored = np.arange(n_value_heads)
    return (stored % n_key_heads) * (n_value_heads // n_key_heads) + stored // n_key_heads


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` refusing duplicate keys (which a different parser might resolve differently)."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def parse_json(raw: bytes, source: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity; any problem is a :class:`FormatError`."""
    def refuse_constant(name: str) -> None:
        raise ValueError(f"non-standard constant {name}")

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=refuse_constant)
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise FormatError(f"{source}: invalid JSON ({exc})") from None
    except RecursionError:
        raise FormatError(f"{source}: invalid JSON (nested too deeply)") from None


def read_file_bytes(path: Path, limit: int = 64 << 20) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes, or :class:`FormatError` naming it."""
    try:
        if not path.is_file():
            raise FormatError(f"{path}: file not found")
        size = path.stat().st_size
        if size > limit:
            raise FormatError(f"{path}: {size} bytes is larger than the {limit}-byte limit")
        return path.read_bytes()
    except OSError as exc:
        raise FormatError(f"{path}: cannot read ({exc.strerror or exc})") from None


def read_text_file(path: Path, limit: int = 64 << 20) -> str:
    """A UTF-8 text file (see :func:`read_file_bytes`)."""
    try:
        return read_file_bytes(path, limit).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def read_json_file(path: Path, required: bool = True, limit: int = 64 << 20) -> dict[str, Any] | None:
    """Parse a JSON object file, raising :class:`FormatError` naming the file on any problem."""
    if not required and not path.is_file():
        return None
    value = parse_json(read_file_bytes(path, limit), str(path))
    if not isinstance(value, dict):
        raise FormatError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _allowed_roots(root: Path) -> list[Path]:
    """``root`` plus, for a Hugging Face cache snapshot (``<repo>/snapshots/<rev>``), the repo's ``blobs``
    directory, where the hub cache points each snapshot file's symlink."""
    absolute = root.absolute()
    roots = [root.resolve()]
    if absolute.parent.name == "snapshots":
        roots.append((absolute.parent.parent / "blobs").resolve())
    return roots


def contained_path(root: Path, relative: str, what: str) -> Path:
    """``root / relative``, refusing absolute paths, ``..`` and symlinks that leave ``root``."""
    if (not isinstance(relative, str) or not relative or os.path.isabs(relative) or "\\" in relative
            or "\0" in relative):
        raise FormatError(f"{root}: {what} names an invalid path {relative!r}")
    try:
        target = (root / relative).resolve()
    except (OSError, RuntimeError) as exc:  # symlink loops
        raise FormatError(f"{root}: {what} path {relative!r} cannot be resolved ({exc})") from None
    if not any(base == target or base in target.parents for base in _allowed_roots(root)):
        raise FormatError(f"{root}: {what} path {relative!r} leaves the model directory")
    return target
