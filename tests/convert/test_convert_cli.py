"""qwen-convert from the command line: batch mode, skipping, --force, bad input, full disks and Ctrl-C."""

from __future__ import annotations

import errno
import importlib
import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import drop_tensor, fixture, read_header, rewrite_header, write_qwen2

from qwen_convert import gguf_writer, npy_writer
from qwen_convert.cli import convert_main
from qwen_runtime.cli_support import INTERRUPTED
from qwen_runtime.formats import open_model_files


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = convert_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    return write_qwen2(tmp_path / "model")


# --- one model ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".gguf", ""])
def test_single_conversion_infers_the_format(capsys, tmp_path: Path, model: Path, suffix: str) -> None:
    out = tmp_path / f"out{suffix}"
    code, stdout, _ = run(capsys, model, "-o", out, "--dtype", "q8_0", "--verify")
    assert code == 0 and "wrote" in stdout
    files = open_model_files(out)
    assert files.format == ("gguf" if suffix else "npy")
    assert leftovers(tmp_path) == []


def test_python_dash_m_runs_the_cli(tmp_path: Path, model: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "qwen_convert", str(model), "-o", str(tmp_path / "m.gguf")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "m.gguf").is_file()


def test_existing_output_is_not_clobbered_without_force(capsys, tmp_path: Path, model: Path) -> None:
    out = tmp_path / "m.gguf"
    out.write_bytes(b"precious")
    code, _, err = run(capsys, model, "-o", out)
    assert code == 5 and "already exists" in err and str(out) in err
    assert out.read_bytes() == b"precious"


def test_force_replaces_an_existing_npy_directory(capsys, tmp_path: Path, model: Path) -> None:
    out = tmp_path / "m"
    assert run(capsys, model, "-o", out, "--dtype", "fp32")[0] == 0
    assert run(capsys, model, "-o", out, "--dtype", "q8_0", "--force")[0] == 0
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "q8_0"
    assert leftovers(tmp_path) == []


# --- bad input: one line naming the file (and tensor), the documented exit code, nothing left behind --------

def _truncate_header(m: Path) -> None:
    (m / "model.safetensors").write_bytes(b"\x10\x00\x00")


def _corrupt_header(m: Path) -> None:
    path = m / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json!!!!"
    path.write_bytes(bytes(data))


def _cut_data(m: Path) -> None:
    path = m / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def _wrong_byte_count(m: Path) -> None:
    header, _ = read_header(m / "model.safetensors")
    header["model.layers.1.mlp.up_proj.weight"]["shape"] = [128, 63]
    rewrite_header(m / "model.safetensors", header)


def _wrong_shape_for_config(m: Path) -> None:
    header, _ = read_header(m / "model.safetensors")
    header["model.layers.0.mlp.up_proj.weight"]["shape"] = [64, 128]  # same bytes, transposed
    rewrite_header(m / "model.safetensors", header)


def _drop_tensor(m: Path) -> None:
    drop_tensor(m / "model.safetensors", "model.layers.1.self_attn.k_proj.weight")


def _unknown_dtype(m: Path) -> None:
    header, _ = read_header(m / "model.safetensors")
    header["model.norm.weight"]["dtype"] = "I16"
    rewrite_header(m / "model.safetensors", header)


def _unknown_architecture(m: Path) -> None:
    config = json.loads((m / "config.json").read_text())
    config["architectures"], config["model_type"] = ["LlamaForCausalLM"], "llama"
    (m / "config.json").write_text(json.dumps(config))


def _config_without_hidden_size(m: Path) -> None:
    config = json.loads((m / "config.json").read_text())
    del config["hidden_size"]
    (m / "config.json").write_text(json.dumps(config))


