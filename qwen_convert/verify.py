"""Semantic verification: prove a converted model (our npy directory, or any GGUF) matches its HF source.

A conversion can finish cleanly and still be wrong: a (1 + w) norm offset applied twice, value heads in the
wrong order, a metadata key missing, a tensor dropped.  :func:`verify_against` checks, against the Hugging
Face source directory:

1. **Tensors.**  Each output tensor's recorded transform is undone (``ssm_a`` -> ``log(-ssm_a)``, ``-1`` on
   the (1 + w) norms, the conv squeeze), its value heads are matched to the source's through the recorded
   permutation (an index map, so it is exact), and the result is compared with the source tensor row chunk by
   row chunk (memory bounded by the chunk).  Every source tensor must be converted or skipped for a stated
   reason (:func:`qwen_runtime.naming.skip_reason`), and every output tensor must come from one.
2. **Metadata.**  GGUF: every key of the model table (:data:`qwen_runtime.gguf_keys.MODEL_KEYS`) that llama.cpp
   reads for the architecture against ``config.json`` (an absent key passes only where llama.cpp's default is
   the right value), plus the tokenizer keys against the tokenizer files, in full: every token's text and
   type (added tokens included), every merge in order, every special-token id and add-token flag the
   source's files give (and none they do not), the chat template.  npy: the manifest and the copied
   config/tokenizer files.
3. **Behaviour** (:mod:`qwen_convert.probe`): next-token distributions of source and output on a probe.

Per-element bounds on ``e = |undo(output) - source|`` (the output's storage type, then the transform):

* F32: ``e == 0`` (bf16/f16/f32 sources widen to float32 exactly).
* F16 / BF16: ``e <= ulp/2`` of the stored value (round to nearest).
* Q8_0: ``e <= d/2 + 127·|fp16(d) - d|`` per 32-block, ``d = amax/127`` of the source block: half a step
  from rounding ``x/d``, plus the fp16 rounding of the scale that every ``|q| <= 127`` multiplies (and 1e-4·d
  for ``x·(1/d)`` computed in float32, as ggml does).
* The 4- to 6-bit types (Q4_0 ... Q6_K, IQ4_NL, IQ4_XS): every quantizer we know (ours, which is gguf-py's, and
  llama.cpp's without an importance matrix) rounds each value to the nearest point of its sub-block's grid,
  computed from the *stored* scales (llama.cpp recomputes the integers after quantizing the scales), so
  ``e <= step/2 + dist(source, grid range)`` from the stored sub-block (``Codec.rounding_bound``; IQ4's step
  is its largest gap between levels), plus 1/32 of a step for the float16 rounding of a 32-block scale the
  integers were computed with (<= 16·2^-11 steps) and float32 arithmetic.
* With an importance matrix (the file records ``quantize.imatrix.file``), llama.cpp's 32-value types (Q4_0 ...
  Q5_1) keep the integers of their search (one trial scale, rounded to nearest) and store the *weighted*
  least-squares scale (and minimum) for them, so a value may lie several steps from the source (measured: up
  to 20 on heavy-tailed importances).  Without the weights, a block is accepted when it is what such a search
  writes (:func:`weighted_search_blocks`): integers non-decreasing in the source, residuals satisfying the
  normal equation for some positive weights (both signs), else it must meet the nearest-grid bound above.
  The K-quants and IQ4 re-round to the stored scales with or without weights: their bound is unchanged.
* (1 + w) norms are compared as stored, exactly: the stored value must be ``1 + w`` as a converter computes
  it, rounded to float32 (ours; llama.cpp's for bf16 and f32 sources, which it widens to float32 first) or to
  the source's own dtype (llama.cpp's for an f16 source, which it keeps; torch arithmetic on a bf16 tensor),
  then to the output's type; the tensor passes when every value equals one of these conventions' values
  (quantized norms: within their type's bound of them).  A band such as ``eps_src·|output|`` would let
  every norm scaled by 1.007 through; a +1 applied twice or not at all is off by exactly 1.
* ``ssm_a = -exp(A_log)`` is undone as ``log(-ssm_a)`` in float64.  A relative error r of the stored exp
  becomes an *absolute* error ``log(1 + r) ≈ r`` in A_log (d log y = dy / y), so the bound is absolute:
  ``2·eps_src`` (float32 exp is within 2 ulp; measured max 1.7·2^-23 over [-8, 4]) plus half an ulp of
  A_log for the final float32 rounding — about one float32 ulp at |A_log| ≈ 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import Keys, TokenType

from qwen_runtime.archs import NEG_EXP, NO_TRANSFORM, PLUS_ONE, VALUE_TRANSFORMS
from qwen_runtime.config import ModelConfig
from qwen_runtime.errors import FormatError, UnsupportedTokenizerError, VerificationError
from qwen_runtime.formats import open_hf_dir, open_model_files
from qwen_runtime.formats.base import TOKENIZER_FILES, V_HEAD_GROUPED, V_HEAD_TILED, ModelFiles
from qwen_runtime.formats.gguf_config import is_metadata_array, metadata_array, without_mtp_blocks
from qwen_runtime.formats.hf_dir import plan_entries
from qwen_runtime.formats.safetensors import SafetensorsEntry
from qwen_runtime.gguf_keys import MODEL_KEYS, gguf_key
from qwen_runtime.naming import (
    INVERSE_TRANSFORMS,
    TRANSFORM_NOTES,
    TensorPlan,
    output_shape,
    plan_tensor,
    tile_v_heads,
)
from qwen_runtime.quants import CODECS
from qwen_runtime.quants.blocks import BlockCodec
from qwen_runtime.tensors import Q8_0_BLOCK, QType, StoredTensor, to_float32

from .gguf_metadata import special_vocab, token_table, tokenizer_pre
from .imatrix import QUANTIZE_FILE_KEY
from .inspect import json_safe
from .policy import DTYPES
from .quantize import rows_per_chunk

# Spacing of 1.0 in each source dtype: the precision a converter may compute a transform in.
SOURCE_EPS = {QType.F32: 2.0**-23, QType.F16: 2.0**-10, QType.BF16: 2.0**-7}
# With an importance matrix llama.cpp's 32-value types keep their search's integers (module docstring).
WEIGHTED_SEARCH_TYPES = frozenset({QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1})
Q8_0_ROUNDING_SLACK = 1e-4  # x * (1/d) in float32 may round to the other side of a .5 by ~127 * 2^-22 steps
FILE_TYPE_DTYPES = {int(ftype): name for name, (_, ftype) in DTYPES.items()}


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
class MetadataCheck:
    """One metadata key (or manifest field) against what the source says it must be."""

    key: str
    expected: Any
    actual: Any
    ok: bool
    note: str = ""


@dataclass
class VerifyReport:
    """Everything :func:`verify_against` found; ``ok`` only when every check passed."""

    output: Path
    source: Path
    format: str
    dtype: str | None
    tensors: list[TensorCheck] = field(default_factory=list)
    metadata: list[MetadataCheck] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # source tensor -> why it is not in the output
    problems: list[str] = field(default_factory=list)  # accounting: missing / unexpected / unmapped tensors
    behaviour: Any = None  # qwen_convert.probe.BehaviourCheck, when run

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        """Every failure, one line each: accounting, then tensors (file order), metadata, behaviour."""
        lines = list(self.problems)
        lines += [f"tensor {t.name!r} (from {t.source}): {t.cause}" for t in self.tensors if not t.ok]
        lines += [f"metadata {m.key!r}: {m.note}" for m in self.metadata if not m.ok]
        if self.behaviour is not None and not self.behaviour.ok:
            lines.append(f"behaviour: {self.behaviour.failure}")
        return lines

    def raise_for_failure(self) -> None:
        """:class:`VerificationError` naming the first failure (and how many there are) unless ``ok``."""
        failures = self.failures()
        if failures:
            more = f" (and {len(failures) - 1} more failures)" if len(failures) > 1 else ""
            raise VerificationError(f"{self.output}: verification against {self.source} failed: "
                                    f"{failures[0]}{more}")


@dataclass(frozen=True)
class SourceTensor:
    """A source tensor and how the converter turns it into its canonical tensor."""

    entry: SafetensorsEntry
    plan: TensorPlan


# ---------------------------------------------------------------------------------------------- opening


def open_output(path: str | Path, config: ModelConfig) -> ModelFiles:
    """Open an npy directory or GGUF file through the readers, leniently, as a model of ``config`` (the
    source's): its structure is checked as always, its metadata and tensor set are checked here, with better
    messages; MTP blocks llama.cpp appends after the decoder layers are left out."""
    return open_model_files(path, expected=config)


def output_dtype(output: ModelFiles) -> str | None:
    """The dtype a converted model declares: its manifest's, or the name of its GGUF file type."""
    if output.format == "npy":
        return output.metadata.get("dtype")
    return FILE_TYPE_DTYPES.get(output.metadata.get(Keys.General.FILE_TYPE, -1))


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


# ---------------------------------------------------------------------------------------------- tensors


class ErrorStats:
    """Streaming error of ``undone`` against ``source``: bound violations, maxima, and the sums that tell an
    offset (``undone = source + c``) or a scale (``undone = k·source``) apart from noise."""

    def __init__(self) -> None:
        self.n = self.violations = 0
        self.max_error = self.max_bound = 0.0
        self.first_bad: tuple[int, int] | None = None  # (row, column) of the first violation
        self.sum_d = self.sum_dd = self.sum_os = self.sum_ss = self.sum_oo = 0.0

    def add(self, undone: np.ndarray, source: np.ndarray, bound: np.ndarray, row0: int) -> None:
        o, s = undone.astype(np.float64), source.astype(np.float64)  # [rows, n]
        d = o - s
        err = np.abs(d)
        bad = ~(err <= bound)  # NaN counts as a violation
        if bad.any() and self.first_bad is None:
            r, c = np.argwhere(bad)[0]
            self.first_bad = (row0 + int(r), int(c))
        self.violations += int(bad.sum())
        finite = np.isfinite(d)
        d, o, s = d[finite], o[finite], s[finite]
        self.n += d.size
        self.max_error = max(self.max_error, float(err.max(initial=0.0)) if finite.all() else math.inf)
        self.max_bound = max(self.max_bound, float(np.max(bound, initial=0.0)))
        self.sum_d += float(d.sum())
        self.sum_dd += float(d @ d)
        self.sum_os += float(o @ s)
        self.sum_ss += float(s @ s)
        self.sum_oo += float(o @ o)

    def offset(self) -> float | None:
        """The constant c when every difference is (nearly) the same non-zero c."""
        if not self.n:
            return None
        mean = self.sum_d / self.n
        std = math.sqrt(max(self.sum_dd / self.n - mean * mean, 0.0))
        return mean if abs(mean) > 0 and std <= 0.01 * abs(mean) else None

    def scale(self) -> float | None:
        """The least-squares k of ``undone ≈ k·source`` when it differs from 1 beyond its own noise."""
        if not self.n or self.sum_ss == 0:
            return None
        k = self.sum_os / self.sum_ss
        residual = max(self.sum_oo - 2 * k * self.sum_os + k * k * self.sum_ss, 0.0)
        noise = math.sqrt(residual / self.sum_ss)  # relative rms of what k does not explain
        return k if abs(k - 1) > 5 * noise / math.sqrt(self.n) + 1e-6 and noise < 0.5 * abs(k - 1) + 0.01 else None


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


GRID_SLACK = 1 / 32  # steps, for the 4- to 6-bit types (module docstring)


def storage_bound(qtype: QType, raw: np.ndarray, stored: np.ndarray, source: np.ndarray,
                  weighted: bool = False) -> np.ndarray:
    """Per-element bound of the output's storage rounding (module docstring), float64 ``[rows, n]``;
    ``weighted``: the file was quantized with an importance matrix (:func:`weighted_search_blocks`)."""
    if qtype == QType.F32:
        return np.zeros(stored.shape)
    if qtype == QType.F16:
        return np.spacing(np.abs(stored).astype(np.float16)).astype(np.float64) / 2
    if qtype == QType.BF16:
        return np.spacing(np.abs(stored)).astype(np.float64) * 2.0**16 / 2
    if qtype == QType.Q8_0:
        blocks = source.reshape(-1, Q8_0_BLOCK)
        d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)  # [n_blocks, 1], as the quantizer
        d16 = d.astype(np.float16).astype(np.float64)
        d = d.astype(np.float64)
        bound = d * (0.5 + Q8_0_ROUNDING_SLACK) + 127 * np.abs(d16 - d)
        return np.broadcast_to(bound, blocks.shape).reshape(source.shape)
    if isinstance(CODECS.get(qtype), BlockCodec):
        bound = CODECS[qtype].rounding_bound(np.ascontiguousarray(raw), source, GRID_SLACK)
        if weighted and qtype in WEIGHTED_SEARCH_TYPES:
            searched = np.repeat(weighted_search_blocks(qtype, raw, source), CODECS[qtype].block_size, axis=1)
            error = np.abs(stored.astype(np.float64) - source)
            bound = np.where(searched, np.maximum(bound, error), bound)
        return bound
    raise FormatError(f"cannot verify tensors stored as {qtype.name}")


