"""Safetensors without loading: parse the JSON header ourselves and memory-map the data region.

Layout (huggingface/safetensors README): 8 bytes little-endian u64 ``N``, ``N`` bytes of UTF-8 JSON mapping
tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the byte buffer
that follows the header), an optional ``"__metadata__"`` object, then the buffer.  BF16 is exposed as
``uint16`` so no ``ml_dtypes`` is needed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError
from .base import parse_json, read_json_file
from .tensors import DENSE_DTYPES, QType

# safetensors dtype string -> GGML type of the stored bytes.
SAFETENSORS_QTYPES: dict[str, QType] = {"F32": QType.F32, "F16": QType.F16, "BF16": QType.BF16}
MAX_HEADER_BYTES = 100 << 20  # the reference implementation's own limit


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file: where its bytes are and how to view them."""

    name: str
    path: Path
    qtype: QType
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int

    def view(self) -> np.ndarray:
        """A read-only memory map of the tensor's bytes with its logical shape."""
        dtype = DENSE_DTYPES[self.qtype]
        count = self.end - self.begin
        if count == 0:
            return np.zeros(self.shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.begin, shape=self.shape)


def read_header(path: Path) -> tuple[dict[str, SafetensorsEntry], dict[str, str]]:
    """Parse and validate the header of one safetensors file: (entries by name, ``__metadata__``)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise FormatError(f"{path}: header length {n} exceeds the file size {size} (truncated or corrupt)")
            raw = f.read(n)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read ({exc.strerror})") from None
    header = parse_json(raw, f"{path}: safetensors header")
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError(f"{path}: '__metadata__' must map strings to strings")
    entries = {name: _entry(path, name, info, 8 + n) for name, info in header.items()}
    _check_layout(path, entries, 8 + n, size)
    return entries, meta


def _entry(path: Path, name: str, info: object, base: int) -> SafetensorsEntry:
    if not isinstance(info, dict):
        raise FormatError(f"{path}: tensor {name!r}: header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_QTYPES:
        raise FormatError(f"{path}: tensor {name!r}: unsupported dtype {dtype!r} "
                          f"(expected one of {sorted(SAFETENSORS_QTYPES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise FormatError(f"{path}: tensor {name!r}: invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise FormatError(f"{path}: tensor {name!r}: invalid data_offsets {offsets!r}")
    qtype = SAFETENSORS_QTYPES[dtype]
    expected = int(np.prod(shape, dtype=object)) * DENSE_DTYPES[qtype].itemsize
    if offsets[1] - offsets[0] != expected:
        raise FormatError(f"{path}: tensor {name!r}: {dtype}{shape} needs {expected} bytes, "
                          f"data_offsets give {offsets[1] - offsets[0]}")
    return SafetensorsEntry(name, path, qtype, tuple(shape), base + offsets[0], base + offsets[1])


def _check_layout(path: Path, entries: dict[str, SafetensorsEntry], start: int, size: int) -> None:
    """Every tensor inside the file, no two tensors sharing bytes, and no unindexed bytes (the reference
    implementation refuses holes too: they would let one file be read differently by different tools)."""
    spans = sorted((e.begin, e.end, e.name) for e in entries.values() if e.end > e.begin)
    for _, end, name in spans:
        if end > size:
            raise FormatError(f"{path}: tensor {name!r}: data ends at byte {end}, past the end of the file "
                              f"({size} bytes; truncated?)")
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise FormatError(f"{path}: tensors {name_a!r} and {name_b!r} overlap")
        if begin_b > end_a:
            raise FormatError(f"{path}: bytes {end_a}..{begin_b} between tensors {name_a!r} and {name_b!r} "
                              f"belong to no tensor")
    covered = (spans[0][0], spans[-1][1]) if spans else (start, start)
    if covered != (start, size):
        raise FormatError(f"{path}: tensor data covers bytes {covered[0]}..{covered[1]}, expected the whole "
                          f"buffer {start}..{size} (truncated, padded or corrupt)")


def read_index(path: Path) -> dict[str, str]:
    """``weight_map`` of a ``model.safetensors.index.json``: tensor name -> shard file name."""
    index = read_json_file(path)
    weight_map = index.get("weight_map") if index else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError(f"{path}: missing or invalid 'weight_map'")
    return weight_map
