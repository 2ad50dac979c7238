"""verify's tensor checks: every output tensor against its Hugging Face source tensor, streamed.

Each output tensor's recorded transform is undone (``ssm_a`` -> ``log(-ssm_a)``, ``-1`` on the (1 + w) norms,
the conv squeeze), its value heads are matched to the source's through the recorded permutation (an index map,
so it is exact), and the result is compared with the source tensor row chunk by row chunk (memory bounded by
the chunk) against each element's bound (:mod:`qwen_convert.verify.bounds`).  Every source tensor must be
converted or skipped for a stated reason (:func:`qwen_runtime.formats.naming.skip_reason`), and every output tensor
must come from one.  A failure is explained by its most likely cause: value heads in the other order, a
transform not applied, a constant offset or scale, non-finite values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qwen_runtime.formats.archs import NO_TRANSFORM, PLUS_ONE, VALUE_TRANSFORMS
from qwen_runtime.formats.base import V_HEAD_GROUPED, V_HEAD_TILED, ModelFiles
from qwen_runtime.formats.config import ModelConfig
from qwen_runtime.formats.hf_dir import plan_entries
from qwen_runtime.formats.naming import (
    INVERSE_TRANSFORMS,
    TRANSFORM_NOTES,
    TensorPlan,
    output_shape,
    plan_tensor,
    tile_v_heads,
)
from qwen_runtime.formats.safetensors import SafetensorsEntry
from qwen_runtime.formats.tensors import StoredTensor, to_float32

from ..error_sums import ErrorSums
from ..imatrix import QUANTIZE_FILE_KEY
from ..quantize import rows_per_chunk
from .bounds import plus_one_conventions, storage_bound, storage_rounding, transform_bound


@dataclass(frozen=True)
class TensorCheck:
    """One output tensor compared with its source tensor."""

    name: str  # canonical name in the output
    source: str  # HF name
    type: str  # stored type in the output
    transform: str  # what was undone before comparing
    max_error: float  # max |undo(output) - source|; (1 + w) norms: max |output - (1 + w)| as stored
    max_bound: float  # the largest per-element bound
    violations: int  # elements outside their bound
    ok: bool
    cause: str = ""


@dataclass(frozen=True)
class SourceTensor:
    """A source tensor and how the converter turns it into its canonical tensor."""

    entry: SafetensorsEntry
    plan: TensorPlan


def plan_sources(directory: Path, config: ModelConfig,
                 v_head_order: str) -> tuple[dict[str, SourceTensor], dict[str, str], list[str]]:
    """(canonical name -> source tensor, skipped source tensor -> reason, problems) for the HF directory."""
    planned: dict[str, SourceTensor] = {}
    skipped: dict[str, str] = {}
    problems: list[str] = []
    for source in plan_entries(directory, config, v_head_order):
        if source.error is not None:
            problems.append(f"source tensor {source.hf_name!r} is neither converted nor skipped for a reason "
                            f"({source.error})")
        elif source.plan is None:
            skipped[source.hf_name] = source.skipped
        else:
            planned[source.plan.name] = SourceTensor(source.entry, source.plan)
    return planned, skipped, problems


class BoundedError:
    """The error of ``undone`` against ``source`` (:class:`~qwen_convert.error_sums.ErrorSums`) and how it meets
    each element's bound: violations, the largest bound and where the first violation is."""

    def __init__(self) -> None:
        self.error = ErrorSums()
        self.violations = 0
        self.max_bound = 0.0
        self.first_bad: tuple[int, int] | None = None  # (row, column) of the first violation

    def add(self, undone: np.ndarray, source: np.ndarray, bound: np.ndarray, row0: int) -> None:
        diff = self.error.add(source, undone)  # [rows, n] float64
        bad = ~(np.abs(diff) <= bound)  # NaN counts as a violation
        if bad.any() and self.first_bad is None:
            r, c = np.argwhere(bad)[0]
            self.first_bad = (row0 + int(r), int(c))
        self.violations += int(bad.sum())
        self.max_bound = max(self.max_bound, float(np.max(bound, initial=0.0)))