def weighted_search_blocks(qtype: QType, raw: np.ndarray, source: np.ndarray) -> np.ndarray:
    """Which 32-blocks of ``raw`` [R, nb * type_size] are what llama.cpp's importance-weighted search of the
    32-value types writes for ``source`` [R, nb * 32] (module docstring): integers non-decreasing in the source
    (against the scale's sign), and residuals ``r = decode - source`` satisfying the weighted least-squares
    normal equation for some positive weights: ``L·r`` (Q4_0, Q5_0: the fit ``d·L``; Q4_1, Q5_1 whose
    minimum was clamped to 0 too) or ``r`` (Q4_1, Q5_1: the fit ``d·L + m``) of both signs, within a
    float16 step of the stored scale (times ``|L|``) and minimum (their rounding; float32 sums lie far below).
    bool ``[R, nb]``."""
    codec = CODECS[qtype]
    rows, block = len(raw), codec.block_size
    fields = np.ascontiguousarray(raw).reshape(rows, -1, codec.type_size)  # [R, nb, bytes]
    d16 = fields[..., 0:2].copy().view("<f2")  # [R, nb, 1]
    m16 = fields[..., 2:4].copy().view("<f2") if codec.has_offset else np.zeros_like(d16)
    d, m = d16.astype(np.float64), m16.astype(np.float64)
    values = codec.reference(fields.reshape(rows, -1)).reshape(rows, -1, block).astype(np.float64)
    x = source.reshape(rows, -1, block).astype(np.float64)  # [R, nb, 32]
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.where(d != 0, np.rint((values - m) / d), 0.0)
    ranked = np.take_along_axis(L * np.where(d < 0, -1.0, 1.0), np.argsort(x, axis=2, kind="stable"), axis=2)
    monotone = (np.diff(ranked, axis=2) >= 0).all(axis=2)
    r = values - x
    ulp = [np.spacing(np.abs(v)).astype(np.float64) for v in (d16, m16)]  # float16 steps, subnormals too
    tol = np.abs(L) * ulp[0] + ulp[1]  # a float16 step of the scale and of the minimum

    def straddles(lever: np.ndarray, used: np.ndarray) -> np.ndarray:
        s = np.sign(lever) * r
        low, high = (used & (s <= tol)).any(axis=2), (used & (s >= -tol)).any(axis=2)
        return (low & high) | ~used.any(axis=2)

    through_origin = straddles(L, L != 0)
    if codec.has_offset:
        fitted = straddles(np.ones_like(L), np.ones(L.shape, bool)) | (through_origin & (m[..., 0] == 0))
    else:
        fitted = through_origin
    return monotone & fitted