BAD_INPUTS: dict[str, tuple[Callable[[Path], None], int, str]] = {
    "truncated header": (_truncate_header, 2, "model.safetensors"),
    "corrupt header": (_corrupt_header, 2, "invalid JSON"),
    "offsets outside the file": (_cut_data, 2, "model.layers.1.mlp.down_proj.weight"),
    "dtype/shape byte mismatch": (_wrong_byte_count, 2, "model.layers.1.mlp.up_proj.weight"),
    "shape disagrees with config": (_wrong_shape_for_config, 2, "blk.0.ffn_up.weight"),
    "tensor missing": (_drop_tensor, 2, "blk.1.attn_k.weight"),
    "unsupported dtype": (_unknown_dtype, 2, "model.norm.weight"),
    "unknown architecture": (_unknown_architecture, 3, "LlamaForCausalLM"),
    "config field missing": (_config_without_hidden_size, 4, "hidden_size"),
}


@pytest.mark.parametrize("fmt", ["npy", "gguf"])
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_clear_line(capsys, tmp_path: Path, model: Path, case: str, fmt: str) -> None:
    damage, exit_code, needle = BAD_INPUTS[case]
    damage(model)
    out = tmp_path / ("out.gguf" if fmt == "gguf" else "out")
    code, _, err = run(capsys, model, "-o", out)
    assert code == exit_code, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert needle in err and str(model) in err
    assert not out.exists() and leftovers(tmp_path) == []


def _sharded_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(fixture("qwen2-tiny"), tmp_path / "sharded"))


def test_missing_shard(capsys, tmp_path: Path) -> None:
    src = _sharded_copy(tmp_path)
    (src / "model-00002-of-00002.safetensors").unlink()
    code, _, err = run(capsys, src, "-o", tmp_path / "o.gguf")
    assert code == 2 and "model-00002-of-00002.safetensors" in err and "missing" in err


def test_index_names_a_tensor_no_shard_has(capsys, tmp_path: Path) -> None:
    src = _sharded_copy(tmp_path)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = "model-00001-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run(capsys, src, "-o", tmp_path / "o.gguf")
    assert code == 2 and "model.layers.0.mlp.extra.weight" in err and "not in any shard" in err


def test_gguf_needs_the_tokenizer(capsys, tmp_path: Path, model: Path) -> None:
    (model / "tokenizer.json").unlink()
    code, _, err = run(capsys, model, "-o", tmp_path / "o.gguf")
    assert code == 2 and "tokenizer.json" in err
    assert leftovers(tmp_path) == []


# --- output problems -----------------------------------------------------------------------------------------

def test_unwritable_output_location(capsys, tmp_path: Path, model: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, _, err = run(capsys, model, "-o", blocker / "out.gguf")
    assert code == 1 and str(blocker / "out.gguf") in err and err.count("\n") == 1


@pytest.mark.parametrize(("fmt", "target"), [("gguf", (gguf_writer.StreamingGGUFWriter, "write_tensor_chunks")),
                                             ("npy", (npy_writer, "npy_header"))])
def test_full_disk_names_output_and_tensor(capsys, monkeypatch, tmp_path: Path, model: Path, fmt: str,
                                           target: tuple) -> None:
    calls = {"n": 0}
    original = getattr(*target)

    def fail_on_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args, **kwargs)

    monkeypatch.setattr(*target, fail_on_third)
    out = tmp_path / ("o.gguf" if fmt == "gguf" else "o")
    code, _, err = run(capsys, model, "-o", out, "--format", fmt)
    assert code == 1 and "No space left on device" in err and str(out) in err and "tensor 'blk.0." in err
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("fmt", ["npy", "gguf"])
def test_interrupt_leaves_nothing_and_keeps_the_old_output(capsys, monkeypatch, tmp_path: Path, model: Path,
                                                          fmt: str) -> None:
    out = tmp_path / ("o.gguf" if fmt == "gguf" else "o")
    assert run(capsys, model, "-o", out, "--dtype", "fp32")[0] == 0
    before = open_model_files(out).tensors["blk.0.ffn_up.weight"].to_float32()
    convert_module = importlib.import_module("qwen_convert.convert")

    def interrupted(tensor, qtype, importance=None):
        yield np.zeros((1, 1), np.uint8)
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "stream_rows", interrupted)
    code, _, err = run(capsys, model, "-o", out, "--dtype", "q8_0", "--force")
    assert code == INTERRUPTED and "interrupted" in err
    assert leftovers(tmp_path) == []
    assert np.array_equal(open_model_files(out).tensors["blk.0.ffn_up.weight"].to_float32(), before)


