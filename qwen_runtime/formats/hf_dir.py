"""Hugging Face model directories: config.json plus one or many safetensors shards."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError
from .archs import VALUE_TRANSFORMS
from .base import V_HEAD_GROUPED, V_HEAD_ORDERS, V_HEAD_TILED, ModelFiles, contained_path, read_json_file
from .config import ModelConfig
from .hf_config import config_from_hf
from .naming import (
    TRANSFORM_NOTES,
    TRANSFORMS,
    TensorPlan,
    check_tensor_set,
    output_shape,
    plan_tensor,
    skip_reason,
    tile_v_heads,
)
from .safetensors import SafetensorsEntry, read_header, read_index
from .tensors import QType, StoredTensor, to_float32

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def shard_entries(directory: Path) -> dict[str, SafetensorsEntry]:
    """Every tensor of the checkpoint, from the index's shards or the single file."""
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        weight_map = read_index(index_path)
        shards = sorted(set(weight_map.values()))
    elif (directory / SINGLE_NAME).is_file():
        weight_map, shards = None, [SINGLE_NAME]
    else:
        found = sorted(p.name for p in directory.glob("*.safetensors"))
        if not found:
            raise FormatError(f"{directory}: no {SINGLE_NAME} or {INDEX_NAME}")
        weight_map, shards = None, found
    entries: dict[str, SafetensorsEntry] = {}
    shard_of: dict[str, str] = {}  # tensor -> the shard name it was read from (the entry's path may be a Hub
    # cache blob the shard's symlink resolves to, named by its hash)
    for shard in shards:
        path = contained_path(directory, shard, f"{INDEX_NAME} shard")
        if not path.is_file():
            raise FormatError(f"{path}: shard listed in {INDEX_NAME} is missing")
        for name, entry in read_header(path)[0].items():
            if name in entries:
                raise FormatError(f"{directory / shard}: tensor {name!r} also appears in {shard_of[name]}")
            entries[name], shard_of[name] = entry, shard
    if weight_map is not None:
        _check_index(directory, weight_map, shard_of)
    return entries


def _check_index(directory: Path, weight_map: dict[str, str], shard_of: dict[str, str]) -> None:
    for name, shard in weight_map.items():
        if name not in shard_of:
            raise FormatError(f"{directory / shard}: tensor {name!r} listed in {INDEX_NAME} is not in any shard")
        if shard_of[name] != shard:
            raise FormatError(f"{directory / INDEX_NAME}: tensor {name!r} is in {shard_of[name]}, not {shard}")


def load_hf_config(directory: Path) -> tuple[dict, ModelConfig]:
    raw = read_json_file(contained_path(directory, "config.json", "config"))
    assert raw is not None
    return raw, config_from_hf(raw, str(directory / "config.json"))


@dataclass(frozen=True)
class SourcePlan:
    """One source tensor of an HF directory and its fate: exactly one of ``plan`` (what it becomes),
    ``skipped`` (why it is left out) or ``error`` (why it cannot be planned) is set."""

    hf_name: str
    entry: SafetensorsEntry
    plan: TensorPlan | None = None
    skipped: str = ""
    error: FormatError | None = None


def plan_entries(directory: Path, config: ModelConfig, v_head_order: str) -> Iterator[SourcePlan]:
    """Every tensor of the checkpoint in name order, planned, skipped or unplannable; callers decide whether
    an unplannable tensor is fatal (the reader) or a finding (verification)."""
    for hf_name, entry in sorted(shard_entries(directory).items()):
        reason = skip_reason(hf_name, config)
        if reason:
            yield SourcePlan(hf_name, entry, skipped=reason)
            continue
        try:
            plan = plan_tensor(hf_name, entry.shape, config, tiled_v_heads=v_head_order == V_HEAD_TILED)
        except FormatError as exc:
            yield SourcePlan(hf_name, entry, error=exc)
            continue
        yield SourcePlan(hf_name, entry, plan=plan)


def _stored(entry: SafetensorsEntry, plan: TensorPlan, config: ModelConfig) -> StoredTensor:
    """A canonical tensor backed by a safetensors entry, transformed lazily when needed."""
    shape = output_shape(plan, entry.shape)
    note = "; ".join(filter(None, [TRANSFORM_NOTES.get(plan.transform),
                                   "value heads tiled" if plan.v_axis is not None else ""]))
    if not plan.transform and plan.v_axis is None:
        return StoredTensor(plan.name, entry.qtype, shape, entry.path, loader=entry.view)
    widen = plan.transform in VALUE_TRANSFORMS

    def load() -> np.ndarray:
        x = entry.view()
        x = TRANSFORMS[plan.transform](to_float32(entry.qtype, x) if widen else x)
        return tile_v_heads(np.asarray(x), plan, config.linear_num_key_heads, config.linear_num_value_heads)

    return StoredTensor(plan.name, QType.F32 if widen else entry.qtype, shape, entry.path, loader=load,
                        transform=note)


def open_hf_dir(path: str | Path, v_head_order: str | None = None) -> ModelFiles:
    """Open an HF directory; tensors are renamed and transformed to the canonical GGUF vocabulary.

    ``v_head_order`` is ``"grouped"`` (default: HF's order, zero-copy) or ``"tiled"`` (llama.cpp's order,
    which copies the affected tensors when they are read; used by the converter).
    """
    directory = Path(path)
    raw, config = load_hf_config(directory)
    order = v_head_order or V_HEAD_GROUPED
    if order not in V_HEAD_ORDERS:
        raise FormatError(f"{directory}: unknown value-head order {order!r}; expected one of {list(V_HEAD_ORDERS)}")
    order = order if config.has_linear_attention else V_HEAD_GROUPED
    tensors: dict[str, StoredTensor] = {}
    skipped: dict[str, str] = {}
    for source in plan_entries(directory, config, order):
        if source.error is not None:
            raise FormatError(f"{source.entry.path}: {source.error}") from None
        if source.plan is None:
            skipped[source.hf_name] = source.skipped
            continue
        plan = source.plan
        if plan.name in tensors:
            raise FormatError(f"{source.entry.path}: tensors {source.hf_name!r} and another both map to "
                              f"{plan.name!r}")
        tensors[plan.name] = _stored(source.entry, plan, config)
    tied = check_tensor_set(config, tensors, str(directory))
    if tied and not config.tie_word_embeddings:
        raise FormatError(f"{directory}: tensor 'lm_head.weight' is missing and tie_word_embeddings is false")
    return ModelFiles(directory, "hf", config, tensors, directory=directory, hf_config=raw, skipped=skipped,
                      v_head_order=order)
