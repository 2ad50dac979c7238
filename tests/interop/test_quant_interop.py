"""GGUF files made by llama.cpp's own quantizer load in our runtime and give the logits of transformers and llama.cpp.

For two small models (``interop_models.QUANT_MODELS``: a Qwen3 whose every row length is a multiple of 256, so
K-quants are used everywhere, and a Qwen2 with hidden size 384, so llama.cpp falls back to 32-value blocks for
most rows), our converter writes an F32 GGUF and ``llama_model_quantize`` turns it into every type we read
(``pure``: one type for every matrix) and into the mixtures people publish (Q4_K_M, Q5_K_M, Q6_K, IQ4_XS).  For
each file:

* the tensor types are the ones asked for (pure) or llama.cpp's mixture, so each type is really exercised;
* ``--verify-against`` the source passes its tensor and metadata checks: llama.cpp's quantizer (without an
  importance matrix) rounds every value to the nearest point of its stored sub-block grid, the bound of
  ``qwen_convert.verify``;
* our logits equal transformers' on the same GGUF (``from_pretrained(dir, gguf_file=...)``, which dequantizes
  through gguf-py to float32) within 1e-4 absolute, with the compiled kernels (``auto``) and with the numpy
  ones: both multiply the same float32 weights;
* llama.cpp's logits are within :data:`LLAMA_FACTOR` x ``E8`` + 1 % of max |logit|.  llama.cpp quantizes the
  *activations* of every matrix product before its integer dot products: to Q8_0 blocks (32 values, step
  amax/127) for the 32-block weight types, to Q8_K blocks (256 values, step amax/127) for the K-quants and
  IQ4_XS, to Q8_1 for Q4_1/Q5_1.  That is an 8-bit rounding of one operand of every product, the same kind of
  perturbation as Q8_0 rounding of the other operand, the weights.  ``E8`` is measured on the same model and
  prompt as max |ours(F32 file with every matrix rounded to Q8_0) - ours(F32 file)|.  A 256-value block's
  maximum is larger than a 32-value block's (about 1.4x for Gaussian values), and llama.cpp rounds the inputs
  of all seven products of a layer (q/k/v share one rounding, gate/up another): the factor 3 covers both.
  Measured (llama.cpp difference / E8, 2026-12-01): 0.81-1.00 for the 32-block types, 1.00-1.57 for the
  K-quants and IQ4_XS (256-blocks), 0.23-0.28 for BF16 (llama.cpp rounds its activations to BF16); E8 is
  0.38 / 0.44 of max |logit| 19-23; transformers vs ours at most 2.9e-5.
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

import interop_models  # noqa: E402
import llama_interop as li  # noqa: E402
from runtime_helpers import load_exact  # noqa: E402

from qwen_convert.convert import convert  # noqa: E402
from qwen_convert.verify import verify_against  # noqa: E402
from qwen_runtime.formats.gguf_parse import parse_gguf  # noqa: E402

MODELS = tuple(interop_models.QUANT_MODELS)
# File type -> the GGML type a pure file holds in its matrices (and the 32-block type llama.cpp falls back to
# where a row length is not a multiple of 256).
PURE = {
    "Q4_0": ("Q4_0", None), "Q4_1": ("Q4_1", None), "Q5_0": ("Q5_0", None), "Q5_1": ("Q5_1", None),
    "Q8_0": ("Q8_0", None), "Q2_K": ("Q2_K", "Q4_0"), "Q3_K_M": ("Q3_K", "Q4_0"), "Q4_K_M": ("Q4_K", "Q5_0"),
    "Q5_K_M": ("Q5_K", "Q5_1"), "Q6_K": ("Q6_K", "Q8_0"), "IQ4_NL": ("IQ4_NL", None),
    "IQ4_XS": ("IQ4_XS", "IQ4_NL"), "BF16": ("BF16", None),
}
MIXTURES = ("Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS")
CASES = [(m, f, True) for m in MODELS for f in PURE] + [(m, f, False) for m in MODELS for f in MIXTURES]
PROMPT = [1, 5, 17, 40, 99, 200, 300, 478, 2, 3, 60, 61, 7, 8, 9, 10]
HF_ABS = 1e-4
LLAMA_FACTOR, LLAMA_FLOOR = 3.0, 1e-2


class Files:
    """The models, their F32 GGUFs (ours) and llama.cpp's quantizations of them, made on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dirs = {name: interop_models.build_quant_model(name, root) for name in MODELS}
        self.f32 = {}
        for name, directory in self.dirs.items():
            self.f32[name] = convert(directory, root / f"{name}-f32.gguf", fmt="gguf", dtype="fp32").output
        self._reference: dict[str, tuple[np.ndarray, float]] = {}

    def quantized(self, model: str, ftype: str, pure: bool) -> Path:
        folder = self.root / f"{model}-{ftype}-{'pure' if pure else 'mix'}"  # one GGUF per folder (transformers)
        path = folder / "model.gguf"
        if not path.is_file():
            folder.mkdir()
            li.llama_quantize(self.f32[model], path, ftype, pure=pure)
        return path

    def reference(self, model: str) -> tuple[np.ndarray, float]:
        """(our logits of the F32 file, E8 = max |ours(pure Q8_0 file) - ours(F32 file)|)."""
        if model not in self._reference:
            f32 = ours(self.f32[model])
            q8 = ours(self.quantized(model, "Q8_0", True))
            self._reference[model] = f32, float(np.abs(q8 - f32).max())
        return self._reference[model]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("quant-interop"))


