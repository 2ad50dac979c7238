"""What ``--force`` may replace: only outputs of ours, never a user's folder, never an input of the run.

Each case is a finding of the audit in issue #42 (``-o some_dir/ --force`` emptied the folder, ``-o SRC --force``
deleted the model, ``qwen-imatrix -o MODEL_DIR --force`` replaced the model folder) or its neighbour.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from convert_helpers import fixture, write_qwen2

from qwen_convert import imatrix_cli
from qwen_convert.batch import plan_jobs
from qwen_convert.cli import convert_main
from qwen_convert.imatrix_cli import main as imatrix_main
from qwen_convert.outputs import atomic_output, check_output
from qwen_runtime.errors import OutputError, OutputExistsError
from qwen_runtime.formats import open_model_files

OUTPUT_EXISTS, OTHER = 5, 1  # README's exit codes


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = convert_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its SHA-256, to show nothing changed."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    return write_qwen2(tmp_path / "model")


def test_force_never_empties_a_users_folder(capsys, tmp_path: Path, model: Path) -> None:
    folder = tmp_path / "some_dir"
    (folder / "notes").mkdir(parents=True)
    (folder / "thesis.tex").write_text("years of work")
    (folder / "notes" / "a.txt").write_text("more")
    before = snapshot(folder)
    code, _, err = run(capsys, model, "-o", f"{folder}/", "--dtype", "q8_0", "--force")
    assert code == OUTPUT_EXISTS and "will not replace this folder" in err and "'notes'" in err
    assert len(err.strip().splitlines()) == 1
    assert snapshot(folder) == before


@pytest.mark.parametrize("how", ["same", "symlink", "parent"])
def test_force_never_writes_over_an_input(capsys, tmp_path: Path, model: Path, how: str) -> None:
    before = snapshot(tmp_path)
    if how == "same":
        out = model
    elif how == "symlink":
        out = tmp_path / "link"
        out.symlink_to(model, target_is_directory=True)
        before = snapshot(tmp_path)
    else:
        out = model / ".." / "."
    code, _, err = run(capsys, model, "-o", out, "--dtype", "q8_0", "--force")
    assert code == OUTPUT_EXISTS and "input of this run" in err
    assert snapshot(tmp_path) == before


def test_force_never_writes_over_the_working_directory(capsys, tmp_path: Path, model: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.txt").write_text("keep")
    monkeypatch.chdir(work)
    code, _, err = run(capsys, model, "-o", ".", "--force")
    assert code == OUTPUT_EXISTS and "working, home or root" in err
    assert (work / "mine.txt").read_text() == "keep"


def test_force_replaces_a_file_only_when_it_is_a_gguf(capsys, tmp_path: Path, model: Path) -> None:
    out = tmp_path / "m.gguf"
    out.write_bytes(b"precious, not a model")
    code, _, err = run(capsys, model, "-o", out, "--force")
    assert code == OUTPUT_EXISTS and "not a GGUF file" in err
    assert out.read_bytes() == b"precious, not a model"
    out.unlink()
    assert run(capsys, model, "-o", out, "--dtype", "fp32")[0] == 0
    assert run(capsys, model, "-o", out, "--dtype", "q8_0", "--force")[0] == 0
    assert open_model_files(out).metadata["general.file_type"] == 7  # LLAMA_FTYPE_MOSTLY_Q8_0


def test_force_replaces_an_npy_output_only_while_it_holds_nothing_else(capsys, tmp_path: Path, model: Path) -> None:
    out = tmp_path / "m"
    assert run(capsys, model, "-o", out, "--dtype", "fp32")[0] == 0
    (out / "my-results.csv").write_text("1,2,3")
    code, _, err = run(capsys, model, "-o", out, "--dtype", "q8_0", "--force")
    assert code == OUTPUT_EXISTS and "'my-results.csv'" in err
    assert (out / "my-results.csv").read_text() == "1,2,3"
    (out / "my-results.csv").unlink()
    assert run(capsys, model, "-o", out, "--dtype", "q8_0", "--force")[0] == 0


def test_force_replaces_an_empty_folder(capsys, tmp_path: Path, model: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert run(capsys, model, "-o", out, "--dtype", "fp32", "--force")[0] == 0
    assert open_model_files(out).format == "npy"


def test_an_output_in_a_missing_folder_is_refused_before_any_work(tmp_path: Path, model: Path) -> None:
    with pytest.raises(OutputError, match="does not exist"):
        check_output(tmp_path / "nowhere" / "m.gguf", force=False, inputs=(model,))


def test_the_target_is_checked_again_before_the_rename(tmp_path: Path) -> None:
    target = tmp_path / "late.gguf"
    with pytest.raises(OutputExistsError), atomic_output(target, force=True) as tmp:
        tmp.write_bytes(b"GGUF")
        target.write_text("appeared meanwhile, a user's")
    assert target.read_text() == "appeared meanwhile, a user's"
    assert [p.name for p in tmp_path.iterdir()] == ["late.gguf"]


# --- qwen-imatrix: the output is checked before the matrix is computed ----------------------------------------

@pytest.fixture()
def no_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the matrix was computed before the output was checked")
    monkeypatch.setattr(imatrix_cli, "compute_imatrix", refuse)


def test_imatrix_never_replaces_the_model_it_reads(capsys, tmp_path: Path, model: Path, no_compute: None) -> None:
    text = tmp_path / "calibration.txt"
    text.write_text("def f(x):\n    return x\n" * 20)
    before = snapshot(model)
    code = imatrix_main([str(model), "-f", str(text), "-o", str(model), "--force"])
    err = capsys.readouterr().err
    assert code == OUTPUT_EXISTS and "input of this run" in err
    assert snapshot(model) == before
    code = imatrix_main([str(model), "-f", str(text), "-o", str(text), "--force"])
    assert code == OUTPUT_EXISTS and text.read_text().startswith("def f")


def test_imatrix_checks_its_folder_before_any_work(capsys, tmp_path: Path, no_compute: None) -> None:
    text = tmp_path / "calibration.txt"
    text.write_text("hello " * 100)
    code = imatrix_main([str(fixture("qwen3-tiny")), "-f", str(text), "-o", str(tmp_path / "missing" / "i.gguf")])
    err = capsys.readouterr().err
    assert code == OTHER and "missing" in err and "does not exist" in err and ".tmp-" not in err


# --- batches: collisions and foreign outputs stop the batch before it starts ----------------------------------

@pytest.mark.parametrize("extra", [[], ["--force", "--jobs", "2"]])
def test_batch_outputs_that_collide_are_an_error_before_work(capsys, tmp_path: Path, extra: list[str]) -> None:
    a, b = write_qwen2(tmp_path / "x" / "model"), write_qwen2(tmp_path / "y" / "model", seed=1)
    out_dir = tmp_path / "out"
    code, _, err = run(capsys, a, b, "--out-dir", out_dir, "--format", "gguf", "--dtype", "fp32", *extra)
    assert code == OTHER and "both" in err and str(a) in err and str(b) in err
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_plan_jobs_refuses_two_sources_of_one_name(tmp_path: Path) -> None:
    with pytest.raises(OutputError, match="would be converted to this output"):
        plan_jobs([tmp_path / "a" / "m", tmp_path / "b" / "m"], tmp_path / "out", ["npy"], ["fp16"])


def test_batch_force_refuses_a_foreign_output_before_any_job(capsys, tmp_path: Path) -> None:
    a, b = write_qwen2(tmp_path / "alpha"), write_qwen2(tmp_path / "beta", seed=1)
    out_dir = tmp_path / "out"
    (out_dir / "beta-fp32").mkdir(parents=True)
    (out_dir / "beta-fp32" / "data.bin").write_bytes(os.urandom(64))
    before = snapshot(out_dir)
    code, _, err = run(capsys, a, b, "--out-dir", out_dir, "--format", "npy", "--dtype", "fp32", "--force")
    assert code == OUTPUT_EXISTS and "'data.bin'" in err
    assert snapshot(out_dir) == before and not (out_dir / "alpha-fp32").exists()


def test_batch_never_writes_over_a_source(capsys, tmp_path: Path) -> None:
    src = write_qwen2(tmp_path / "out" / "m-fp32")
    m = write_qwen2(tmp_path / "m")
    before = snapshot(src)
    code, _, err = run(capsys, m, src, "--out-dir", tmp_path / "out", "--format", "npy", "--dtype", "fp32", "--force")
    assert code == OUTPUT_EXISTS and "input of this run" in err
    assert snapshot(src) == before
