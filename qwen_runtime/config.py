"""One :class:`ModelConfig` for every supported family, from ``config.json`` or GGUF metadata.

Field names follow Hugging Face's ``config.json`` so a reader can check them against the source.  The
``arch`` string is the GGUF architecture name (``qwen2``, ``qwen3``, ``qwen35``); what differs between the
architectures is in :mod:`qwen_runtime.archs`, the GGUF keys in :mod:`qwen_runtime.gguf_keys`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFValueType, Keys

from .archs import (
    ARCHS,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SUPPORTED_ARCHS,
    V_HEAD_GROUPED,
    V_HEAD_TILED,
    ArchSpec,
    layer_types_from_interval,
)
from .errors import ConfigError, UnsupportedArchitectureError
from .gguf_keys import MODEL_KEYS, ModelKey, gguf_key, without_mtp_blocks

# HF `architectures` entry (or `model_type` when that is absent) -> GGUF architecture name.
HF_ARCHITECTURES: dict[str, str] = {hf: spec.name for spec in ARCHS.values() for hf in spec.hf_architectures}
HF_MODEL_TYPES: dict[str, str] = {hf: spec.name for spec in ARCHS.values() for hf in spec.hf_model_types}

# Sanity bounds on untrusted configs: far above any real Qwen model, low enough that nothing sized from a
# config (layer lists, tensor tables, caches) can be absurd before a file or memory check sees it.
MAX_LAYERS = 1024
MAX_DIM = 1 << 20  # hidden/intermediate sizes, head counts and head dims
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 24
MAX_MODEL_ARRAY = 4 * MAX_LAYERS  # entries of a per-layer (or rope-section) array of the model table


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
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Qwen3.5)
    layer_types: tuple[str, ...] = ()
    full_attention_interval: int = 0
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    mrope_sections: tuple[int, ...] = ()
    v_head_order: str = V_HEAD_GROUPED
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_layer_count(self.num_hidden_layers, "config")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)
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
        if self.v_head_order not in (V_HEAD_GROUPED, V_HEAD_TILED):
            raise ConfigError(f"config: unknown v_head_order {self.v_head_order!r}")

    @property
    def spec(self) -> ArchSpec:
        """What this architecture does differently (:mod:`qwen_runtime.archs`)."""
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


def _build(fields: dict[str, Any], source: str) -> ModelConfig:
    """``ModelConfig(**fields)`` with validation errors naming ``source``."""
    try:
        return ModelConfig(**fields)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {str(exc).removeprefix('config: ')}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _get(cfg: Mapping[str, Any], key: str, kind: type | tuple[type, ...], source: str,
         default: Any = ...) -> Any:
    value = cfg.get(key, default)
    if value is ...:
        raise ConfigError(f"{source}: missing field {key!r}")
    if value is None and default is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: field {key!r} should be {getattr(kind, '__name__', kind)}, "
                          f"got {type(value).__name__} {value!r}")
    return value


def hf_arch(cfg: Mapping[str, Any], source: str = "config.json") -> str:
    """The GGUF architecture name for an HF config, or :class:`UnsupportedArchitectureError`."""
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(f"{source}: field 'architectures' should be a list")
    for name in archs:
        if isinstance(name, str) and name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if not archs and isinstance(model_type, str) and model_type in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[model_type]
    named = archs or [cfg.get("model_type")]
    raise UnsupportedArchitectureError(
        f"{source}: unsupported architecture {named}; supported: {sorted(HF_ARCHITECTURES)}")


def text_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten Qwen3.5's nested ``text_config`` over the top level, as llama.cpp's converter does."""
    nested = cfg.get("text_config")
    return {**cfg, **nested} if isinstance(nested, dict) else dict(cfg)


def _rope(cfg: Mapping[str, Any], source: str) -> tuple[float, float, tuple[int, ...]]:
    """(rope_theta, partial_rotary_factor, mrope_section) from either the flat or the v5 layout."""
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: field 'rope_parameters' should be an object")
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"{source}: field 'rope_scaling' should be an object")
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type is not None and rope_type not in ("default", "mrope"):
        raise ConfigError(f"{source}: rope scaling type {rope_type!r} is not supported")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not _is_number(theta) or theta <= 0:
        raise ConfigError(f"{source}: field 'rope_theta' should be a positive number, got {theta!r}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if not _is_number(partial) or not 0 < partial <= 1:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' should be a number in (0, 1], got {partial!r}")
    sections = params.get("mrope_section") or scaling.get("mrope_section") or []
    if not isinstance(sections, list) or not all(_is_int(s) and s >= 0 for s in sections):
        raise ConfigError(f"{source}: field 'mrope_section' should be a list of non-negative integers")
    return float(theta), float(partial), tuple(sections)


