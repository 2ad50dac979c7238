"""qwen-demo: the bundled model, output reuse, completions in a fresh process, the whole demo end to end."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
from runtime_helpers import fixture_dir

import qwen_runtime
from qwen_convert import demo
from qwen_convert.demo import (
    CONVERTED,
    REUSED,
    STAMP_FILE,
    MissingAssetError,
    bundled_model_path,
    complete,
    complete_in_fresh_process,
    heldout_text_path,
    prepare_outputs,
)
from qwen_convert.demo_cli import main as demo_main

TEXT = Path(textwrap.__file__)


def bundled() -> Path:
    try:
        return bundled_model_path()
    except MissingAssetError:
        pytest.skip("the bundled model (qwen_runtime/assets/qwen3-stdlib) has not been committed yet")


def test_bundled_model_loads_from_the_package() -> None:
    path = bundled()
    assert path.parts[-3:] == ("qwen_runtime", "assets", "qwen3-stdlib")
    assert (path / "heldout.txt").is_file() and heldout_text_path(path) == path / "heldout.txt"
    model = qwen_runtime.load(path)
    assert model.config.arch == "qwen3"
    [result] = qwen_runtime.generate(model, "def ", max_new_tokens=4)
    assert len(result.token_ids) >= 1


def test_a_missing_text_falls_back_to_the_bundled_model_else_is_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert heldout_text_path(tmp_path) == bundled() / "heldout.txt"

    def no_bundled_model() -> Path:
        raise MissingAssetError("no bundled model")

    monkeypatch.setattr(demo, "bundled_model_path", no_bundled_model)
    with pytest.raises(MissingAssetError, match="--file"):
        heldout_text_path(tmp_path)


def test_outputs_are_reused_only_when_complete_and_from_the_same_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("qwen3-tiny"), src)
    out = tmp_path / "out"
    first = prepare_outputs(src, out)
    assert [(o.format, o.dtype, o.status) for o in first] == [
        (f, d, CONVERTED) for f in ("npy", "gguf") for d in ("fp32", "fp16", "q8_0")]
    assert all(o.path.exists() and o.path.parent == out for o in first)
    assert [o.status for o in prepare_outputs(src, out)] == [REUSED] * 6
    shutil.rmtree(first[2].path)  # an output removed: only it is made again
    assert [o.status for o in prepare_outputs(src, out)] == [REUSED] * 2 + [CONVERTED] + [REUSED] * 3
    config = json.loads((src / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5  # another source under the same name: everything is made again
    (src / "config.json").write_text(json.dumps(config))
    assert [o.status for o in prepare_outputs(src, out)] == [CONVERTED] * 6
    assert json.loads((out / STAMP_FILE).read_text())["source"] == str(src.resolve())


def test_inspect_summary_orders_the_dtypes(tmp_path: Path) -> None:
    outputs = {(o.format, o.dtype): o for o in prepare_outputs(fixture_dir("qwen3-tiny"), tmp_path)}
    for fmt in ("npy", "gguf"):
        fp32, fp16, q8 = (outputs[fmt, d] for d in ("fp32", "fp16", "q8_0"))
        assert fp32.bytes_per_parameter == 4.0 and fp32.rmse == 0.0
        assert 2.0 <= fp16.bytes_per_parameter < 2.1 and 1.0 < q8.bytes_per_parameter < 1.2
        assert fp16.rmse < q8.rmse and q8.min_cosine > 0.999


@pytest.mark.slow
def test_completion_in_a_fresh_process_equals_in_process() -> None:
    path = fixture_dir("qwen3-tiny")
    here = complete(path, "def ", 6)
    fresh = complete_in_fresh_process(path, "def ", 6)
    assert fresh.text == here.text and fresh.new_tokens == here.new_tokens == 6
    assert fresh.peak_rss_kb > 0 and fresh.tokens_per_second > 0


def _demo(out: Path, *extra: str) -> list[str]:
    return ["--model", str(fixture_dir("qwen3-tiny")), "--text", str(TEXT), "--out", str(out),
            "--eval-tokens", "300", "--max-new-tokens", "4", "--ctx", "64", "--stride", "32", *extra]


@pytest.mark.slow
def test_demo_end_to_end_then_reused(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    args = _demo(Path("qwen-demo-out"))
    assert demo_main(args) == 0
    out = capsys.readouterr().out
    assert out.count("converted") == 6 and "1. Outputs" in out and "2. Quality" in out and "3. Greedy" in out
    quality = out.split("2. Quality")[1].split("3. Greedy")[0]
    for label in ("npy fp32", "npy fp16", "npy q8_0", "gguf fp32", "gguf fp16", "gguf q8_0"):
        assert label in quality and out.split("3. Greedy")[1].count(label) == 1
    assert "source" in quality and "peak RSS" in out
    assert (tmp_path / "qwen-demo-out" / "qwen3-tiny-q8_0.gguf").is_file()
    assert demo_main(args) == 0
    again = capsys.readouterr().out
    assert again.count("reused") == 6 and "converted" not in again.split("2. Quality")[0]


@pytest.mark.slow
def test_demo_of_the_bundled_model_with_defaults(tmp_path: Path, monkeypatch, capsys) -> None:
    bundled()
    monkeypatch.chdir(tmp_path)
    assert demo_main(["--eval-tokens", "512", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-stdlib-q8_0.gguf" in out and (tmp_path / "qwen-demo-out").is_dir()


def test_demo_errors_are_one_line(tmp_path: Path, capsys) -> None:
    assert demo_main(_demo(tmp_path / "out", "--text", str(tmp_path / "missing.txt"))) == 2
    err = capsys.readouterr().err
    assert err.startswith("qwen-demo: error:") and "missing.txt" in err and err.count("\n") == 1


def test_calibration_text_leaves_out_modules_in_the_evaluation_text() -> None:
    import argparse

    from qwen_convert.demo import calibration_text

    evaluation = Path(argparse.__file__).read_text(encoding="utf-8")
    assert calibration_text("").startswith(evaluation[:1000])  # argparse is the first calibration module
    calibration = calibration_text(evaluation)
    assert calibration and len(calibration) <= demo.CALIBRATION_BYTES
    assert not {line for line in evaluation.splitlines() if len(line.strip()) > 40} & set(calibration.splitlines())


@pytest.mark.slow
def test_kquant_outputs_without_and_with_an_imatrix_are_reused(tmp_path: Path) -> None:
    from qwen_convert.convert import open_source, plan_model
    from qwen_convert.demo import KQUANT_MIXES, prepare_kquant_outputs
    from qwen_convert.imatrix import load_importance
    from qwen_convert.policy import QuantOptions
    from qwen_runtime.formats.gguf_parse import parse_gguf

    src, out = fixture_dir("qwen3-tiny"), tmp_path / "out"
    prepare_outputs(src, out)
    calibration = " ".join(f"def f{i}(x):\n    return x * {i}" for i in range(100))
    first = prepare_kquant_outputs(src, out, calibration)
    assert [(o.dtype, o.imatrix, o.status) for o in first] == [
        (m, w, CONVERTED) for w in (False, True) for m in KQUANT_MIXES]
    assert first[-1].label == "gguf iq4_xs +imatrix" and first[-1].path.name == "qwen3-tiny-iq4_xs-imatrix.gguf"
    importance, files = load_importance(out / "qwen3-tiny.imatrix.gguf"), open_source(src)
    for o in first:  # the keys only where a tensor was quantized with the vectors (not all of q6_k's here)
        used = o.imatrix and bool(importance.used_by(plan_model(files, o.dtype, QuantOptions(imatrix=True))))
        assert ("quantize.imatrix.file" in parse_gguf(o.path).metadata) == used
    assert sum(o.imatrix for o in first) == 7 and sum("quantize.imatrix.file" in parse_gguf(o.path).metadata
                                                       for o in first) >= 5
    assert [o.status for o in prepare_kquant_outputs(src, out, calibration)] == [REUSED] * 14
    again = prepare_kquant_outputs(src, out, calibration + " ")  # another calibration text: weighted ones remade
    assert [o.status for o in again] == [REUSED] * 7 + [CONVERTED] * 7


@pytest.mark.slow
def test_lowbit_mixes_that_need_the_imatrix_have_only_their_weighted_output(tmp_path: Path) -> None:
    """``qwen-demo --lowbit``: on the bundled model (rows of 256), iq2_xxs cannot be written without the importance
    matrix (the converter refuses, as llama-quantize does), so it has only its weighted GGUF; tq2_0 has both."""
    from qwen_convert.demo import LOWBIT_MIXES, prepare_kquant_outputs

    src, out = bundled(), tmp_path / "out"
    prepare_outputs(src, out)
    calibration = " ".join(f"def f{i}(x):\n    return x * {i}" for i in range(100))
    got = prepare_kquant_outputs(src, out, calibration, mixes=("iq2_xxs", "tq2_0"))
    assert [(o.dtype, o.imatrix, o.status) for o in got] == [
        ("tq2_0", False, CONVERTED), ("iq2_xxs", True, CONVERTED), ("tq2_0", True, CONVERTED)]
    assert not (out / f"{src.name}-iq2_xxs.gguf").exists()
    assert {"iq2_xxs", "tq2_0"} <= set(LOWBIT_MIXES)
