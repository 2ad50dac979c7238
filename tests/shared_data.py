"""Where the project's shared data lives: ``../shared`` beside the repository (as laid out for CI).

``QWEN_SHARED_DIR`` overrides the location.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(os.environ.get("QWEN_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))
MODEL_CONFIGS = SHARED / "data" / "model-configs"
TOKENIZERS = SHARED / "data" / "tokenizers"


def shared_file(path: Path) -> Path:
    """``path`` if it exists, else skip the test naming what is missing."""
    if not path.exists():
        pytest.skip(f"shared data not found: {path} (set QWEN_SHARED_DIR)")
    return path
