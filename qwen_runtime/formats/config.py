"""One :class:`ModelConfig` for every supported family: the hyper-parameters of a model, whatever file they came from.

Field names follow Hugging Face's ``config.json`` so a reader can check them against the source.  The
``arch`` string is the GGUF architecture name (``qwen2``, ``qwen3``, ``qwen35``); what differs between the
architectures is in :mod:`qwen_runtime.formats.archs`.  The readers decode a config: ``config.json`` in
:mod:`qwen_runtime.formats.hf_config`, GGUF metadata (through the key table of :mod:`qwen_runtime.formats.gguf_keys`)
in :mod:`qwen_runtime.formats.gguf_config`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .archs import ARCHS, FULL_ATTENTION, LINEAR_ATTENTION, ArchSpec
from .rope import RopeScaling

# Sanity bounds on untrusted configs: far above any real Qwen model, low enough that nothing sized from a
# config (layer lists, tensor tables, caches) can be absurd before a file or memory check sees it.
MAX_LAYERS = 1024
MAX_DIM = 1 << 20  # hidden/intermediate sizes, head counts and head dims
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 24


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Qwen2 / Qwen3 / Qwen3.5 text decoder."""

    arch: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rotary_dim: int
    layer_types: tuple[str, ...] = ()
    full_attention_interval: int = 0
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    mrope_sections: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None  # None: the frequencies as trained (:mod:`qwen_runtime.formats.rope`)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_layer_count(self.num_hidden_layers, "config")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)
        if self.rope_scaling is not None and not self.rope_scaling.original_context:
            object.__setattr__(self, "rope_scaling", dataclasses.replace(
                self.rope_scaling, original_context=self.max_position_embeddings))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` when the values cannot describe a working model."""
        bounds = {"hidden_size": MAX_DIM, "intermediate_size": MAX_DIM, "num_hidden_layers": MAX_LAYERS,
                  "vocab_size": MAX_VOCAB, "num_attention_heads": MAX_DIM, "num_key_value_heads": MAX_DIM,
                  "head_dim": MAX_DIM, "max_position_embeddings": MAX_CONTEXT}
        for name, limit in bounds.items():
            if not 0 < getattr(self, name) <= limit:
                raise ConfigError(f"config: {name} must be in 1..{limit}, got {getattr(self, name)}")
        for name in ("rms_norm_eps", "rope_theta"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"config: {name} must be a positive finite number, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"config: num_attention_heads {self.num_attention_heads} is not a multiple "
                              f"of num_key_value_heads {self.num_key_value_heads}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(f"config: rotary dimension {self.rotary_dim} invalid for head_dim {self.head_dim}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"config: layer_types has {len(self.layer_types)} entries, "
                              f"expected num_hidden_layers={self.num_hidden_layers}")
        if self.has_linear_attention:
            self._validate_linear()

    def _validate_linear(self) -> None:
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads"):
            if not 0 < getattr(self, name) <= MAX_DIM:
                raise ConfigError(f"config: {name} must be in 1..{MAX_DIM} for linear-attention layers, "
                                  f"got {getattr(self, name)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("config: linear_num_value_heads must be a multiple of linear_num_key_heads")

    @property
    def context_window(self) -> int:
        """The longest context the model runs: its ``max_position_embeddings``, or the scaled window of its
        rope scaling when that is longer (Qwen2.5's configs keep 32768 there and ask for YaRN x4)."""
        scaled = self.rope_scaling.context if self.rope_scaling is not None else 0
        return min(max(self.max_position_embeddings, scaled), MAX_CONTEXT)

    @property
    def spec(self) -> ArchSpec:
        """What this architecture does differently (:mod:`qwen_runtime.formats.archs`)."""
        return ARCHS[self.arch]

    @property
    def has_linear_attention(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR_ATTENTION

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def check_layer_count(layers: int, source: str, name: str = "num_hidden_layers") -> None:
    """Refuse a layer count outside 1..MAX_LAYERS before anything is sized from it."""
    if not 0 < layers <= MAX_LAYERS:
        raise ConfigError(f"{source}: {name} must be in 1..{MAX_LAYERS}, got {layers}")



def build_config(fields: dict[str, Any], source: str) -> ModelConfig:
    """``ModelConfig(**fields)`` with validation errors naming ``source``."""
    try:
        return ModelConfig(**fields)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {str(exc).removeprefix('config: ')}") from None
