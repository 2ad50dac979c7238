"""Checks on the committed tiny checkpoints in tests/fixtures (built by scripts/make_fixtures.py).

Structure tests need only the standard library and numpy (the safetensors header is parsed by hand).
The ``oracle`` tests re-run transformers on the stored prompts and compare with the stored reference .npz.
"""

from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from float_error import check_rows

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REFERENCE = FIXTURES / "reference"
NAMES = ("qwen2-tiny", "deepseek-tiny", "qwen3-tiny", "qwen35-tiny", "qwen35-tiny-gqa", "qwen35-vl-tiny")
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
PROMPT_LENGTHS = (5, 11, 17)
GREEDY_STEPS = 16
# float64 transformers on any machine vs the stored float64 logits.  float64 rounds 2^-29 times finer than
# float32, so the float64 runs differ by about 2^-29 of the float32 bound (< 1e-12), except where transformers
# computes in float32 whatever the model's dtype (the rotary inverse frequencies): those values are the same
# IEEE float32 operations on every x86-64 CPU.
FLOAT64_ATOL = 1e-9

EXPECTED_ARCH = {
    "qwen2-tiny": "Qwen2ForCausalLM",
    "deepseek-tiny": "Qwen2ForCausalLM",
    "qwen3-tiny": "Qwen3ForCausalLM",
    "qwen35-tiny": "Qwen3_5ForCausalLM",
    "qwen35-tiny-gqa": "Qwen3_5ForCausalLM",
    "qwen35-vl-tiny": "Qwen3_5ForConditionalGeneration",
}
EXPECTED_DTYPES = {
    "qwen2-tiny": {"BF16"},
    "deepseek-tiny": {"BF16", "F32"},
    "qwen3-tiny": {"BF16", "F16"},
    "qwen35-tiny": {"BF16", "F32"},
    "qwen35-tiny-gqa": {"BF16", "F32"},
    "qwen35-vl-tiny": {"BF16", "F32"},
}
# special tokens expected in each tokenizer.json: content -> (id, special)
QWEN_SPECIALS = {
    "<|endoftext|>": (480, True),
    "<|im_start|>": (481, True),
    "<|im_end|>": (482, True),
    "<think>": (483, False),
    "</think>": (484, False),
}
DEEPSEEK_SPECIALS = {
    "<｜end▁of▁sentence｜>": (480, True),
    "<｜User｜>": (481, False),
    "<｜Assistant｜>": (482, False),
    "<｜begin▁of▁sentence｜>": (483, True),
    "<think>": (484, False),
    "</think>": (485, False),
}


# ----------------------------------------------------------------------------------------------- helpers


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor entries of a .safetensors header: u64 little-endian length, then that many bytes of JSON."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def load_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return [model_dir / name for name in sorted(set(load_json(index)["weight_map"].values()))]
    return [model_dir / "model.safetensors"]


def all_tensors(model_dir: Path) -> dict[str, dict[str, Any]]:
    tensors: dict[str, dict[str, Any]] = {}
    for path in weight_files(model_dir):
        tensors.update(read_safetensors_header(path))
    return tensors


def text_config(model_dir: Path) -> dict[str, Any]:
    config = load_json(model_dir / "config.json")
    return config.get("text_config", config)


def tokenizer_size(model_dir: Path) -> int:
    tokenizer = load_json(model_dir / "tokenizer.json")
    return len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"])


def dtypes_where(tensors: dict[str, dict[str, Any]], predicate: Any) -> set[str]:
    return {info["dtype"] for name, info in tensors.items() if predicate(name)}


def oracle_module() -> Any:
    return importlib.import_module("hf_oracle")


# ----------------------------------------------------------------------------------------------- structure


@pytest.mark.parametrize("name", NAMES)
def test_fixture_files_exist(name: str) -> None:
    model_dir = FIXTURES / name
    for file in CONFIG_FILES:
        assert (model_dir / file).is_file(), f"{name}: missing {file}"
    for path in weight_files(model_dir):
        assert path.is_file(), f"{name}: missing {path.name}"
    assert (REFERENCE / f"{name}.npz").is_file()
    assert load_json(model_dir / "config.json")["architectures"] == [EXPECTED_ARCH[name]]


