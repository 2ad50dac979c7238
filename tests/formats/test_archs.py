"""The per-architecture specs and the GGUF key table that the reader, the writer and verify share."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
from runtime_helpers import fixture_dir

from qwen_runtime.errors import ConfigError
from qwen_runtime.formats import open_model_files
from qwen_runtime.formats.archs import ARCHS, FULL_ATTENTION, LINEAR_ATTENTION, layer_types_from_interval
from qwen_runtime.formats.config import ModelConfig
from qwen_runtime.formats.gguf_config import config_from_gguf
from qwen_runtime.formats.gguf_keys import MODEL_KEYS, gguf_key
from qwen_runtime.formats.hf_config import HF_ARCHITECTURES, hf_arch

FIXTURES = ("qwen2-tiny", "deepseek-tiny", "qwen3-tiny", "qwen35-tiny", "qwen35-tiny-gqa")


def gguf_key_templates() -> set[str]:
    groups = [getattr(gguf.Keys, name) for name in dir(gguf.Keys) if not name.startswith("_")]
    return {getattr(g, k) for g in groups for k in dir(g) if not k.startswith("_") and isinstance(getattr(g, k), str)}


def test_keys_are_the_gguf_package_constants_and_fields_are_config_fields() -> None:
    # plus the one key newer than gguf 0.19, named as llama.cpp's gguf-py names it
    templates = gguf_key_templates() | {"{arch}.attention.recurrent_layers"}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for row in MODEL_KEYS:
        assert row.key in templates, row.key
        assert row.field in fields, row.field
        assert set(row.written or ()) <= set(row.archs) <= set(ARCHS), row.key


@pytest.mark.parametrize("name", FIXTURES)
def test_what_the_writer_stores_the_reader_reads_back(name: str) -> None:
    """Through the table alone: every key written for the architecture, then config_from_gguf."""
    config = open_model_files(fixture_dir(name)).config
    meta = {gguf.Keys.General.ARCHITECTURE: config.arch, gguf.Keys.Tokenizer.LIST: ["t"] * config.vocab_size}
    meta |= {gguf_key(row.key, config.arch): row.value(config) for row in MODEL_KEYS if row.written_for(config.arch)}
    read = config_from_gguf(meta, name, tied=config.tie_word_embeddings)
    for row in MODEL_KEYS:
        if config.arch in row.archs:
            assert getattr(read, row.field) == getattr(config, row.field), row.key
    assert read.layer_types == config.layer_types


def test_every_hf_architecture_maps_to_its_spec() -> None:
    for spec in ARCHS.values():
        for hf in spec.hf_architectures:
            assert HF_ARCHITECTURES[hf] == spec.name == hf_arch({"architectures": [hf]})
        for model_type in spec.hf_model_types:
            assert hf_arch({"model_type": model_type}) == spec.name


def test_layer_types_from_the_interval() -> None:
    assert layer_types_from_interval(8, 4) == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,) + (LINEAR_ATTENTION,) * 3 + (
        FULL_ATTENTION,)
    assert layer_types_from_interval(2, 1) == (FULL_ATTENTION, FULL_ATTENTION)


def test_recurrent_layers_carry_any_layer_pattern() -> None:
    """llama.cpp's per-layer recurrent flags: read in preference to the interval, derived from it when absent,
    MTP blocks' trailing False flags allowed, anything else refused naming the key."""
    config = open_model_files(fixture_dir("qwen35-tiny")).config
    meta = {gguf.Keys.General.ARCHITECTURE: config.arch, gguf.Keys.Tokenizer.LIST: ["t"] * config.vocab_size}
    meta |= {gguf_key(r.key, config.arch): r.value(config) for r in MODEL_KEYS if r.written_for(config.arch)}
    key = "qwen35.attention.recurrent_layers"
    assert meta[key] == [True, True, True, False]
    assert config_from_gguf(meta, "f.gguf", tied=True).layer_types == config.layer_types
    meta[key] = [False, True, False, True]
    assert config_from_gguf(meta, "f.gguf", tied=True).layer_types == (FULL_ATTENTION, LINEAR_ATTENTION) * 2
    meta[key] = [False, True, False, True, False]  # one MTP block appended
    assert config_from_gguf(meta, "f.gguf", tied=True).layer_types == (FULL_ATTENTION, LINEAR_ATTENTION) * 2
    del meta[key]
    assert config_from_gguf(meta, "f.gguf", tied=True).layer_types == config.layer_types
    for bad, match in (([1, 0, 1, 0], "should be an array of booleans"), ([True, False], "has 2 entries for 4")):
        with pytest.raises(ConfigError, match=f"'{key}'.*{match}"):
            config_from_gguf({**meta, key: bad}, "f.gguf", tied=True)


def test_gguf_metadata_errors_name_the_file_and_key() -> None:
    config = open_model_files(fixture_dir("qwen35-tiny")).config
    meta = {gguf.Keys.General.ARCHITECTURE: config.arch, gguf.Keys.Tokenizer.LIST: ["t"] * config.vocab_size}
    meta |= {gguf_key(r.key, config.arch): r.value(config) for r in MODEL_KEYS if r.written_for(config.arch)}
    with pytest.raises(ConfigError, match=r"f\.gguf: metadata key 'qwen35\.full_attention_interval': must be positive"):
        config_from_gguf({**meta, "qwen35.full_attention_interval": 0}, "f.gguf", tied=True)
    with pytest.raises(ConfigError, match=r"f\.gguf: 'qwen35\.block_count' - nextn_predict_layers must be in"):
        config_from_gguf({**meta, "qwen35.block_count": 10**9}, "f.gguf", tied=True)
    with pytest.raises(ConfigError, match="disagrees with"):
        config_from_gguf({**meta, "qwen35.attention.value_length": config.head_dim + 1}, "f.gguf", tied=True)
    assert config_from_gguf({**meta, "qwen35.block_count": config.num_hidden_layers + 1,
                             "qwen35.nextn_predict_layers": 1}, "f.gguf", tied=True) == config_from_gguf(
        meta, "f.gguf", tied=True)