def value_order(plan: TensorPlan, n: int, config: ModelConfig) -> np.ndarray | None:
    """Source index of each output index along the value-head axis (None when nothing is reordered)."""
    if plan.v_axis is None:
        return None
    flat = dataclasses.replace(plan, v_axis=0)
    return tile_v_heads(np.arange(n), flat, config.linear_num_key_heads, config.linear_num_value_heads)


def aligned_source(entry: SafetensorsEntry, plan: TensorPlan, out_shape: tuple[int, ...],
                   config: ModelConfig) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, float32 rows) of the source in the output's row layout, chunk by chunk."""
    width = out_shape[-1]
    view = entry.view().reshape(-1, width)  # [C,1,K] conv -> [C,K]; 1-D -> [1, n]
    permuted_columns = plan.v_axis is not None and plan.v_axis == len(out_shape) - 1
    order = value_order(plan, width if permuted_columns else len(view), config)
    step = rows_per_chunk(width)
    for start in range(0, len(view), step):
        stop = min(start + step, len(view))
        if order is None:
            rows = view[start:stop]
        elif permuted_columns:
            rows = view[start:stop][:, order]
        else:
            rows = view[order[start:stop]]
        yield start, to_float32(entry.qtype, np.ascontiguousarray(rows))


def compare_plus_one(out: StoredTensor, src: SourceTensor, config: ModelConfig, weighted: bool = False) -> BoundedError:
    """A (1 + w) norm compared as stored: against each convention of :func:`plus_one_conventions` rounded to
    the output's type, exactly (bound 0), or within a quantized type's bound; the convention with the fewest
    violations is the tensor's (one converter wrote the whole tensor)."""
    stats: list[BoundedError] = []
    stored_rows = out.rows2d()
    for start, source in aligned_source(src.entry, src.plan, out.shape, config):
        raw = stored_rows[start:start + len(source)]
        stored = to_float32(out.qtype, raw)
        for i, wanted in enumerate(plus_one_conventions(source, src.entry.qtype)):
            if i == len(stats):
                stats.append(BoundedError())
            expected = storage_rounding(out.qtype, wanted)
            if expected is None:
                expected, bound = wanted, storage_bound(out.qtype, raw, stored, wanted, weighted)
            else:
                bound = np.zeros(stored.shape)
            stats[i].add(stored, expected, bound, start)
    return min(stats, key=lambda s: s.violations, default=BoundedError())


def compare_tensor(out: StoredTensor, src: SourceTensor, config: ModelConfig, weighted: bool = False) -> BoundedError:
    """Stream ``out`` against its source with ``src.plan`` undone; returns the accumulated error.  (1 + w)
    norms are compared as stored instead (:func:`compare_plus_one`)."""
    if src.plan.transform == PLUS_ONE:
        return compare_plus_one(out, src, config, weighted)
    stats = BoundedError()
    stored_rows = out.rows2d()
    # Value transforms are undone on the output; the squeeze only reshapes, so the source is read as [C, K].
    inverse = INVERSE_TRANSFORMS[src.plan.transform if src.plan.transform in VALUE_TRANSFORMS else NO_TRANSFORM]
    for start, source in aligned_source(src.entry, src.plan, out.shape, config):
        raw = stored_rows[start:start + len(source)]
        stored = to_float32(out.qtype, raw)
        with np.errstate(invalid="ignore", divide="ignore"):
            undone = inverse(stored)
        base = storage_bound(out.qtype, raw, stored, source, weighted)
        bound = transform_bound(src.plan, stored, undone, base, src.entry.qtype)
        stats.add(undone, source, bound, start)
    return stats


