"""llama.cpp's 1- to 3-bit and ternary files load in our runtime and give the logits of transformers and llama.cpp.

The Qwen3 of test_quant_interop.py (every row length a multiple of 256), quantized by ``llama_model_quantize`` to
each low-bit type (``pure``: every matrix, the embedding included) and to the mixtures published repositories
list (IQ2_S, IQ2_M, IQ3_XS, IQ3_M, IQ1_M), with an importance matrix of ones for every matrix (llama.cpp refuses
IQ2_XXS, IQ2_XS, IQ2_S and IQ1_S without one).  For each file, as in test_quant_interop.py: the matrices hold
the type asked for; our logits (compiled kernels, then numpy) equal transformers' on the same GGUF (which
dequantizes through gguf-py) within 1e-4; llama.cpp's are within ``LLAMA_FACTOR x E8 + 1 %`` of max |logit|
(llama.cpp rounds the activations to 8 bits before its integer dot products).  MXFP4 is not here: llama.cpp
writes it for MoE experts only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.peer, pytest.mark.oracle, pytest.mark.slow]
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peer` extra) is not installed")
torch = pytest.importorskip("torch", reason="torch (the `oracle` extra) is not installed")
transformers = pytest.importorskip("transformers", reason="transformers (the `oracle` extra) is not installed")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files (the `oracle` extra)")

import llama_interop as li  # noqa: E402
from test_quant_interop import (  # noqa: E402
    HF_ABS,
    LLAMA_FACTOR,
    LLAMA_FLOOR,
    Files,
    hf_gguf_logits,
    llama_logits,
    matrix_types,
    ours,
)

from qwen_runtime.formats.gguf_parse import parse_gguf  # noqa: E402

MODEL = "qwen3"
# File type -> the GGML type its matrices hold (pure) or one they hold (mixture); llama.cpp's base type of the
# IQ2_S file type is IQ2_XS, of IQ2_M IQ2_S.
PURE = {"IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_M": "IQ2_S", "IQ3_XXS": "IQ3_XXS", "IQ3_S": "IQ3_S",
        "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M", "TQ1_0": "TQ1_0", "TQ2_0": "TQ2_0"}
MIXTURES = {"IQ2_S": "IQ2_XS", "IQ2_M": "IQ2_S", "IQ3_XS": "IQ3_S", "IQ3_M": "IQ3_S", "IQ1_M": "IQ1_M"}
CASES = [(f, True) for f in PURE] + [(f, False) for f in MIXTURES]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("lowbit-interop"))


def quantized(files: Files, ftype: str, pure: bool) -> Path:
    folder = files.root / f"{MODEL}-{ftype}-{'pure' if pure else 'mix'}"  # one GGUF per folder (transformers)
    path = folder / "model.gguf"
    if not path.is_file():
        folder.mkdir()
        source = files.f32[MODEL]
        ones = {t.name: np.ones(t.shape[-1], np.float32) for t in parse_gguf(source).tensors if len(t.shape) == 2}
        li.llama_quantize(source, path, ftype, pure=pure, imatrix=ones)
    return path


@pytest.mark.parametrize(("ftype", "pure"), CASES, ids=[f"{f}-{'pure' if p else 'mix'}" for f, p in CASES])
def test_llama_low_bit_file_matches_transformers_and_llama(files: Files, ftype: str, pure: bool) -> None:
    path = quantized(files, ftype, pure)
    types = set(matrix_types(path).values())
    assert (types == {PURE[ftype]}) if pure else (MIXTURES[ftype] in types), sorted(types)
    got = ours(path)
    expected = hf_gguf_logits(path)
    hf_error = float(np.abs(got - expected).max())
    assert hf_error <= HF_ABS, f"{path.parent.name}: max |ours - transformers| = {hf_error:.3g}"
    numpy_error = float(np.abs(ours(path, "numpy") - expected).max())
    assert numpy_error <= HF_ABS, f"{path.parent.name}: numpy kernels: max |ours - transformers| = {numpy_error:.3g}"
    _, e8 = files.reference(MODEL)
    llama_error = float(np.abs(llama_logits(path) - got).max())
    bound = LLAMA_FACTOR * e8 + LLAMA_FLOOR * float(np.abs(got).max())
    assert llama_error <= bound, (f"{path.parent.name}: max |llama.cpp - ours| = {llama_error:.3g} > {bound:.3g} "
                                  f"(E8 {e8:.3g}, ratio {llama_error / e8:.2f})")
