"""Shared helpers of the runtime tests: fixture paths, the session's converted copies, reference arrays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qwen_convert.convert import convert, verify_written_checksums
from qwen_convert.demo import bundled_model_path
from qwen_runtime.models import Model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DENSE_FAMILIES = ("qwen2-tiny", "qwen3-tiny", "deepseek-tiny")


def fixture_dir(name: str) -> Path:
    path = FIXTURES / name
    if not (path / "config.json").is_file():
        pytest.skip(f"fixture {name} not generated yet")
    return path


def reference(name: str) -> dict[str, np.ndarray]:
    path = FIXTURES / "reference" / f"{name}.npz"
    if not path.is_file():
        pytest.skip(f"reference {path.name} not generated yet")
    with np.load(path) as data:
        return dict(data)


class Converted:
    """The committed fixtures converted in-process by qwen_convert, each (name, format, dtype) once per session:
    ``converted(name, "npy" | "gguf" | "hf", dtype)`` is its path (``"hf"``: the fixture directory itself;
    ``"bundled"`` names the bundled model).  Each output was read back against the checksums written
    (``verify_written_checksums``).  The session shares them: read them, copy one before changing it.  Provided
    by ``tests/conftest.py`` as the session fixture ``converted``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths: dict[tuple[str, str, str], Path] = {}

    def __call__(self, name: str, fmt: str, dtype: str = "fp32") -> Path:
        src = bundled_model_path() if name == "bundled" else fixture_dir(name)
        if fmt == "hf":
            return src
        if (name, fmt, dtype) not in self.paths:
            out = self.root / f"{name}-{dtype}{'.gguf' if fmt == 'gguf' else ''}"
            self.paths[name, fmt, dtype] = convert(src, out, fmt, dtype, verify=verify_written_checksums).output
        return self.paths[name, fmt, dtype]


KERNELS = ("numpy", "numba")  # the reference kernels and their compiled twins


def load_exact(path: str | Path, **options: Any) -> Model:
    """``qwen_runtime.load`` with a float32 KV cache (its default is f16, llama.cpp's): float32 arithmetic's
    numbers, the ones the oracles (transformers, reference.py, llama.cpp with an F32 cache) are held to."""
    import qwen_runtime

    return qwen_runtime.load(path, **qwen_runtime.EXACT_CACHE, **options)


def use_kernels(model: Model, kernels: str) -> Model:
    """``model`` running on ``kernels`` (skips "numba" where numba is not installed)."""
    if kernels == "numba":
        pytest.importorskip("numba")
    model.workspace.kernels = kernels
    return model
