"""``--target-bpw X``: per-tensor types chosen by measured sensitivity to reach X bits per weight.

**Sensitivity.**  For each quantizable matrix ``W [rows, n]`` and each candidate type ``q`` (:data:`CANDIDATES`,
after llama.cpp's row-length fallback), the tensor is encoded with our encoders exactly as the converter would
write it (imatrix-weighted where llama.cpp weights) and decoded with the codec's plain ``reference`` decoder;
its error is ``Σ_j imp_j · Σ_rows (W - Ŵ)²`` (``imp``: the imatrix's per-column mean squared activation, ones
without one).  Since ``imp_j`` estimates ``E[x_j²]``, that sum estimates ``E‖(W - Ŵ) x‖²``, the squared noise
the tensor adds to its output; it is divided by ``Σ_j imp_j · Σ_rows W²`` (≈ ``E‖W x‖²``), so each value is the
noise-to-signal ratio of the tensor's output.  Every matrix of a pre-norm residual network writes into (or
feeds) the normalised residual stream, so these ratios are comparable across kinds and shapes, and the total
distortion is taken as their sum.

**Allocation.**  Each tensor's (bits, error) points are reduced to their lower convex hull; the hull steps of
all tensors are taken in order of decreasing error removed per bit, starting from every tensor at its cheapest
candidate, while they fit the budget ``X × (weights of the quantizable matrices)`` (a step that does not fit
ends its tensor's upgrades).  That is the greedy solution of the Lagrangian relaxation: the result is at most
X bits per weight and short of it by less than the next step of any tensor that could still be upgraded.

**Constraints.**  Tensors llama.cpp keeps unquantized stay F32 (norms, ``ssm_*`` and conv1d of Gated DeltaNet,
1-D tensors); the output and a tied token embedding get the mix's type (Q6_K, Q8_0 when its row length is not a
multiple of 256) or ``--output-tensor-type`` / ``--token-embedding-type`` / ``--tensor-type``, and count
towards the budget without being allocated.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from qwen_runtime.errors import QwenError
from qwen_runtime.formats.base import ModelFiles
from qwen_runtime.formats.tensors import QType, StoredTensor, stored_nbytes
from qwen_runtime.quants import codec, to_float32

from .imatrix import Importance
from .policy import (
    OUTPUT_NAME,
    Category,
    ModelFacts,
    QuantOptions,
    allows_quantization,
    fallback,
    llama_order,
    plan_types,
    tensor_category,
)
from .quantize import encode_rows, rows_per_chunk

# The types the allocation chooses among, cheapest first (each after llama.cpp's row-length fallback).
CANDIDATES = (QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0)
# The mix whose output rule (and general.file_type) a --target-bpw conversion uses unless --dtype names one.
DEFAULT_MIX = "q4_k_m"


@dataclass(frozen=True)
class Sensitivity:
    """One tensor's relative importance-weighted error per candidate type (cheapest first)."""

    name: str
    shape: tuple[int, ...]
    errors: dict[QType, float]  # type -> Σ imp·(W-Ŵ)² / Σ imp·W²

    @property
    def weights(self) -> int:
        return int(np.prod(self.shape))

    def bits(self, qtype: QType) -> int:
        return stored_nbytes(qtype, self.shape) * 8


def candidate_types(name: str, row_length: int) -> tuple[QType, ...]:
    """:data:`CANDIDATES` after llama.cpp's fallback for rows of ``row_length``, deduplicated, by size."""
    types = dict.fromkeys(fallback(name, row_length, q) for q in CANDIDATES)
    return tuple(sorted(types, key=lambda q: stored_nbytes(q, (1, row_length))))


def error_weights(name: str, row_length: int, importance: Importance | None) -> np.ndarray:
    """The per-column weights ``[n]`` of the error: the imatrix vector of ``name`` if it has one of that length,
    else ones."""
    vector = importance.vectors.get(name) if importance is not None else None
    if vector is None or vector.size != row_length:
        return np.ones(row_length, np.float64)
    return vector.astype(np.float64)


