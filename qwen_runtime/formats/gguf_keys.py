"""The GGUF keys of a model's hyper-parameters: one table for the reader, the writer and verify (docs §4.2).

Each :class:`ModelKey` says which :class:`~qwen_runtime.formats.config.ModelConfig` field a key carries, its GGUF
type, the architectures whose files carry it (llama.cpp reads it for them), where llama.cpp's converter
writes it, and llama.cpp's value when it is absent.  :func:`qwen_runtime.formats.gguf_config.config_from_gguf`
reads the keys, ``qwen_convert.gguf_metadata`` writes them and ``qwen_convert.verify`` checks them against the
source.  Key names are ``gguf.Keys`` templates, expanded per architecture by :func:`gguf_key`.

A new key is one row: ``encode``/``decode`` where the stored value is not the field itself (a per-layer bool
array for ``layer_types``, say), a ``default`` where llama.cpp derives it when absent, and a ``decode`` that
raises :class:`~qwen_runtime.errors.ConfigError` for values no model can have (the reader adds file and key).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gguf import GGUFValueType, Keys

from ..errors import ConfigError
from .archs import FULL_ATTENTION, LINEAR_ATTENTION, QWEN2, QWEN3, QWEN35, layer_types_from_interval
from .rope import ROPE_SCALING_TYPES, YARN, YARN_BETA_FAST, YARN_BETA_SLOW, RopeScaling

UINT32, FLOAT32, INT32, BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.INT32, GGUFValueType.BOOL
STRING = GGUFValueType.STRING
# gguf 0.19 (our dependency) predates this key; llama.cpp's gguf-py names it Keys.Attention.RECURRENT_LAYERS.
RECURRENT_LAYERS = getattr(Keys.Attention, "RECURRENT_LAYERS", "{arch}.attention.recurrent_layers")
ALL = (QWEN2, QWEN3, QWEN35)
Config = Any  # a qwen_runtime.formats.config.ModelConfig
Fields = Mapping[str, Any]  # ModelConfig fields by name (those read so far, for the reader)
# A default is called with the fields and the file's metadata (the vocabulary size defaults to the token count).


@dataclass(frozen=True)
class ModelKey:
    """One GGUF metadata key of the model table."""

    key: str  # gguf.Keys template, e.g. "{arch}.block_count"
    type: GGUFValueType  # of the value, or of each element of an array
    field: str  # the ModelConfig field it carries
    archs: tuple[str, ...]  # architectures whose files carry it (llama.cpp reads it for them)
    default: Callable[[Fields, Mapping[str, Any]], Any] | None = None  # llama.cpp's value when absent; None: required
    written: tuple[str, ...] | None = None  # where llama.cpp's converter (and ours) writes it; None: every arch
    encode: Callable[[Config], Any] | None = None  # the stored value, when not the field itself
    decode: Callable[[Any, Fields], Any] | None = None  # the field from the stored value, when not the value itself
    array: bool = False

    def written_for(self, arch: str) -> bool:
        return arch in (self.archs if self.written is None else self.written)

    def value(self, config: Config) -> Any:
        """The value a file of ``config`` stores under this key."""
        return self.encode(config) if self.encode else getattr(config, self.field)

    def field_value(self, stored: Any, fields: Fields) -> Any:
        """The config field's value from the stored value (and the fields read before it)."""
        return self.decode(stored, fields) if self.decode else stored


def gguf_key(template: str, arch: str) -> str:
    """Expand a ``gguf.Keys`` template such as ``{arch}.block_count``."""
    return template.format(arch=arch)


