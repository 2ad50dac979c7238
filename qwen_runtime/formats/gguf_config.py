"""GGUF metadata (ours or llama.cpp's) as a :class:`ModelConfig`, through the key table of
:mod:`qwen_runtime.formats.gguf_keys`; and the multi-token-prediction blocks newer converters append, decided here
once."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gguf import GGUFValueType, Keys

from ..errors import ConfigError, UnsupportedArchitectureError
from .archs import SUPPORTED_ARCHS
from .base import is_int, is_number
from .config import MAX_LAYERS, ModelConfig, build_config, check_layer_count
from .gguf_keys import MODEL_KEYS, ModelKey, gguf_key, rope_scaling_from_metadata

MAX_MODEL_ARRAY = 4 * MAX_LAYERS  # entries of a per-layer (or rope-section) array of the model table

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
        if not is_number(value):
            raise ConfigError(f"{source}: metadata key {key!r} should be float, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{source}: metadata key {key!r} should be finite, got {value!r}")
        return float(value)
    if not is_int(value):
        raise ConfigError(f"{source}: metadata key {key!r} should be int, got {type(value).__name__} {value!r}")
    return value


def _model_keys(meta: Mapping[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The ModelConfig fields that the table of :mod:`qwen_runtime.formats.gguf_keys` gives for ``arch``."""
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
    if value is not None and not (is_int(value) and value >= 0):
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
        if not all(isinstance(v, bool) if boolean else is_int(v) for v in value):
            return None
        value = np.array(value, dtype=bool if boolean else np.int64)
    if not isinstance(value, np.ndarray) or value.ndim != 1:
        return None
    if boolean:
        return value if value.dtype.kind == "b" else None
    return value if value.dtype.kind in "iu" else None


def mtp_block_count(meta: Mapping[str, Any], arch: str) -> int:
    """How many multi-token-prediction blocks newer converters append after the decoder layers and count in
    ``block_count`` (``nextn_predict_layers``; 0 when absent or not a count)."""
    count = meta.get(gguf_key(Keys.LLM.NEXTN_PREDICT_LAYERS, arch), 0)
    return count if is_int(count) and count > 0 else 0


def without_mtp_blocks(meta: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """``meta`` with ``block_count`` net of the MTP blocks (:func:`mtp_block_count`), so that it counts the
    decoder layers the key table's fields describe."""
    meta = dict(meta)
    block_key = gguf_key(Keys.LLM.BLOCK_COUNT, arch)
    if is_int(meta.get(block_key)):
        meta[block_key] -= mtp_block_count(meta, arch)
    return meta


def is_mtp_tensor(name: str, n_layers: int, n_mtp: int) -> bool:
    """Whether ``name`` is a tensor of one of the ``n_mtp`` MTP blocks after the ``n_layers`` decoder layers
    (``blk.<i>.*`` with ``n_layers <= i < n_layers + n_mtp``); readers leave them out."""
    parts = name.split(".")
    return (len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit()
            and n_layers <= int(parts[1]) < n_layers + n_mtp)


def config_from_gguf(meta: Mapping[str, Any], source: str, *, tied: bool) -> ModelConfig:
    """Build a :class:`ModelConfig` from GGUF metadata (ours or llama.cpp's); ``tied``: the file has no
    ``output.weight`` (the LM head is the token embedding), which only its tensor list tells."""
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
    try:
        fields["rope_scaling"] = rope_scaling_from_metadata(m, arch, fields["max_position_embeddings"])
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    eos = _token_id(m, Keys.Tokenizer.EOS_ID, source)
    fields.update(
        arch=arch,
        tie_word_embeddings=tied,
        bos_token_id=_token_id(m, Keys.Tokenizer.BOS_ID, source),
        eos_token_ids=(eos,) if eos is not None else (),
    )
    return build_config(fields, source)
