"""The real-model data the tests use, all inside the repository (``tests/data``, see its README).

``MODEL_CONFIGS``: small Hugging Face JSON files of real models. ``tokenizer_json(name)``: the real Qwen
tokenizers (``qwen2_qwen3``, ``qwen3_5``), rebuilt once from their compressed packs.
"""

from __future__ import annotations

from pathlib import Path

from real_tokenizers import tokenizer_json, tokenizers_dir

DATA = Path(__file__).resolve().parents[1] / "data"
MODEL_CONFIGS = DATA / "model-configs"

__all__ = ["DATA", "MODEL_CONFIGS", "tokenizer_json", "tokenizers_dir"]
