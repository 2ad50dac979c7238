"""A validating GGUF parser for untrusted files: every length, count and offset is checked first.

``gguf.GGUFReader`` trusts the file: it allocates from claimed string lengths and array counts and builds
views from claimed offsets.  This parser checks each claim against the bytes that remain before acting on
it, so a hostile file costs at most its own size.  Layout (GGUF v2/v3, little-endian; see
docs/qwen-architectures.md §4.1):

1. magic ``GGUF``, version u32, tensor_count u64, kv_count u64;
2. kv_count key/values: key string (u64 length + UTF-8), value type u32, value;
3. tensor_count infos: name string, n_dims u32, dims u64 x n_dims (ggml order), type u32, offset u64;
4. padding to ``general.alignment`` (default 32), then the data section; each offset is relative to it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType, Keys

from ..errors import FormatError

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
INT64_MAX = (1 << 63) - 1
# struct format of each scalar value type.
SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
STRING_MIN_BYTES = 8  # the u64 length of an empty string
KV_MIN_BYTES = STRING_MIN_BYTES + 4 + 1  # key, value type, smallest value
TENSOR_INFO_MIN_BYTES = STRING_MIN_BYTES + 4 + 8 + 4 + 8  # name, n_dims, one dim, type, offset


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in the info table, already checked against the file."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (ggml dims reversed)
    offset: int  # absolute file offset of the first byte
    nbytes: int


@dataclass(frozen=True)
class GGUFLayout:
    """Everything the header of a GGUF file says, validated; ``data`` maps the whole file read-only."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    alignment: int
    data_offset: int  # absolute offset of the data section
    data: np.ndarray  # uint8 memmap of the whole file


