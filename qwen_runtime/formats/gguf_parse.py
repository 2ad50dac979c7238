"""A validating GGUF parser for untrusted files: every length, count and offset is checked first.

``gguf.GGUFReader`` trusts the file: it allocates from claimed string lengths and array counts and builds
views from claimed offsets.  This parser checks each claim against the bytes that remain before acting on
it, and keeps what it reads in the map, so a hostile file costs at most its own size (its pages, once read)
plus a few MiB: numeric arrays are read-only numpy views of the map, a string array keeps one offset per
:data:`INDEX_STRIDE` elements, and the text it decodes (keys, string values, tensor names) is bounded by
:data:`MAX_DECODED_TEXT`, the key and tensor counts by :data:`MAX_KEYS` and :data:`MAX_TENSORS`, string
arrays outside the vocabulary (keys other readers add) by :data:`MAX_OTHER_STRINGS` elements.
Layout (GGUF v2/v3, little-endian; see docs/qwen-architectures.md §4.1):

1. magic ``GGUF``, version u32, tensor_count u64, kv_count u64;
2. kv_count key/values: key string (u64 length + UTF-8), value type u32, value;
3. tensor_count infos: name string, n_dims u32, dims u64 x n_dims (ggml order), type u32, offset u64;
4. padding to ``general.alignment`` (default 32), then the data section; each offset is relative to it.
"""

from __future__ import annotations

import bisect
import codecs
import operator
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
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
_U64 = struct.Struct("<Q")
KV_MIN_BYTES = STRING_MIN_BYTES + 4 + 1  # key, value type, smallest value
TENSOR_INFO_MIN_BYTES = STRING_MIN_BYTES + 4 + 8 + 4 + 8  # name, n_dims, one dim, type, offset
INDEX_STRIDE = 16  # elements of a string array per stored offset: <= 1/16 of the array's bytes (>= 8 each)
ITER_CHUNK = 256 * INDEX_STRIDE  # elements read from the map at a time while iterating a string array
UTF8_SLICE = 1 << 20  # bytes of a string array copied at a time for its UTF-8 check
# What a header may make us hold beyond its own pages.  Real models: ~50 keys, ~1,100 tensors (405B dense,
# or a MoE with merged experts) and ~20 KB of text (the chat template); a hostile file of small keys or
# tensors costs a few hundred bytes of Python objects per entry, and decoded text up to 4 bytes per byte.
MAX_KEYS = 1 << 14
MAX_TENSORS = 1 << 14
MAX_DECODED_TEXT = 4 << 20  # UTF-8 bytes of keys, string values and tensor names decoded into ``str``
# String arrays are walked element by element: the vocabulary's (tokens, merges) up to a vocabulary's size,
# any other key's (tags, languages, ...) far fewer.  Numeric arrays are views of the map and cost nothing.
VOCABULARY_ARRAYS = frozenset({Keys.Tokenizer.LIST, Keys.Tokenizer.MERGES})
MAX_VOCABULARY_STRINGS = 1 << 22  # qwen_runtime.formats.config.MAX_VOCAB
MAX_OTHER_STRINGS = 1 << 16