def _eos_ids(cfg: Mapping[str, Any], source: str) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(_is_int(e) and e >= 0 for e in ids):
        raise ConfigError(f"{source}: field 'eos_token_id' should be a non-negative integer or a list of them, "
                          f"got {eos!r}")
    return tuple(ids)


def config_from_hf(raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from a parsed HF ``config.json`` (flat or nested)."""
    arch = hf_arch(raw, source)
    cfg = text_config(raw)
    hidden = _get(cfg, "hidden_size", int, source)
    heads = _get(cfg, "num_attention_heads", int, source)
    head_dim = _get(cfg, "head_dim", int, source, None) or hidden // max(heads, 1)
    theta, partial, sections = _rope(cfg, source)
    layers = _get(cfg, "num_hidden_layers", int, source)
    check_layer_count(layers, source)
    spec = ARCHS[arch]
    partial = partial if ("partial_rotary_factor" in cfg or "rope_parameters" in cfg) else spec.partial_rotary_factor
    fields: dict[str, Any] = dict(
        arch=arch,
        hidden_size=hidden,
        intermediate_size=_get(cfg, "intermediate_size", int, source),
        num_hidden_layers=layers,
        vocab_size=_get(cfg, "vocab_size", int, source),
        num_attention_heads=heads,
        num_key_value_heads=_get(cfg, "num_key_value_heads", int, source, heads),
        head_dim=head_dim,
        rms_norm_eps=_get(cfg, "rms_norm_eps", float, source, 1e-6),
        rope_theta=theta,
        max_position_embeddings=_get(cfg, "max_position_embeddings", int, source, 32768),
        tie_word_embeddings=_get(raw, "tie_word_embeddings", bool, source,
                                 cfg.get("tie_word_embeddings", False)),
        rotary_dim=int(head_dim * partial),
        attention_bias=spec.attention_bias or bool(cfg.get("attention_bias", False)),
        qk_norm=spec.qk_norm,
        bos_token_id=_get(cfg, "bos_token_id", int, source, None),
        eos_token_ids=_eos_ids(cfg, source),
    )
    if spec.hybrid:
        fields.update(_linear_fields(cfg, layers, source), mrope_sections=sections)
    return _build(fields, source)


def _linear_fields(cfg: Mapping[str, Any], layers: int, source: str) -> dict[str, Any]:
    interval = _get(cfg, "full_attention_interval", int, source, 4)
    if interval <= 0:
        raise ConfigError(f"{source}: field 'full_attention_interval' must be positive, got {interval}")
    types = cfg.get("layer_types")
    if types is None:
        types = list(layer_types_from_interval(layers, interval))
    if not isinstance(types, list) or any(t not in (FULL_ATTENTION, LINEAR_ATTENTION) for t in types):
        raise ConfigError(f"{source}: field 'layer_types' should list 'linear_attention'/'full_attention'")
    return dict(
        layer_types=tuple(types),
        full_attention_interval=interval,
        linear_conv_kernel_dim=_get(cfg, "linear_conv_kernel_dim", int, source),
        linear_key_head_dim=_get(cfg, "linear_key_head_dim", int, source),
        linear_value_head_dim=_get(cfg, "linear_value_head_dim", int, source),
        linear_num_key_heads=_get(cfg, "linear_num_key_heads", int, source),
        linear_num_value_heads=_get(cfg, "linear_num_value_heads", int, source),
        v_head_order=V_HEAD_GROUPED,
    )


def _meta_value(meta: Mapping[str, Any], key: str, source: str, value_type: GGUFValueType,
                array: bool = False) -> Any:
    """The value stored under ``key``, of ``value_type`` (the elements', for an array); ConfigError names the key."""
    value = meta[key]
    if array:
        kind = "booleans" if value_type == GGUFValueType.BOOL else "non-negative integers"
        values = metadata_array(value, boolean=value_type == GGUFValueType.BOOL)
        if values is None or (values.dtype.kind != "b" and (values < 0).any()):
            raise ConfigError(f"{source}: metadata key {key!r} should be an array of {kind}")
        if len(values) > MAX_MODEL_ARRAY:
            raise ConfigError(f"{source}: metadata key {key!r} has {len(values)} entries, more than "
                              f"{MAX_MODEL_ARRAY}")
        return values.tolist()
    if value_type == GGUFValueType.FLOAT32:
        if not _is_number(value):
            raise ConfigError(f"{source}: metadata key {key!r} should be float, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{source}: metadata key {key!r} should be finite, got {value!r}")
        return float(value)
    if not _is_int(value):
        raise ConfigError(f"{source}: metadata key {key!r} should be int, got {type(value).__name__} {value!r}")
    return value


def _model_keys(meta: Mapping[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The ModelConfig fields that the table of :mod:`qwen_runtime.gguf_keys` gives for ``arch``."""
    fields: dict[str, Any] = {}
    for row in MODEL_KEYS:
        key = gguf_key(row.key, arch)
        if arch not in row.archs or (row.field in fields and key not in meta):
            continue
        value = _row_value(meta, row, key, fields, source)
        if fields.setdefault(row.field, value) != value:
            raise ConfigError(f"{source}: metadata key {key!r} = {value!r} disagrees with {fields[row.field]!r} "
                              f"given for {row.field} by an earlier key")
        if row.field == "num_hidden_layers":  # bounded before a later default sizes anything by it
            check_layer_count(value, source, f"{key!r} - nextn_predict_layers")
    return fields


def _row_value(meta: Mapping[str, Any], row: ModelKey, key: str, fields: Mapping[str, Any], source: str) -> Any:
    """A row's field from its stored value, or llama.cpp's default when the key is absent."""
    present = key in meta
    if not present and row.default is None:
        raise ConfigError(f"{source}: missing metadata key {key!r}")
    stored = _meta_value(meta, key, source, row.type, row.array) if present else None
    try:
        return row.field_value(stored, fields) if present else row.default(fields, meta)
    except ConfigError as exc:  # a decode's or a default's own check, e.g. a positive interval
        raise ConfigError(f"{source}: metadata key {key!r}: {exc}") from None


def _token_id(meta: Mapping[str, Any], key: str, source: str) -> int | None:
    value = meta.get(key)
    if value is not None and not (_is_int(value) and value >= 0):
        raise ConfigError(f"{source}: metadata key {key!r} should be a token id, got {value!r}")
    return value


def is_metadata_array(value: Any) -> bool:
    """Whether a GGUF metadata value is an array: the parser's read-only numpy view of numbers or its
    ``GGUFStrings`` (or a list, in metadata built by hand)."""
    return (isinstance(value, Sequence) and not isinstance(value, str)) or (
        isinstance(value, np.ndarray) and value.ndim == 1)


def metadata_array(value: Any, boolean: bool = False) -> np.ndarray | None:
    """A GGUF array of integers (``boolean``: of booleans) as a 1-D numpy array, without copying the parser's
    view; None when ``value`` is not one.  Lists (metadata built by hand) are converted."""
    if isinstance(value, list):
        if not all(isinstance(v, bool) if boolean else _is_int(v) for v in value):
            return None
        value = np.array(value, dtype=bool if boolean else np.int64)
    if not isinstance(value, np.ndarray) or value.ndim != 1:
        return None
    if boolean:
        return value if value.dtype.kind == "b" else None
    return value if value.dtype.kind in "iu" else None


def config_from_gguf(meta: Mapping[str, Any], source: str) -> ModelConfig:
    """Build a :class:`ModelConfig` from GGUF metadata (ours or llama.cpp's)."""
    arch = meta.get(Keys.General.ARCHITECTURE)
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchitectureError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: {list(SUPPORTED_ARCHS)}")
    m = {k: (v.item() if hasattr(v, "item") and getattr(v, "ndim", 1) == 0 else v) for k, v in meta.items()}
    tokens = m.get(Keys.Tokenizer.LIST)
    if tokens is not None and not is_metadata_array(tokens):
        raise ConfigError(f"{source}: metadata key {Keys.Tokenizer.LIST!r} should be an array")
    nextn_key = gguf_key(Keys.LLM.NEXTN_PREDICT_LAYERS, arch)
    if nextn_key in m:
        _meta_value(m, nextn_key, source, GGUFValueType.UINT32)  # an integer, or a ConfigError naming the key
    fields = _model_keys(without_mtp_blocks(m, arch), arch, source)
    spec = ARCHS[arch]
    eos = _token_id(m, Keys.Tokenizer.EOS_ID, source)
    fields.update(
        arch=arch,
        tie_word_embeddings=False,  # decided by the reader from the presence of output.weight
        qk_norm=spec.qk_norm,
        attention_bias=spec.attention_bias,
        bos_token_id=_token_id(m, Keys.Tokenizer.BOS_ID, source),
        eos_token_ids=(eos,) if eos is not None else (),
    )
    if spec.hybrid:
        fields["v_head_order"] = V_HEAD_TILED
    return _build(fields, source)