# --- batch mode ----------------------------------------------------------------------------------------------

def test_batch_converts_every_combination_then_skips_then_forces(capsys, tmp_path: Path) -> None:
    a, b = write_qwen2(tmp_path / "alpha"), write_qwen2(tmp_path / "beta", layers=3, seed=1)
    out_dir = tmp_path / "out"
    argv = [a, b, "--out-dir", out_dir, "--format", "npy,gguf", "--dtype", "fp16,q8_0"]
    code, stdout, _ = run(capsys, *argv)
    names = sorted(p.name for p in out_dir.iterdir())
    assert code == 0 and names == sorted(["alpha-fp16", "alpha-q8_0", "alpha-fp16.gguf", "alpha-q8_0.gguf",
                                          "beta-fp16", "beta-q8_0", "beta-fp16.gguf", "beta-q8_0.gguf"])
    assert stdout.count("converted") == 8 and "seconds" in stdout
    code, stdout, _ = run(capsys, *argv)
    assert code == 0 and stdout.count("skipped") == 8
    code, stdout, _ = run(capsys, *argv, "--force", "--jobs", "2")
    assert code == 0 and stdout.count("converted") == 8


def test_batch_keeps_going_past_failures(capsys, tmp_path: Path) -> None:
    good, bad = write_qwen2(tmp_path / "good"), write_qwen2(tmp_path / "bad")
    _unknown_architecture(bad)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "good-fp32.gguf").write_bytes(b"half-written by someone else")
    code, stdout, err = run(capsys, bad, good, "--out-dir", out_dir, "--format", "gguf,npy", "--dtype", "fp32")
    assert code == 1
    assert stdout.count("failed") >= 3 and stdout.count("converted") == 1  # bad x2, corrupt good-fp32.gguf
    assert "LlamaForCausalLM" in stdout and "use --force" in stdout
    assert (out_dir / "good-fp32" / "manifest.json").is_file()
    assert "Traceback" not in err


def test_usage_errors(capsys, tmp_path: Path, model: Path) -> None:
    with pytest.raises(SystemExit):
        convert_main([str(model)])
    with pytest.raises(SystemExit):
        convert_main([str(model), "-o", str(tmp_path / "x"), "--dtype", "q3_k"])
    with pytest.raises(SystemExit):
        convert_main([str(model), str(model), "-o", str(tmp_path / "x")])
    capsys.readouterr()


def test_deepseek_template_warnings_are_explained_not_printed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from qwen_convert.convert import convert

    caplog.set_level(logging.INFO)
    convert(fixture("deepseek-tiny"), tmp_path / "ds.gguf", "gguf", "fp16")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    notes = [r.getMessage() for r in caplog.records if r.name == "qwen_convert.gguf_metadata"]
    assert not warnings, [r.getMessage() for r in warnings]
    assert any("Unknown leading special token" in n and "add_bos_token=True" in n for n in notes)
    assert not logging.getLogger("gguf.vocab").filters  # the filter is only there while SpecialVocab reads
    # without add_bos_token the template's guess decides add_bos, and gguf-py's warning is shown as it is
    src = Path(shutil.copytree(fixture("deepseek-tiny"), tmp_path / "src"))
    config = json.loads((src / "tokenizer_config.json").read_text())
    del config["add_bos_token"]
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    caplog.clear()
    convert(src, tmp_path / "ds2.gguf", "gguf", "fp16")
    assert any(r.name == "gguf.vocab" and r.levelno == logging.WARNING for r in caplog.records)
