"""Convert, quantize and inspect Qwen models: HF safetensors -> npy directories or GGUF files."""

from .convert import ConvertResult, convert
from .inspect import compare, model_stats

__all__ = ["ConvertResult", "compare", "convert", "model_stats"]
