"""GGUF model files (ours or llama.cpp's), parsed by the validating :mod:`.gguf_parse` reader.

Tensors are zero-copy views of the file's read-only memory map; metadata values are plain Python values
(strings, ints, floats, bools), except arrays, which stay in the map: numeric arrays as read-only 1-D numpy
views, string arrays as :class:`~.gguf_parse.GGUFStrings` (the token and merge lists would otherwise cost
~30 MB of ``str``, a hostile 20 MB array of INT16 400 MB of Python ints).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import MODEL_TENSOR, Keys

from ..errors import FormatError
from .base import V_HEAD_GROUPED, V_HEAD_TILED, ModelFiles
from .config import ModelConfig
from .gguf_config import config_from_gguf, is_mtp_tensor, mtp_block_count
from .gguf_parse import GGUFLayout, GGUFTensorInfo, parse_gguf, tensor_view
from .naming import check_tensor_set, expected_tensors, tensor_name
from .tensors import SUPPORTED_QTYPES, StoredTensor, stored_view

SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)


def split_names(name: str) -> list[str]:
    """Every part's name of a split GGUF from its first part's (``<prefix>-00001-of-0000n.gguf``); ``[name]``
    for a file not named as a first part."""
    match = SPLIT_NAME.fullmatch(name)
    if match is None or int(match["index"]) != 1:
        return [name]
    return [f"{match['prefix']}-{i:05d}-of-{match['count']}.gguf" for i in range(1, int(match["count"]) + 1)]


def split_parts(first: GGUFLayout) -> list[GGUFLayout]:
    """Every part of a split GGUF (llama.cpp's gguf-split: files ``<prefix>-0000i-of-0000n.gguf`` with
    ``split.*`` keys, the model's metadata in the first), opened from the first; an unsplit file is its one part."""
    meta = first.metadata
    count = meta.get(Keys.Split.LLM_KV_SPLIT_COUNT, 1)
    if count == 1:
        return [first]
    if meta.get(Keys.Split.LLM_KV_SPLIT_NO) != 0:
        raise FormatError(f"{first.path}: part {meta.get(Keys.Split.LLM_KV_SPLIT_NO)!r} (from 0) of a split GGUF; "
                          f"open the first part")
    names = split_names(first.path.name)
    if not isinstance(count, int) or len(names) != count:
        raise FormatError(f"{first.path}: {Keys.Split.LLM_KV_SPLIT_COUNT} is {count!r}, but the file is not named "
                          f"<prefix>-00001-of-<count>.gguf as the first of that many parts")
    parts = [first]
    for index, name in enumerate(names[1:], start=2):
        path = first.path.with_name(name)
        if not path.is_file():
            raise FormatError(f"{path}: part {index} of {count} of the split GGUF {first.path.name} is missing")
        part = parse_gguf(path)
        got = (part.metadata.get(Keys.Split.LLM_KV_SPLIT_NO), part.metadata.get(Keys.Split.LLM_KV_SPLIT_COUNT))
        if got != (index - 1, count):
            raise FormatError(f"{path}: split.no and split.count are {got}, expected {(index - 1, count)}")
        parts.append(part)
    total = sum(len(part.tensors) for part in parts)
    if meta.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, total) != total:
        raise FormatError(f"{first.path}: {Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT} is "
                          f"{meta[Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT]!r}, but the {count} parts hold {total}")
    return parts


def _tensor(layout: GGUFLayout, info: GGUFTensorInfo) -> StoredTensor:
    if info.qtype not in SUPPORTED_QTYPES:
        raise FormatError(f"{layout.path}: tensor {info.name!r} has type {info.qtype.name}; supported: "
                          f"{[q.name for q in SUPPORTED_QTYPES]}")
    data = stored_view(info.qtype, tensor_view(layout, info), info.shape)
    return StoredTensor(info.name, info.qtype, info.shape, layout.path, data=np.asarray(data))


def check_tensor_count(path: Path, infos: list[GGUFTensorInfo], config: ModelConfig) -> None:
    """The number of decoder tensors must be what the architecture needs (with or without ``output``)."""
    count = len(infos)
    tied = len(expected_tensors(config, tied=True))
    if count not in (tied, tied + 1):
        raise FormatError(f"{path}: {count} tensors, but a {config.arch} model of this config has "
                          f"{tied} ({tied + 1} with a separate output.weight)")


def _tied(parts: list[GGUFLayout]) -> bool:
    """Whether the LM head is the token embedding: no part holds ``output.weight``."""
    return not any(info.name == tensor_name(MODEL_TENSOR.OUTPUT) for part in parts for info in part.tensors)


def open_gguf(path: str | Path, expected: ModelConfig | None = None) -> ModelFiles:
    """Open a GGUF model file (the first part of a split one); tensors are zero-copy views of the files'
    memory maps.  ``expected``: open leniently as a model of that config (see :func:`.open_model_files`)."""
    layout = parse_gguf(path)
    parts = split_parts(layout)
    config = expected or config_from_gguf(layout.metadata, str(layout.path), tied=_tied(parts))
    mtp = mtp_block_count(layout.metadata, config.arch)
    decoder = [(part, info) for part in parts for info in part.tensors
               if not is_mtp_tensor(info.name, config.num_hidden_layers, mtp)]
    if expected is None:
        check_tensor_count(layout.path, [info for _, info in decoder], config)
    tensors: dict[str, StoredTensor] = {}
    for part, info in decoder:
        if info.name in tensors:
            raise FormatError(f"{part.path}: tensor {info.name!r} is also in an earlier part")
        tensors[info.name] = _tensor(part, info)
    if expected is None:
        check_tensor_set(config, tensors, str(layout.path))
    order = V_HEAD_TILED if config.spec.hybrid else V_HEAD_GROUPED  # llama.cpp's converter tiles them
    return ModelFiles(layout.path, "gguf", config, tensors, metadata=dict(layout.metadata), v_head_order=order)