def test_qwen2_is_sharded() -> None:
    model_dir = FIXTURES / "qwen2-tiny"
    assert not (model_dir / "model.safetensors").exists()
    index = load_json(model_dir / "model.safetensors.index.json")
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    seen: dict[str, str] = {}
    total = 0
    for file in files:
        for tensor, info in read_safetensors_header(model_dir / file).items():
            seen[tensor] = file
            start, end = info["data_offsets"]
            total += end - start
    assert seen == index["weight_map"]
    assert total == index["metadata"]["total_size"]


@pytest.mark.parametrize("name", NAMES)
def test_dtypes(name: str) -> None:
    tensors = all_tensors(FIXTURES / name)
    assert {info["dtype"] for info in tensors.values()} == EXPECTED_DTYPES[name]


def test_deepseek_norms_and_biases_are_f32() -> None:
    tensors = all_tensors(FIXTURES / "deepseek-tiny")
    assert dtypes_where(tensors, lambda n: n.endswith(("norm.weight", ".bias"))) == {"F32"}
    assert dtypes_where(tensors, lambda n: n.endswith("proj.weight")) == {"BF16"}
    assert any(n.endswith(".bias") for n in tensors)


def test_qwen3_attention_is_f16() -> None:
    tensors = all_tensors(FIXTURES / "qwen3-tiny")
    assert dtypes_where(tensors, lambda n: ".self_attn." in n) == {"F16"}
    assert dtypes_where(tensors, lambda n: ".self_attn." not in n) == {"BF16"}


@pytest.mark.parametrize("name", ["qwen35-tiny", "qwen35-tiny-gqa", "qwen35-vl-tiny"])
def test_qwen35_ssm_params_are_f32(name: str) -> None:
    tensors = all_tensors(FIXTURES / name)
    ssm = [n for n in tensors if n.endswith(("A_log", "dt_bias"))]
    assert len(ssm) == 2 * 3  # three linear-attention layers
    assert dtypes_where(tensors, lambda n: n in ssm) == {"F32"}
    assert dtypes_where(tensors, lambda n: n not in ssm) == {"BF16"}


def test_vl_has_visual_mtp_and_language_model_prefix() -> None:
    model_dir = FIXTURES / "qwen35-vl-tiny"
    tensors = all_tensors(model_dir)
    assert any(n.startswith("model.visual.") for n in tensors)
    assert "mtp.fc.weight" in tensors and "mtp.layers.0.self_attn.q_proj.weight" in tensors
    text = [n for n in tensors if not n.startswith(("model.visual.", "mtp."))]
    assert text and all(n.startswith("model.language_model.") for n in text)
    config = load_json(model_dir / "config.json")
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    assert config["vision_config"]["out_hidden_size"] == config["text_config"]["hidden_size"]


@pytest.mark.parametrize("name", NAMES)
def test_tied_embeddings(name: str) -> None:
    tensors = all_tensors(FIXTURES / name)
    tied = text_config(FIXTURES / name).get("tie_word_embeddings", False)
    assert tied == (name != "deepseek-tiny")
    assert ("lm_head.weight" in tensors) == (not tied)


@pytest.mark.parametrize("name", NAMES)
def test_shapes_fit_config(name: str) -> None:
    model_dir = FIXTURES / name
    config = text_config(model_dir)
    tensors = all_tensors(model_dir)
    embed = next(info for n, info in tensors.items() if n.endswith("embed_tokens.weight"))
    assert embed["shape"] == [config["vocab_size"], config["hidden_size"]]
    assert config["vocab_size"] > tokenizer_size(model_dir)
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    q_rows = config["num_attention_heads"] * head_dim * (2 if "qwen35" in name else 1)
    q_proj = [info["shape"] for n, info in tensors.items() if n.endswith("self_attn.q_proj.weight")]
    assert q_proj and all(shape == [q_rows, config["hidden_size"]] for shape in q_proj)


@pytest.mark.parametrize("name", NAMES)
def test_matrix_rows_are_q8_0_friendly(name: str) -> None:
    for tensor, info in all_tensors(FIXTURES / name).items():
        if len(info["shape"]) == 2:
            assert info["shape"][1] % 32 == 0, f"{name}: {tensor} {info['shape']}"


