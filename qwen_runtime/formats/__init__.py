"""Readers for every on-disk format; each yields a :class:`~qwen_runtime.formats.base.ModelFiles`."""

from __future__ import annotations

from pathlib import Path

from ..errors import FormatError
from .base import ModelFiles
from .config import ModelConfig
from .gguf_file import open_gguf
from .hf_dir import open_hf_dir
from .npy_dir import MANIFEST_NAME, open_npy_dir

__all__ = ["ModelFiles", "detect_format", "open_model_files", "open_gguf", "open_hf_dir", "open_npy_dir",
           "verify_model_files"]


def detect_format(path: str | Path) -> str:
    """``"gguf"``, ``"npy"`` or ``"hf"`` for a model path, or :class:`FormatError`."""
    p = Path(path)
    if not p.exists():
        raise FormatError(f"{p}: no such file or directory")
    if p.is_file():
        with open(p, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise FormatError(f"{p}: not a GGUF file (bad magic) and not a model directory")
    if (p / MANIFEST_NAME).is_file():
        return "npy"
    if (p / "config.json").is_file():
        return "hf"
    raise FormatError(f"{p}: neither an npy model directory ({MANIFEST_NAME}) nor an HF one (config.json)")


def open_model_files(path: str | Path, v_head_order: str | None = None,
                     expected: ModelConfig | None = None) -> ModelFiles:
    """Open any supported model path lazily (weights stay memory-mapped).

    ``v_head_order``: the order an HF directory's Qwen3.5 value heads are presented in (``grouped``, its own,
    by default; a converted file keeps the order it stores).  ``expected``: open a converted model (GGUF or
    npy) leniently, as a model of that config, for verification: its structure is checked as always (header,
    bounds, alignment, types and sizes; each ``.npy`` header and size against the manifest), but not its
    metadata nor its tensor set, which may be incomplete; ``config`` is then ``expected``.
    """
    fmt = detect_format(path)
    if fmt == "gguf":
        return open_gguf(path, expected)
    if fmt == "npy":
        return open_npy_dir(path, expected=expected)
    if expected is not None:
        raise FormatError(f"{path}: a Hugging Face directory is a source, not a converted output")
    return open_hf_dir(path, v_head_order=v_head_order)


def verify_model_files(path: str | Path) -> tuple[ModelFiles, str]:
    """Open a model with every integrity check; return it and a one-line account of what was checked.

    Every reader already checks structure on open (header bounds, alignment, type sizes, overlaps, the
    architecture's tensor names and shapes); an npy directory also has each file's SHA-256 recomputed and
    compared with its manifest.  Any failure is a :class:`FormatError`.
    """
    fmt = detect_format(path)
    files = open_npy_dir(path, verify=True) if fmt == "npy" else open_model_files(path)
    checks = {
        "npy": "manifest, .npy headers, sizes, SHA-256 checksums",
        "gguf": "header, metadata, alignment, offsets and bounds, type sizes",
        "hf": "config, safetensors headers, offsets and bounds, shard index",
    }[fmt]
    summary = (f"{files.path}: OK ({fmt}, {files.config.arch}, {len(files.tensors)} tensors; checked {checks}, "
               f"architecture tensor set and shapes)")
    return files, summary