def transform_bound(plan: TensorPlan, stored: np.ndarray, undone: np.ndarray, base: np.ndarray,
                    source_qtype: QType) -> np.ndarray:
    """Widen the storage bound by the rounding of the converter's transform (module docstring)."""
    eps = SOURCE_EPS.get(source_qtype, SOURCE_EPS[QType.F32])
    if plan.transform == NEG_EXP:
        with np.errstate(divide="ignore", invalid="ignore"):
            relative = np.where(stored != 0, base / np.abs(stored.astype(np.float64)), np.inf)
        return relative + 2 * eps + np.spacing(np.abs(undone)).astype(np.float64) / 2
    return base


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16 (ties to even), as float32; NaN stays NaN."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isnan(x), x, rounded)


def plus_one_conventions(source: np.ndarray, source_qtype: QType) -> list[np.ndarray]:
    """``1 + w`` as each converter convention computes it (module docstring): in float32, and rounded to the
    source's dtype when that is narrower.  float32 ``[rows, n]`` each."""
    exact = source.astype(np.float32) + np.float32(1)
    if source_qtype == QType.F16:
        return [exact, exact.astype(np.float16).astype(np.float32)]
    if source_qtype == QType.BF16:
        return [exact, round_to_bf16(exact)]
    return [exact]


