"""The error model of verify's tensor checks: how far ``undo(output)`` may lie from the source, per element.

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

import numpy as np

from qwen_runtime.errors import FormatError
from qwen_runtime.formats.archs import NEG_EXP
from qwen_runtime.formats.naming import TensorPlan
from qwen_runtime.formats.tensors import Q8_0_BLOCK, QType
from qwen_runtime.quants import CODECS
from qwen_runtime.quants.blocks import BlockCodec

# Spacing of 1.0 in each source dtype: the precision a converter may compute a transform in.
SOURCE_EPS = {QType.F32: 2.0**-23, QType.F16: 2.0**-10, QType.BF16: 2.0**-7}
# With an importance matrix llama.cpp's 32-value types keep their search's integers (module docstring).
WEIGHTED_SEARCH_TYPES = frozenset({QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1})
Q8_0_ROUNDING_SLACK = 1e-4  # x * (1/d) in float32 may round to the other side of a .5 by ~127 * 2^-22 steps
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

