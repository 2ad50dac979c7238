"""Fuzzing the safetensors / HF directory reader: mutated real shards either open (and every tensor view is
readable) or raise FormatError; nothing else may escape.  ``QWEN_FUZZ_EXAMPLES`` sets the examples per test."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from hostile_helpers import FIXTURES, FUZZ, mutated, touch
from hypothesis import event, given
from hypothesis import strategies as st

from qwen_runtime.errors import FormatError
from qwen_runtime.formats import open_hf_dir

SHARD = "model.safetensors"
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**65, 2**65) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(shutil.copytree(FIXTURES / "qwen3-tiny", tmp_path_factory.mktemp("fuzz-st") / "model"))


@pytest.fixture(scope="module")
def original(model: Path) -> bytes:
    return (model / SHARD).read_bytes()


def open_or_refuse(model: Path, data: bytes) -> None:
    (model / SHARD).write_bytes(data)
    try:
        files = open_hf_dir(model)
    except FormatError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("accepted")
    touch(files)


def split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


@FUZZ
@given(data=st.data())
def test_mutated_bytes(model: Path, original: bytes, data: st.DataObject) -> None:
    focus = 8 + struct.unpack("<Q", original[:8])[0]
    open_or_refuse(model, data.draw(mutated(original, focus)))


@FUZZ
@given(data=st.data())
def test_shuffled_offsets_and_fields(model: Path, original: bytes, data: st.DataObject) -> None:
    header, buffer = split(original)
    names = sorted(k for k in header if k != "__metadata__")
    if data.draw(st.booleans()):
        order = data.draw(st.permutations(names))
        offsets = [header[n]["data_offsets"] for n in order]
        for name, span in zip(names, offsets, strict=True):
            header[name]["data_offsets"] = span
    for _ in range(data.draw(st.integers(0, 2))):
        entry = header[data.draw(st.sampled_from(names))]
        entry[data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = data.draw(JSON_VALUES)
    text = json.dumps(header).encode()
    open_or_refuse(model, struct.pack("<Q", len(text)) + text + buffer)