def test_qwen35_value_heads() -> None:
    plain = text_config(FIXTURES / "qwen35-tiny")
    gqa = text_config(FIXTURES / "qwen35-tiny-gqa")
    assert plain["linear_num_key_heads"] == plain["linear_num_value_heads"] == 2
    assert (gqa["linear_num_key_heads"], gqa["linear_num_value_heads"]) == (2, 4)
    a_log = all_tensors(FIXTURES / "qwen35-tiny-gqa")["model.layers.0.linear_attn.A_log"]
    assert a_log["shape"] == [4]
    rope = plain["rope_parameters"]
    assert rope["partial_rotary_factor"] == 0.25 and sum(rope["mrope_section"]) * 2 == plain["head_dim"] // 4


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens(name: str) -> None:
    model_dir = FIXTURES / name
    expected = DEEPSEEK_SPECIALS if name == "deepseek-tiny" else QWEN_SPECIALS
    added = {t["content"]: (t["id"], t["special"]) for t in load_json(model_dir / "tokenizer.json")["added_tokens"]}
    assert added == expected
    generation = load_json(model_dir / "generation_config.json")
    if name == "deepseek-tiny":
        assert (generation["bos_token_id"], generation["eos_token_id"]) == (483, 480)
        assert load_json(model_dir / "tokenizer_config.json")["add_bos_token"] is True
    else:
        assert generation["eos_token_id"] == [482, 480]
        assert load_json(model_dir / "tokenizer_config.json")["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("name", NAMES)
def test_reference_npz(name: str) -> None:
    vocab = text_config(FIXTURES / name)["vocab_size"]
    with np.load(REFERENCE / f"{name}.npz") as ref:
        for index, length in enumerate(PROMPT_LENGTHS):
            assert ref[f"prompt_{index}"].dtype == np.int64 and ref[f"prompt_{index}"].shape == (length,)
            logits = ref[f"logits_{index}"]
            assert logits.dtype == np.float32 and logits.shape == (length, vocab)
            assert np.all(np.isfinite(logits)) and 0.5 < logits.std() < 10
        assert ref["greedy_ids"].dtype == np.int64 and ref["greedy_ids"].shape == (GREEDY_STEPS,)
        assert ref["greedy_logits"].shape == (GREEDY_STEPS, vocab)
        np.testing.assert_array_equal(ref["greedy_logits"].argmax(-1), ref["greedy_ids"])
        for index, length in enumerate(PROMPT_LENGTHS):
            assert ref[f"logits64_{index}"].dtype == np.float64 and ref[f"logits64_{index}"].shape == (length, vocab)
            assert ref[f"bound_{index}"].shape == (length,) and np.all(ref[f"bound_{index}"] > 0)
            check_rows(ref[f"logits_{index}"], ref[f"logits64_{index}"], ref[f"bound_{index}"],
                       f"{name}: stored float32 logits_{index}")
        assert ref["greedy_logits64"].shape == (GREEDY_STEPS, vocab) and ref["greedy_bound"].shape == (GREEDY_STEPS,)
        check_rows(ref["greedy_logits"], ref["greedy_logits64"], ref["greedy_bound"], f"{name}: stored greedy_logits")


# ----------------------------------------------------------------------------------------------- oracle


@pytest.mark.oracle
@pytest.mark.parametrize("name", NAMES)
def test_transformers_matches_reference(name: str) -> None:
    """Live transformers float32 against the stored float64 logits, within the derived float32 bound.

    (Not against the stored float32 logits: those carry the rounding of the machine that made them, and two
    float32 runs on different CPUs differ by up to twice the bound.)
    """
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    oracle = oracle_module()
    model_dir = FIXTURES / name
    with np.load(REFERENCE / f"{name}.npz") as ref:
        for index in range(len(PROMPT_LENGTHS)):
            live = oracle.hf_logits(model_dir, ref[f"prompt_{index}"], None)[0]
            check_rows(live, ref[f"logits64_{index}"], ref[f"bound_{index}"], f"{name}: logits_{index}")
            live64 = oracle.hf_logits(model_dir, ref[f"prompt_{index}"], None, "float64")[0]
            np.testing.assert_allclose(live64, ref[f"logits64_{index}"], rtol=0, atol=FLOAT64_ATOL)
        ids, logits = oracle.hf_greedy(model_dir, ref["prompt_0"], GREEDY_STEPS)
        check_rows(logits, ref["greedy_logits64"], ref["greedy_bound"], f"{name}: greedy_logits")
        np.testing.assert_array_equal(ids, ref["greedy_ids"])