def storage_rounding(qtype: QType, values: np.ndarray) -> np.ndarray | None:
    """float32 ``values`` as a float output type stores them (round to nearest even); None for the quantized
    types, whose stored values are compared within their bound instead."""
    if qtype == QType.F32:
        return values
    if qtype == QType.F16:
        return values.astype(np.float16).astype(np.float32)
    if qtype == QType.BF16:
        return round_to_bf16(values)
    return None


def compare_plus_one(out: StoredTensor, src: SourceTensor, config: ModelConfig, weighted: bool = False) -> ErrorStats:
    """A (1 + w) norm compared as stored: against each convention of :func:`plus_one_conventions` rounded to
    the output's type, exactly (bound 0), or within a quantized type's bound; the convention with the fewest
    violations is the tensor's (one converter wrote the whole tensor)."""
    stats: list[ErrorStats] = []
    stored_rows = out.rows2d()
    for start, source in aligned_source(src.entry, src.plan, out.shape, config):
        raw = stored_rows[start:start + len(source)]
        stored = to_float32(out.qtype, raw)
        for i, wanted in enumerate(plus_one_conventions(source, src.entry.qtype)):
            if i == len(stats):
                stats.append(ErrorStats())
            expected = storage_rounding(out.qtype, wanted)
            if expected is None:
                expected, bound = wanted, storage_bound(out.qtype, raw, stored, wanted, weighted)
            else:
                bound = np.zeros(stored.shape)
            stats[i].add(stored, expected, bound, start)
    return min(stats, key=lambda s: s.violations, default=ErrorStats())