def tensor_sensitivity(tensor: StoredTensor, importance: Importance | None = None,
                       types: tuple[QType, ...] | None = None) -> Sensitivity:
    """Relative weighted error of ``tensor`` stored as each of ``types`` (default: :func:`candidate_types`),
    encoded as the converter writes it and decoded by the codec's reference decoder, a chunk of rows at a time."""
    n = tensor.shape[-1]
    types = types or candidate_types(tensor.name, n)
    weights = error_weights(tensor.name, n, importance)  # [n]
    source = tensor.rows2d()
    squared = {q: np.zeros(n, np.float64) for q in types}  # per-column Σ_rows (W - Ŵ)²
    energy = np.zeros(n, np.float64)  # per-column Σ_rows W²
    step = rows_per_chunk(n)
    for start in range(0, len(source), step):
        rows = to_float32(tensor.qtype, source[start:start + step])  # [r, n]
        energy += np.square(rows, dtype=np.float64).sum(axis=0)
        for q in types:
            vector = importance.for_tensor(tensor.name, n, q) if importance is not None else None
            decoded = codec(q).reference(encode_rows(rows, q, vector)).reshape(rows.shape)  # [r, n]
            squared[q] += np.square(rows.astype(np.float64) - decoded).sum(axis=0)
    total = float(weights @ energy)
    errors = {q: float(weights @ squared[q]) / total if total > 0 else 0.0 for q in types}
    return Sensitivity(tensor.name, tuple(tensor.shape), errors)


def fixed_types(files: ModelFiles, dtype: str, options: QuantOptions | None = None) -> dict[str, QType]:
    """The tensors whose type is not allocated, with their type: unquantizable ones (F32), the output and a tied
    token embedding (the mix's choice or the options'), and those named by ``--tensor-type``."""
    options = options or QuantOptions()
    shapes = {n: t.shape for n, t in files.tensors.items()}
    planned = plan_types(shapes, dtype, ModelFacts.from_config(files.config), options)
    tied = OUTPUT_NAME not in shapes
    fixed = {}
    for name, qtype in planned.items():
        category = tensor_category(name)
        if (not allows_quantization(name, shapes[name]) or category == Category.OUTPUT
                or (category == Category.TOKEN_EMBD and (tied or options.token_embedding_type is not None))
                or options.manual_type(name) is not None):
            fixed[name] = qtype
    return fixed


def model_sensitivities(files: ModelFiles, importance: Importance | None = None,
                        skip: Mapping[str, QType] | None = None, names: Iterable[str] | None = None,
                        ) -> list[Sensitivity]:
    """:func:`tensor_sensitivity` of every quantizable tensor of ``files`` (or of ``names``) not in ``skip``, in
    llama.cpp's order."""
    names = [n for n in (files.tensors if names is None else names)
             if allows_quantization(n, files.tensors[n].shape) and n not in (skip or {})]
    return [tensor_sensitivity(files.tensors[n], importance) for n in sorted(names, key=llama_order)]


@dataclass(frozen=True)
class Allocation:
    """The chosen types and what they add up to."""

    types: dict[str, QType]  # every allocated tensor
    bits: int  # stored bits of all quantizable matrices (allocated and fixed)
    weights: int  # their weights
    bounds: tuple[float, float]  # the lowest and highest bits per weight reachable

    @property
    def bpw(self) -> float:
        return self.bits / self.weights


def _hull(s: Sensitivity) -> list[QType]:
    """The candidates on the lower convex hull of (bits, error), cheapest first: each one removes less error per
    added bit than the one before."""
    hull: list[QType] = []
    for q in sorted(s.errors, key=s.bits):
        if hull and s.errors[q] >= s.errors[hull[-1]]:
            continue  # costs more and is no better
        while len(hull) >= 2 and _gain(s, hull[-2], hull[-1]) <= _gain(s, hull[-1], q):
            hull.pop()
        hull.append(q)
    return hull