def _rope_sections(c: Config) -> list[int]:
    """IMROPE sections padded to 4; without mrope_section every rotary slot uses the text position."""
    sections = list(c.mrope_sections) or [c.rotary_dim // 2]
    return (sections + [0, 0, 0, 0])[:4]


def _positive(value: int, fields: Fields) -> int:
    if value <= 0:
        raise ConfigError(f"must be positive, got {value}")
    return value


def _head_size(fields: Fields, meta: Mapping[str, Any]) -> int:
    return fields["hidden_size"] // max(fields["num_attention_heads"], 1)


def _layer_types_from_interval(fields: Fields, meta: Mapping[str, Any]) -> tuple[str, ...]:
    return layer_types_from_interval(fields["num_hidden_layers"], fields["full_attention_interval"])


def _layer_types(recurrent: list[bool], fields: Fields) -> tuple[str, ...]:
    """Per-layer types from llama.cpp's recurrent flags; flags past the decoder layers belong to the
    multi-token-prediction blocks newer converters append (full attention, so False)."""
    layers = fields["num_hidden_layers"]
    if len(recurrent) < layers or any(recurrent[layers:]):
        raise ConfigError(f"has {len(recurrent)} entries for {layers} layers (plus only non-recurrent MTP blocks)")
    return tuple(LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent[:layers])


def _token_count(fields: Fields, meta: Mapping[str, Any]) -> int:
    tokens = meta.get(Keys.Tokenizer.LIST)
    return len(tokens) if tokens is not None else 0


# In reading order: a default or a decode may use the fields of the rows above it.
MODEL_KEYS: tuple[ModelKey, ...] = (
    ModelKey(Keys.LLM.BLOCK_COUNT, UINT32, "num_hidden_layers", ALL),
    ModelKey(Keys.LLM.CONTEXT_LENGTH, UINT32, "max_position_embeddings", ALL),
    ModelKey(Keys.LLM.EMBEDDING_LENGTH, UINT32, "hidden_size", ALL),
    ModelKey(Keys.LLM.FEED_FORWARD_LENGTH, UINT32, "intermediate_size", ALL),
    ModelKey(Keys.LLM.VOCAB_SIZE, UINT32, "vocab_size", ALL, _token_count, written=()),
    ModelKey(Keys.Attention.HEAD_COUNT, UINT32, "num_attention_heads", ALL),
    ModelKey(Keys.Attention.HEAD_COUNT_KV, UINT32, "num_key_value_heads", ALL, lambda f, m: f["num_attention_heads"]),
    ModelKey(Keys.Attention.KEY_LENGTH, UINT32, "head_dim", ALL, _head_size, written=(QWEN3, QWEN35)),
    ModelKey(Keys.Attention.VALUE_LENGTH, UINT32, "head_dim", ALL, _head_size, written=(QWEN3, QWEN35)),
    ModelKey(Keys.Attention.LAYERNORM_RMS_EPS, FLOAT32, "rms_norm_eps", ALL),
    ModelKey(Keys.Rope.FREQ_BASE, FLOAT32, "rope_theta", ALL, lambda f, m: 10000.0),
    # llama.cpp defaults the rotary width to the head size, right for qwen2/qwen3; its converter writes it
    # only where it differs (qwen35's partial rotary), and so do we.
    ModelKey(Keys.Rope.DIMENSION_COUNT, UINT32, "rotary_dim", ALL, lambda f, m: f["head_dim"], written=(QWEN35,)),
    ModelKey(Keys.Rope.DIMENSION_SECTIONS, INT32, "mrope_sections", (QWEN35,), lambda f, m: (),
             encode=_rope_sections, decode=lambda v, f: tuple(s for s in v if s), array=True),
    ModelKey(Keys.SSM.CONV_KERNEL, UINT32, "linear_conv_kernel_dim", (QWEN35,)),
    ModelKey(Keys.SSM.STATE_SIZE, UINT32, "linear_key_head_dim", (QWEN35,)),
    ModelKey(Keys.SSM.GROUP_COUNT, UINT32, "linear_num_key_heads", (QWEN35,)),
    ModelKey(Keys.SSM.TIME_STEP_RANK, UINT32, "linear_num_value_heads", (QWEN35,)),
    ModelKey(Keys.SSM.INNER_SIZE, UINT32, "linear_value_head_dim", (QWEN35,), encode=lambda c: c.linear_value_dim,
             decode=lambda v, f: v // max(f["linear_num_value_heads"], 1)),
    ModelKey(Keys.LLM.FULL_ATTENTION_INTERVAL, UINT32, "full_attention_interval", (QWEN35,), lambda f, m: 4,
             decode=_positive),
    # llama.cpp's converter writes a bool per layer (linear attention) from config.json's layer_types, after
    # the interval it also writes, and its loader prefers it: any layer pattern transformers accepts round-trips.
    ModelKey(RECURRENT_LAYERS, BOOL, "layer_types", (QWEN35,), _layer_types_from_interval,
             encode=lambda c: [t == LINEAR_ATTENTION for t in c.layer_types], decode=_layer_types, array=True),
)


# RoPE scaling (:mod:`qwen_runtime.formats.rope`) is one optional group of keys rather than rows of the table:
# llama.cpp's
# converter writes them only for a config.json with rope_scaling, type and factor always, YaRN's original context
# always, and YaRN's betas and attention factor only where config.json gives them (llama.cpp's defaults are
# transformers' otherwise).  Its rope.scaling.yarn_ext_factor (1 for YaRN) and yarn_log_multiplier (DeepSeek's
# mscale_all_dim) have no counterpart in Qwen's configs: a file setting them otherwise is refused.
YARN_KEYS = (Keys.Rope.SCALING_YARN_BETA_FAST, Keys.Rope.SCALING_YARN_BETA_SLOW, Keys.Rope.SCALING_YARN_ATTN_FACTOR)


def rope_scaling_metadata(config: Config) -> list[tuple[str, GGUFValueType, Any]]:
    """(key, type, value) of the ``rope.scaling.*`` keys a file of ``config`` stores (none without scaling)."""
    scaling: RopeScaling | None = config.rope_scaling
    if scaling is None:
        return []
    arch = config.arch
    out = [(gguf_key(Keys.Rope.SCALING_TYPE, arch), STRING, scaling.type),
           (gguf_key(Keys.Rope.SCALING_FACTOR, arch), FLOAT32, scaling.factor)]
    if scaling.type != YARN:
        return out
    if not scaling.truncate:
        raise ConfigError("rope_scaling.truncate is false, which GGUF cannot say (llama.cpp always truncates)")
    out.append((gguf_key(Keys.Rope.SCALING_ORIG_CTX_LEN, arch), UINT32, scaling.original_context))
    given = dict(zip(YARN_KEYS, (scaling.beta_fast, scaling.beta_slow, scaling.attention_factor), strict=True))
    defaults = dict(zip(YARN_KEYS, (YARN_BETA_FAST, YARN_BETA_SLOW, None), strict=True))
    out += [(gguf_key(key, arch), FLOAT32, value) for key, value in given.items() if value != defaults[key]]
    return out


def rope_scaling_from_metadata(meta: Mapping[str, Any], arch: str, context_length: int) -> RopeScaling | None:
    """The :class:`RopeScaling` of a file's ``rope.scaling.*`` keys, read as llama.cpp reads them (the original
    context defaults to the context length); None for type ``none`` or no type.  ConfigError names the key."""
    def value(template: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        key = gguf_key(template, arch)
        got = meta.get(key, default)
        if got is not None and (not isinstance(got, kind) or isinstance(got, bool)):
            raise ConfigError(f"metadata key {key!r} should be {getattr(kind, '__name__', 'a number')}, got {got!r}")
        return got

    number = (int, float)
    kind = value(Keys.Rope.SCALING_TYPE, str)
    if kind is None or kind == "none":
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ConfigError(f"metadata key {gguf_key(Keys.Rope.SCALING_TYPE, arch)!r} is {kind!r}; supported: none, "
                          f"{', '.join(ROPE_SCALING_TYPES)}")
    for template, neutral in ((Keys.Rope.SCALING_YARN_EXT_FACTOR, 1.0), (Keys.Rope.SCALING_YARN_LOG_MUL, 0.0)):
        if value(template, number, neutral) != neutral:
            raise ConfigError(f"metadata key {gguf_key(template, arch)!r} = {value(template, number)} is not "
                              f"supported (only {neutral})")
    factor = value(Keys.Rope.SCALING_FACTOR, number)
    if factor is None:
        raise ConfigError(f"missing metadata key {gguf_key(Keys.Rope.SCALING_FACTOR, arch)!r}")
    original = value(Keys.Rope.SCALING_ORIG_CTX_LEN, int, context_length) or context_length
    attention = value(Keys.Rope.SCALING_YARN_ATTN_FACTOR, number)
    return RopeScaling(kind, float(factor), original, float(value(Keys.Rope.SCALING_YARN_BETA_FAST, number,
                                                                  YARN_BETA_FAST)),
                       float(value(Keys.Rope.SCALING_YARN_BETA_SLOW, number, YARN_BETA_SLOW)),
                       None if attention is None else float(attention))
