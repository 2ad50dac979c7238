"""Shared helpers of the runtime tests: fixture paths, converted copies, reference arrays."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qwen_runtime.models import Model

FIXTURES = Path(__file__).parent / "fixtures"
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


def converter_available() -> bool:
    return importlib.util.find_spec("qwen_convert") is not None and \
        importlib.util.find_spec("qwen_convert.__main__") is not None


def convert(src: Path, out: Path, fmt: str, dtype: str) -> Path:
    """Run ``python -m qwen_convert`` (skips the test while the converter has not landed)."""
    if not converter_available():
        pytest.skip("qwen_convert is not available yet")
    if not out.exists():
        cmd = [sys.executable, "-m", "qwen_convert", str(src), "-o", str(out), "--format", fmt, "--dtype", dtype]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"conversion failed: {proc.stderr[-2000:]}"
    return out


class Converted:
    """Per-session cache of converted fixtures: ``get(name, "npy"|"gguf"|"hf", dtype)``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, name: str, fmt: str, dtype: str = "fp32") -> Path:
        src = fixture_dir(name)
        if fmt == "hf":
            return src
        suffix = ".gguf" if fmt == "gguf" else ""
        return convert(src, self.root / f"{name}-{dtype}{suffix}", fmt, dtype)


KERNELS = ("numpy", "numba")  # the reference kernels and their compiled twins


def use_kernels(model: Model, kernels: str) -> Model:
    """``model`` running on ``kernels`` (skips "numba" where numba is not installed)."""
    if kernels == "numba":
        pytest.importorskip("numba")
    model.workspace.kernels = kernels
    return model
