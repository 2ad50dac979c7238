"""Helpers for the hostile-input and fuzz tests: converted copies of the fixtures and a raw GGUF packer."""

from __future__ import annotations

import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import pytest

from qwen_runtime.formats.gguf_parse import SCALAR_FORMATS
from qwen_runtime.formats.npy_dir import read_npy_header

FIXTURES = Path(__file__).parent / "fixtures"


def copy_fixture(name: str, dest: Path) -> Path:
    """A private copy of a committed HF fixture (tests may corrupt it)."""
    target = dest / name
    shutil.copytree(FIXTURES / name, target)
    return target


def converted(name: str, root: Path, fmt: str, dtype: str = "fp32") -> Path:
    """The fixture converted in-process by qwen_convert (skipped while the converter is missing)."""
    convert_module = pytest.importorskip("qwen_convert.convert")
    out = root / f"{name}-{dtype}{'.gguf' if fmt == 'gguf' else '.npy'}"
    if not out.exists():
        convert_module.convert(FIXTURES / name, out, fmt, dtype)
    return out


def pack_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def pack_value(vtype: gguf.GGUFValueType, value: Any, etype: gguf.GGUFValueType | None = None) -> bytes:
    if vtype == gguf.GGUFValueType.STRING:
        return pack_string(value)
    if vtype == gguf.GGUFValueType.ARRAY:
        assert etype is not None
        return struct.pack("<IQ", etype, len(value)) + b"".join(pack_value(etype, v) for v in value)
    return struct.pack(SCALAR_FORMATS[vtype], value)


@dataclass
class RawGGUF:
    """A GGUF file as editable parts; :meth:`pack` writes exactly what the fields say (right or wrong)."""

    kvs: list[tuple[str, gguf.GGUFValueType, Any, gguf.GGUFValueType | None]]
    infos: list[tuple[str, tuple[int, ...], int, int]]  # name, ggml dims, type, offset
    data: bytes
    version: int = 3
    magic: bytes = b"GGUF"
    alignment: int = 32
    tensor_count: int | None = None
    kv_count: int | None = None

    @classmethod
    def from_file(cls, path: Path) -> RawGGUF:
        reader = gguf.GGUFReader(path)
        kvs = []
        for name, f in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            etype = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            kvs.append((name, f.types[0], f.contents(), etype))
        start = reader.data_offset
        infos = [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset) - start)
                 for t in reader.tensors]
        return cls(kvs, infos, path.read_bytes()[start:])

    def header(self) -> bytes:
        out = [self.magic, struct.pack("<I", self.version),
               struct.pack("<Q", len(self.infos) if self.tensor_count is None else self.tensor_count),
               struct.pack("<Q", len(self.kvs) if self.kv_count is None else self.kv_count)]
        for key, vtype, value, etype in self.kvs:
            out += [pack_string(key), struct.pack("<I", vtype), pack_value(vtype, value, etype)]
        for name, dims, qtype, offset in self.infos:
            out += [pack_string(name), struct.pack("<I", len(dims)), struct.pack(f"<{len(dims)}Q", *dims),
                    struct.pack("<IQ", qtype, offset)]
        return b"".join(out)

    def pack(self) -> bytes:
        head = self.header()
        return head + b"\0" * (-len(head) % self.alignment) + self.data

    def write(self, path: Path) -> Path:
        path.write_bytes(self.pack())
        return path

    def set_kv(self, key: str, vtype: gguf.GGUFValueType, value: Any,
               etype: gguf.GGUFValueType | None = None) -> None:
        self.kvs = [kv for kv in self.kvs if kv[0] != key] + [(key, vtype, value, etype)]

    def drop_kv(self, key: str) -> None:
        self.kvs = [kv for kv in self.kvs if kv[0] != key]


def npy_header_length(path: Path) -> int:
    """Bytes before the array data of a ``.npy`` file."""
    return read_npy_header(path, path.stem)[2]
