"""Qwen3.5 from converted npy / GGUF copies (tiled value-head order): fp32 equals transformers, fp16 / q8_0
compute exactly the network their stored weights define and stay within a justified distance of fp32.

Tolerances for the quantized types.  Weight rounding is a relative perturbation of about 2**-11 (fp16) and
0.54 % rms (q8_0: step amax/127 per block of 32).  These random 4-layer fixtures are unusually sensitive:
a Gated DeltaNet output is a small difference of large terms (|o| ≈ |v| / 30 here) that the gated RMSNorm
scales back up, so one linear-attention layer turns a 0.5 % input perturbation into about 5 %, and q8_0
moves the logits by 15-45 % of their scale.  So the checks are (1) exactness: a quantized model equals the
float32 model built from its own dequantized weights (1e-4), which is what the runtime controls; and (2) q8_0
moves the logits by at most TWIN_MARGIN (4) times what the rounding twin (qwen_convert/verify/behaviour.py) moves
them: the fp32 weights plus independent uniform noise of each Q8_0 block's step (amax/127), computed from the fp32
weights alone, i.e. more draws of what correct rounding does (the largest of TWIN_DRAWS = 3; measured: the q8_0 file's
largest logit change is 0.8-2.9x that); fp16 stays within 20 x 2**-11 of the logit scale (the amplification
above).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from float_error import check_greedy, check_rows, reference64
from runtime_helpers import Converted, load_exact, reference

from qwen_convert.convert import convert
from qwen_convert.verify import verify_against
from qwen_convert.verify.behaviour import TWIN_DRAWS, TWIN_MARGIN, rounding_twin
from qwen_runtime.formats import ModelFiles, open_model_files
from qwen_runtime.formats.base import V_HEAD_TILED
from qwen_runtime.formats.gguf_parse import parse_gguf
from qwen_runtime.formats.tensors import QType, StoredTensor
from qwen_runtime.models import Model, WeightStore

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NAMES = ("qwen35-tiny", "qwen35-tiny-gqa", "qwen35-vl-tiny")
ATOL = 1e-4  # a quantized model against the float32 model of its own dequantized weights


def with_tensors(files: ModelFiles, arrays: dict[str, np.ndarray]) -> Model:
    """A model of ``files`` whose named tensors are replaced by float32 arrays."""
    tensors = dict(files.tensors)
    for name, array in arrays.items():
        data = np.ascontiguousarray(array, np.float32)
        tensors[name] = StoredTensor(name, QType.F32, array.shape, "<test>", data=data)
    patched = dataclasses.replace(files, tensors=tensors)
    return Model(patched, WeightStore(patched))


def quantized_names(files: ModelFiles) -> list[str]:
    return [n for n, t in files.tensors.items() if t.qtype != QType.F32]


@pytest.mark.parametrize("fmt", ["npy", "gguf"])
@pytest.mark.parametrize("name", NAMES)
def test_fp32_copy_matches_transformers(converted: Converted, name: str, fmt: str) -> None:
    ref = reference(name)
    model = load_exact(converted(name, fmt))
    if model.config.linear_num_value_heads > model.config.linear_num_key_heads:
        assert model.files.v_head_order == V_HEAD_TILED
    for i in range(3):
        check_rows(model.logits(ref[f"prompt_{i}"][None])[0], ref[f"logits64_{i}"], ref[f"bound_{i}"], f"logits_{i}")
    cache = model.make_cache(1, len(ref["prompt_0"]) + 16)
    logits = model.forward(ref["prompt_0"][None], cache, last_only=True)[0]
    steps = []
    for step in range(16):
        steps.append(logits)
        logits = model.forward(np.array([[ref["greedy_ids"][step]]]), cache, last_only=True)[0]
    check_greedy(np.argmax(steps, axis=-1), np.stack(steps), ref, f"{fmt} greedy decoding")


@pytest.mark.parametrize("dtype", ["fp16", "q8_0"])
@pytest.mark.parametrize("fmt", ["npy", "gguf"])
@pytest.mark.parametrize("name", NAMES)
def test_quantized_model_is_exact_for_its_weights(converted: Converted, name: str, fmt: str, dtype: str) -> None:
    prompt = reference(name)["prompt_2"][None]
    files = open_model_files(converted(name, fmt, dtype))
    assert quantized_names(files), "expected some tensors stored in a quantized type"
    dequantized = with_tensors(files, {n: files.tensors[n].to_float32() for n in quantized_names(files)})
    np.testing.assert_allclose(Model(files, WeightStore(files)).logits(prompt), dequantized.logits(prompt),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_quantized_types_stay_close_to_fp32(converted: Converted, name: str) -> None:
    prompt = reference(name)["prompt_2"][None]
    fp32 = open_model_files(converted(name, "gguf"))
    base = Model(fp32, WeightStore(fp32)).logits(prompt)[0]
    scale = float(np.abs(base).max())
    fp16 = load_exact(converted(name, "gguf", "fp16")).logits(prompt)[0]
    assert float(np.abs(fp16 - base).max()) <= 20 * 2.0**-11 * scale

    q8 = open_model_files(converted(name, "gguf", "q8_0"))
    q8_error = float(np.abs(Model(q8, WeightStore(q8)).logits(prompt)[0] - base).max())
    twin_error = max(float(np.abs(rounding_twin(fp32, q8, seed).logits(prompt)[0] - base).max())
                     for seed in range(TWIN_DRAWS))
    assert q8_error <= TWIN_MARGIN * twin_error, (q8_error, twin_error)


def test_converted_files_are_read_in_tiled_order(converted: Converted) -> None:
    path: Path = converted("qwen35-tiny-gqa", "gguf")
    assert open_model_files(path).v_head_order == V_HEAD_TILED
    assert open_model_files(converted("qwen35-tiny-gqa", "hf")).v_head_order != V_HEAD_TILED


def with_layers_swapped(src: Path, out: Path, a: int, b: int) -> Path:
    """A copy of a Qwen3.5 checkpoint whose layers ``a`` and ``b`` trade places (tensor names in the safetensors
    header, entries of layer_types): a layer pattern full_attention_interval cannot express."""
    shutil.copytree(src, out)
    path = out / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    names = {f"model.layers.{a}.": f"model.layers.{b}.", f"model.layers.{b}.": f"model.layers.{a}."}

    def renamed(name: str) -> str:
        return next((names[p] + name[len(p):] for p in names if name.startswith(p)), name)

    text = json.dumps({renamed(k): v for k, v in header.items()}).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])
    config = json.loads((out / "config.json").read_text())
    types = config["layer_types"]
    types[a], types[b] = types[b], types[a]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_any_layer_pattern_round_trips_through_gguf(tmp_path: Path) -> None:
    """[linear, full, linear, linear] with full_attention_interval 4: the GGUF carries recurrent_layers (as
    llama.cpp's converter writes it), the runtime reads it, and the file computes what the source does."""
    src = with_layers_swapped(FIXTURES / "qwen35-tiny", tmp_path / "swapped", 1, 3)
    out = convert(src, tmp_path / "swapped.gguf", "gguf", "fp32").output
    meta = parse_gguf(out).metadata
    assert meta["qwen35.attention.recurrent_layers"].tolist() == [True, False, True, True]
    assert meta["qwen35.full_attention_interval"] == 4
    model = load_exact(out)
    assert model.config.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention")
    prompt = reference("qwen35-tiny")["prompt_2"][None]
    np.testing.assert_allclose(model.logits(prompt), load_exact(src).logits(prompt), atol=ATOL, rtol=0)
    assert verify_against(out, src).ok


@pytest.mark.slow
@pytest.mark.oracle
def test_any_layer_pattern_matches_transformers(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    src = with_layers_swapped(FIXTURES / "qwen35-tiny", tmp_path / "swapped", 1, 3)
    out = convert(src, tmp_path / "swapped.gguf", "gguf", "fp32").output
    prompt = reference("qwen35-tiny")["prompt_2"]
    want, bound = reference64(src, prompt)
    check_rows(load_exact(out).logits(prompt[None]), want, bound, "swapped layers")