class GGUFStrings(Sequence[str]):
    """A GGUF string array left in the file map; an element is decoded from its UTF-8 bytes when read.

    Token and merge lists hold 150k-250k strings: as ``str`` objects they would cost ~30 MB for the life of
    the model, here 8 bytes per :data:`INDEX_STRIDE` elements.  ``buf`` is the uint8 map of the whole file;
    ``index`` [ceil(n / INDEX_STRIDE)] int64: ``index[k]`` is the file offset of element ``k·INDEX_STRIDE``'s
    u64 length; ``end`` the offset past the last element.  Element ``i`` is found by walking the lengths from
    ``index[i // INDEX_STRIDE]``.  The parser has checked every bound and every element's UTF-8.  Slices are
    lists; a ``GGUFStrings`` equals a list of the same strings, or another ``GGUFStrings`` of the same strings.
    """

    __slots__ = ("_view", "_index", "_n", "_end")

    def __init__(self, buf: np.ndarray, index: np.ndarray, n: int, end: int) -> None:
        self._view = memoryview(buf)  # slicing a memoryview costs far less than slicing an np.memmap
        self._index, self._n, self._end = index, n, end

    def __len__(self) -> int:
        return self._n

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
        length_at = _U64.unpack_from
        for start in range(0, len(self), ITER_CHUNK):
            base = int(self._index[start // INDEX_STRIDE])
            stop = start + ITER_CHUNK
            end = int(self._index[stop // INDEX_STRIDE]) if stop < len(self) else self._end
            raw = self._view[base:end].tobytes()  # slices of bytes decode faster than of a memoryview
            pos = 0
            for _ in range(min(ITER_CHUNK, len(self) - start)):
                (length,) = length_at(raw, pos)
                pos += STRING_MIN_BYTES + length
                yield raw[pos - length:pos].decode("utf-8")

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
        pos = int(self._index[i // INDEX_STRIDE])
        for _ in range(i % INDEX_STRIDE):
            pos += STRING_MIN_BYTES + _U64.unpack_from(self._view, pos)[0]
        (length,) = _U64.unpack_from(self._view, pos)
        return str(self._view[pos + STRING_MIN_BYTES:pos + STRING_MIN_BYTES + length], "utf-8")

    def _raw(self) -> memoryview:
        return self._view[int(self._index[0]):self._end] if self._n else self._view[:0]


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
    metadata: dict[str, Any]  # str, int, float, bool; arrays: read-only 1-D numpy views, or GGUFStrings
    tensors: tuple[GGUFTensorInfo, ...]
    alignment: int
    data_offset: int  # absolute offset of the data section
    data: np.ndarray  # uint8 memmap of the whole file


class _Cursor:
    """Reads little-endian fields from the mapped file, refusing any read past its end."""

    def __init__(self, path: Path, buf: np.ndarray) -> None:
        self.path, self.buf, self.pos, self.size = path, buf, 0, buf.size
        self.text_left = MAX_DECODED_TEXT

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
        """A string decoded into ``str``, counted against :data:`MAX_DECODED_TEXT`."""
        length = self.scalar("<Q", f"length of {what}")
        self.need(length, what)
        if length > self.text_left:
            raise FormatError(f"{self.path}: {what} is {length} bytes long: the header's keys, string values and "
                              f"tensor names may hold at most {MAX_DECODED_TEXT} bytes of text in all")
        self.text_left -= length
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
        view, pos, size, index, heads = memoryview(self.buf), self.pos, self.size, array("q"), array("q")
        length_at, utf8 = _U64.unpack_from, _Utf8Check(self, what, pos)
        add_head = heads.append
        for block in range(0, n, INDEX_STRIDE):
            index.append(pos)
            for i in range(block, min(block + INDEX_STRIDE, n)):
                add_head(pos)
                try:
                    (length,) = length_at(view, pos)
                except struct.error:  # fewer than 8 bytes left
                    self.pos = pos
                    self.need(STRING_MIN_BYTES, f"length of element {i} of {what}")
                pos += STRING_MIN_BYTES + length
                if pos > size:
                    self.pos = pos - length
                    self.need(length, f"element {i} of {what}")
            if pos - utf8.done >= UTF8_SLICE:
                utf8.feed(heads, pos, index)
                heads = array("q")
                add_head = heads.append
        utf8.feed(heads, pos, index, final=True)
        self.pos = pos
        offsets = np.frombuffer(index, dtype=np.int64) if index else np.zeros(0, np.int64)
        offsets.flags.writeable = False
        return GGUFStrings(self.buf, offsets, n, pos)

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


class _Utf8Check:
    """The UTF-8 check of a string array, streamed while it is parsed: its bytes, each u64 length overwritten
    with ASCII spaces, go through one incremental decoder :data:`UTF8_SLICE` bytes at a time.  No multi-byte
    sequence spans an ASCII byte, so the stream decodes iff every element does, and its first error lies in the
    first bad element, which is then decoded alone for the message."""

    def __init__(self, cur: _Cursor, what: str, start: int) -> None:
        self.cur, self.what, self.done = cur, what, start
        self.decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, heads: array, upto: int, index: array, final: bool = False) -> None:
        """Check bytes ``done .. upto``; ``heads``: offsets of the lengths that start in them."""
        where = np.frombuffer(heads, dtype=np.int64) if heads else np.zeros(0, np.int64)
        for begin in range(self.done, max(upto, self.done + 1), UTF8_SLICE):  # once at least, to end a final
            stop = min(begin + UTF8_SLICE, upto)
            region = np.array(self.cur.buf[begin:stop])  # a copy, to overwrite the lengths in
            for k in range(STRING_MIN_BYTES):
                at = where + (k - begin)
                region[at[(at >= 0) & (at < stop - begin)]] = ord(" ")
            pending = len(self.decoder.getstate()[0])
            try:
                self.decoder.decode(memoryview(region), final and stop == upto)
            except UnicodeDecodeError as exc:
                self.fail(begin - pending + exc.start, index)
        self.done = upto

    def fail(self, offset: int, index: array) -> None:
        """Raise the FormatError of the element holding the first bad byte (at file ``offset``)."""
        view, length_at = memoryview(self.cur.buf), _U64.unpack_from
        block = bisect.bisect_right(index, offset) - 1
        i, pos = block * INDEX_STRIDE, index[block]
        while pos + STRING_MIN_BYTES + length_at(view, pos)[0] <= offset:  # the bad byte is past element i
            pos += STRING_MIN_BYTES + length_at(view, pos)[0]
            i += 1
        begin = pos + STRING_MIN_BYTES
        end = begin + length_at(view, pos)[0]
        decoder, done = codecs.getincrementaldecoder("utf-8")(), begin
        try:
            while True:
                stop = min(done + UTF8_SLICE, end)
                pending = len(decoder.getstate()[0])
                decoder.decode(view[done:stop], stop == end)
                if stop == end:
                    break
                done = stop
        except UnicodeDecodeError as exc:
            raise FormatError(f"{self.cur.path}: element {i} of {self.what} is not valid UTF-8 ({exc.reason} at "
                              f"byte {done - pending + exc.start - begin})") from None
        raise AssertionError("unreachable: the stream's first error lies in this element")


def _value(cur: _Cursor, vtype: GGUFValueType, key: str) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.string(f"value of {key!r}")
    if vtype == GGUFValueType.ARRAY:
        return _array(cur, key)
    return cur.scalar(SCALAR_FORMATS[vtype], f"value of {key!r}")


def _array(cur: _Cursor, key: str) -> np.ndarray | GGUFStrings:
    etype = cur.value_type(f"array {key!r}")
    if etype == GGUFValueType.ARRAY:
        raise FormatError(f"{cur.path}: key {key!r}: nested arrays are not supported")
    if etype == GGUFValueType.STRING:
        n = cur.count(STRING_MIN_BYTES, f"array {key!r}")
        limit = MAX_VOCABULARY_STRINGS if key in VOCABULARY_ARRAYS else MAX_OTHER_STRINGS
        if n > limit:
            raise FormatError(f"{cur.path}: key {key!r}: a string array of {n} elements, more than the {limit} "
                              f"allowed {'for a vocabulary' if key in VOCABULARY_ARRAYS else 'outside the vocabulary'}")
        return cur.strings(n, f"{key!r}")
    dtype = np.dtype(SCALAR_FORMATS[etype])
    n = cur.count(dtype.itemsize, f"array {key!r}")
    values = np.frombuffer(cur.buf, dtype=dtype, count=n, offset=cur.pos)  # a view of the map, read-only
    values.flags.writeable = False
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
    for count, limit, what in ((kv_count, MAX_KEYS, "metadata keys"), (tensor_count, MAX_TENSORS, "tensors")):
        if count > limit:
            raise FormatError(f"{cur.path}: {count} {what}, more than the {limit} a model file may have")
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
