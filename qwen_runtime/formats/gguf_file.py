"""GGUF files (ours or llama.cpp's), read through ``gguf.GGUFReader``'s memory map."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from ..config import config_from_gguf
from ..errors import FormatError
from ..naming import check_tensors
from ..tensors import DENSE_DTYPES, SUPPORTED_QTYPES, QType, StoredTensor, stored_nbytes, stored_shape
from .base import ModelFiles


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value pairs as Python values (strings decoded, arrays as lists)."""
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types and field.types[0] == GGUFValueType.STRING and isinstance(value, bytes):
            value = value.decode("utf-8", errors="replace")
        meta[name] = value
    return meta

def _tensor(path: Path, t: Any) -> StoredTensor:
    name = str(t.name)
    try:
        qtype = QType(int(t.tensor_type))
    except ValueError:
        raise FormatError(f"{path}: tensor {name!r} has unknown GGML type {int(t.tensor_type)}") from None
    if qtype not in SUPPORTED_QTYPES:
        raise FormatError(f"{path}: tensor {name!r} has type {qtype.name}; supported: "
                          f"{[q.name for q in SUPPORTED_QTYPES]}")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    raw = np.asarray(t.data).reshape(-1).view(np.uint8)
    if raw.size != stored_nbytes(qtype, shape):
        raise FormatError(f"{path}: tensor {name!r} has {raw.size} bytes, {qtype.name}{list(shape)} needs "
                          f"{stored_nbytes(qtype, shape)}")
    if qtype == QType.Q8_0:
        data = raw.reshape(stored_shape(qtype, shape))
    else:
        data = raw.view(DENSE_DTYPES[qtype]).reshape(shape)
    return StoredTensor(name, qtype, shape, path, data=data)

def open_reader(path: Path) -> GGUFReader:
    """``GGUFReader`` with every failure on a malformed file turned into a :class:`FormatError`."""
    try:
        return GGUFReader(path, "r")
    except FormatError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, AssertionError, OSError,
            MemoryError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: not a valid GGUF file ({type(exc).__name__}: {exc})") from None

def open_gguf(path: str | Path) -> ModelFiles:
    """Open a GGUF model file; tensors are zero-copy views of the file's memory map."""

    path = Path(path)
    reader = open_reader(path)
    meta = read_metadata(reader)
    config = config_from_gguf(meta, str(path))
    tensors: dict[str, StoredTensor] = {}
    for t in reader.tensors:
        stored = _tensor(path, t)
        if stored.name in tensors:
            raise FormatError(f"{path}: tensor {stored.name!r} appears twice")
        tensors[stored.name] = stored
    n_layers = config.num_hidden_layers
    tensors = {k: v for k, v in tensors.items() if not _is_nextn(k, n_layers)}
    tied = check_tensors(config, tensors, str(path))
    config = config.replace(tie_word_embeddings=tied)
    return ModelFiles(path, "gguf", config, tensors, metadata=meta)

def _is_nextn(name: str, n_layers: int) -> bool:
    """Tensors of MTP blocks that llama.cpp appends after the decoder layers (``nextn_predict_layers``)."""
    parts = name.split(".")
    return len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= n_layers
