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

import operator
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, overload

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
ITER_CHUNK = 4096  # offsets turned into Python ints at a time while iterating a string array


class GGUFStrings(Sequence[str]):
    """A GGUF string array left in the file map; an element is decoded from its UTF-8 bytes when read.

    Token and merge lists hold 150k-250k strings: as ``str`` objects they would cost ~30 MB for the life of
    the model, here 8 bytes each.  ``buf`` is the uint8 map of the whole file; ``offsets`` [n + 1] int64:
    ``offsets[i]`` is the file offset of element ``i``'s u64 length, ``offsets[n]`` the end of the array, so
    element ``i`` is the bytes ``offsets[i] + 8 .. offsets[i + 1]``.  The parser has checked every bound and
    every element's UTF-8.  Slices are lists; a ``GGUFStrings`` equals a list of the same strings, or another
    ``GGUFStrings`` of the same strings.
    """

    __slots__ = ("_view", "_offsets")

    def __init__(self, buf: np.ndarray, offsets: np.ndarray) -> None:
        self._view = memoryview(buf)  # slicing a memoryview costs far less than slicing an np.memmap
        self._offsets = offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self._element(i) for i in range(*index.indices(len(self)))]
        i = operator.index(index)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"string array index {i} out of range for {n} elements")
        return self._element(i % n)

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self), ITER_CHUNK):
            bounds = self._offsets[start:start + ITER_CHUNK + 1].tolist()
            base = bounds[0]
            raw = self._view[base:bounds[-1]].tobytes()  # slices of bytes decode faster than of a memoryview
            for begin, end in pairwise(bounds):
                yield raw[begin - base + STRING_MIN_BYTES:end - base].decode("utf-8")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GGUFStrings):  # same strings <=> same length-prefixed bytes
            return len(self) == len(other) and self._raw() == other._raw()
        if isinstance(other, list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __repr__(self) -> str:
        more = ", ..." if len(self) > 3 else ""
        return f"GGUFStrings([{', '.join(map(repr, self[:3]))}{more}], len={len(self)})"

    def _element(self, i: int) -> str:
        begin, end = self._offsets[i:i + 2].tolist()
        return str(self._view[begin + STRING_MIN_BYTES:end], "utf-8")

    def _raw(self) -> memoryview:
        return self._view[int(self._offsets[0]):int(self._offsets[-1])]


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
    metadata: dict[str, Any]  # str, int, float, bool; arrays: list of numbers or GGUFStrings
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
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        return self.text(raw, what)

    def text(self, raw: np.ndarray | memoryview, what: str) -> str:
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"{self.path}: {what} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None

    def strings(self, n: int, what: str) -> GGUFStrings:
        """``n`` strings in a row with :meth:`string`'s checks, left in the map (token lists hold ~250k)."""
        view, pos, size, offsets = memoryview(self.buf), self.pos, self.size, array("q")
        length_at, add = struct.Struct("<Q").unpack_from, offsets.append
        for i in range(n):
            add(pos)
            try:
                (length,) = length_at(view, pos)
            except struct.error:  # fewer than 8 bytes left
                self.pos = pos
                self.need(STRING_MIN_BYTES, f"length of element {i} of {what}")
            pos += STRING_MIN_BYTES + length
            if pos > size:
                self.pos = pos - length
                self.need(length, f"element {i} of {what}")
        add(pos)
        self.pos = pos
        bounds = np.frombuffer(offsets, dtype=np.int64)
        bounds.flags.writeable = False
        self.check_utf8(bounds, what)
        return GGUFStrings(self.buf, bounds)

    def check_utf8(self, bounds: np.ndarray, what: str) -> None:
        """Every element of a string array (``bounds`` as in :class:`GGUFStrings`) is valid UTF-8.

        One decode of a copy of the array whose u64 lengths are overwritten with ASCII spaces: no multi-byte
        sequence spans an ASCII byte, so the copy decodes iff every element does, and its first error lies
        in the first bad element, which is then decoded alone for :meth:`text`'s message.
        """
        heads = bounds[:-1] - bounds[0]  # [n] where each length sits in the copy
        region = np.array(self.buf[bounds[0]:bounds[-1]])
        for k in range(STRING_MIN_BYTES):
            region[heads + k] = ord(" ")
        try:
            str(region, "utf-8")
        except UnicodeDecodeError as exc:
            i = int(np.searchsorted(heads, exc.start, side="right")) - 1
            begin, end = bounds[i:i + 2].tolist()
            self.text(self.buf[begin + STRING_MIN_BYTES:end], f"element {i} of {what}")
            raise  # unreachable: element i holds the first error, so text() raised

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


def _array(cur: _Cursor, key: str) -> list[Any] | GGUFStrings:
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
