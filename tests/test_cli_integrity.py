"""CLIs on broken inputs: one line on stderr and the documented exit code; ``qwen-inspect --verify``."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from hostile_helpers import converted, copy_fixture

from qwen_convert.cli import convert_main, inspect_main
from qwen_runtime.cli import main as run_main
from qwen_runtime.errors import EXIT_CODES, ConfigError, FormatError, UnsupportedArchitectureError


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    return {fmt: converted("qwen3-tiny", root, fmt, "q8_0") for fmt in ("npy", "gguf")}


def one_error_line(capsys: pytest.CaptureFixture[str], prog: str) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), lines
    return lines[0]


@pytest.mark.parametrize("fmt", ["npy", "gguf"])
def test_inspect_verify_accepts_a_clean_output(outputs: dict[str, Path], fmt: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_main([str(outputs[fmt]), "--verify"]) == 0
    assert "OK (" in capsys.readouterr().out


def test_inspect_verify_catches_a_changed_npy_file(outputs: dict[str, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    model = Path(shutil.copytree(outputs["npy"], tmp_path / "m"))
    manifest = json.loads((model / "manifest.json").read_text())
    name, entry = next(iter(manifest["tensors"].items()))
    path = model / entry["file"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert inspect_main([str(model), "--verify"]) == EXIT_CODES[FormatError]
    line = one_error_line(capsys, "qwen-inspect")
    assert repr(name) in line and "checksum" in line


def test_inspect_verify_catches_a_broken_gguf(outputs: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(outputs["gguf"].read_bytes()[:-40])
    assert inspect_main([str(broken), "--verify"]) == EXIT_CODES[FormatError]
    assert "truncated" in one_error_line(capsys, "qwen-inspect")


def test_convert_verify_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "v.gguf"
    assert convert_main([str(copy_fixture("qwen3-tiny", tmp_path)), "-o", str(out), "--dtype", "q8_0",
                         "--verify"]) == 0
    assert inspect_main([str(out), "--verify"]) == 0


@pytest.mark.parametrize(("edit", "error"), [
    (lambda c: c.update(hidden_size="big"), ConfigError),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), UnsupportedArchitectureError),
])
def test_run_on_a_bad_config(tmp_path: Path, edit, error: type, capsys: pytest.CaptureFixture[str]) -> None:
    model = copy_fixture("qwen3-tiny", tmp_path)
    config = json.loads((model / "config.json").read_text())
    edit(config)
    (model / "config.json").write_text(json.dumps(config))
    assert run_main([str(model), "-p", "hi"]) == EXIT_CODES[error]
    assert "config.json" in one_error_line(capsys, "qwen-run")


def test_run_on_a_hostile_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hostile = tmp_path / "hostile.gguf"
    hostile.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1 << 60).to_bytes(8, "little") + bytes(16))
    assert run_main([str(hostile), "-p", "hi"]) == EXIT_CODES[FormatError]
    assert "tensor count" in one_error_line(capsys, "qwen-run")


def test_readme_documents_every_exit_code() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", readme, re.MULTILINE)}
    assert set(EXIT_CODES.values()) <= documented
