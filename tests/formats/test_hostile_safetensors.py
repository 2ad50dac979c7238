"""Hostile Hugging Face directories: safetensors headers, shard indexes, paths and config.json."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from hostile_helpers import copy_fixture

from qwen_runtime.errors import ConfigError, FormatError, UnsupportedArchitectureError
from qwen_runtime.formats import open_hf_dir
from qwen_runtime.formats.safetensors import read_header
from qwen_runtime.text.chat import load_chat_format


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write(path: Path, header: bytes, buffer: bytes, length: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + buffer)
    return path


def edit_header(path: Path, edit: Callable[[dict], None]) -> Path:
    header, buffer = split(path)
    edit(header)
    return write(path, json.dumps(header).encode(), buffer)


@pytest.fixture
def single(tmp_path: Path) -> Path:
    return copy_fixture("qwen3-tiny", tmp_path) / "model.safetensors"


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    return copy_fixture("qwen2-tiny", tmp_path)


def fails(path: Path, *fragments: str, error: type = FormatError) -> None:
    with pytest.raises(error) as info:
        read_header(path) if path.suffix == ".safetensors" else open_hf_dir(path)
    for fragment in (str(path), *fragments):
        assert fragment in str(info.value), str(info.value)


def first_tensor(header: dict) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def test_header_length_beyond_the_file(single: Path) -> None:
    header, buffer = split(single)
    write(single, json.dumps(header).encode(), buffer, length=len(buffer) + 10**6)
    fails(single, "exceeds the file size")
    write(single, b"{}", b"", length=1 << 62)
    fails(single, "exceeds the file size")
    single.write_bytes(b"\x01\x02")
    fails(single, "truncated")


@pytest.mark.parametrize(("header", "fragment"), [
    (b"{not json", "invalid JSON"), (b'{"a": "\xff"}', "invalid JSON"), (b"[1, 2]", "not a JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, "invalid JSON"), (b'{"x": NaN}', "invalid JSON"),
    (b'{"__metadata__": {"k": 1}}', "__metadata__"),
])
def test_invalid_header_json(single: Path, header: bytes, fragment: str) -> None:
    write(single, header, b"")
    fails(single, fragment)


def test_duplicate_json_keys(single: Path) -> None:
    header, buffer = split(single)
    name = first_tensor(header)
    text = json.dumps(header)
    duplicated = text[:-1] + f", {json.dumps(name)}: {json.dumps(header[name])}}}"
    write(single, duplicated.encode(), buffer)
    fails(single, "duplicate key", repr(name))


def test_overlapping_offsets(single: Path) -> None:
    def overlap(h: dict) -> None:
        names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        a, b = h[names[0]], h[names[1]]
        if a["data_offsets"][1] - a["data_offsets"][0] == b["data_offsets"][1] - b["data_offsets"][0]:
            b["data_offsets"] = list(a["data_offsets"])
        else:
            b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + b["data_offsets"][1]
                                 - b["data_offsets"][0]]
    fails(edit_header(single, overlap), "overlap")


def test_out_of_bounds_offsets(single: Path) -> None:
    def shift(h: dict) -> None:
        name = first_tensor(h)
        begin, end = h[name]["data_offsets"]
        h[name]["data_offsets"] = [begin + 10**9, end + 10**9]
    fails(edit_header(single, shift), "past the end of the file")


def test_truncated_data(single: Path) -> None:
    single.write_bytes(single.read_bytes()[:-8])
    fails(single, "truncated")


def test_trailing_bytes_belong_to_no_tensor(single: Path) -> None:
    single.write_bytes(single.read_bytes() + b"\0" * 64)
    fails(single, "whole buffer")


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("dtype", "I64", "unsupported dtype 'I64'"), ("dtype", "BOOL", "unsupported dtype"),
    ("dtype", ["F32"], "unsupported dtype"), ("shape", [-1, 4], "invalid shape"), ("shape", "4", "invalid shape"),
    ("shape", [True], "invalid shape"), ("data_offsets", [5, 1], "invalid data_offsets"),
    ("data_offsets", [0], "invalid data_offsets"), ("data_offsets", [0.0, 4.0], "invalid data_offsets"),
    ("shape", [10**30, 10**30], "needs"),
])
def test_bad_entry_fields(single: Path, field: str, value: object, fragment: str) -> None:
    def bad(h: dict) -> None:
        h[first_tensor(h)][field] = value
    header, _ = split(single)
    fails(edit_header(single, bad), repr(first_tensor(header)), fragment)


def test_dtype_size_disagreement(single: Path) -> None:
    def widen(h: dict) -> None:
        entry = h[first_tensor(h)]
        entry["dtype"] = "F32" if entry["dtype"] != "F32" else "F16"
    fails(edit_header(single, widen), "needs", "data_offsets give")


def set_index(directory: Path, shard: str) -> Path:
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = shard
    index_path.write_text(json.dumps(index))
    return directory


@pytest.mark.parametrize(("shard", "fragment"), [
    ("../model-00001-of-00002.safetensors", "leaves the model directory"),
    ("/etc/passwd", "invalid path"), ("a\0b", "invalid path"), ("", "invalid path"),
    ("sub\\..\\x", "invalid path"),
])
def test_index_naming_shards_outside(sharded: Path, shard: str, fragment: str) -> None:
    fails(set_index(sharded, shard), fragment)


def test_index_shard_symlink_leaving_the_directory(sharded: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((sharded / "model-00001-of-00002.safetensors").read_bytes())
    os.symlink(outside, sharded / "evil.safetensors")
    fails(set_index(sharded, "evil.safetensors"), "leaves the model directory")


def test_index_weight_map_invalid(sharded: Path) -> None:
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": {"a": 1}}')
    fails(sharded, "weight_map")


def test_config_symlink_leaving_the_directory(sharded: Path, tmp_path: Path) -> None:
    outside = tmp_path / "config.json"
    (sharded / "config.json").rename(outside)
    os.symlink(outside, sharded / "config.json")
    fails(sharded, "leaves the model directory")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_file_symlink_leaving_the_directory(tmp_path: Path, name: str) -> None:
    directory = copy_fixture("qwen3-tiny", tmp_path)
    outside = tmp_path / name
    (directory / name).rename(outside)
    os.symlink(outside, directory / name)
    with pytest.raises(FormatError, match="leaves the model directory"):
        load_chat_format(open_hf_dir(directory))


def test_chat_template_jinja_symlink_leaving_the_directory(tmp_path: Path) -> None:
    directory = copy_fixture("qwen3-tiny", tmp_path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    os.symlink("/etc/hostname", directory / "chat_template.jinja")
    with pytest.raises(FormatError, match="leaves the model directory"):
        load_chat_format(open_hf_dir(directory))


def test_hf_cache_snapshot_symlinks_into_blobs_are_allowed(tmp_path: Path) -> None:
    repo = tmp_path / "models--Qwen--tiny"
    source = copy_fixture("qwen3-tiny", tmp_path)
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        blob = repo / "blobs" / f"blob-{file.name}"
        file.rename(blob)
        os.symlink(Path("../../blobs") / blob.name, snapshot / file.name)
    assert open_hf_dir(snapshot).tensors


@pytest.mark.parametrize(("edit", "fragment", "error"), [
    (lambda c: c.pop("hidden_size"), "missing field 'hidden_size'", ConfigError),
    (lambda c: c.update(hidden_size="64"), "field 'hidden_size' should be int", ConfigError),
    (lambda c: c.update(num_hidden_layers=True), "should be int", ConfigError),
    (lambda c: c.update(num_hidden_layers=10**12), "num_hidden_layers must be in", ConfigError),
    (lambda c: c.update(vocab_size=-1), "vocab_size must be in", ConfigError),
    (lambda c: c.update(rms_norm_eps="small"), "rms_norm_eps", ConfigError),
    (lambda c: c.update(rope_theta=[1]), "rope_theta", ConfigError),
    (lambda c: c.update(rope_scaling="yarn"), "rope_scaling", ConfigError),
    (lambda c: c.update(eos_token_id="x"), "eos_token_id", ConfigError),
    (lambda c: c.update(architectures=[["Qwen3ForCausalLM"]]), "unsupported architecture",
     UnsupportedArchitectureError),
    (lambda c: c.update(architectures="Qwen3ForCausalLM"), "should be a list", ConfigError),
    (lambda c: c.update(num_attention_heads=3), "multiple", ConfigError),
])
def test_config_fields(tmp_path: Path, edit: Callable[[dict], object], fragment: str, error: type) -> None:
    directory = copy_fixture("qwen3-tiny", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    fails(directory, "config.json", fragment, error=error)


@pytest.mark.parametrize(("edit", "fragment"), [
    (lambda c: c["text_config"].update(linear_num_key_heads="2"), "linear_num_key_heads"),
    (lambda c: c["text_config"].update(layer_types=["linear_attention", "sliding"]), "layer_types"),
    (lambda c: c["text_config"].update(full_attention_interval=0), "full_attention_interval"),
    (lambda c: c["text_config"]["rope_parameters"].update(partial_rotary_factor=7), "partial_rotary_factor"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=["a"]), "mrope_section"),
])
def test_qwen35_config_fields(tmp_path: Path, edit: Callable[[dict], object], fragment: str) -> None:
    directory = copy_fixture("qwen35-vl-tiny", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    fails(directory, "config.json", fragment, error=ConfigError)