def _gain(s: Sensitivity, a: QType, b: QType) -> float:
    """Error removed per added bit going from ``a`` to ``b``."""
    return (s.errors[a] - s.errors[b]) / (s.bits(b) - s.bits(a))


def allocate(sensitivities: list[Sensitivity], target_bpw: float, fixed_bits: int = 0,
             fixed_weights: int = 0) -> Allocation:
    """Types for ``sensitivities`` giving at most ``target_bpw`` bits per weight over them and the fixed
    tensors (``fixed_bits`` over ``fixed_weights``), by the greedy Lagrangian allocation of the module's
    docstring.  :class:`QwenError` naming the reachable range when the target is outside it."""
    weights = fixed_weights + sum(s.weights for s in sensitivities)
    hulls = {s.name: _hull(s) for s in sensitivities}
    by_name = {s.name: s for s in sensitivities}
    lowest = fixed_bits + sum(s.bits(min(s.errors, key=s.bits)) for s in sensitivities)
    highest = fixed_bits + sum(s.bits(max(s.errors, key=s.bits)) for s in sensitivities)
    bounds = (lowest / weights, highest / weights) if weights else (0.0, 0.0)
    if not weights or not bounds[0] <= target_bpw <= bounds[1]:
        raise QwenError(f"--target-bpw {target_bpw:g}: this model's quantizable matrices can be stored at "
                        f"{bounds[0]:.4f} to {bounds[1]:.4f} bits per weight")
    budget = target_bpw * weights
    steps = [(-_gain(by_name[name], a, b), order, name, i)
             for order, (name, hull) in enumerate(hulls.items()) for i, (a, b) in enumerate(itertools.pairwise(hull))]
    level = {name: 0 for name in hulls}
    stopped: set[str] = set()
    used = lowest
    for _, _, name, i in sorted(steps):
        if name in stopped or level[name] != i:
            continue
        s, hull = by_name[name], hulls[name]
        cost = s.bits(hull[i + 1]) - s.bits(hull[i])
        if used + cost > budget:
            stopped.add(name)
            continue
        used += cost
        level[name] = i + 1
    types = {name: hulls[name][level[name]] for name in hulls}
    return Allocation(types, used, weights, bounds)


def plan_target(files: ModelFiles, target_bpw: float, dtype: str = DEFAULT_MIX,
                importance: Importance | None = None, options: QuantOptions | None = None,
                ) -> tuple[dict[str, QType], Allocation]:
    """Every tensor's type for ``--target-bpw`` (the fixed tensors' from the mix ``dtype`` and ``options``),
    and the allocation."""
    fixed = fixed_types(files, dtype, options)
    quantizable = {n: q for n, q in fixed.items() if allows_quantization(n, files.tensors[n].shape)}
    fixed_bits = sum(stored_nbytes(q, files.tensors[n].shape) * 8 for n, q in quantizable.items())
    fixed_weights = sum(int(np.prod(files.tensors[n].shape)) for n in quantizable)
    allocation = allocate(model_sensitivities(files, importance, fixed), target_bpw, fixed_bits, fixed_weights)
    return {**fixed, **allocation.types}, allocation


def sensitivity_table(sensitivities: list[Sensitivity]) -> str:
    """Relative weighted error (×10⁻³) per tensor and candidate type ("-": not a candidate for its rows)."""
    types = list(dict.fromkeys(q for s in sensitivities for q in s.errors))
    types.sort(key=lambda q: codec(q).type_size * 8 / codec(q).block_size)
    width = max([len("tensor"), *(len(s.name) for s in sensitivities)])
    lines = [f"{'tensor':<{width}}  {'weights':>9}  " + "  ".join(f"{q.name:>8}" for q in types),
             "relative weighted squared error x1e-3 (Σ imp·(W-Ŵ)² / Σ imp·W²)"]
    for s in sensitivities:
        cells = [f"{s.errors[q] * 1e3:8.3f}" if q in s.errors else f"{'-':>8}" for q in types]
        lines.append(f"{s.name:<{width}}  {s.weights:>9,}  " + "  ".join(cells))
    return "\n".join(lines)
