"""llama.cpp's mixes (``--dtype q4_k_m`` ...) and llama-quantize's per-tensor options, against llama.cpp itself.

The oracle tests quantize an F32 GGUF of each ``interop_models.MIX_MODELS`` model (Qwen2 untied with 4 query
groups, Qwen3 tied, Qwen3.5 with Gated DeltaNet layers, and a Qwen2 whose rows are 384 and 200 values) with
``llama_model_quantize`` for every mix, with and without ``pure``, and with the per-tensor options; our
``plan_types`` must give every tensor llama.cpp's type, and ``general.file_type`` must be llama.cpp's.

Bytes: every tensor of llama.cpp's output is encoded by us from the same float32 values (weighted by the same
importance vectors where llama.cpp weights) and compared byte for byte, and our own converted file
(``convert(dtype=mix)``) must equal llama.cpp's tensor by tensor.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import fixture
from runtime_helpers import Converted

from qwen_convert.cli import convert_main, convert_parser, quant_options
from qwen_convert.convert import check_writable, convert
from qwen_convert.imatrix import Importance
from qwen_convert.policy import (
    MIXES,
    WEIGHTS_REQUIRED,
    ModelFacts,
    QuantOptions,
    fallback,
    needs_importance,
    parse_tensor_type,
    plan_types,
    use_more_bits,
)
from qwen_convert.quantize import encode_rows
from qwen_runtime.errors import FormatError, QwenError
from qwen_runtime.formats import open_hf_dir, open_model_files
from qwen_runtime.formats.tensors import QType

# ------------------------------------------------------------------------------------------------ unit

def test_use_more_bits_is_llama_cpp_table() -> None:
    # n = 10: the first eighth (i < 1), the last eighth (i >= 8), and i - 1 = 2 mod 3
    assert [i for i in range(10) if use_more_bits(i, 10)] == [0, 3, 6, 8, 9]
    assert [i for i in range(24) if use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]


@pytest.mark.parametrize(("qtype", "row", "expected"), [
    (QType.Q4_K, 512, QType.Q4_K), (QType.Q4_K, 384, QType.Q5_0), (QType.Q5_K, 384, QType.Q5_1),
    (QType.Q6_K, 384, QType.Q8_0), (QType.Q2_K, 384, QType.Q4_0), (QType.Q3_K, 384, QType.Q4_0),
    (QType.IQ4_XS, 384, QType.IQ4_NL), (QType.Q4_K, 200, QType.F16), (QType.Q8_0, 200, QType.F16),
    (QType.IQ4_NL, 200, QType.F16), (QType.F16, 200, QType.F16),
])
def test_fallback_is_llama_cpp_twin(qtype: QType, row: int, expected: QType) -> None:
    assert fallback("blk.0.ffn_down.weight", row, qtype) == expected


def test_fallback_refuses_type_without_twin() -> None:
    with pytest.raises(QwenError, match="blk.0.x.weight: row length 384 .* no fallback type for Q8_K"):
        fallback("blk.0.x.weight", 384, QType.Q8_K)


def test_tensor_type_parsing() -> None:
    assert parse_tensor_type("attn_v=Q8_0") == ("attn_v", QType.Q8_0)
    assert parse_tensor_type(r"blk\.[0-3]\.ffn_down=q6_k") == (r"blk\.[0-3]\.ffn_down", QType.Q6_K)
    assert parse_tensor_type("attn_v=iq2_xxs") == ("attn_v", QType.IQ2_XXS)  # the i-quants we write
    for bad in ("attn_v", "=q8_0", "attn_v=", "attn_v=q8_k", "attn_v=mxfp4"):
        with pytest.raises(QwenError, match="--tensor-type"):
            parse_tensor_type(bad)
    with pytest.raises(QwenError, match="not a regular expression"):
        QuantOptions(tensor_types=(("attn_[v", QType.Q8_0),))


def _tiny(name: str = "qwen3-tiny") -> tuple[dict[str, tuple[int, ...]], ModelFacts]:
    files = open_hf_dir(fixture(name))
    return {n: t.shape for n, t in files.tensors.items()}, ModelFacts.from_config(files.config)


def test_overrides_precedence_on_tiny_model() -> None:
    shapes, facts = _tiny()  # tied, rows of 64 and 128
    options = QuantOptions(tensor_types=(("ffn_down", QType.Q4_0), ("blk.0", QType.Q8_0)),
                           output_type=QType.Q5_1)
    types = plan_types(shapes, "q4_k_m", facts, options)
    assert types["blk.1.ffn_down.weight"] == QType.Q4_0  # first match wins
    assert types["blk.0.attn_q.weight"] == QType.Q8_0
    assert types["token_embd.weight"] == QType.Q5_1  # tied: the output type
    assert types["blk.1.attn_q.weight"] == QType.Q5_0  # Q4_K falls back: rows of 64
    assert types["blk.0.attn_norm.weight"] == QType.F32
    with pytest.raises(QwenError, match="--token-embedding-type Q4_K: tensor token_embd.weight has rows of 64"):
        plan_types(shapes, "q4_k_m", facts, QuantOptions(token_embedding_type=QType.Q4_K))
    with pytest.raises(QwenError, match="need a quantized --dtype"):
        plan_types(shapes, "fp16", facts, QuantOptions(pure=True))


@pytest.mark.parametrize(("mix", "bumped"), [("q4_0", QType.Q4_1), ("q4_1", None), ("q5_0", QType.Q5_1),
                                             ("q5_1", None)])
def test_legacy_mixes_follow_llama_quantize(mix: str, bumped: QType | None) -> None:
    """llama-quantize's Q4_0..Q5_1: output.weight Q6_K (Q8_0 where 256 does not divide its rows, F16 where 32
    does not), the untied embedding the base type, Q4_0/Q5_0's first eighth of ffn_down one type up with an
    importance matrix only; --pure stores every matrix in the base type."""
    base = MIXES[mix].base
    shapes = {"token_embd.weight": (1000, 512), "output.weight": (1000, 512), "blk.0.attn_norm.weight": (512,),
              **{f"blk.{i}.{kind}.weight": (512, 512) for i in range(16) for kind in ("attn_v", "ffn_down")}}
    facts = ModelFacts(16, 4)
    types = plan_types(shapes, mix, facts)
    assert types["output.weight"] == QType.Q6_K and types["token_embd.weight"] == base
    assert types["blk.0.attn_norm.weight"] == QType.F32
    assert {t for n, t in types.items() if n.startswith("blk.") and n.endswith("0.ffn_down.weight")} == {base}
    weighted = plan_types(shapes, mix, facts, QuantOptions(imatrix=True))
    assert [n for n in shapes if weighted[n] != types[n]] == (
        [] if bumped is None else ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"])  # 16 // 8 layers
    assert bumped is None or weighted["blk.1.ffn_down.weight"] == bumped
    assert set(plan_types(shapes, mix, facts, QuantOptions(pure=True)).values()) == {base, QType.F32}
    tiny, tiny_facts = _tiny()  # tied, rows of 64: Q6_K falls back to Q8_0 for the output (the embedding)
    assert plan_types(tiny, mix, tiny_facts)["token_embd.weight"] == QType.Q8_0
    odd = {"output.weight": (10, 48), "blk.0.ffn_up.weight": (48, 64)}
    assert plan_types(odd, mix, ModelFacts(1, 1)) == {"output.weight": QType.F16, "blk.0.ffn_up.weight": base}


def test_ternary_and_q2_k_s_mixes_follow_llama_quantize() -> None:
    """tq1_0/tq2_0: every matrix ternary but the untied embedding (Q4_K) and the output (Q6_K); q2_k_s: Q2_K
    with Q4_K for attn_v at 4+ query groups and the first eighth of ffn_down, and llama-quantize's rule of which
    tensors need an importance matrix (its Q2_K ones, not the embedding or output; the i-quants in any file)."""
    shapes = {"token_embd.weight": (1000, 512), "output.weight": (1000, 512), "blk.0.ffn_up.weight": (512, 384),
              **{f"blk.{i}.{kind}.weight": (512, 512) for i in range(8) for kind in ("attn_v", "ffn_down")}}
    for mix, base in (("tq1_0", QType.TQ1_0), ("tq2_0", QType.TQ2_0)):
        types = plan_types(shapes, mix, ModelFacts(8, 4))
        assert types["token_embd.weight"] == QType.Q4_K and types["output.weight"] == QType.Q6_K
        assert types["blk.0.ffn_up.weight"] == QType.Q4_0  # 384 columns: llama.cpp's fallback
        assert {types[n] for n in shapes if n.startswith("blk.") and "ffn_up" not in n} == {base}
    for groups, attn_v in ((4, QType.Q4_K), (2, QType.Q2_K)):
        types = plan_types(shapes, "q2_k_s", ModelFacts(8, groups))
        assert {types[f"blk.{i}.attn_v.weight"] for i in range(8)} == {attn_v}
        assert [types[f"blk.{i}.ffn_down.weight"] for i in range(2)] == [QType.Q4_K, QType.Q2_K]
    assert needs_importance("blk.1.ffn_down.weight", QType.Q2_K, "Q2_K_S")
    assert not needs_importance("blk.1.ffn_down.weight", QType.Q2_K, "q2_k")
    assert not needs_importance("output.weight", QType.IQ3_XXS, "q4_k_m")
    assert needs_importance("blk.0.attn_q.weight", QType.IQ3_XXS, "q4_k_m")  # an override to an i-quant
    assert not needs_importance("blk.0.attn_q.weight", QType.TQ1_0, "tq1_0")


@pytest.mark.parametrize(("mix", "base", "bumped", "attn_output"), [
    ("iq2_xxs", QType.IQ2_XXS, QType.Q2_K, QType.IQ2_XXS), ("iq2_xs", QType.IQ2_XS, QType.Q2_K, QType.IQ2_XS),
    ("iq2_s", QType.IQ2_XS, QType.IQ3_S, QType.IQ3_S), ("iq2_m", QType.IQ2_S, QType.IQ3_S, QType.IQ3_S),
    ("iq1_s", QType.IQ1_S, QType.Q2_K, QType.IQ2_XXS), ("iq1_m", QType.IQ1_M, QType.Q2_K, QType.IQ2_XXS)])
def test_iq2_mixes_follow_llama_quantize(mix: str, base: QType, bumped: QType, attn_output: QType) -> None:
    """iq2_xxs, iq2_xs, iq2_s, iq2_m, iq1_s, iq1_m: output (and a tied embedding) Q5_K, attn_v Q4_K at 4+ query
    groups, the untied embedding, attn_v below 4 groups and the first eighth of ffn_down one type up (Q2_K, or
    IQ3_S for iq2_s/iq2_m, whose attn_output is IQ3_S too; IQ1's attn_output is IQ2_XXS), the rest the base type
    (IQ4_NL where 256 does not divide the rows); every tensor of the base type, and only those (IQ2_XXS
    attn_output too), needs an importance matrix."""
    shapes = {"token_embd.weight": (1000, 512), "output.weight": (1000, 512), "blk.0.ffn_up.weight": (512, 384),
              **{f"blk.{i}.{kind}.weight": (512, 512) for i in range(16) for kind in ("attn_v", "ffn_down",
                                                                                       "attn_output", "attn_q")}}
    for groups, attn_v in ((4, QType.Q4_K), (1, bumped)):
        types = plan_types(shapes, mix, ModelFacts(16, groups))
        assert (types["output.weight"], types["token_embd.weight"]) == (QType.Q5_K, bumped)
        assert {types[f"blk.{i}.attn_v.weight"] for i in range(16)} == {attn_v}
        assert [types[f"blk.{i}.ffn_down.weight"] for i in range(3)] == [bumped, bumped, base]
        assert {types[f"blk.{i}.attn_output.weight"] for i in range(16)} == {attn_output}
        assert {types[f"blk.{i}.attn_q.weight"] for i in range(16)} == {base}
        assert types["blk.0.ffn_up.weight"] == QType.IQ4_NL
        assert [n for n, q in types.items() if needs_importance(n, q, mix)] == [
            n for n, q in types.items() if q == base or q == attn_output == QType.IQ2_XXS]
    tied = {n: s for n, s in shapes.items() if n != "output.weight"}
    assert plan_types(tied, mix, ModelFacts(16, 4))["token_embd.weight"] == QType.Q5_K
    assert needs_importance("output.weight", QType.IQ2_XS, "q4_k_m")  # llama.cpp cannot encode it without
    assert not needs_importance("output.weight", QType.IQ2_S, "q4_k_m")  # it can: the rule's exception holds


def test_iq3_mixes_follow_llama_quantize() -> None:
    """iq3_xxs: output Q5_K, untied embedding IQ3_S, attn_q/attn_k IQ2_S, attn_output IQ3_S, attn_v Q4_K at 4+
    query groups (else IQ3_S without an importance matrix, IQ3_XXS with), ffn_down Q4_K for the first eighth and
    Q3_K after without a matrix; iq3_xs: IQ3_S with attn_q/attn_k IQ3_XXS and ffn_up/ffn_gate IQ3_XXS between
    the first and last eighth; iq3_s: IQ3_S, attn_v Q4_K at 4+ groups; iq3_m: attn_v Q4_K, attn_output Q4_K and
    the first eighth of ffn_down Q4_K; the output Q6_K for all but iq3_xxs."""
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_gate", "ffn_down")
    shapes = {"token_embd.weight": (1000, 512), "output.weight": (1000, 512),
              **{f"blk.{i}.{kind}.weight": (512, 512) for i in range(16) for kind in kinds}}

    def layers(types: dict[str, QType], kind: str) -> list[QType]:
        return [types[f"blk.{i}.{kind}.weight"] for i in range(16)]

    xxs = QType.IQ3_XXS
    for imatrix in (False, True):
        for groups in (1, 4):
            types = plan_types(shapes, "iq3_xxs", ModelFacts(16, groups), QuantOptions(imatrix=imatrix))
            assert (types["output.weight"], types["token_embd.weight"]) == (QType.Q5_K, QType.IQ3_S)
            assert set(layers(types, "attn_q")) == set(layers(types, "attn_k")) == {QType.IQ2_S}
            assert set(layers(types, "attn_output")) == {QType.IQ3_S}
            assert set(layers(types, "attn_v")) == {QType.Q4_K if groups >= 4 else xxs if imatrix else QType.IQ3_S}
            assert layers(types, "ffn_down") == ([xxs] * 16 if imatrix else [QType.Q4_K] * 2 + [QType.Q3_K] * 14)
            assert set(layers(types, "ffn_up")) == set(layers(types, "ffn_gate")) == {xxs}
    s_types = QType.IQ3_S
    for groups in (1, 4):
        facts = ModelFacts(16, groups)
        attn_v = QType.Q4_K if groups >= 4 else s_types
        types = plan_types(shapes, "iq3_xs", facts)
        assert (types["output.weight"], types["token_embd.weight"]) == (QType.Q6_K, s_types)
        assert set(layers(types, "attn_q")) == set(layers(types, "attn_k")) == {xxs}
        assert set(layers(types, "attn_v")) == {attn_v}
        assert layers(types, "ffn_up") == layers(types, "ffn_gate") == [s_types] * 2 + [xxs] * 12 + [s_types] * 2
        assert set(layers(types, "ffn_down")) == set(layers(types, "attn_output")) == {s_types}
        types = plan_types(shapes, "iq3_s", facts)
        assert set(layers(types, "attn_v")) == {attn_v} and types["output.weight"] == QType.Q6_K
        assert {types[n] for n in shapes if "attn_v" not in n and n != "output.weight"} == {s_types}
        types = plan_types(shapes, "iq3_m", facts)
        assert set(layers(types, "attn_v")) == set(layers(types, "attn_output")) == {QType.Q4_K}
        assert layers(types, "ffn_down") == [QType.Q4_K] * 2 + [s_types] * 14
        assert set(layers(types, "attn_q")) == set(layers(types, "ffn_up")) == {s_types}
    options = QuantOptions(tensor_types=(("blk.0.ffn_up", QType.Q8_0),))  # not counted: the rest shift by one
    assert layers(plan_types(shapes, "iq3_xs", ModelFacts(16, 1), options), "ffn_up") == (
        [QType.Q8_0, s_types, s_types] + [xxs] * 12 + [s_types])


def test_cli_options_reach_the_plan(tmp_path: Path) -> None:
    args = convert_parser().parse_args([str(fixture("qwen3-tiny")), "-o", "x.gguf", "--dtype", "q5_k_m",
                                        "--tensor-type", "attn_K=Q8_0", "--tensor-type", "ffn=q4_1",
                                        "--output-tensor-type", "f16", "--pure"])
    options = quant_options(args)
    assert options == QuantOptions(pure=True, tensor_types=(("attn_K", QType.Q8_0), ("ffn", QType.Q4_1)),
                                   output_type=QType.F16)
    assert convert_main([str(fixture("qwen3-tiny")), "-o", str(tmp_path / "a.gguf"), "--dtype", "fp16",
                         "--tensor-type", "attn=q8_0"]) == 2  # a usage error
    assert not (tmp_path / "a.gguf").exists()
    with pytest.raises(SystemExit):
        convert_main([str(fixture("qwen3-tiny")), "--out-dir", str(tmp_path), "--dtype", "q4_k_m", "--pure"])


def test_unwritable_type_is_refused_before_any_output(tmp_path: Path, monkeypatch) -> None:
    convert_module = sys.modules[convert.__module__]

    def no_q8(x: np.ndarray, qtype: QType, importance: np.ndarray | None = None) -> np.ndarray:
        if qtype == QType.Q8_0:
            raise FormatError("cannot write tensors of type Q8_0")
        return encode_rows(x, qtype, importance)

    monkeypatch.setattr(convert_module, "encode_rows", no_q8)
    with pytest.raises(FormatError, match="tensor 'token_embd.weight': this converter cannot write type Q8_0"):
        convert(fixture("qwen3-tiny"), tmp_path / "m.gguf", "gguf", "q4_k_m")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", ["q4_k_m", "q3_k_l"])
def test_mix_on_tiny_model_npy_equals_gguf(converted: Converted, dtype: str) -> None:
    """Rows of 64 and 128: every K-quant falls back to a 32-value type the converter writes today."""
    shapes, facts = _tiny()
    planned = plan_types(shapes, dtype, facts)
    gguf = open_model_files(converted("qwen3-tiny", "gguf", dtype))
    npy = open_model_files(converted("qwen3-tiny", "npy", dtype))
    assert gguf.metadata["general.file_type"] == int(MIXES[dtype].file_type)
    assert {n: t.qtype for n, t in gguf.tensors.items()} == planned
    for name, tensor in npy.tensors.items():
        assert tensor.qtype == planned[name], name
        assert np.array_equal(tensor.data, gguf.tensors[name].data), name


def test_check_writable_accepts_converter_types() -> None:
    from qwen_convert.policy import TensorSpec

    check_writable([TensorSpec("a.weight", (4, 32), q) for q in (QType.F32, QType.F16, QType.Q8_0, QType.Q4_1)])


# ------------------------------------------------------------------------------------------------ oracle

OPTION_CASES = {  # name: (mix, QuantOptions, the same for llama_quantize)
    "tensor-types": ("q4_k_m", QuantOptions(tensor_types=((r"blk\.[01]\.attn_v", QType.Q8_0), ("ffn_up", QType.Q5_K),
                                                          ("ssm_out", QType.Q6_K))),
                     {"tensor_types": [(r"blk\.[01]\.attn_v", "Q8_0"), ("ffn_up", "Q5_K"), ("ssm_out", "Q6_K")]}),
    "output-embedding": ("q3_k_m", QuantOptions(output_type=QType.Q8_0, token_embedding_type=QType.Q4_1),
                         {"output_tensor_type": "Q8_0", "token_embedding_type": "Q4_1"}),
    "tied-output": ("q5_k_s", QuantOptions(output_type=QType.Q4_0), {"output_tensor_type": "Q4_0"}),
    "pure-override": ("q6_k", QuantOptions(pure=True, tensor_types=(("attn_q", QType.Q4_0),)),
                      {"pure": True, "tensor_types": [("attn_q", "Q4_0")]}),
    "iq4-with-imatrix-rule": ("iq4_xs", QuantOptions(imatrix=True), None),
}


class MixFiles:
    """The mix models, their F32 GGUFs (ours) and llama.cpp's quantizations of them, made on demand."""

    def __init__(self, root: Path) -> None:
        import interop_models

        self.root = root
        self.models = list(interop_models.MIX_MODELS)
        self.dirs = {name: interop_models.build_mix_model(name, root) for name in self.models}
        self.f32 = {name: convert(d, root / f"{name}-f32.gguf", fmt="gguf", dtype="fp32").output
                    for name, d in self.dirs.items()}
        self._importance: dict[str, Importance] = {}

    def llama(self, model: str, mix: str, label: str, **kwargs) -> Path:
        import llama_interop as li

        path = self.root / f"{model}-{mix}-{label}.gguf"
        if not path.is_file():
            li.llama_quantize(self.f32[model], path, mix.upper(), **kwargs)
        return path

    def importance_file(self, model: str) -> Importance:
        """A qwen-imatrix run on the model, written to a file and read back as qwen-convert reads it (once)."""
        from qwen_convert.imatrix import load_importance, write_imatrix
        from qwen_convert.imatrix_collect import compute_imatrix

        if model not in self._importance:
            calibration = " ".join(f"def f{i}(x):\n    return x * {i} + len('{model}')" for i in range(120))
            path = self.root / f"{model}-imatrix.gguf"
            write_imatrix(path, compute_imatrix(self.f32[model], calibration, "calib", n_ctx=64))
            self._importance[model] = load_importance(path)
        return self._importance[model]

    def importance(self, model: str) -> dict[str, np.ndarray]:
        """llama-quantize's vectors of a qwen-imatrix run on the model (computed once)."""
        return self.importance_file(model).vectors

    def needs_importance(self, model: str, mix: str, options: QuantOptions) -> bool:
        """Whether llama-quantize refuses ``mix`` on ``model`` without an importance matrix."""
        return any(needs_importance(n, q, mix) for n, q in self.ours(model, mix, options).items())

    def ours(self, model: str, mix: str, options: QuantOptions) -> dict[str, QType]:
        files = open_hf_dir(self.dirs[model])
        return plan_types({n: t.shape for n, t in files.tensors.items()}, mix, ModelFacts.from_config(files.config),
                          options)


@pytest.fixture(scope="module")
def mix_files(tmp_path_factory: pytest.TempPathFactory) -> MixFiles:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peer` extra) is not installed")
    pytest.importorskip("transformers", reason="the mix models are built with transformers (the `oracle` extra)")
    return MixFiles(tmp_path_factory.mktemp("quant-mixes"))


def compare_with_llama(files: MixFiles, model: str, theirs_path: Path, ours: dict[str, QType],
                       importance: dict[str, np.ndarray] | None = None) -> None:
    """Assert types equal and bytes equal, tensor by tensor (weighted by ``importance`` where llama.cpp
    weights)."""
    from qwen_convert.imatrix import WEIGHTED_TYPES
    from qwen_runtime.formats.gguf_parse import parse_gguf, tensor_view

    theirs, source = parse_gguf(theirs_path), open_model_files(files.f32[model])
    assert {t.name: t.qtype.name for t in theirs.tensors} == {n: q.name for n, q in ours.items()}
    for info in theirs.tensors:
        weights = (importance or {}).get(info.name) if info.qtype in WEIGHTED_TYPES else None
        values = np.ascontiguousarray(source.tensors[info.name].data, dtype=np.float32)
        rows = values.reshape(-1, values.shape[-1]) if values.ndim > 1 else values.reshape(1, -1)
        encoded = np.ascontiguousarray(encode_rows(rows, info.qtype, weights))
        assert encoded.tobytes() == bytes(tensor_view(theirs, info)), f"{theirs_path.name}: {info.name} bytes"


@pytest.mark.peer
@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("pure", [False, True], ids=["mix", "pure"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_types_and_file_type_match_llama_quantize(mix_files: MixFiles, mix: str, pure: bool) -> None:
    """Every model: the tensor types of llama-quantize's dry run equal our plan.  One model per mix and form
    (the models in turn, so each architecture meets about a quarter of the mixes): llama-quantize's file has the
    dry run's types and the mix's file type, and our whole file equals it, metadata and bytes.  (Each type's
    encoder is held to ggml's bytes row by row in test_kquant_writers and test_iq_writers; this test adds the
    plan, the importance wiring and the file.)"""
    import llama_interop as li

    from qwen_runtime.formats.gguf_parse import parse_gguf

    turn = (2 * list(MIXES).index(mix) + pure) % len(mix_files.models)
    written = False
    for model in mix_files.models[turn:] + mix_files.models[:turn]:
        # the mixes llama.cpp refuses without an importance matrix get one (q2_k_s where Q2_K fits the rows)
        weighted = mix_files.needs_importance(model, mix, QuantOptions(pure=pure))
        importance = mix_files.importance_file(model) if weighted else None
        if weighted and "output.weight" in importance.vectors:
            raise AssertionError("qwen-imatrix records no output.weight (llama-imatrix's default)")
        planned = mix_files.ours(model, mix, QuantOptions(pure, imatrix=weighted))
        if planned.get("output.weight", planned["token_embd.weight"]) in WEIGHTS_REQUIRED:
            # --pure iq2_xxs: llama.cpp would abort the process encoding output.weight without a vector (an
            # assert in quantize_iq2_xxs); we refuse before writing
            with pytest.raises(QwenError, match="need an importance matrix"):
                convert(mix_files.dirs[model], mix_files.root / "refused.gguf", "gguf", mix,
                        options=QuantOptions(pure=pure), importance=importance)
            continue
        vectors = importance and importance.vectors
        dry_run = li.llama_quantize_types(mix_files.f32[model], mix.upper(), pure=pure, imatrix=vectors)
        assert dry_run == {n: q.name for n, q in planned.items()}
        if written:
            continue
        written = True
        theirs = mix_files.llama(model, mix, ("pure" if pure else "mix") + ("-imatrix" if weighted else ""),
                                 pure=pure, imatrix=vectors)
        parsed = parse_gguf(theirs)
        assert parsed.metadata["general.file_type"] == int(MIXES[mix].file_type)
        assert {t.name: t.qtype.name for t in parsed.tensors} == dry_run
        # the whole file: metadata and structure, then the stored bytes (differing tensors named)
        ours = convert(mix_files.dirs[model], mix_files.root / f"ours-{model}-{mix}-{pure}.gguf", "gguf", mix,
                       options=QuantOptions(pure=pure), importance=importance).output
        ours_file, theirs_file = li.gguf_structure(ours), li.gguf_structure(theirs)
        assert ours_file.tensors == theirs_file.tensors
        assert li.data_diff(ours_file, theirs_file) == []


@pytest.mark.peer
@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, v in OPTION_CASES.items() if v[2] is not None])
def test_per_tensor_options_match_llama_quantize(mix_files: MixFiles, case: str) -> None:
    mix, options, llama_kwargs = OPTION_CASES[case]
    for model in mix_files.models:
        theirs = mix_files.llama(model, mix, case, **llama_kwargs)
        compare_with_llama(mix_files, model, theirs, mix_files.ours(model, mix, options))


@pytest.mark.peer
@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("mix", ["q2_k", "q4_k_m", "iq4_xs", "q4_0", "q5_0"])
def test_imatrix_weighted_tensors_match_llama_quantize(mix_files: MixFiles, mix: str) -> None:
    """Given the same importance vectors (from qwen-imatrix on the model), llama.cpp's types and, for the
    weighted types encode_rows writes, its bytes."""
    for model in ("qwen3-mix", "qwen2-odd"):
        vectors = mix_files.importance(model)
        theirs = mix_files.llama(model, mix, "weighted", imatrix=vectors)
        compare_with_llama(mix_files, model, theirs, mix_files.ours(model, mix, QuantOptions(imatrix=True)),
                           vectors)


@pytest.mark.peer
@pytest.mark.oracle
@pytest.mark.slow
def test_imatrix_changes_iq4_ffn_down_as_llama_quantize(mix_files: MixFiles) -> None:
    """With an importance matrix llama.cpp drops the IQ4 mixes' Q5_K bump of the first eighth of ffn_down."""
    import llama_interop as li

    model = "qwen2-mix"  # 10 layers: the bump covers blk.0
    source = open_model_files(mix_files.f32[model])
    ones = {n: np.ones(t.shape[-1], np.float32) for n, t in source.tensors.items()
            if n.startswith("blk.") and len(t.shape) == 2}
    mix, options, _ = OPTION_CASES["iq4-with-imatrix-rule"]
    theirs = mix_files.root / f"{model}-{mix}-imatrix.gguf"
    li.llama_quantize(mix_files.f32[model], theirs, mix.upper(), imatrix=ones)
    ours = mix_files.ours(model, mix, options)
    assert ours["blk.0.ffn_down.weight"] == QType.IQ4_XS
    assert mix_files.ours(model, mix, QuantOptions())["blk.0.ffn_down.weight"] == QType.Q5_K
    from qwen_runtime.formats.gguf_parse import parse_gguf

    assert {t.name: t.qtype for t in parse_gguf(theirs).tensors} == ours


@pytest.mark.peer
@pytest.mark.oracle
@pytest.mark.slow
def test_mixes_llama_quantize_refuses_without_imatrix_are_refused(mix_files: MixFiles, tmp_path: Path,
                                                                   capsys) -> None:
    """q2_k_s on a model whose rows Q2_K fits: llama-quantize fails without an importance matrix; so does
    qwen-convert, before any output, with exit code 2 and one line naming the tensors that need one (those
    llama.cpp stores as Q2_K given a matrix, token_embd and output excepted)."""
    import llama_interop as li

    from qwen_runtime.formats.gguf_parse import parse_gguf

    model = "qwen3-mix"
    with pytest.raises(RuntimeError, match="could not quantize"):
        li.llama_quantize(mix_files.f32[model], tmp_path / "theirs.gguf", "Q2_K_S")
    weighted = parse_gguf(mix_files.llama(model, "q2_k_s", "mix-imatrix", imatrix=mix_files.importance(model)))
    needing = [t.name for t in weighted.tensors
               if t.qtype == QType.Q2_K and t.name not in ("token_embd.weight", "output.weight")]
    assert len(needing) > 6
    out = tmp_path / "ours.gguf"
    assert convert_main([str(mix_files.dirs[model]), "-o", str(out), "--dtype", "Q2_K_S"]) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and f"{len(needing)} tensors need an importance matrix (--imatrix FILE)" in message
    assert all(name in message for name in needing[:6]) and f"and {len(needing) - 6} more" in message
    assert list(tmp_path.iterdir()) == []
    assert convert_main([str(mix_files.dirs[model]), "-o", str(out), "--dtype", "q2_k_s", "--pure",
                         "--tensor-type", "attn_q=q4_k"]) == 2  # per-tensor options do not lift the rule
    assert not out.exists()


@pytest.mark.peer
@pytest.mark.oracle
@pytest.mark.slow
def test_iq3_xxs_tensors_match_llama_quantize(mix_files: MixFiles, tmp_path: Path) -> None:
    """--tensor-type ...=iq3_xxs with an importance matrix: llama.cpp's types (IQ4_NL where 256 does not divide
    the rows) and bytes, tensor by tensor and in our converted file; without the matrix both refuse."""
    import llama_interop as li

    pattern = r"ffn_(up|down)|attn_(q|output)\."
    for model in ("qwen3-mix", "qwen2-odd"):
        importance = mix_files.importance_file(model)
        theirs = mix_files.llama(model, "q4_k_m", "iq3_xxs", tensor_types=[(pattern, "IQ3_XXS")],
                                 imatrix=importance.vectors)
        options = QuantOptions(tensor_types=((pattern, QType.IQ3_XXS),))
        planned = mix_files.ours(model, "q4_k_m", replace(options, imatrix=True))
        assert QType.IQ3_XXS in planned.values() or model == "qwen2-odd"
        compare_with_llama(mix_files, model, theirs, planned, importance.vectors)
        ours = convert(mix_files.dirs[model], tmp_path / f"{model}.gguf", "gguf", "q4_k_m", options=options,
                       importance=importance).output
        ours_file, theirs_file = li.gguf_structure(ours), li.gguf_structure(theirs)
        assert ours_file.tensors == theirs_file.tensors and li.data_diff(ours_file, theirs_file) == []
    with pytest.raises(QwenError, match=r"tensors need an importance matrix \(--imatrix FILE\).*blk\.0\.attn_q"):
        convert(mix_files.dirs["qwen3-mix"], tmp_path / "refused.gguf", "gguf", "q4_k_m", options=options)
    assert not (tmp_path / "refused.gguf").exists()


def test_quant_options_argparse_defaults() -> None:
    args = convert_parser().parse_args(["src", "-o", "x.gguf"])
    assert quant_options(args) == QuantOptions()
