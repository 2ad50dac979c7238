"""A GGUF file written through ``gguf.GGUFWriter``, tensor data streamed in row chunks.

Order of the file (GGUF v3): header, key/values, tensor infos (all known up front from the plan), then
each tensor's bytes, aligned to 32.  ``GGUFWriter`` only holds the infos (name, shape, type, size); the
data of one tensor is produced chunk by chunk and written straight to the file, so memory stays bounded.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.gguf_writer import WriterState

from qwen_runtime.formats.base import ModelFiles
from qwen_runtime.formats.tensors import DENSE_DTYPES, stored_shape

from .gguf_metadata import add_model_metadata, add_tokenizer_metadata
from .policy import TensorSpec
from .quantize import write_chunks

# numpy dtype of the elements of a metadata array, for the integer arrays we pack in bulk.
_INT_ARRAY_DTYPES = {GGUFValueType.INT32: np.dtype("<i4"), GGUFValueType.UINT32: np.dtype("<u4")}


class StreamingGGUFWriter(GGUFWriter):
    """``GGUFWriter`` plus :meth:`write_tensor_chunks`, the streaming twin of ``write_tensor_data``.

    It also packs the big tokenizer arrays (150k+ strings, token types) in bulk: gguf packs each item with
    its own ``struct.pack`` call, which takes seconds.  The bytes are the same (little-endian files only).
    """

    def _pack_val(self, val: Any, vtype: GGUFValueType, add_vtype: bool,
                  sub_type: GGUFValueType | None = None) -> bytes:
        if vtype != GGUFValueType.ARRAY or not isinstance(val, list) or len(val) < 1024:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        if all(isinstance(v, str) for v in val):
            item_type, body = GGUFValueType.STRING, _pack_strings(val)
        elif all(type(v) is int for v in val) and (sub_type or GGUFValueType.INT32) in _INT_ARRAY_DTYPES:
            item_type = sub_type or GGUFValueType.INT32
            body = np.asarray(val, dtype=_INT_ARRAY_DTYPES[item_type]).tobytes()
        else:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<I", vtype) if add_vtype else b""
        return head + struct.pack("<IQ", item_type, len(val)) + body

    def write_tensor_chunks(self, chunks: Iterable[np.ndarray]) -> tuple[int, str]:
        """Write the next tensor (in info order) from C-contiguous chunks; returns (bytes, SHA-256 of them)."""
        if self.state not in (WriterState.TI_DATA, WriterState.WEIGHTS) or self.fout is None:
            raise ValueError(f"expected tensor infos to be written, got {self.state}")
        fout = self.fout[0]
        name = next(iter(self.tensors[0]))
        info = self.tensors[0].pop(name)
        self.write_padding(fout, fout.tell())
        digest = hashlib.sha256()
        written = write_chunks(fout, chunks, digest)
        if written != info.nbytes:
            raise ValueError(f"tensor {name!r}: wrote {written} bytes, its info says {info.nbytes}")
        self.write_padding(fout, written)
        self.state = WriterState.WEIGHTS
        return written, digest.hexdigest()


def _pack_strings(values: list[str]) -> bytes:
    """GGUF string items: each a little-endian u64 byte length followed by the UTF-8 bytes."""
    encoded = [v.encode("utf-8") for v in values]
    lengths = np.fromiter(map(len, encoded), dtype="<u8", count=len(encoded)).tobytes()
    return b"".join(lengths[8 * i:8 * i + 8] + e for i, e in enumerate(encoded))


def _add_info(writer: GGUFWriter, spec: TensorSpec) -> None:
    """Declare a tensor: logical shape for dense types, byte shape for quantized ones (gguf's convention)."""
    dtype = DENSE_DTYPES[spec.qtype] if spec.qtype in DENSE_DTYPES else np.dtype(np.uint8)
    writer.add_tensor_info(spec.name, stored_shape(spec.qtype, spec.shape), dtype, spec.nbytes, raw_dtype=spec.qtype)


class GGUFFileWriter:
    """Writes one GGUF file: metadata and tensor infos on creation, then tensors in plan order."""

    def __init__(self, path: Path, files: ModelFiles, dtype: str, specs: Sequence[TensorSpec], name: str,
                 extra: dict[str, str | int] | None = None) -> None:
        """``extra``: more keys (strings, or integers stored as u32), e.g. ``quantize.imatrix.*``."""
        if files.directory is None:
            raise ValueError("GGUF output needs a model directory with tokenizer files")
        self.path = path
        self.checksums: dict[str, str] = {}
        self._writer = StreamingGGUFWriter(path, files.config.arch)
        add_model_metadata(self._writer, files.config, dtype, name)
        add_tokenizer_metadata(self._writer, files.directory, files.config)
        for key, value in (extra or {}).items():
            if isinstance(value, str):
                self._writer.add_string(key, value)
            else:
                self._writer.add_uint32(key, value)
        for spec in specs:
            _add_info(self._writer, spec)
        try:
            self._writer.write_header_to_file()
            self._writer.write_kv_data_to_file()
            self._writer.write_ti_data_to_file()
        except BaseException:
            self._writer.close()
            raise

    def write_tensor(self, spec: TensorSpec, chunks: Iterable[np.ndarray]) -> None:
        """Append the data of ``spec`` (the next tensor in plan order)."""
        self.checksums[spec.name] = self._writer.write_tensor_chunks(chunks)[1]

    def finish(self) -> None:
        """Flush everything to disk."""
        self._writer.flush()
        self._writer.close()

    def __enter__(self) -> GGUFFileWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._writer.close()