def ours(path: Path, kernels: str = "auto") -> np.ndarray:
    return load_exact(path, kernels=kernels).logits([PROMPT])[0]


def hf_gguf_logits(path: Path) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float().numpy()


def llama_logits(path: Path) -> np.ndarray:
    model = li.LlamaModel(path)
    try:
        return model.logits(PROMPT)
    finally:
        model.close()


def matrix_types(path: Path) -> dict[str, str]:
    return {t.name: t.qtype.name for t in parse_gguf(path).tensors if len(t.shape) == 2}


@pytest.mark.parametrize(("model", "ftype", "pure"), CASES,
                         ids=[f"{m}-{f}-{'pure' if p else 'mix'}" for m, f, p in CASES])
def test_llama_quantized_file_matches_transformers_and_llama(files: Files, model: str, ftype: str,
                                                             pure: bool) -> None:
    path = files.quantized(model, ftype, pure)
    types = matrix_types(path)
    if pure:
        wanted, fallback = PURE[ftype]
        assert wanted in types.values(), f"{ftype} pure holds {sorted(set(types.values()))}"
        assert set(types.values()) <= {wanted, fallback}, types
        if model == "qwen3":
            assert set(types.values()) == {wanted}, types
    report = verify_against(path, files.dirs[model], behaviour=False)
    assert report.ok, report.failures()
    got = ours(path)  # the compiled kernels where numba imports
    expected = hf_gguf_logits(path)
    hf_error = float(np.abs(got - expected).max())
    assert hf_error <= HF_ABS, f"{path.parent.name}: max |ours - transformers| = {hf_error:.3g}"
    numpy_error = float(np.abs(ours(path, "numpy") - expected).max())  # and the numpy reference kernels
    assert numpy_error <= HF_ABS, f"{path.parent.name}: numpy kernels: max |ours - transformers| = {numpy_error:.3g}"
    _, e8 = files.reference(model)
    theirs = llama_logits(path)
    llama_error = float(np.abs(theirs - got).max())
    bound = LLAMA_FACTOR * e8 + LLAMA_FLOOR * float(np.abs(got).max())
    assert llama_error <= bound, (f"{path.parent.name}: max |llama.cpp - ours| = {llama_error:.3g} > {bound:.3g} "
                                  f"(E8 {e8:.3g}, ratio {llama_error / e8:.2f})")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_our_quantized_files_hold_llama_cpp_quantizer_bytes(files: Files, model: str, dtype: str) -> None:
    """Our --dtype output, from the same float32 values, holds exactly what llama.cpp's quantizer writes (its
    mix: the legacy types' output.weight Q6_K or its fallback)."""
    ours_path = convert(files.dirs[model], files.root / f"{model}-ours-{dtype}.gguf", fmt="gguf", dtype=dtype).output
    theirs_path = files.quantized(model, dtype.upper(), False)
    ours_file, theirs_file = li.gguf_structure(ours_path), li.gguf_structure(theirs_path)
    assert ours_file.tensors == theirs_file.tensors  # names, shapes and types
    assert li.data_diff(ours_file, theirs_file) == []
