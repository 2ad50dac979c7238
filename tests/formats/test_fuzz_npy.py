"""Fuzzing the npy directory reader: mutated manifests and ``.npy`` headers either open (and every tensor view
is readable) or raise FormatError; nothing else may escape.  ``QWEN_FUZZ_EXAMPLES`` sets the examples per test."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hostile_helpers import FUZZ, mutated, npy_header_length, touch
from hypothesis import event, given
from hypothesis import strategies as st
from runtime_helpers import Converted

from qwen_runtime.errors import FormatError
from qwen_runtime.formats import open_npy_dir
from qwen_runtime.formats.npy_dir import MANIFEST_NAME

pytestmark = pytest.mark.slow  # hypothesis: QWEN_FUZZ_EXAMPLES mutated files per test

MANIFEST_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**65, 2**65), st.text(max_size=12),
    st.sampled_from(["../x.npy", "/etc/passwd", "config.json", MANIFEST_NAME, "F32", "Q8_0", "BF16", "Q4_0", "Q5_1",
                     "Q4_K"]),
    st.lists(st.integers(-2, 2**40), max_size=5))


@pytest.fixture(scope="module", params=["q8_0", "q5_1"])  # q5_1: a 4-field block dtype (d, m, qh, qs)
def model(converted: Converted, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    root = tmp_path_factory.mktemp("fuzz-npy")
    return Path(shutil.copytree(converted("qwen3-tiny", "npy", request.param), root / "model"))


@contextmanager
def replaced(path: Path, data: bytes) -> Iterator[None]:
    """``path`` holds ``data`` for the duration (the module's model is shared by every example)."""
    original = path.read_bytes()
    path.write_bytes(data)
    try:
        yield
    finally:
        path.write_bytes(original)


def open_or_refuse(model: Path) -> None:
    try:
        files = open_npy_dir(model, verify=True)
    except FormatError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("accepted")
    touch(files)


def tensor_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.npy"))


@FUZZ
@given(data=st.data())
def test_mutated_npy_headers(model: Path, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(tensor_files(model)))
    original = path.read_bytes()
    with replaced(path, data.draw(mutated(original, npy_header_length(path)))):
        open_or_refuse(model)


@FUZZ
@given(data=st.data())
def test_mutated_manifest(model: Path, data: st.DataObject) -> None:
    path = model / MANIFEST_NAME
    original = path.read_bytes()
    if data.draw(st.booleans()):
        mutated_text = data.draw(mutated(original, len(original)))
    else:
        manifest = json.loads(original)
        entries = manifest["tensors"]
        names = sorted(entries)
        if data.draw(st.booleans()):  # swap the files of two entries
            a, b = data.draw(st.permutations(names))[:2]
            entries[a]["file"], entries[b]["file"] = entries[b]["file"], entries[a]["file"]
        for _ in range(data.draw(st.integers(1, 3))):
            entry = entries[data.draw(st.sampled_from(names))]
            entry[data.draw(st.sampled_from(["file", "shape", "type", "nbytes", "sha256"]))] = \
                data.draw(MANIFEST_VALUES)
        mutated_text = json.dumps(manifest).encode()
    with replaced(path, mutated_text):
        open_or_refuse(model)
