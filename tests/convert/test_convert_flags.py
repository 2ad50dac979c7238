"""qwen-convert's flags: llama.cpp's type names in any case for --dtype and the type options (one table in
policy.py), and every flag that cannot apply refused in one line before any work, writing nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_helpers import fixture_dir

from qwen_convert.cli import convert_main, convert_parser
from qwen_convert.policy import ModelFacts, check_dtype, parse_type, plan_types
from qwen_runtime.cli_support import USAGE_ERROR
from qwen_runtime.errors import UsageError
from qwen_runtime.formats.tensors import QType

MODEL = str(fixture_dir("qwen3-tiny"))


@pytest.mark.parametrize(("spelling", "name"), [
    ("Q4_K_M", "q4_k_m"), ("q4_k_m", "q4_k_m"), ("f16", "fp16"), ("F16", "fp16"), ("fp16", "fp16"),
    ("FP16", "fp16"), ("F32", "fp32"), ("fp32", "fp32"), ("q8_0", "q8_0"), ("Q8_0", "q8_0"), ("IQ4_XS", "iq4_xs"),
])
def test_dtype_takes_llama_cpp_spellings(spelling: str, name: str) -> None:
    assert check_dtype(spelling) == name
    assert convert_parser().parse_args([MODEL, "--output-dir", "x", "--dtype", f"{spelling},q4_0"]).dtype == \
        [name, "q4_0"]


@pytest.mark.parametrize(("spelling", "qtype"), [
    ("f16", QType.F16), ("F16", QType.F16), ("fp16", QType.F16), ("FP32", QType.F32), ("f32", QType.F32),
    ("q8_0", QType.Q8_0), ("Q4_K", QType.Q4_K), ("iq4_nl", QType.IQ4_NL),
])
def test_type_options_take_the_same_spellings(spelling: str, qtype: QType) -> None:
    assert parse_type(spelling, "--tensor-type") is qtype


def test_a_mix_spelled_in_capitals_plans_as_the_mix() -> None:
    shapes = {"token_embd.weight": (64, 32), "blk.0.attn_v.weight": (32, 32), "blk.0.ffn_down.weight": (32, 64),
              "output.weight": (64, 32)}
    facts = ModelFacts(1, 1)
    assert plan_types(shapes, "Q4_K_M", facts) == plan_types(shapes, "q4_k_m", facts)


@pytest.mark.parametrize(("text", "message"), [
    ("bf16", "does not write BF16"), ("BF16", "does not write BF16"), ("q9_9", "unknown dtype 'q9_9'"),
])
def test_unwritable_and_unknown_dtypes_are_usage_errors(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        check_dtype(text)


def test_a_mix_is_not_a_tensor_type() -> None:
    with pytest.raises(UsageError, match="q4_k_m is a --dtype mix; its base type is Q4_K"):
        parse_type("Q4_K_M", "--tensor-type 'ffn=Q4_K_M'")


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one stderr line of a refused command line, argparse's or the command's (both exit 2)."""
    try:
        code = convert_main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == USAGE_ERROR
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qwen-convert: error: "), lines
    return lines[0]


@pytest.mark.parametrize(("options", "message"), [
    (["--dtype", "fp16", "--imatrix", "missing.gguf"], "--imatrix: --dtype fp16 stores no tensor in a type"),
    (["--dtype", "q8_0", "--imatrix", "missing.gguf"], "--imatrix: --dtype q8_0 stores no tensor in a type"),
    (["--keep-failed"], "--keep-failed keeps an output that failed --verify: it needs --verify"),
    (["--jobs", "2"], "--jobs runs a batch's conversions in parallel"),
    (["--dtype", "q8_0", "--target-bpw", "5"], "--target-bpw needs one of llama.cpp's mixes"),
])
def test_flags_that_cannot_apply_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str],
                                             message: str) -> None:
    """`--dtype fp16 --imatrix` wrote quantize.imatrix.* keys into a file made without it; --keep-failed without
    --verify and --jobs with -o were ignored."""
    out = tmp_path / "out.gguf"
    assert message in refused(capsys, [MODEL, "-o", str(out), *options])
    assert list(tmp_path.iterdir()) == []


def test_imatrix_is_taken_when_a_type_uses_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """q8_0 with a per-tensor type the matrix weights gets past the check (and on to reading the file)."""
    assert convert_main([MODEL, "-o", str(tmp_path / "o.gguf"), "--dtype", "q8_0", "--tensor-type", "attn_v=q4_0",
                         "--imatrix", str(tmp_path / "missing.gguf")]) != 0
    assert "stores no tensor" not in capsys.readouterr().err


def test_name_in_a_batch_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "--name convert one model" in refused(capsys, [MODEL, "--output-dir", str(tmp_path), "--name", "x"])


def test_a_folder_of_model_folders_is_refused_once_with_the_glob_hint(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    models = tmp_path / "models"
    for name in ("a", "b", "c", "d"):
        (models / name).mkdir(parents=True)
        (models / name / "config.json").write_text("{}")
    line = refused(capsys, [str(models), "--output-dir", str(tmp_path / "out"), "--dtype", "q8_0,fp16,fp32",
                            "--format", "npy,gguf"])
    assert f"{models}: a folder of 4 model folders (a, b, c, ...)" in line and f"{models}/* --output-dir" in line
    assert not (tmp_path / "out").exists()
    assert "a folder of 1 model folders" not in refused(capsys, [str(models), "-o", str(tmp_path / "x.gguf")])


@pytest.mark.parametrize(("out", "fmt", "message"), [
    ("x.gguf", "npy", "a .gguf name for an npy output"),
    ("X.GGUF", "npy", "a .gguf name for an npy output"),
    ("folder", "gguf", "a folder; a GGUF output is a file"),
    ("file", "npy", "a file; an npy output is a folder"),
])
def test_an_output_name_that_contradicts_its_format_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               out: str, fmt: str, message: str) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_bytes(b"x")
    before = sorted(tmp_path.iterdir())
    assert message in refused(capsys, [MODEL, "-o", str(tmp_path / out), "--format", fmt, "--force"])
    assert sorted(tmp_path.iterdir()) == before and (tmp_path / "file").read_bytes() == b"x"


def test_a_bad_tensor_type_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(capsys, [MODEL, "-o", str(tmp_path / "o.gguf"), "--dtype", "q8_0", "--tensor-type", "attn=q9"])
    assert "unknown or unwritable type 'q9'" in line