class _Cursor:
    """Reads little-endian fields from the mapped file, refusing any read past its end."""

    def __init__(self, path: Path, buf: np.ndarray) -> None:
        self.path, self.buf, self.pos, self.size = path, buf, 0, buf.size

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.remaining:
            raise FormatError(f"{self.path}: {what} needs {nbytes} bytes at offset {self.pos}, but only "
                              f"{self.remaining} remain in the file (truncated or corrupt)")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        length = self.scalar("<Q", f"length of {what}")
        self.need(length, what)
        raw = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"{self.path}: {what} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None

    def strings(self, n: int, what: str) -> list[str]:
        """``n`` strings in a row: :meth:`string`'s checks in one tight loop (token lists hold ~250k strings)."""
        view, pos, size, out = memoryview(self.buf), self.pos, self.size, []
        length_at = struct.Struct("<Q").unpack_from
        for i in range(n):
            if pos + STRING_MIN_BYTES > size:
                self.pos = pos
                self.need(STRING_MIN_BYTES, f"length of element {i} of {what}")
            (length,) = length_at(view, pos)
            pos += STRING_MIN_BYTES
            if length > size - pos:
                self.pos = pos
                self.need(length, f"element {i} of {what}")
            try:
                out.append(str(view[pos:pos + length], "utf-8"))
            except UnicodeDecodeError as exc:
                raise FormatError(f"{self.path}: element {i} of {what} is not valid UTF-8 ({exc.reason} at byte "
                                  f"{exc.start})") from None
            pos += length
        self.pos = pos
        return out

    def count(self, min_bytes: int, what: str) -> int:
        """A u64 element count, refused when even minimal elements could not fit in the rest of the file."""
        n = self.scalar("<Q", f"count of {what}")
        if n * min_bytes > self.remaining:
            raise FormatError(f"{self.path}: {what}: count {n} cannot fit in the {self.remaining} bytes left "
                              f"(at least {min_bytes} bytes each)")
        return n

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.scalar("<I", f"value type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise FormatError(f"{self.path}: {what} has unknown value type {raw}") from None


def _value(cur: _Cursor, vtype: GGUFValueType, key: str) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.string(f"value of {key!r}")
    if vtype == GGUFValueType.ARRAY:
        return _array(cur, key)
    return cur.scalar(SCALAR_FORMATS[vtype], f"value of {key!r}")


def _array(cur: _Cursor, key: str) -> list[Any]:
    etype = cur.value_type(f"array {key!r}")
    if etype == GGUFValueType.ARRAY:
        raise FormatError(f"{cur.path}: key {key!r}: nested arrays are not supported")
    if etype == GGUFValueType.STRING:
        n = cur.count(STRING_MIN_BYTES, f"array {key!r}")
        return cur.strings(n, f"{key!r}")
    dtype = np.dtype(SCALAR_FORMATS[etype])
    n = cur.count(dtype.itemsize, f"array {key!r}")
    values = np.frombuffer(cur.buf, dtype=dtype, count=n, offset=cur.pos).tolist()
    cur.pos += n * dtype.itemsize
    return values


def _metadata(cur: _Cursor, kv_count: int) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for i in range(kv_count):
        key = cur.string(f"key {i}")
        if key in meta:
            raise FormatError(f"{cur.path}: metadata key {key!r} appears twice")
        meta[key] = _value(cur, cur.value_type(f"key {key!r}"), key)
    return meta


def _alignment(path: Path, meta: dict[str, Any]) -> int:
    value = meta.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value & (value - 1):
        raise FormatError(f"{path}: {Keys.General.ALIGNMENT!r} is {value!r}, expected a positive power of two")
    return value


def tensor_nbytes(path: Path, name: str, qtype: GGMLQuantizationType, ggml_dims: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``qtype`` with ggml dims (ne0 first), checked for overflow and block size."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    if ggml_dims[0] % block:
        raise FormatError(f"{path}: tensor {name!r}: row length {ggml_dims[0]} is not a multiple of the "
                          f"{qtype.name} block size {block}")
    n_elements = int(np.prod(ggml_dims, dtype=object))
    if n_elements > INT64_MAX:
        raise FormatError(f"{path}: tensor {name!r}: dims {list(ggml_dims)} overflow a 64-bit element count")
    return n_elements // block * type_size


def _tensor_info(cur: _Cursor, index: int) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
    name = cur.string(f"name of tensor {index}")
    n_dims = cur.scalar("<I", f"n_dims of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise FormatError(f"{cur.path}: tensor {name!r} has {n_dims} dims, expected 1..{MAX_DIMS}")
    dims = tuple(cur.scalar("<Q", f"dims of tensor {name!r}") for _ in range(n_dims))
    raw_type = cur.scalar("<I", f"type of tensor {name!r}")
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise FormatError(f"{cur.path}: tensor {name!r} has unknown GGML type {raw_type}") from None
    if qtype not in GGML_QUANT_SIZES:
        raise FormatError(f"{cur.path}: tensor {name!r} has GGML type {qtype.name} of unknown size")
    offset = cur.scalar("<Q", f"offset of tensor {name!r}")
    return name, qtype, dims, offset


def _tensor_infos(cur: _Cursor, count: int) -> list[tuple[str, GGMLQuantizationType, tuple[int, ...], int]]:
    infos, names = [], set()
    for i in range(count):
        info = _tensor_info(cur, i)
        if info[0] in names:
            raise FormatError(f"{cur.path}: tensor {info[0]!r} appears twice")
        names.add(info[0])
        infos.append(info)
    return infos


def _place(path: Path, raw: list, alignment: int, data_offset: int, size: int) -> tuple[GGUFTensorInfo, ...]:
    """Check each tensor's offset (aligned, inside the file, no overlap) and size."""
    placed = []
    for name, qtype, dims, offset in raw:
        nbytes = tensor_nbytes(path, name, qtype, dims)
        if offset % alignment:
            raise FormatError(f"{path}: tensor {name!r}: offset {offset} is not a multiple of the "
                              f"alignment {alignment}")
        if data_offset + offset + nbytes > size:
            raise FormatError(f"{path}: tensor {name!r}: {qtype.name}{list(dims)} needs bytes "
                              f"{offset}..{offset + nbytes} of the data section, which has {size - data_offset}"
                              f" bytes (truncated or corrupt)")
        placed.append(GGUFTensorInfo(name, qtype, tuple(reversed(dims)), data_offset + offset, nbytes))
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in placed if t.nbytes)
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise FormatError(f"{path}: tensors {name_a!r} and {name_b!r} overlap")
    return tuple(placed)


def _header(cur: _Cursor) -> tuple[int, int, int]:
    """(version, tensor_count, kv_count) after checking magic and version."""
    magic = cur.scalar("<I", "magic")
    if magic != GGUF_MAGIC:
        raise FormatError(f"{cur.path}: not a GGUF file (magic {magic:#010x}, expected {GGUF_MAGIC:#010x})")
    version = cur.scalar("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise FormatError(f"{cur.path}: GGUF version {version}{hint} is not supported; "
                          f"expected one of {list(SUPPORTED_VERSIONS)}")
    tensor_count = cur.scalar("<Q", "tensor count")
    kv_count = cur.count(KV_MIN_BYTES, "metadata key/values")
    if tensor_count * TENSOR_INFO_MIN_BYTES > cur.remaining:
        raise FormatError(f"{cur.path}: tensor count {tensor_count} cannot fit in the {cur.remaining} bytes "
                          f"left (at least {TENSOR_INFO_MIN_BYTES} bytes of info each)")
    return version, tensor_count, kv_count


def _map(path: Path) -> np.ndarray:
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise FormatError(f"{path}: not a regular file")
        if size == 0:
            raise FormatError(f"{path}: empty file, not a GGUF model")
        return np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as exc:
        raise FormatError(f"{path}: cannot read ({exc.strerror})") from None


def parse_gguf(path: str | Path) -> GGUFLayout:
    """Parse and validate a GGUF file's header, metadata and tensor table (tensor bytes stay mapped)."""
    path = Path(path)
    cur = _Cursor(path, _map(path))
    version, tensor_count, kv_count = _header(cur)
    meta = _metadata(cur, kv_count)
    alignment = _alignment(path, meta)
    raw = _tensor_infos(cur, tensor_count)
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = _place(path, raw, alignment, data_offset, cur.size)
    return GGUFLayout(path, version, meta, tensors, alignment, data_offset, cur.buf)


def tensor_view(layout: GGUFLayout, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes as a zero-copy uint8 view of the file map."""
    return layout.data[info.offset:info.offset + info.nbytes]
