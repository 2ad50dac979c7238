"""A Hugging Face ``config.json`` (flat, or Qwen3.5's nested ``text_config``) as a :class:`ModelConfig`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError, UnsupportedArchitectureError
from .archs import ARCHS, FULL_ATTENTION, LINEAR_ATTENTION, layer_types_from_interval
from .base import is_int, is_number
from .config import ModelConfig, build_config, check_layer_count
from .rope import ROPE_SCALING_TYPES, YARN, YARN_BETA_FAST, YARN_BETA_SLOW, RopeScaling, yarn_mscale

# HF `architectures` entry (or `model_type` when that is absent) -> GGUF architecture name.
HF_ARCHITECTURES: dict[str, str] = {hf: spec.name for spec in ARCHS.values() for hf in spec.hf_architectures}
HF_MODEL_TYPES: dict[str, str] = {hf: spec.name for spec in ARCHS.values() for hf in spec.hf_model_types}


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
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not is_number(theta) or theta <= 0:
        raise ConfigError(f"{source}: field 'rope_theta' should be a positive number, got {theta!r}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if not is_number(partial) or not 0 < partial <= 1:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' should be a number in (0, 1], got {partial!r}")
    sections = params.get("mrope_section") or scaling.get("mrope_section") or []
    if not isinstance(sections, list) or not all(is_int(s) and s >= 0 for s in sections):
        raise ConfigError(f"{source}: field 'mrope_section' should be a list of non-negative integers")
    return float(theta), float(partial), tuple(sections)


def _rope_scaling(cfg: Mapping[str, Any], max_position: int, source: str) -> RopeScaling | None:
    """The ``rope_scaling`` (or transformers 5's ``rope_parameters``) of a config, read as transformers'
    ``modeling_rope_utils`` reads it: ``type`` is the older spelling of ``rope_type``; YaRN's original context
    defaults to ``max_position_embeddings``, and a top-level ``original_max_position_embeddings`` wins; its
    attention factor comes from ``attention_factor``, else from ``mscale``/``mscale_all_dim`` when both are
    set, else is YaRN's default."""
    found = [d for d in (cfg.get("rope_parameters"), cfg.get("rope_scaling")) if isinstance(d, dict)
             and (d.get("rope_type") or d.get("type")) not in (None, "default", "mrope")]
    if not found:
        return None
    params = found[0]
    rope_type = params.get("rope_type") or params.get("type")
    if rope_type not in ROPE_SCALING_TYPES:
        why = (" (its frequencies follow the length of the sequence run, which a KV cache built at shorter "
               "lengths cannot)" if rope_type == "dynamic" else "")
        raise ConfigError(f"{source}: rope scaling type {rope_type!r} is not supported{why}; supported: "
                          f"{', '.join(ROPE_SCALING_TYPES)}")

    def number(key: str, default: Any = None) -> Any:
        value = params.get(key)
        if value is None:
            return default
        if not is_number(value):
            raise ConfigError(f"{source}: field 'rope_scaling.{key}' should be a number, got {value!r}")
        return float(value)

    original = cfg.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    original = max_position if original is None else original
    if not is_int(original):
        raise ConfigError(f"{source}: field 'original_max_position_embeddings' should be int, got {original!r}")
    factor = number("factor", max_position / original if rope_type == YARN else None)
    if factor is None:
        raise ConfigError(f"{source}: rope scaling type {rope_type!r} needs field 'rope_scaling.factor'")
    attention = number("attention_factor")
    mscale, mscale_all_dim = number("mscale"), number("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{source}: field 'rope_scaling.truncate' should be a boolean, got {truncate!r}")
    try:
        return RopeScaling(rope_type, factor, original, number("beta_fast") or YARN_BETA_FAST,
                           number("beta_slow") or YARN_BETA_SLOW, attention, truncate)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _eos_ids(cfg: Mapping[str, Any], source: str) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(is_int(e) and e >= 0 for e in ids):
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
    max_position = _get(cfg, "max_position_embeddings", int, source, 32768)
    spec = ARCHS[arch]
    if cfg.get("attention_bias") is True and not spec.attention_bias:
        raise ConfigError(f"{source}: attention_bias is true, but {arch} models have no q/k/v biases "
                          f"(nor does llama.cpp's {arch})")
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
        max_position_embeddings=max_position,
        rope_scaling=_rope_scaling(cfg, max_position, source),
        tie_word_embeddings=_get(raw, "tie_word_embeddings", bool, source,
                                 cfg.get("tie_word_embeddings", False)),
        rotary_dim=int(head_dim * partial),
        bos_token_id=_get(cfg, "bos_token_id", int, source, None),
        eos_token_ids=_eos_ids(cfg, source),
    )
    if spec.hybrid:
        fields.update(_linear_fields(cfg, layers, source), mrope_sections=sections)
    return build_config(fields, source)


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
    )

