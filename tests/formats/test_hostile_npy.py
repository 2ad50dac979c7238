"""Hostile npy model directories: manifest paths, .npy headers that disagree, pickles, changed files."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hostile_helpers import npy_header_length
from runtime_helpers import Converted

from qwen_runtime.errors import FormatError
from qwen_runtime.formats import open_npy_dir
from qwen_runtime.formats.npy_dir import MANIFEST_NAME
from qwen_runtime.formats.tensors import Q8_0_DTYPE


@pytest.fixture(scope="module")
def source(converted: Converted) -> Path:
    return converted("qwen3-tiny", "npy", "q8_0")


@pytest.fixture
def model(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "model"))


def manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST_NAME).read_text())


def edit_manifest(directory: Path, edit: Callable[[dict], object]) -> Path:
    data = manifest(directory)
    edit(data)
    (directory / MANIFEST_NAME).write_text(json.dumps(data))
    return directory


def entry(directory: Path, kind: str = "Q8_0") -> tuple[str, dict]:
    """The first tensor of the manifest stored as ``kind``."""
    return next((n, e) for n, e in manifest(directory)["tensors"].items() if e["type"] == kind)


def fails(directory: Path, *fragments: str, verify: bool = False) -> str:
    with pytest.raises(FormatError) as info:
        open_npy_dir(directory, verify=verify)
    message = str(info.value)
    assert str(directory) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_clean_copy_verifies(model: Path) -> None:
    assert open_npy_dir(model, verify=True).tensors


@pytest.mark.parametrize(("file", "fragment"), [
    ("../outside.npy", "leaves the model directory"), ("/etc/passwd", "invalid path"), (None, "invalid path"),
    ("a\0.npy", "invalid path"), ("sub/../../x.npy", "leaves the model directory"),
])
def test_manifest_paths_outside(model: Path, file: object, fragment: str) -> None:
    name, _ = entry(model)
    fails(edit_manifest(model, lambda m: m["tensors"][name].update(file=file)), repr(name), fragment)


def test_symlink_leaving_the_directory(model: Path, tmp_path: Path) -> None:
    name, info = entry(model)
    outside = tmp_path / "outside.npy"
    shutil.copy(model / info["file"], outside)
    (model / info["file"]).unlink()
    os.symlink(outside, model / info["file"])
    fails(model, repr(name), "leaves the model directory")


def test_symlink_to_a_device_is_refused(model: Path) -> None:
    name, info = entry(model)
    (model / info["file"]).unlink()
    os.symlink("/dev/zero", model / info["file"])
    fails(model, "leaves the model directory")


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"shape": [2, 64], "nbytes": 2 * 2 * 34}, "manifest says"), ({"shape": [-1]}, "positive integers"),
    ({"shape": "64"}, "positive"), ({"shape": [1, 1, 1, 1, 32]}, "positive integers"),
    ({"type": "F16"}, "disagrees with F16"), ({"type": "IQ2_XXS"}, "unsupported type"), ({"type": 7}, "unknown type"),
    ({"nbytes": 1}, "nbytes"), ({"shape": [33]}, "divisible by 32"),
])
def test_manifest_disagrees_with_the_file(model: Path, changes: dict, fragment: str) -> None:
    name, info = entry(model)
    info.update(changes)
    fails(edit_manifest(model, lambda m: m["tensors"].update({name: info})), repr(name), fragment)


def write_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.lib.format.write_array(f, array, allow_pickle=True)


def test_npy_header_disagrees(model: Path) -> None:
    name, info = entry(model, "F32")
    shape = tuple(info["shape"])
    write_npy(model / info["file"], np.zeros(shape[::-1] if len(shape) == 2 else (shape[0] + 1,), np.float32))
    fails(model, repr(name), "manifest says")
    write_npy(model / info["file"], np.zeros(shape, np.float64))
    fails(model, repr(name), "float64")


def test_file_shorter_than_its_header_claims(model: Path) -> None:
    name, info = entry(model)
    path = model / info["file"]
    path.write_bytes(path.read_bytes()[:-1])
    fails(model, repr(name), "truncated")
    path.write_bytes(path.read_bytes()[: npy_header_length(path) - 3])
    fails(model, repr(name), "not a valid .npy")


def test_trailing_data(model: Path) -> None:
    name, info = entry(model)
    path = model / info["file"]
    path.write_bytes(path.read_bytes() + b"\0")
    fails(model, repr(name), "trailing data")


def test_pickled_object_arrays_are_refused_without_unpickling(model: Path, tmp_path: Path) -> None:
    name, info = entry(model, "F32")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    write_npy(model / info["file"], np.array([Evil()], dtype=object))
    fails(model, repr(name), "object dtype")
    assert not marker.exists()
    (model / info["file"]).write_bytes(b"\x80\x04K\x01.")  # a bare pickle, no .npy magic
    fails(model, repr(name), "not a valid .npy")


def test_fortran_order_is_refused(model: Path) -> None:
    name, info = entry(model)
    rows, cols = info["shape"]
    write_npy(model / info["file"], np.asfortranarray(np.zeros((rows, cols // 32), Q8_0_DTYPE)))
    fails(model, repr(name), "Fortran")


def test_changed_file_is_caught_by_the_checksum(model: Path) -> None:
    name, info = entry(model)
    path = model / info["file"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    assert open_npy_dir(model).tensors  # structurally fine ...
    fails(model, repr(name), "checksum does not match", verify=True)  # ... but not what was written


def test_missing_checksum_under_verify(model: Path) -> None:
    name, _ = entry(model)
    fails(edit_manifest(model, lambda m: m["tensors"][name].pop("sha256")), repr(name), "sha256", verify=True)


@pytest.mark.parametrize(("edit", "fragment"), [
    (lambda m: m.update(format="other"), "format is 'other'"), (lambda m: m.update(version=99), "version 99"),
    (lambda m: m.update(tensors=[]), "'tensors' must be an object"),
    (lambda m: m.update(architecture="qwen2"), "disagrees with config.json"),
    (lambda m: m["tensors"].popitem(), "is missing"),
])
def test_manifest_fields(model: Path, edit: Callable[[dict], object], fragment: str) -> None:
    fails(edit_manifest(model, edit), fragment)
