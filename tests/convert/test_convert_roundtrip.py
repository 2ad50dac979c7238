"""Every fixture x {npy, gguf} x {fp32, fp16, q8_0}: read back with our readers and compare with the source.

The conversions are the session's (``converted``, tests/conftest.py), each checked against the checksums written
(``verify_written_checksums``) before it is renamed into place."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import ALL_FIXTURES, fixture
from gguf import GGUFReader, GGUFValueType, Keys, LlamaFileType, SpecialVocab, TokenType, quants
from runtime_helpers import Converted

from qwen_convert.gguf_metadata import special_vocab
from qwen_convert.policy import tensor_qtype
from qwen_runtime.formats import open_hf_dir, open_model_files
from qwen_runtime.formats.base import TOKENIZER_FILES, V_HEAD_TILED
from qwen_runtime.formats.hf_config import config_from_hf
from qwen_runtime.formats.tensors import Q8_0_BLOCK, Q8_0_DTYPE, QType

FORMATS = ("npy", "gguf")
DTYPES = ("fp32", "fp16", "q8_0")


def q8_0_bound(reference: np.ndarray) -> np.ndarray:
    """Per-element bound on |dequant(Q8_0(x)) - x|: half a step plus the fp16 rounding of the scale."""
    blocks = reference.reshape(-1, Q8_0_BLOCK)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    scale_error = np.abs(scale.astype(np.float16).astype(np.float32) - scale) * 127
    bound = scale / 2 + scale_error + 1e-6 * scale * 127  # [n_blocks, 1]
    return np.broadcast_to(bound, blocks.shape).reshape(reference.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_round_trip(converted: Converted, name: str, fmt: str, dtype: str) -> None:
    source = open_hf_dir(fixture(name), v_head_order=V_HEAD_TILED)
    result = open_model_files(converted(name, fmt, dtype))
    assert sorted(result.tensors) == sorted(source.tensors)
    assert result.v_head_order == source.v_head_order
    for tensor_name, src in source.tensors.items():
        got = result.tensors[tensor_name]
        assert got.qtype == tensor_qtype(tensor_name, src.shape, dtype), tensor_name
        reference, values = src.to_float32(), got.to_float32()
        if got.qtype == QType.F32:
            assert np.array_equal(values, reference), tensor_name
        elif got.qtype == QType.F16:
            assert np.array_equal(values, reference.astype(np.float16).astype(np.float32)), tensor_name
        else:
            assert np.array_equal(got.data, quants.quantize(reference, QType.Q8_0)), tensor_name
            assert np.all(np.abs(values - reference) <= q8_0_bound(reference)), tensor_name


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_npy_directory_layout(converted, name: str) -> None:
    out = converted(name, "npy", "q8_0")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "q8_0" and manifest["format"] == "qwen-numpy-npy"
    for tensor_name, info in manifest["tensors"].items():
        array = np.load(out / info["file"], mmap_mode="r")
        assert isinstance(array, np.memmap), tensor_name
        if info["type"] == "Q8_0":
            assert array.dtype == Q8_0_DTYPE
    source = fixture(name)
    assert config_from_hf(json.loads((out / "config.json").read_text())) is not None
    for file in TOKENIZER_FILES:
        if (source / file).is_file():
            assert (out / file).read_bytes() == (source / file).read_bytes()
    open_model_files(out)  # checksums were verified during conversion; the reader accepts the directory


def test_q8_0_npy_and_gguf_hold_the_same_bytes(converted) -> None:
    npy = open_model_files(converted("qwen3-tiny", "npy", "q8_0"))
    gguf = open_model_files(converted("qwen3-tiny", "gguf", "q8_0"))
    for name, tensor in npy.tensors.items():
        assert np.array_equal(tensor.data, gguf.tensors[name].data), name


def _fields(path: Path) -> dict[str, tuple[GGUFValueType, object]]:
    reader = GGUFReader(path)
    return {name: (field.types[-1] if field.types[0] != GGUFValueType.ARRAY else field.types[0], field.contents())
            for name, field in reader.fields.items()}


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_gguf_metadata_keys_and_types(converted, name: str) -> None:
    source = open_hf_dir(fixture(name))
    c, arch = source.config, source.config.arch
    fields = _fields(converted(name, "gguf", "q8_0"))
    U32, F32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    expected = {
        Keys.General.ARCHITECTURE: (GGUFValueType.STRING, arch),
        Keys.General.FILE_TYPE: (U32, int(LlamaFileType.MOSTLY_Q8_0)),
        Keys.General.QUANTIZATION_VERSION: (U32, 2),
        f"{arch}.block_count": (U32, c.num_hidden_layers),
        f"{arch}.context_length": (U32, c.max_position_embeddings),
        f"{arch}.embedding_length": (U32, c.hidden_size),
        f"{arch}.feed_forward_length": (U32, c.intermediate_size),
        f"{arch}.attention.head_count": (U32, c.num_attention_heads),
        f"{arch}.attention.head_count_kv": (U32, c.num_key_value_heads),
        Keys.Tokenizer.MODEL: (GGUFValueType.STRING, "gpt2"),
    }
    if arch != "qwen2":
        expected |= {f"{arch}.attention.key_length": (U32, c.head_dim),
                     f"{arch}.attention.value_length": (U32, c.head_dim)}
    if arch == "qwen35":
        expected |= {f"{arch}.rope.dimension_count": (U32, c.rotary_dim),
                     f"{arch}.ssm.conv_kernel": (U32, c.linear_conv_kernel_dim),
                     f"{arch}.ssm.state_size": (U32, c.linear_key_head_dim),
                     f"{arch}.ssm.group_count": (U32, c.linear_num_key_heads),
                     f"{arch}.ssm.time_step_rank": (U32, c.linear_num_value_heads),
                     f"{arch}.ssm.inner_size": (U32, c.linear_value_dim),
                     f"{arch}.full_attention_interval": (U32, c.full_attention_interval)}
    for key, value in expected.items():
        assert fields[key] == value, key
    assert fields[f"{arch}.rope.freq_base"][0] == F32
    assert fields[f"{arch}.rope.freq_base"][1] == pytest.approx(c.rope_theta)
    assert fields[f"{arch}.attention.layer_norm_rms_epsilon"][0] == F32
    assert fields[Keys.General.NAME][1] == name
    if arch == "qwen35":
        assert fields[f"{arch}.rope.dimension_sections"] == (GGUFValueType.ARRAY, [*c.mrope_sections, 0])


@pytest.mark.parametrize(("name", "pre", "add_bos"), [("qwen2-tiny", "qwen2", False), ("qwen3-tiny", "qwen2", None),
                                                     ("deepseek-tiny", "deepseek-r1-qwen", True),
                                                     ("qwen35-vl-tiny", "qwen2", None)])
def test_gguf_tokenizer_metadata(converted, name: str, pre: str, add_bos: bool | None) -> None:
    """(The Qwen3.5 fixtures share the fixtures' tokenizer, which splits with Qwen2's regex: 'qwen2'.)"""
    directory = fixture(name)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    config = open_hf_dir(directory).config
    fields = _fields(converted(name, "gguf", "fp16"))
    assert fields[Keys.Tokenizer.PRE][1] == pre
    tokens, types = fields[Keys.Tokenizer.LIST][1], fields[Keys.Tokenizer.TOKEN_TYPE][1]
    assert len(tokens) == len(types) == config.vocab_size
    for text, i in tokenizer["model"]["vocab"].items():
        assert tokens[i] == text and types[i] == TokenType.NORMAL
    for added in tokenizer["added_tokens"]:
        assert tokens[added["id"]] == added["content"]
        assert types[added["id"]] in (TokenType.CONTROL, TokenType.USER_DEFINED)
    unused = [i for i in range(config.vocab_size) if types[i] == TokenType.UNUSED]
    assert all(tokens[i] == f"[PAD{i}]" for i in unused)
    assert len(fields[Keys.Tokenizer.MERGES][1]) == len(tokenizer["model"]["merges"])
    assert fields[Keys.Tokenizer.EOS_ID][0] == GGUFValueType.UINT32
    assert Keys.Tokenizer.CHAT_TEMPLATE in fields
    assert fields.get(Keys.Tokenizer.ADD_BOS, (None, None))[1] == add_bos


def test_tokenizer_config_ids_win_over_config_json(converted) -> None:
    fields = _fields(converted("qwen2-tiny", "gguf", "fp16"))
    tokenizer = json.loads((fixture("qwen2-tiny") / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert fields[Keys.Tokenizer.EOS_ID][1] == ids["<|im_end|>"]  # config.json's eos_token_id is another id
    assert fields[Keys.Tokenizer.PAD_ID][1] == ids["<|endoftext|>"]
    assert fields[Keys.Tokenizer.BOS_ID][1] == json.loads((fixture("qwen2-tiny") / "config.json").read_text())[
        "bos_token_id"]  # tokenizer_config has no bos: config.json fills the gap


def _vocab_fields(special: SpecialVocab) -> tuple:
    return (special.merges, special.special_token_ids, special.add_special_token, special.chat_template)


def _tokenizer_variant(tmp_path: Path, name: str, edit) -> Path:
    """A copy of a fixture's tokenizer files (and config.json) with ``edit(directory, tokenizer)`` applied."""
    directory = tmp_path / name
    directory.mkdir()
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(fixture(name) / file, directory / file)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    edit(directory, tokenizer)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


