"""qwen_runtime: run Qwen2 / Qwen2.5 / DeepSeek-R1-Distill-Qwen / Qwen3 (and Qwen3.5) with numpy alone.

    from qwen_runtime import load
    model = load("path/to/model")          # HF dir, npy dir or GGUF file; weights stay memory-mapped
    logits = model.logits(ids)             # int [B, T] -> float32 [B, T, V]
"""

from __future__ import annotations

from pathlib import Path

from .models import Model, build_model
from .weights import TILE_ELEMENTS

__all__ = ["Model", "load"]


def load(path: str | Path, tile_elements: int = TILE_ELEMENTS) -> Model:
    """Open a model (HF directory, npy directory or GGUF file) for inference.

    Weights are memory-mapped and used in their stored type; ``tile_elements`` sets how many weights of a
    BF16/F16/Q8_0 matrix are widened to float32 at a time.
    """
    return build_model(path, tile_elements)
