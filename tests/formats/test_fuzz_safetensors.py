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
from qwen_runtime.formats.base import V_HEAD_GROUPED, V_HEAD_TILED

pytestmark = pytest.mark.slow  # hypothesis: QWEN_FUZZ_EXAMPLES mutated files per test

SHARD = "model.safetensors"
ORDERS = st.sampled_from([V_HEAD_GROUPED, V_HEAD_TILED])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**65, 2**65) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)


SOURCES = ("qwen3-tiny", "qwen35-tiny-gqa")  # plain tensors; Qwen3.5 transforms and value-head tiling


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, bytes]]:
    root = tmp_path_factory.mktemp("fuzz-st")
    copies = {name: Path(shutil.copytree(FIXTURES / name, root / name)) for name in SOURCES}
    return {name: (path, (path / SHARD).read_bytes()) for name, path in copies.items()}


def open_or_refuse(model: Path, data: bytes, v_head_order: str) -> None:
    (model / SHARD).write_bytes(data)
    try:
        files = open_hf_dir(model, v_head_order=v_head_order)
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
def test_mutated_bytes(models: dict[str, tuple[Path, bytes]], data: st.DataObject) -> None:
    model, original = models[data.draw(st.sampled_from(SOURCES))]
    focus = 8 + struct.unpack("<Q", original[:8])[0]
    open_or_refuse(model, data.draw(mutated(original, focus)), data.draw(ORDERS))


@FUZZ
@given(data=st.data())
def test_shuffled_offsets_and_fields(models: dict[str, tuple[Path, bytes]], data: st.DataObject) -> None:
    model, original = models[data.draw(st.sampled_from(SOURCES))]
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
    open_or_refuse(model, struct.pack("<Q", len(text)) + text + buffer, data.draw(ORDERS))