def _jinja_template_and_string_merges(directory: Path, tokenizer: dict) -> None:
    tokenizer["model"]["merges"] = [" ".join(pair) for pair in tokenizer["model"]["merges"]]
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "chat_template.jinja").write_text(config.pop("chat_template"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def _merges_txt_only(directory: Path, tokenizer: dict) -> None:
    lines = [" ".join(pair) for pair in tokenizer["model"]["merges"]]
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(lines) + "\n")
    tokenizer["model"]["merges"] = []


def _merges_with_spaces(directory: Path, tokenizer: dict) -> None:
    tokenizer["model"]["merges"][:2] = [["a b", "c"], [" ", "d "]]


@pytest.mark.parametrize("edit", [None, _jinja_template_and_string_merges, _merges_txt_only, _merges_with_spaces])
@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_special_vocab_matches_gguf_reading_the_directory(tmp_path: Path, name: str, edit) -> None:
    directory = fixture(name) if edit is None else _tokenizer_variant(tmp_path, name, edit)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    vocab_size = open_hf_dir(fixture(name)).config.vocab_size
    reference = SpecialVocab(directory, load_merges=True, n_vocab=vocab_size)
    assert _vocab_fields(special_vocab(directory, tokenizer, vocab_size)) == _vocab_fields(reference)


def test_special_vocab_does_not_parse_tokenizer_json_again(tmp_path: Path) -> None:
    directory = _tokenizer_variant(tmp_path, "qwen3-tiny", lambda directory, tokenizer: None)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    expected = _vocab_fields(SpecialVocab(directory, load_merges=True, n_vocab=512))
    (directory / "tokenizer.json").write_text("not JSON")
    assert _vocab_fields(special_vocab(directory, tokenizer, 512)) == expected
