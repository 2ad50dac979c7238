"""Helpers for the hostile-input and fuzz tests: private copies of the fixtures and a raw GGUF packer."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from qwen_runtime.formats import ModelFiles
from qwen_runtime.formats.gguf_parse import SCALAR_FORMATS
from qwen_runtime.formats.npy_dir import read_npy_header

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def copy_fixture(name: str, dest: Path) -> Path:
    """A private copy of a committed HF fixture (tests may corrupt it)."""
    target = dest / name
    shutil.copytree(FIXTURES / name, target)
    return target


# Types given to the matrices of quantized_mix(), in turn: every quantized type the runtime reads.
MIX_TYPES = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.Q5_K,
             gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.Q3_K, gguf.GGMLQuantizationType.IQ4_XS,
             gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q5_1, gguf.GGMLQuantizationType.IQ4_NL,
             gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.BF16)


def quantized_mix(root: Path) -> Path:
    """A valid two-layer Qwen3 GGUF (hidden 256, so 256-value K-quant blocks fit) whose matrices hold, in turn,
    every quantized type the runtime reads, filled with seeded random blocks (for the fuzz tests)."""
    from safetensors.numpy import save_file

    out = root / "quantized-mix.gguf"
    if out.exists():
        return out
    source = root / "quantized-mix-hf"
    source.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(FIXTURES / "qwen3-tiny" / name, source / name)
    config = json.loads((FIXTURES / "qwen3-tiny" / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=2)
    (source / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], 256), "model.norm.weight": (256,)}
    for layer in ("model.layers.0.", "model.layers.1."):
        shapes |= {layer + "input_layernorm.weight": (256,), layer + "post_attention_layernorm.weight": (256,),
                   layer + "self_attn.q_proj.weight": (256, 256), layer + "self_attn.k_proj.weight": (128, 256),
                   layer + "self_attn.v_proj.weight": (128, 256), layer + "self_attn.o_proj.weight": (256, 256),
                   layer + "self_attn.q_norm.weight": (64,), layer + "self_attn.k_norm.weight": (64,),
                   layer + "mlp.gate_proj.weight": (512, 256), layer + "mlp.up_proj.weight": (512, 256),
                   layer + "mlp.down_proj.weight": (256, 512)}
    save_file({n: rng.normal(0, 0.05, s).astype(np.float32) for n, s in shapes.items()},
              str(source / "model.safetensors"))
    raw = RawGGUF.from_file(converted_dir(source, root, "fp32"))
    infos, data = [], b""
    types = iter(MIX_TYPES * 2)
    for name, dims, qtype, offset in raw.infos:
        if len(dims) == 2:
            qtype = next(types)
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            blob = rng.integers(0, 256, dims[0] // block * size * dims[1], dtype=np.uint8).tobytes()
        else:
            blob = raw.data[offset:offset + 4 * int(np.prod(dims))]
        data += b"\0" * (-len(data) % raw.alignment)
        infos.append((name, dims, int(qtype), len(data)))
        data += blob
    raw.infos, raw.data = infos, data
    return raw.write(out)


def converted_dir(source: Path, root: Path, dtype: str) -> Path:
    """An HF directory converted to GGUF in-process by qwen_convert."""
    convert_module = pytest.importorskip("qwen_convert.convert")
    out = root / f"{source.name}-{dtype}.gguf"
    if not out.exists():
        convert_module.convert(source, out, "gguf", dtype)
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


@dataclass(repr=False)
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

    def __repr__(self) -> str:
        return f"RawGGUF({len(self.kvs)} keys, {len(self.infos)} tensors, {len(self.data)} data bytes)"

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


# --- fuzzing -------------------------------------------------------------------------------------------------
# CI runs a few hundred examples per test; QWEN_FUZZ_EXAMPLES=10000 is the documented long run (docs/reliability.md).
FUZZ_EXAMPLES = int(os.environ.get("QWEN_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
INFLATED = (0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
MUTATIONS = ("flip", "byte", "truncate", "inflate64", "inflate32", "insert", "delete", "number")


@st.composite
def mutated(draw: st.DrawFn, data: bytes, focus: int) -> bytes:
    """``data`` after 1-4 random mutations, positions mostly within the first ``focus`` bytes (the header):
    bit flips, byte overwrites, truncation, length-field inflation (u64/u32 writes of extreme values),
    insertions, deletions and decimal numbers (JSON) replaced by extreme values."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        if not buf:
            break
        kind = draw(st.sampled_from(MUTATIONS))
        end = min(focus, len(buf)) if draw(st.integers(0, 9)) else len(buf)
        pos = draw(st.integers(0, max(end - 1, 0)))
        if kind == "flip":
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte":
            buf[pos] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del buf[pos:]
        elif kind in ("inflate64", "inflate32"):
            width = 8 if kind == "inflate64" else 4
            value = draw(st.sampled_from(INFLATED) | st.integers(0, 2**64 - 1)) % (1 << (8 * width))
            buf[pos:pos + width] = value.to_bytes(width, "little")
        elif kind == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del buf[pos:pos + draw(st.integers(1, 16))]
        else:
            buf = _replace_number(draw, buf, end)
    return bytes(buf)


def _replace_number(draw: st.DrawFn, buf: bytearray, end: int) -> bytearray:
    numbers = list(re.finditer(rb"-?\d+", bytes(buf[:end])))
    if not numbers:
        return buf
    match = draw(st.sampled_from(numbers))
    value = draw(st.sampled_from(INFLATED) | st.integers(-2**70, 2**70))
    return buf[:match.start()] + str(value).encode() + buf[match.end():]


def touch(files: ModelFiles) -> None:
    """Read the first and last element of every tensor: a view past the end of a file would crash here."""
    for tensor in files.tensors.values():
        data = np.asarray(tensor.data).reshape(-1)
        if data.size:
            _ = data[0], data[-1]
