"""--target-bpw: sensitivities (against a plain recomputation), the allocation (target, determinism, bounds) and
the constraints of llama.cpp's policy kept by the converted file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from convert_helpers import fixture

from qwen_convert.bpw import (
    CANDIDATES,
    Sensitivity,
    allocate,
    candidate_types,
    fixed_types,
    plan_target,
    tensor_sensitivity,
)
from qwen_convert.cli import convert_main, inspect_main
from qwen_convert.convert import open_source
from qwen_convert.imatrix import Importance
from qwen_convert.policy import ModelFacts, QuantOptions, allows_quantization, plan_types
from qwen_convert.quantize import encode_rows
from qwen_runtime.errors import QwenError
from qwen_runtime.formats import open_gguf
from qwen_runtime.formats.tensors import QType
from qwen_runtime.quants import codec

BUNDLED = Path(__file__).resolve().parents[2] / "qwen_runtime" / "assets" / "qwen3-stdlib"


def _importance(vectors: dict[str, np.ndarray]) -> Importance:
    return Importance(Path("test.imatrix"), vectors, None, 0)


@pytest.mark.parametrize("weighted", [False, True])
def test_sensitivity_equals_a_plain_recomputation(weighted: bool) -> None:
    tensor = open_source(BUNDLED).tensors["blk.0.attn_k.weight"]  # rows of 256: every K-quant applies
    w = tensor.to_float32().astype(np.float32)  # [128, 256]
    imp = np.random.default_rng(0).uniform(0.1, 3.0, w.shape[1]).astype(np.float32)
    importance = _importance({tensor.name: imp}) if weighted else None
    found = tensor_sensitivity(tensor, importance)
    assert tuple(found.errors) == CANDIDATES
    weights = imp.astype(np.float64) if weighted else np.ones(w.shape[1])
    for qtype in CANDIDATES:
        vector = imp if weighted and qtype != QType.Q8_0 else None  # llama.cpp does not weight Q8_0
        decoded = codec(qtype).reference(encode_rows(w, qtype, vector)).astype(np.float64)
        expected = (weights * (w - decoded) ** 2).sum() / (weights * w.astype(np.float64) ** 2).sum()
        # the same float64 terms summed in another order: pairwise summation errs by ~log2(n) ulps (n = 32768)
        assert found.errors[qtype] == pytest.approx(expected, rel=1e-12)
    ordered = [found.errors[q] for q in CANDIDATES]
    assert ordered == sorted(ordered, reverse=True)  # more bits, less error on a trained matrix


def test_short_rows_fall_back_as_llama_cpp() -> None:
    assert candidate_types("x.weight", 256) == CANDIDATES
    assert candidate_types("x.weight", 64) == (QType.Q4_0, QType.Q5_0, QType.Q5_1, QType.Q8_0)
    assert candidate_types("x.weight", 48) == (QType.F16,)


def _synthetic(count: int = 12, seed: int = 1) -> list[Sensitivity]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        rows, scale = int(rng.choice([32, 64, 96])), float(rng.uniform(0.3, 3.0))
        errors = {q: scale * 4.0 ** -(2 + k) * float(rng.uniform(0.8, 1.2)) for k, q in enumerate(CANDIDATES)}
        out.append(Sensitivity(f"blk.{i}.ffn_up.weight", (rows, 256), errors))
    return out


def _next_step_bits(s: Sensitivity, chosen: QType) -> list[int]:
    return [s.bits(q) - s.bits(chosen) for q in s.errors if s.bits(q) > s.bits(chosen)]


@pytest.mark.parametrize("target", [2.95, 3.9, 4.5, 5.25, 6.6, 8.25])
def test_allocation_hits_the_target_within_one_step(target: float) -> None:
    sens = _synthetic()
    fixed_bits, fixed_weights = 64 * 256 * 6, 64 * 256  # a fixed tensor at 6 bits per weight
    result = allocate(sens, target, fixed_bits, fixed_weights)
    by_name = {s.name: s for s in sens}
    bits = fixed_bits + sum(by_name[n].bits(q) for n, q in result.types.items())
    assert bits == result.bits
    assert result.weights == fixed_weights + sum(s.weights for s in sens)
    assert result.bpw <= target
    left = target * result.weights - result.bits
    steps = [b for n, q in result.types.items() for b in _next_step_bits(by_name[n], q)]
    assert not steps or left < min(steps)  # no further upgrade of any tensor fits
    assert allocate(sens, target, fixed_bits, fixed_weights) == result  # deterministic


def test_allocation_spends_bits_where_they_remove_most_error() -> None:
    sens = _synthetic()
    loud = Sensitivity("blk.99.attn_v.weight", (64, 256), {q: 100 * e for q, e in sens[0].errors.items()})
    result = allocate([*sens, loud], 4.0)
    # loud's error per bit removed exceeds every other tensor's at every step (scales differ by at most 10x)
    loud_bpw = loud.bits(result.types[loud.name]) / loud.weights
    assert all(s.bits(result.types[s.name]) / s.weights < loud_bpw for s in sens)


@pytest.mark.parametrize("target", [1.5, 9.0])
def test_impossible_targets_are_refused_naming_the_bounds(target: float) -> None:
    sens = _synthetic()
    low = sum(s.bits(QType.Q2_K) for s in sens) / sum(s.weights for s in sens)
    high = sum(s.bits(QType.Q8_0) for s in sens) / sum(s.weights for s in sens)
    with pytest.raises(QwenError, match=rf"{low:.4f} to {high:.4f} bits per weight"):
        allocate(sens, target)


@pytest.mark.parametrize("model", ["qwen35-tiny", "qwen3-tiny"])
def test_plan_keeps_llama_cpp_constraints(model: str) -> None:
    files = open_source(fixture(model))
    shapes = {n: t.shape for n, t in files.tensors.items()}
    mix = plan_types(shapes, "q4_k_m", ModelFacts.from_config(files.config))
    types, allocation = plan_target(files, 6.0)
    for name, shape in shapes.items():
        if not allows_quantization(name, shape):
            assert types[name] == QType.F32, name  # norms, ssm_a, ssm_conv1d, biases: as llama.cpp
        elif name in ("token_embd.weight", "output.weight") and name in fixed_types(files, "q4_k_m"):
            assert types[name] == mix[name], name  # output / tied embedding: the mix's type
        else:
            assert types[name] in candidate_types(name, shape[-1]), name
    assert allocation.bpw <= 6.0
    forced = plan_target(files, 6.0, options=QuantOptions(tensor_types=(("ffn_down", QType.Q8_0),)))[0]
    assert all(q == QType.Q8_0 for n, q in forced.items() if "ffn_down" in n)


@pytest.mark.slow
def test_cli_writes_the_planned_types_and_reports_bpw(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m.gguf"
    assert convert_main([str(BUNDLED), "-o", str(out), "--target-bpw", "5.0"]) == 0
    printed = capsys.readouterr().out
    types, allocation = plan_target(open_source(BUNDLED), 5.0)
    assert f"{allocation.bpw:.4f} over the quantizable matrices" in printed
    written = open_gguf(out)
    assert {n: written.tensors[n].qtype for n in types} == types
    assert convert_main([str(BUNDLED), "-o", str(tmp_path / "x.gguf"), "--target-bpw", "12"]) != 0
    assert "bits per weight" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


def test_inspect_shows_sensitivity(capsys) -> None:
    assert inspect_main([str(fixture("qwen3-tiny")), "--sensitivity"]) == 0
    table = capsys.readouterr().out
    assert "blk.0.ffn_down.weight" in table and "Q4_0" in table and "Q8_0" in table
    assert inspect_main([str(fixture("qwen3-tiny")), "--sensitivity", "--filter", "ffn_up"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert rows and all("ffn_up" in row for row in rows)