def compare_tensor(out: StoredTensor, src: SourceTensor, config: ModelConfig, weighted: bool = False) -> ErrorStats:
    """Stream ``out`` against its source with ``src.plan`` undone; returns the accumulated error.  (1 + w)
    norms are compared as stored instead (:func:`compare_plus_one`)."""
    if src.plan.transform == PLUS_ONE:
        return compare_plus_one(out, src, config, weighted)
    stats = ErrorStats()
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
    return TensorCheck(out.name, plan.source, out.qtype.name, notes, stats.max_error, stats.max_bound,
                       stats.violations, ok, cause)


def diagnose(out: StoredTensor, src: SourceTensor, config: ModelConfig, order: str, stats: ErrorStats,
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


def _numeric_cause(plan: TensorPlan, stats: ErrorStats) -> str:
    where = f" (first at row {stats.first_bad[0]}, column {stats.first_bad[1]})" if stats.first_bad else ""
    offset, scale = stats.offset(), stats.scale()
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
    if not math.isfinite(stats.max_error):
        return f"non-finite values where the source is finite{where}"
    return (f"{stats.violations} values outside the bound: max |error| {stats.max_error:.4g}, "
            f"largest bound {stats.max_bound:.4g}{where}")


def compare_tensors(output: ModelFiles, planned: dict[str, SourceTensor], config: ModelConfig,
                  report: VerifyReport) -> None:
    """Every output tensor against its source; every planned source tensor present in the output."""
    weighted = QUANTIZE_FILE_KEY in output.metadata
    for name, tensor in output.tensors.items():
        if name not in planned:
            report.problems.append(f"unexpected tensor {name!r}: no source tensor maps to it")
            continue
        report.tensors.append(check_tensor(tensor, planned[name], config, output.v_head_order, weighted))
    for name, src in planned.items():
        if name not in output.tensors:
            report.problems.append(f"missing tensor {name!r} (source {src.plan.source!r} was not converted)")


# ---------------------------------------------------------------------------------------------- metadata


def _same(expected: Any, actual: Any) -> bool:
    if isinstance(actual, np.ndarray):  # a numeric array: a view of the file map
        return isinstance(expected, (list, tuple, np.ndarray)) and np.array_equal(np.asarray(expected), actual)
    if isinstance(expected, float) or isinstance(actual, float):
        return (isinstance(actual, (int, float)) and not isinstance(actual, bool)
                and np.float32(expected) == np.float32(actual))
    return expected == actual


def _pre_check(files: ModelFiles, tokenizer_json: dict[str, Any], meta: dict[str, Any]) -> MetadataCheck:
    """tokenizer.ggml.pre against the split of the source's tokenizer.json (a failure if no name reproduces it)."""
    assert files.directory is not None
    try:
        pre = tokenizer_pre(files.config, tokenizer_json, files.read_json("tokenizer_config.json") or {},
                            files.directory / "tokenizer.json")
    except UnsupportedTokenizerError as exc:
        return MetadataCheck(Keys.Tokenizer.PRE, None, meta.get(Keys.Tokenizer.PRE), False,
                             f"no GGUF pre-tokenizer reproduces the source's tokenizer ({exc})")
    return _key_check(Keys.Tokenizer.PRE, pre, meta)


def _key_check(key: str, expected: Any, meta: dict[str, Any], default: Any = ...) -> MetadataCheck:
    if key not in meta:
        if default is not ... and _same(expected, default):
            return MetadataCheck(key, expected, None, True, f"absent; llama.cpp's default {default!r} is right")
        return MetadataCheck(key, expected, None, False, f"missing (source says {_short(expected)})")
    actual = meta[key]
    if _same(expected, actual):
        return MetadataCheck(key, expected, actual, True)
    return MetadataCheck(key, expected, actual, False, f"is {_short(actual)}, the source says {_short(expected)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def gguf_model_checks(meta: dict[str, Any], config: ModelConfig) -> list[MetadataCheck]:
    """Every key of the model table that llama.cpp reads for the architecture, against the source config.

    An absent key passes where llama.cpp's default is the source's value; block_count is net of appended MTP
    blocks.
    """
    arch = config.arch
    checks = [_key_check(Keys.General.ARCHITECTURE, arch, meta)]
    meta = without_mtp_blocks(meta, arch)
    fields = asdict(config)
    for row in MODEL_KEYS:
        if arch in row.archs:
            default = row.default(fields, meta) if row.default is not None else ...
            checks.append(_key_check(gguf_key(row.key, arch), row.value(config), meta, default))
    return checks


def gguf_tokenizer_checks(meta: dict[str, Any], files: ModelFiles) -> list[MetadataCheck]:
    """Tokenizer keys against tokenizer.json / tokenizer_config.json (the same rules the converters use)."""
    directory, config = files.directory, files.config
    assert directory is not None
    tokenizer_json = files.read_json("tokenizer.json")
    if tokenizer_json is None:
        return [MetadataCheck("tokenizer.json", "present", None, False, "the source has no tokenizer.json")]
    tokens, types = token_table(tokenizer_json, config.vocab_size, directory / "tokenizer.json")
    added = {int(t["id"]) for t in tokenizer_json.get("added_tokens") or [] if isinstance(t, dict)}
    special = special_vocab(directory, tokenizer_json, config.vocab_size)
    checks = [_key_check(Keys.Tokenizer.MODEL, "gpt2", meta), _pre_check(files, tokenizer_json, meta),
              _token_list_check(tokens, meta.get(Keys.Tokenizer.LIST), added),
              _token_type_check(types, tokens, meta.get(Keys.Tokenizer.TOKEN_TYPE), added),
              _merges_check(special.merges, meta.get(Keys.Tokenizer.MERGES))]
    for kind in sorted(set(special.special_token_types) | set(special.special_token_ids)):
        key = getattr(Keys.Tokenizer, f"{kind.upper()}_ID", None)
        if key is not None:
            checks.append(_optional_key_check(key, special.special_token_ids.get(kind), meta))
    for kind in sorted({"bos", "eos", "sep"} | set(special.add_special_token)):
        key = getattr(Keys.Tokenizer, f"ADD_{kind.upper()}", None)
        if key is not None:
            checks.append(_optional_key_check(key, special.add_special_token.get(kind), meta, absent_means=False))
    checks.append(_optional_key_check(Keys.Tokenizer.CHAT_TEMPLATE, special.chat_template, meta))
    return checks


def _optional_key_check(key: str, expected: Any, meta: dict[str, Any], absent_means: Any = None) -> MetadataCheck:
    """A key the source's files may or may not give: when they give none, the output must not claim one
    (``absent_means``: the value an absent key stands for, which a stored key may repeat)."""
    if expected is not None:
        return _key_check(key, expected, meta)
    actual = meta.get(key)
    ok = actual is None or (absent_means is not None and _same(absent_means, actual))
    return MetadataCheck(key, None, actual, ok, "" if ok else f"is {_short(actual)}, the source's tokenizer files "
                                                               f"give none")


def _token_name(i: int, tokens: list[str], added: set[int]) -> str:
    return f"{'added token' if i in added else 'token'} {i} ({tokens[i]!r})"


def _token_type_check(expected: list[int], tokens: list[str], actual: Any, added: set[int]) -> MetadataCheck:
    """Every token's GGUF type (NORMAL, CONTROL, USER_DEFINED, UNUSED) against tokenizer.json's rule."""
    key = Keys.Tokenizer.TOKEN_TYPE
    summary = f"{len(expected)} token types"
    stored = metadata_array(actual)
    if stored is None:
        return MetadataCheck(key, summary, None, False, "missing or not an array of integers")
    if len(stored) != len(expected):
        return MetadataCheck(key, summary, f"{len(stored)} token types", False,
                             f"has {len(stored)} entries for {len(expected)} tokens")
    differ = np.flatnonzero(stored != np.asarray(expected, dtype=np.int64))
    if len(differ):
        i = int(differ[0])
        return MetadataCheck(key, summary, summary, False,
                             f"{len(differ)} token types differ from tokenizer.json's; first: "
                             f"{_token_name(i, tokens, added)} is {_type_name(int(stored[i]))}, expected "
                             f"{_type_name(expected[i])}")
    return MetadataCheck(key, summary, summary, True)


def _type_name(value: int) -> str:
    try:
        return TokenType(value).name
    except ValueError:
        return str(value)


def _first_difference(expected: list[str], actual: Any) -> int | None:
    """The first index where two sequences of the same length differ, or None."""
    return next((i for i, (a, b) in enumerate(zip(expected, actual, strict=True)) if a != b), None)


def _merges_check(expected: list[str], actual: Any) -> MetadataCheck:
    """Every BPE merge, in order (their order is their priority)."""
    key = Keys.Tokenizer.MERGES
    summary = f"{len(expected)} merges"
    if not is_metadata_array(actual):
        return MetadataCheck(key, summary, None, False, "missing")
    if len(actual) != len(expected):
        return MetadataCheck(key, summary, f"{len(actual)} merges", False,
                             f"has {len(actual)} merges, the source has {len(expected)}")
    first = _first_difference(expected, actual)
    if first is not None:
        return MetadataCheck(key, summary, summary, False,
                             f"merge {first} is {actual[first]!r}, the source has {expected[first]!r}")
    return MetadataCheck(key, summary, summary, True)


def _token_list_check(expected: list[str], actual: Any, added: set[int]) -> MetadataCheck:
    key = Keys.Tokenizer.LIST
    summary = f"{len(expected)} tokens"
    if not is_metadata_array(actual):
        return MetadataCheck(key, summary, None, False, "missing")
    if len(actual) != len(expected):
        return MetadataCheck(key, summary, f"{len(actual)} tokens", False,
                             f"has {len(actual)} tokens, config.json vocab_size is {len(expected)}")
    first = _first_difference(expected, actual)
    if first is not None:
        kind = "added token" if first in added else "token"
        return MetadataCheck(key, summary, summary, False,
                             f"{kind} {first} is {actual[first]!r}, tokenizer.json has {expected[first]!r}")
    return MetadataCheck(key, summary, summary, True)


def npy_checks(output: ModelFiles, files: ModelFiles) -> list[MetadataCheck]:
    """Manifest fields, the copied config.json and tokenizer files against the source directory."""
    manifest, config = output.metadata, files.config
    checks = [_key_check("architecture", config.arch, manifest),
              _key_check("tied_embeddings", config.tie_word_embeddings, manifest)]
    for name, allowed in (("dtype", tuple(DTYPES)), ("v_head_order", (V_HEAD_GROUPED, V_HEAD_TILED))):
        value = manifest.get(name)
        checks.append(MetadataCheck(name, allowed, value, value in allowed,
                                    "" if value in allowed else f"is {value!r}, expected one of {list(allowed)}"))
    for name in ("config.json", *TOKENIZER_FILES):
        checks += _copied_file_check(files, output.path, name)
    return checks


def _copied_file_check(files: ModelFiles, out_dir: Path, name: str) -> list[MetadataCheck]:
    assert files.directory is not None
    source = files.directory / name
    if not source.is_file():
        return []
    copy = out_dir / name
    if not copy.is_file():
        return [MetadataCheck(name, "copied", None, False, "missing from the output directory")]
    if name == "config.json":
        same = json.loads(copy.read_text(encoding="utf-8")) == files.hf_config
    else:
        same = copy.read_bytes() == source.read_bytes()
    return [MetadataCheck(name, "copied", "copied", same, "" if same else "differs from the source's")]


def check_metadata(output: ModelFiles, files: ModelFiles) -> list[MetadataCheck]:
    """Every metadata key or manifest field the architecture needs, consistent with the source."""
    if output.format == "npy":
        return npy_checks(output, files)
    return gguf_model_checks(output.metadata, files.config) + gguf_tokenizer_checks(output.metadata, files)


# ---------------------------------------------------------------------------------------------- entry point


def verify_against(output_path: str | Path, source_dir: str | Path, behaviour: bool = True) -> VerifyReport:
    """Verify a converted model against its HF source: tensors, accounting, metadata and (``behaviour``)
    next-token distributions on a probe.  Never raises for a mismatch: read :attr:`VerifyReport.ok` /
    :meth:`VerifyReport.failures`, or call :meth:`VerifyReport.raise_for_failure`."""
    source = open_hf_dir(source_dir)
    config = source.config
    output = open_output(output_path, config)
    dtype = output_dtype(output)
    report = VerifyReport(Path(output_path), Path(source_dir), output.format, dtype)
    planned, report.skipped, report.problems = plan_sources(Path(source_dir), config, output.v_head_order)
    compare_tensors(output, planned, config, report)
    report.metadata = check_metadata(output, source)
    if behaviour:
        from .probe import behaviour_check

        report.behaviour = behaviour_check(source, output.path, dtype)
    return report


# ---------------------------------------------------------------------------------------------- rendering


def skipped_summary(skipped: dict[str, str]) -> str:
    """``12 vision tower (text weights only); 1 tied to the token embedding``."""
    return "; ".join(f"{n} {reason}" for reason, n in Counter(skipped.values()).most_common())


def report_summary(report: VerifyReport) -> str:
    """A few lines: what was checked and the verdict (the CLIs print this)."""
    failed_t = sum(not t.ok for t in report.tensors)
    failed_m = sum(not m.ok for m in report.metadata)
    lines = [f"verify {report.output} against {report.source} ({report.format}, {report.dtype or '?'})",
             f"  tensors:   {len(report.tensors)} compared, {failed_t} failed, {len(report.problems)} accounting "
             f"problems; skipped source tensors: {skipped_summary(report.skipped) or 'none'}",
             f"  metadata:  {len(report.metadata)} keys checked, {failed_m} failed"]
    if report.behaviour is not None:
        lines.append(f"  behaviour: {report.behaviour.summary()}")
    failures = report.failures()
    lines.append("  result:    verified" if not failures else f"  result:    FAILED ({len(failures)} failures)")
    lines += [f"  - {line}" for line in failures[:10]]
    if len(failures) > 10:
        lines.append(f"  - ... {len(failures) - 10} more")
    return "\n".join(lines)


def report_table(report: VerifyReport) -> str:
    """Per-tensor table (name, type, transform, max error, bound, status) followed by the summary."""
    width = max([4] + [len(t.name) for t in report.tensors])
    lines = [f"{'name':<{width}}  {'type':<5} {'max_error':>10} {'max_bound':>10}  status  transform"]
    for t in report.tensors:
        lines.append(f"{t.name:<{width}}  {t.type:<5} {t.max_error:>10.3g} {t.max_bound:>10.3g}  "
                     f"{'ok' if t.ok else 'FAILED':<6}  {t.transform}")
    return "\n".join(lines + [report_summary(report)])


def report_json(report: VerifyReport) -> dict[str, Any]:
    """JSON-ready form of a report (non-finite floats as strings)."""
    data = {"output": str(report.output), "source": str(report.source), "format": report.format,
            "dtype": report.dtype, "ok": report.ok, "failures": report.failures(),
            "tensors": [asdict(t) for t in report.tensors], "metadata": [asdict(m) for m in report.metadata],
            "skipped": report.skipped, "problems": report.problems,
            "behaviour": asdict(report.behaviour) if report.behaviour is not None else None}
    return json_safe(data)




# ---------------------------------------------------------------------------------------------- converter hook

FAILED_SUFFIX = ".FAILED-VERIFY"


def failed_path(target: Path) -> Path:
    """Where ``--keep-failed`` keeps an output that failed verification: ``<name>.FAILED-VERIFY``."""
    return target.with_name(target.name + FAILED_SUFFIX)


class ConversionVerifier:
    """The converter's ``--verify`` for one output: re-read the checksums, then :func:`verify_against` the
    source, on the temporary output before it is renamed into place.  On failure the temporary output is
    removed by the converter, or kept as ``<target>.FAILED-VERIFY`` with ``keep_failed``, and
    :class:`VerificationError` names the first failure.  ``report`` holds the last report."""

    def __init__(self, source: str | Path, target: str | Path, keep_failed: bool = False,
                 behaviour: bool = True) -> None:
        self.source, self.target = Path(source), Path(target)
        self.keep_failed, self.behaviour = keep_failed, behaviour
        self.report: VerifyReport | None = None

    def __call__(self, tmp: Path, fmt: str, checksums: dict[str, str]) -> None:
        from .convert import remove_path, verify_written_checksums

        verify_written_checksums(tmp, fmt, checksums)
        report = verify_against(tmp, self.source, self.behaviour)
        report.output = self.target
        self.report = report
        if report.ok:
            return
        fate = "output removed"
        if self.keep_failed:
            kept = failed_path(self.target)
            remove_path(kept)
            tmp.rename(kept)
            fate = f"kept as {kept}"
        failures = report.failures()
        more = f" (and {len(failures) - 1} more failures)" if len(failures) > 1 else ""
        raise VerificationError(f"{self.target}: verification against {self.source} failed: {failures[0]}{more}; "
                                f"{fate}")


@dataclass(frozen=True)
class BatchVerifier:
    """Makes the :class:`ConversionVerifier` of each batch job (picklable for worker processes)."""

    keep_failed: bool = False
    behaviour: bool = True

    def __call__(self, job: Any) -> ConversionVerifier:  # job: qwen_convert.batch.ConversionJob
        return ConversionVerifier(job.src, job.out, self.keep_failed, self.behaviour)
