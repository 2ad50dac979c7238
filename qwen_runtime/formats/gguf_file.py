"""GGUF model files (ours or llama.cpp's), parsed by the validating :mod:`.gguf_parse` reader.

Tensors are zero-copy views of the file's read-only memory map; metadata values are plain Python values
(strings, ints, floats, bools), except arrays, which stay in the map: numeric arrays as read-only 1-D numpy
views, string arrays as :class:`~.gguf_parse.GGUFStrings` (the token and merge lists would otherwise cost
~30 MB of ``str``, a hostile 20 MB array of INT16 400 MB of Python ints).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import ModelConfig, config_from_gguf
from ..errors import FormatError
from ..naming import check_tensor_set, expected_tensors
from ..tensors import SUPPORTED_QTYPES, StoredTensor, stored_view
from .base import ModelFiles
from .gguf_parse import GGUFLayout, GGUFTensorInfo, parse_gguf, tensor_view


def _tensor(layout: GGUFLayout, info: GGUFTensorInfo) -> StoredTensor:
    if info.qtype not in SUPPORTED_QTYPES:
        raise FormatError(f"{layout.path}: tensor {info.name!r} has type {info.qtype.name}; supported: "
                          f"{[q.name for q in SUPPORTED_QTYPES]}")
    data = stored_view(info.qtype, tensor_view(layout, info), info.shape)
    return StoredTensor(info.name, info.qtype, info.shape, layout.path, data=np.asarray(data))


def _is_nextn(name: str, n_layers: int) -> bool:
    """Tensors of MTP blocks that llama.cpp appends after the decoder layers (``nextn_predict_layers``)."""
    parts = name.split(".")
    return len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= n_layers


def check_tensor_count(layout: GGUFLayout, config: ModelConfig) -> None:
    """The number of decoder tensors must be what the architecture needs (with or without ``output``)."""
    count = sum(not _is_nextn(t.name, config.num_hidden_layers) for t in layout.tensors)
    tied = len(expected_tensors(config, tied=True))
    if count not in (tied, tied + 1):
        raise FormatError(f"{layout.path}: {count} tensors, but a {config.arch} model of this config has "
                          f"{tied} ({tied + 1} with a separate output.weight)")


def open_gguf(path: str | Path) -> ModelFiles:
    """Open a GGUF model file; tensors are zero-copy views of the file's memory map."""
    layout = parse_gguf(path)
    config = config_from_gguf(layout.metadata, str(layout.path))
    check_tensor_count(layout, config)
    tensors = {info.name: _tensor(layout, info) for info in layout.tensors
               if not _is_nextn(info.name, config.num_hidden_layers)}
    tied = check_tensor_set(config, tensors, str(layout.path))
    config = config.replace(tie_word_embeddings=tied)
    return ModelFiles(layout.path, "gguf", config, tensors, metadata=dict(layout.metadata))
