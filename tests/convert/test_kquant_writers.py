"""The K-quant and IQ4 writers (qwen_convert/kquant_encode.py, iq4_encode.py) against llama.cpp's quantizer.

* Without llama.cpp: ``nearest_int`` is ggml's bit formula on every kind of input, and gaussian rows decode
  (our reference decoders) to the nearest point of their sub-block's grid, as llama.cpp's final re-rounding
  makes them.
* ``peer`` (llama-cpp-python): our bytes equal those of ``ggml_quantize_chunk`` in the ``libggml-base.so``
  llama-cpp-python ships (the function ``llama_model_quantize`` calls for every tensor) on rows of varied
  statistics, without and with importance weights; and, whole files, those of ``llama_model_quantize --pure``
  run on an F32 GGUF of a model with 1024/4864 (K-quants, IQ4) and 896 (IQ4_NL) columns, tensor by tensor and
  streamed in chunks, again without and with an importance matrix (passed as ``llama-quantize`` passes what it
  reads from a file), including the Q5_0/Q5_1 that Q4_K/Q5_K files fall back to for 896-column rows (weighted
  by the importance too: ``qwen_convert/legacy_encode.py``).  Our reference decoder of our bytes equals
  ggml's ``dequantize_row_*`` of its bytes.
* ``peer`` + ``slow``: the ``llama-quantize`` tool built from the sdist's vendored source
  (``scripts/llama_tools.py``) with an importance matrix file (legacy ``.dat``) written here.

No block differs (0 of every count below): llama.cpp's quantizers are plain float32 C without fused
multiply-adds in this build (``objdump`` of ``libggml-base.so`` finds no ``vfmadd``), and the searches repeat
their operations in order (``qwen_convert/quant_search.py``).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES

from qwen_convert import quant_search
from qwen_convert.kquant_encode import nearest_int
from qwen_convert.quantize import SEARCHED, encode_rows, stream_rows
from qwen_runtime.formats.tensors import QType
from qwen_runtime.quants import CODECS

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3-tiny"
K_TYPES = (QType.Q4_K, QType.Q6_K, QType.Q5_K, QType.Q3_K, QType.Q2_K, QType.IQ4_NL, QType.IQ4_XS)
# llama_model_quantize file type whose --pure files hold each type
PURE_FTYPE = {QType.Q2_K: "Q2_K", QType.Q3_K: "Q3_K_M", QType.Q4_K: "Q4_K_M", QType.Q5_K: "Q5_K_M",
              QType.Q6_K: "Q6_K", QType.IQ4_NL: "IQ4_NL", QType.IQ4_XS: "IQ4_XS"}
KINDS = ("gaussian", "student-t", "half-zeros", "constant", "tiny", "positive", "block-scales", "zero-halves",
         "cauchy", "zero")


def varied_rows(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """float32 [rows, n]: each row one of :data:`KINDS` (heavy tails, zeros, constants, values near and below
    float32's smallest normal, all-positive rows, blocks of very different magnitudes)."""
    x = 0.02 * rng.standard_normal((rows, n))
    for r, kind in enumerate(np.arange(rows) % len(KINDS)):
        name = KINDS[kind]
        if name == "student-t":
            x[r] = 0.02 * rng.standard_t(2, n)
        elif name == "half-zeros":
            x[r][rng.random(n) < 0.5] = 0
        elif name == "constant":
            x[r] = rng.choice([0.5, -0.25, 3.0, 1e-20])
        elif name == "tiny":
            x[r] = rng.standard_normal(n) * 10.0 ** rng.choice([-30, -37, -39, -42, -44])
        elif name == "positive":
            x[r] = rng.uniform(0, 1, n)
        elif name == "block-scales":
            x[r] *= np.repeat(10.0 ** rng.integers(-4, 5, n // 32), 32)
        elif name == "zero-halves":
            x[r, : n // 2] = 0
        elif name == "cauchy":
            x[r] = 0.01 * rng.standard_cauchy(n)
        elif name == "zero":
            x[r] = 0
    return x.astype(np.float32)


def varied_importance(rng: np.random.Generator, n: int, kind: int) -> np.ndarray:
    """float32 [n] importance weights: uniform, log-normal (6 decades), 30 % zeros, all ones, or zero over
    every other run of 16 columns (whole sub-blocks without weight: llama.cpp divides by zero sums)."""
    choices = (lambda: rng.uniform(0, 10, n), lambda: rng.lognormal(0, 3, n),
               lambda: np.where(rng.random(n) < 0.3, 0, rng.uniform(0, 1, n)), lambda: np.ones(n),
               lambda: np.where(np.arange(n) // 16 % 2 == 0, 0, rng.uniform(0, 1, n)))
    return choices[kind % len(choices)]().astype(np.float32)


def block_mismatches(ours: np.ndarray, theirs: np.ndarray, qtype: QType) -> int:
    size = GGML_QUANT_SIZES[qtype][1]
    return int((ours.reshape(-1, size) != theirs.reshape(-1, size)).any(axis=1).sum())


# ------------------------------------------------------------------------------------------ no llama.cpp

def ggml_nearest_int(f: np.float32) -> int:
    """ggml's nearest_int, one value at a time with struct (the definition the vectorised ones follow)."""
    (bits,) = struct.unpack("<i", struct.pack("<f", np.float32(f) + np.float32(12582912.0)))
    return (bits & 0x7FFFFF) - 0x400000


def test_nearest_int_is_ggml_bit_formula() -> None:
    values = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 1e-40, 4194303.0, 4194304.5, 5e6, -5e6, 1e30, -1e30,
                       np.inf, -np.inf, np.nan, 0.0, -0.0, 12582911.0, -12582912.0, 0.49999997],
                      np.float32)
    values = np.concatenate([values, np.random.default_rng(1).standard_normal(200).astype(np.float32) * 40])
    expected = [ggml_nearest_int(v) for v in values]
    with np.errstate(invalid="ignore"):
        assert nearest_int(values).tolist() == expected
        assert [quant_search.nearest_int(v) for v in values] == expected


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_values_round_to_their_sub_block_grid(qtype: QType) -> None:
    """Gaussian rows: each value decodes to a nearest point of its sub-block's grid (d * q - m over the
    type's integers), the property llama.cpp's final re-rounding gives; with or without importance."""
    rng = np.random.default_rng(7)
    x = (0.02 * rng.standard_normal((6, 512))).astype(np.float32)
    codec = CODECS[qtype]
    for importance in (None, varied_importance(rng, 512, 0)):
        encoded = encode_rows(x, qtype, importance)
        assert encoded.dtype == np.uint8 and encoded.shape == (6, codec.stored_shape((512,))[0])
        decoded = codec.reference(encoded).reshape(x.shape)
        sub = codec.sub
        grid = _grids(codec, encoded)  # [sub-blocks, levels]
        err = np.abs(decoded.reshape(-1, sub) - x.reshape(-1, sub))
        best = np.abs(grid[:, None, :] - x.reshape(-1, sub)[:, :, None]).min(axis=2)
        top = np.abs(grid).max(axis=1, keepdims=True)
        # K-quants re-round against the float16 scale they store: float32 rounding of x / d only.  IQ4 picks
        # levels with its float32 scale d, then stores d as float16 (relative error <= 2**-11, or half the
        # subnormal step 2**-25 over d below 2**-14): each level moves by that much of the largest, so the
        # distance to the chosen level exceeds the best by at most twice that
        slack = 1e-6
        if qtype in (QType.IQ4_NL, QType.IQ4_XS):
            d16 = np.abs(encoded.reshape(-1, codec.type_size)[:, :2].copy().view("<f2").astype(np.float32))
            slack = 2 * np.maximum(2.0**-11, 2.0**-25 / d16).repeat(codec.block_size // sub)[:, None]
        assert np.all(err <= best + slack * top), f"{qtype.name}: a value is not at its nearest grid point"


def _grids(codec, encoded: np.ndarray) -> np.ndarray:
    """Every value a sub-block can decode to: its scale and offset applied to each stored integer level."""
    from qwen_runtime.quants.scratch import Scratch

    scratch = Scratch()
    fields = np.ascontiguousarray(encoded.reshape(-1, codec.type_size).T)  # [type_size, blocks]
    scale, offset = codec.scales(fields, scratch)  # [sub-blocks per block, blocks]
    scale, offset = scale.T.reshape(-1, 1), (None if offset is None else offset.T.reshape(-1, 1))
    if codec.qtype in (QType.IQ4_NL, QType.IQ4_XS):
        from qwen_runtime.quants.iq4 import IQ4_LEVELS
        ints = IQ4_LEVELS.astype(np.float32)[None]
    else:
        ints = np.arange(codec.int_range[0], codec.int_range[1] + 1, dtype=np.float32)[None]
    values = scale * ints
    return values if offset is None else values - offset


# ------------------------------------------------------------------------------------------ llama.cpp

def _ggml():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peer` extra) is not installed")
    # Where llama-cpp-python itself loads its libraries from: LLAMA_CPP_LIB_PATH (.ci/run's one llama.cpp build,
    # scripts/llama_tools.py) or the package's own lib/.
    libs = os.environ.get("LLAMA_CPP_LIB_PATH") or Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(str(Path(libs) / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def ggml_quantize(lib, x: np.ndarray, qtype: QType, importance: np.ndarray | None) -> np.ndarray:
    rows, n = x.shape
    block, size = GGML_QUANT_SIZES[qtype]
    out = np.empty((rows, n // block * size), np.uint8)
    weights = None if importance is None else np.ascontiguousarray(importance, np.float32)
    lib.ggml_quantize_chunk(int(qtype), np.ascontiguousarray(x).ctypes.data, out.ctypes.data, 0, rows, n,
                            None if weights is None else weights.ctypes.data)
    return out


def ggml_dequantize(lib, raw: np.ndarray, qtype: QType, n: int) -> np.ndarray:
    name = qtype.name.lower() if qtype.name.startswith("IQ") else "q" + qtype.name[1:]  # q4_K, iq4_xs
    fn = getattr(lib, f"dequantize_row_{name}")
    out = np.empty(raw.shape[0] * n, np.float32)
    fn(ctypes.c_void_p(np.ascontiguousarray(raw).ctypes.data), ctypes.c_void_p(out.ctypes.data),
       ctypes.c_int64(out.size))
    return out.reshape(raw.shape[0], n)


@pytest.mark.peer
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_bytes_equal_ggml_quantize_chunk(qtype: QType, weighted: bool) -> None:
    lib = _ggml()
    rng = np.random.default_rng([int(qtype), weighted])
    widths = (896, 4864) if qtype == QType.IQ4_NL else (256, 4864)
    for width in widths:
        x = varied_rows(rng, 3 * len(KINDS), width)
        for kind in range(5 if weighted else 1):
            importance = varied_importance(rng, width, kind) if weighted else None
            ours, theirs = encode_rows(x, qtype, importance), ggml_quantize(lib, x, qtype, importance)
            assert block_mismatches(ours, theirs, qtype) == 0, f"{qtype.name} width {width} kind {kind}"
        decoded = CODECS[qtype].reference(ours).reshape(x.shape)
        expected = ggml_dequantize(lib, theirs, qtype, width)
        assert np.array_equal(decoded, expected, equal_nan=True)


@pytest.mark.peer
@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1], ids=lambda q: q.name)
def test_weighted_32_blocks_equal_ggml_quantize_chunk(qtype: QType) -> None:
    """With importance llama.cpp's Q4_0..Q5_1 run their own weighted search (llama-quantize's fallback for
    rows not a multiple of 256 in the K mixes); without, the reference ``gguf.quants`` reproduces."""
    lib = _ggml()
    rng = np.random.default_rng(int(qtype))
    x = varied_rows(rng, 3 * len(KINDS), 896)
    for kind in range(5):
        importance = varied_importance(rng, 896, kind)
        ours, theirs = encode_rows(x, qtype, importance), ggml_quantize(lib, x, qtype, importance)
        assert block_mismatches(ours, theirs, qtype) == 0, f"{qtype.name} importance kind {kind}"
    assert block_mismatches(encode_rows(x, qtype), ggml_quantize(lib, x, qtype, None), qtype) == 0


# ------------------------------------------------------------------------------ whole files, llama_model_quantize

def write_model(root: Path, hidden: int, intermediate: int, seed: int) -> Path:
    """A one-layer Qwen2 checkpoint (float32 safetensors) whose matrices are :func:`varied_rows`."""
    from safetensors.numpy import save_file

    root.mkdir(parents=True)
    config = json.loads((FIXTURE / "config.json").read_text())
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=hidden,
                  intermediate_size=intermediate, num_attention_heads=hidden // 64, num_key_value_heads=2,
                  head_dim=64, num_hidden_layers=1, tie_word_embeddings=False, torch_dtype="float32")
    (root / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (root / name).write_bytes((FIXTURE / name).read_bytes())
    rng, vocab, kv = np.random.default_rng(seed), config["vocab_size"], 2 * 64
    layer = "model.layers.0."
    matrices = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
                layer + "self_attn.q_proj.weight": (hidden, hidden), layer + "self_attn.k_proj.weight": (kv, hidden),
                layer + "self_attn.v_proj.weight": (kv, hidden), layer + "self_attn.o_proj.weight": (hidden, hidden),
                layer + "mlp.gate_proj.weight": (intermediate, hidden),
                layer + "mlp.up_proj.weight": (intermediate, hidden),
                layer + "mlp.down_proj.weight": (hidden, intermediate)}
    tensors = {name: varied_rows(rng, *shape) for name, shape in matrices.items()}
    vectors = {"model.norm.weight": hidden, layer + "input_layernorm.weight": hidden,
               layer + "post_attention_layernorm.weight": hidden, layer + "self_attn.q_proj.bias": hidden,
               layer + "self_attn.k_proj.bias": kv, layer + "self_attn.v_proj.bias": kv}
    tensors.update({name: np.ones(size, np.float32) for name, size in vectors.items()})
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


class Files:
    """F32 GGUFs of two models (ours) and llama.cpp's --pure quantizations of them, made on demand."""

    MODELS = {"k": (1024, 4864), "nl": (896, 4864)}  # "nl": 896 columns, IQ4_NL's 32-blocks only

    def __init__(self, root: Path) -> None:
        from qwen_convert.convert import convert

        self.root = root
        self.f32 = {name: convert(write_model(root / name, *shape, seed=i), root / f"{name}-f32.gguf", fmt="gguf",
                                  dtype="fp32").output for i, (name, shape) in enumerate(self.MODELS.items())}
        self.importance = {}
        from qwen_runtime.formats.gguf_parse import parse_gguf

        rng = np.random.default_rng(11)
        for model, path in self.f32.items():
            for i, t in enumerate(parse_gguf(path).tensors):
                if len(t.shape) == 2:
                    self.importance[model, t.name] = varied_importance(rng, t.shape[-1], i)

    def quantized(self, model: str, qtype: QType, weighted: bool) -> Path:
        path = self.root / f"{model}-{qtype.name}-{'imatrix' if weighted else 'plain'}.gguf"
        if not path.is_file():
            imatrix = {name: v for (m, name), v in self.importance.items() if m == model} if weighted else None
            quantize_with_importance(self.f32[model], path, PURE_FTYPE[qtype], imatrix)
        return path


def quantize_with_importance(src: Path, dst: Path, ftype: str, imatrix: dict[str, np.ndarray] | None) -> None:
    """``llama_model_quantize --pure`` of ``src``, with importance vectors per tensor name when given (the
    ``imatrix`` field of its parameters: what llama-quantize fills from an imatrix file)."""
    import llama_cpp
    import llama_interop as li

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.pure, params.nthread = True, 2
    keep = []
    if imatrix:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for slot, (name, values) in zip(entries, imatrix.items(), strict=False):
            keep.append(np.ascontiguousarray(values, np.float32))
            slot.name, slot.size = name.encode(), values.size
            slot.data = keep[-1].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        params.imatrix = entries
    with li.captured_llama_logs() as logs:
        status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    assert status == 0 and dst.is_file(), logs.text()[-2000:]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peer` extra) is not installed")
    return Files(tmp_path_factory.mktemp("kquant-files"))


# "nl" (896 columns): IQ4_NL everywhere; Q4_K and Q5_K files hold them only in ffn_down (4864 columns) and fall
# back to Q5_0 / Q5_1 elsewhere, weighted by the importance too
FILE_CASES = [(model, q, w) for q in K_TYPES
              for model in (("k", "nl") if q in (QType.IQ4_NL, QType.Q4_K, QType.Q5_K) else ("k",))
              for w in (False, True)]
WRITTEN = (*K_TYPES, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1)


@pytest.mark.peer
@pytest.mark.slow
@pytest.mark.parametrize(("model", "qtype", "weighted"), FILE_CASES,
                         ids=[f"{m}-{q.name}-{'imatrix' if w else 'plain'}" for m, q, w in FILE_CASES])
def test_streamed_tensors_equal_llama_model_quantize(files: Files, model: str, qtype: QType,
                                                     weighted: bool) -> None:
    from qwen_runtime.formats import open_model_files
    from qwen_runtime.formats.gguf_parse import parse_gguf, tensor_view

    source = open_model_files(files.f32[model])
    layout = parse_gguf(files.quantized(model, qtype, weighted))
    ours_types = [t for t in layout.tensors if t.qtype in WRITTEN]
    assert len(ours_types) == 9  # every matrix of the layer, the embedding and the output
    assert any(t.qtype == qtype for t in ours_types)
    for t in ours_types:
        importance = files.importance[model, t.name] if weighted else None
        ours = np.concatenate([c.reshape(-1) for c in stream_rows(source.tensors[t.name], t.qtype, importance)])
        theirs = np.frombuffer(bytes(tensor_view(layout, t)), np.uint8)
        assert block_mismatches(ours, theirs, t.qtype) == 0, t.name
    if weighted:  # the importance changed llama.cpp's bytes, so it was used
        plain = parse_gguf(files.quantized(model, qtype, False))
        name = ours_types[0].name
        other = next(t for t in plain.tensors if t.name == name)
        assert bytes(tensor_view(plain, other)) != bytes(tensor_view(layout, ours_types[0]))


# ------------------------------------------------------------------------------ the llama-quantize tool

def write_legacy_imatrix(path: Path, importance: dict[str, np.ndarray]) -> None:
    """llama-imatrix's legacy ``.dat``: entries (name, ncall = 1, values), then chunk count and dataset."""
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(importance)))
        for name, values in importance.items():
            f.write(struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 1, values.size))
            f.write(np.ascontiguousarray(values, "<f4").tobytes())
        f.write(struct.pack("<i", 1) + struct.pack("<i", 4) + b"test")


@pytest.mark.peer
@pytest.mark.slow
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_llama_quantize_tool_with_imatrix_file(files: Files, qtype: QType, tmp_path: Path) -> None:
    import subprocess

    import llama_interop as li
    import llama_tools

    from qwen_runtime.formats import open_model_files
    from qwen_runtime.formats.gguf_parse import parse_gguf, tensor_view

    try:
        tool = llama_tools.build_tools(["llama-quantize"])["llama-quantize"]
    except li.ConverterUnavailable as exc:
        pytest.skip(f"llama-quantize could not be built: {exc}")
    importance = {name: v for (m, name), v in files.importance.items() if m == "k"}
    write_legacy_imatrix(tmp_path / "imatrix.dat", importance)
    out = tmp_path / "out.gguf"
    done = subprocess.run([str(tool), "--pure", "--imatrix", str(tmp_path / "imatrix.dat"), str(files.f32["k"]),
                           str(out), PURE_FTYPE[qtype], "2"], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    source, layout = open_model_files(files.f32["k"]), parse_gguf(out)
    quantized = [t for t in layout.tensors if t.qtype == qtype]
    assert len(quantized) == 9
    for t in quantized:
        ours = np.concatenate([c.reshape(-1) for c in stream_rows(source.tensors[t.name], qtype, importance[t.name])])
        assert block_mismatches(ours, np.frombuffer(bytes(tensor_view(layout, t)), np.uint8), qtype) == 0, t.name


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_npy_files_hold_the_blocks(qtype: QType, tmp_path: Path) -> None:
    """An npy tensor file (the npy writer's header, then the encoded rows) loads as the type's block dtype,
    one row of blocks per tensor row, with the bytes of the encoding and the scale ``d`` in its field."""
    from qwen_convert.npy_writer import npy_header
    from qwen_convert.policy import TensorSpec
    from qwen_runtime.formats.npy_dir import npy_dtype, npy_shape

    x = varied_rows(np.random.default_rng(5), 4, 512)
    encoded = encode_rows(x, qtype)
    path = tmp_path / "t.npy"
    path.write_bytes(npy_header(TensorSpec("t", x.shape, qtype)) + encoded.tobytes())
    array = np.load(path, mmap_mode="r")
    assert array.dtype == npy_dtype(qtype)
    assert array.shape == npy_shape(qtype, x.shape) == (4, 512 // CODECS[qtype].block_size)
    assert np.array_equal(np.asarray(array).view(np.uint8).reshape(4, -1), encoded)
    d_at = {QType.Q2_K: 80, QType.Q3_K: 108, QType.Q6_K: 208}.get(qtype, 0)
    first_d = encoded[:, d_at:d_at + 2].copy().view("<f2")[:, 0]
    assert np.array_equal(array["d"][:, 0], first_d, equal_nan=True)


def test_bad_shapes_are_refused() -> None:
    from qwen_runtime.errors import FormatError

    x = np.zeros((2, 512), np.float32)
    with pytest.raises(FormatError, match="divisible by 256"):
        encode_rows(x[:, :384], QType.Q4_K)
    with pytest.raises(FormatError, match="importance has shape"):
        encode_rows(x, QType.Q6_K, np.ones(256, np.float32))


def test_searched_types_are_the_writers_listed() -> None:
    # the lattice i-quants: tests/convert/test_iq_writers.py
    lattice = {QType.IQ3_XXS, QType.IQ3_S, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ1_S, QType.IQ1_M}
    assert set(SEARCHED) == {*K_TYPES, *lattice}


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.IQ4_XS], ids=lambda q: q.name)
def test_bytes_do_not_depend_on_threads(qtype: QType) -> None:
    rng = np.random.default_rng(3)
    x, importance = varied_rows(rng, 23, 512), varied_importance(rng, 512, 1)
    one = encode_rows(x, qtype, importance, threads=1)
    assert np.array_equal(one, encode_rows(x, qtype, importance, threads=4))
    assert np.array_equal(one[5:9], encode_rows(x[5:9], qtype, importance, threads=1))