def check_tensor(out: StoredTensor, src: SourceTensor, config: ModelConfig, order: str,
                 weighted: bool = False) -> TensorCheck:
    """Compare one output tensor with its source (``weighted``: the file was quantized with an importance
    matrix); a failure carries its most likely cause."""
    plan = src.plan
    notes = "; ".join(filter(None, [TRANSFORM_NOTES.get(plan.transform, ""),
                                    "value heads tiled" if plan.v_axis is not None else ""]))
    expected = output_shape(plan, src.entry.shape)
    if out.shape != expected:
        return TensorCheck(out.name, plan.source, out.qtype.name, notes, math.inf, 0.0, 0, False,
                           f"shape {list(out.shape)}, expected {list(expected)} from the source")
    stats = compare_tensor(out, src, config, weighted)
    ok = stats.violations == 0
    cause = "" if ok else diagnose(out, src, config, order, stats, weighted)
    return TensorCheck(out.name, plan.source, out.qtype.name, notes, stats.error.max_abs, stats.max_bound,
                       stats.violations, ok, cause)


def diagnose(out: StoredTensor, src: SourceTensor, config: ModelConfig, order: str, stats: BoundedError,
             weighted: bool = False) -> str:
    """The most specific explanation of a failed comparison."""
    plan = src.plan
    other = V_HEAD_GROUPED if order == V_HEAD_TILED else V_HEAD_TILED
    alternative = plan_tensor(plan.source, src.entry.shape, config, tiled_v_heads=other == V_HEAD_TILED)
    if alternative.v_axis != plan.v_axis and not compare_tensor(out, SourceTensor(src.entry, alternative),
                                                               config, weighted).violations:
        return (f"value heads are in {other} order, but the output declares {order} "
                f"(Hv={config.linear_num_value_heads} > Hk={config.linear_num_key_heads})")
    if plan.transform in VALUE_TRANSFORMS:
        untransformed = dataclasses.replace(plan, transform="")
        if not compare_tensor(out, SourceTensor(src.entry, untransformed), config, weighted).violations:
            return f"stored without the transform ({TRANSFORM_NOTES[plan.transform]})"
    return _numeric_cause(plan, stats)


def _numeric_cause(plan: TensorPlan, stats: BoundedError) -> str:
    where = f" (first at row {stats.first_bad[0]}, column {stats.first_bad[1]})" if stats.first_bad else ""
    offset, scale = stats.error.offset(), stats.error.scale()
    if offset is not None:
        hint = ""
        if abs(offset - 1) < 1e-3:
            hint = (": the (1 + w) norm offset is applied twice" if plan.transform == PLUS_ONE
                    else ": +1 added to a tensor that takes none")
        elif abs(offset + 1) < 1e-3 and plan.transform == PLUS_ONE:
            hint = ": the (1 + w) norm offset is missing"
        return f"every value is off by {offset:+.6g}{hint}"
    if scale is not None:
        relative = "1 + w of the source" if plan.transform == PLUS_ONE else "the source"
        return f"values are scaled by x{scale:.6g} relative to {relative}"
    if not math.isfinite(stats.error.max_abs):
        return f"non-finite values where the source is finite{where}"
    return (f"{stats.violations} values outside the bound: max |error| {stats.error.max_abs:.4g}, "
            f"largest bound {stats.max_bound:.4g}{where}")


def compare_tensors(output: ModelFiles, planned: dict[str, SourceTensor],
                    config: ModelConfig) -> tuple[list[TensorCheck], list[str]]:
    """(each output tensor against its source, accounting problems: output tensors no source maps to, planned
    source tensors missing from the output)."""
    weighted = QUANTIZE_FILE_KEY in output.metadata
    checks: list[TensorCheck] = []
    problems: list[str] = []
    for name, tensor in output.tensors.items():
        if name not in planned:
            problems.append(f"unexpected tensor {name!r}: no source tensor maps to it")
            continue
        checks.append(check_tensor(tensor, planned[name], config, output.v_head_order, weighted))
    for name, src in planned.items():
        if name not in output.tensors:
            problems.append(f"missing tensor {name!r} (source {src.plan.source!r} was not converted)")
    return checks, problems
