"""CLIs on broken inputs: one line on stderr and the documented exit code; ``qwen-inspect --verify``; every
CLI's help gives every default, the tools share one naming scheme, and a missing extra is one line."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_helpers import copy_fixture
from runtime_helpers import Converted, fixture_dir

from qwen_convert import cli as convert_cli
from qwen_convert import demo_cli, imatrix_cli
from qwen_convert.cli import convert_main, inspect_main
from qwen_runtime import cli as run_cli
from qwen_runtime import eval_cli
from qwen_runtime.backend.compile_events import describe, listen
from qwen_runtime.cli import main as run_main
from qwen_runtime.cli_support import COMPILING, HelpFormatter, run_guarded
from qwen_runtime.errors import (
    EXIT_CODES,
    ConfigError,
    FormatError,
    MissingExtraError,
    UnsupportedArchitectureError,
    exit_code,
)
from qwen_serve import cli as serve_cli

PARSERS = {"qwen-run": run_cli.configure_parser, "qwen-eval": eval_cli.configure_parser,
           "qwen-convert": convert_cli.convert_parser, "qwen-inspect": convert_cli.inspect_parser,
           "qwen-demo": demo_cli.configure_parser, "qwen-serve": serve_cli.configure_parser,
           "qwen-imatrix": imatrix_cli.imatrix_parser}
# The shared short flags and the one long name each stands for in every tool that has it.
SHARED = {"-o": "--output", "-n": "--max-new-tokens", "-c": "--ctx", "-f": "--file"}


@pytest.fixture(scope="module")
def outputs(converted: Converted) -> dict[str, Path]:
    return {fmt: converted("qwen3-tiny", fmt, "q8_0") for fmt in ("npy", "gguf")}


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


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_help_gives_every_default(prog: str) -> None:
    parser = PARSERS[prog]()
    assert parser.prog == prog and issubclass(parser.formatter_class, HelpFormatter)
    formatter = parser._get_formatter()
    for action in options(parser):
        text = formatter._expand_help(action) if action.help else ""
        assert text, f"{prog} {action.option_strings[0]} has no help"
        if action.nargs != 0:  # an option with a value: its default, or that it has none
            assert "default" in text, f"{prog} {action.option_strings[0]}: {text!r}"
    assert "%(default)" not in parser.format_help()


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_one_naming_scheme(prog: str) -> None:
    parser = PARSERS[prog]()
    positionals = [a for a in parser._actions if not a.option_strings]
    assert all(a.metavar == "MODEL" for a in positionals)  # one positional name (qwen-demo: --model MODEL)
    for action in options(parser):
        for short, long in SHARED.items():
            if short in action.option_strings:
                assert long in action.option_strings, f"{prog}: {short} is not {long}"
            elif long in action.option_strings:
                pytest.fail(f"{prog}: {long} without {short}")


@pytest.mark.parametrize(("prog", "argv", "dest"), [
    ("qwen-demo", ["--out", "X"], "out"), ("qwen-demo", ["-o", "X"], "out"), ("qwen-demo", ["--output", "X"], "out"),
    ("qwen-demo", ["--text", "X"], "text"), ("qwen-demo", ["-f", "X"], "text"),
    ("qwen-convert", ["M", "--out-dir", "X"], "out_dir"), ("qwen-convert", ["M", "--output-dir", "X"], "out_dir"),
    ("qwen-eval", ["M", "-f", "t", "--max-tokens", "7"], "max_tokens"),
    ("qwen-eval", ["M", "-f", "t", "--eval-tokens", "7"], "max_tokens"),
    ("qwen-serve", ["M", "--max-context", "7"], "max_context"), ("qwen-serve", ["M", "-c", "7"], "max_context"),
    ("qwen-run", ["M", "--ctx", "7"], "ctx"),
])
def test_old_spellings_stay_as_aliases(prog: str, argv: list[str], dest: str) -> None:
    value = getattr(PARSERS[prog]().parse_args(argv), dest)
    assert str(value) in ("X", "7")


def test_missing_extra_exit_code_is_in_the_readme() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = exit_code(MissingExtraError("x"))
    assert re.search(rf"^\| {code} \| .*extra", readme, re.MULTILINE)


def without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Simulate uninstalled packages: importing them fails as if they were missing."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [m for m in sys.modules if m in ("qwen_serve.app", "qwen_serve.ray_app")]:
        monkeypatch.delitem(sys.modules, name)


def test_serve_help_without_the_serve_extra(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    without(monkeypatch, "starlette", "uvicorn")
    with pytest.raises(SystemExit) as exc:
        serve_cli.main(["--help"])
    assert exc.value.code == 0 and "--max-body" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "missing", "extra"), [
    ([], ("starlette", "uvicorn"), "serve"),
    (["--ray"], ("ray",), "ray"),
])
def test_serve_without_an_extra_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                            argv: list[str], missing: tuple[str, ...], extra: str) -> None:
    without(monkeypatch, *missing)
    assert serve_cli.main([str(fixture_dir("qwen3-tiny")), *argv]) == exit_code(MissingExtraError("x"))
    line = one_error_line(capsys, "qwen-serve")
    assert f"the {extra} extra" in line and f"qwen-numpy[{extra}]" in line


def test_batch_tools_without_ray_are_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    without(monkeypatch, "ray")
    model = str(fixture_dir("qwen3-tiny"))
    assert convert_main([model, "--output-dir", str(tmp_path), "--executor", "ray"]) == 1
    assert "ray extra" in one_error_line(capsys, "qwen-convert")
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x\n" * 20)
    assert eval_cli.main([model, "-f", str(text), "-c", "16", "--executor", "ray"]) == 1
    assert "ray extra" in one_error_line(capsys, "qwen-eval")


def test_eval_passes_activations_to_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``qwen-eval --activations q8`` loads its models (and the reference) with 8-bit activations."""
    seen: list[str] = []

    def fake_load(path: str, **kwargs: object) -> None:
        seen.append(str(kwargs["activations"]))
        raise ConfigError("stop here")

    monkeypatch.setattr(eval_cli, "load", fake_load)
    text = tmp_path / "t.txt"
    text.write_text("one two three")
    assert eval_cli.main([str(fixture_dir("qwen3-tiny")), "-f", str(text), "--activations", "q8"]) == \
        EXIT_CODES[ConfigError]
    assert seen == ["q8"]


def test_serve_takes_activations_and_turns(converted: Converted, capsys: pytest.CaptureFixture[str]) -> None:
    """``qwen-serve --activations q8 --cache-turns``: the app's model multiplies 8-bit activations and its prefix
    cache keeps turns (the banner says both); --cache-turns without a prefix cache is refused."""
    app_module = pytest.importorskip("qwen_serve.app")
    args = serve_cli.configure_parser().parse_args(["M", "--activations", "q8", "--cache-turns"])
    assert args.activations == "q8" and args.cache_turns
    app = app_module.create_app(converted("qwen3-tiny", "gguf", "q8_0"), kernels="numba",
                                activations=args.activations, cache_turns=args.cache_turns)
    banner = app_module.startup_banner(app, "http://x")
    assert app.state.server.engine.model.workspace.activations == "q8"
    assert "activations q8" in banner and "with turns" in banner
    with pytest.raises(SystemExit) as exc:
        serve_cli.main(["M", "--cache-turns", "--cache-memory", "0"])
    assert exc.value.code == 2 and "--cache-turns needs the prefix cache" in capsys.readouterr().err


def test_a_command_says_once_that_numba_compiles(capsys: pytest.CaptureFixture[str]) -> None:
    """A first run on a machine waits for numba to compile its kernels: one line on stderr says so, once per run,
    and a compile after the command returned says nothing (functions made here are never in numba's cache, so
    they compile; loads from the cache send no compile event)."""
    import numba

    listen()  # what loading a model with the compiled kernels does first

    def fresh(k: int):  # -> a new compiled function
        def add(x: int) -> int:
            return x + k

        return numba.njit(add)

    def main() -> int:
        return fresh(1)(1) + fresh(2)(1) - 5

    assert run_guarded("qwen-x", main) == 0
    assert capsys.readouterr().err == f"qwen-x: {COMPILING.format(what='kernels')}\n"
    assert fresh(3)(1) == 4
    assert capsys.readouterr().err == ""


def test_the_compile_note_names_each_group_of_kernels_once(capsys: pytest.CaptureFixture[str]) -> None:
    """A wait of several groups (--activations q8 compiles the Q4_0..Q5_1 kernels, then the 8-bit-activation
    ones: 66 s in the audit, with one unexplained line) says what compiles as each group starts, once per group;
    numba's own helpers add no line."""
    import numba

    listen()

    def compiled(module: str, k: int):  # -> a new compiled function of ``module`` (numba imports a real one)
        def add(x: int) -> int:
            return x + k

        add.__module__ = module
        return numba.njit(add)

    def main() -> int:
        legacy, int8 = "qwen_runtime.backend.kernels.legacy_probe", "qwen_runtime.backend.kernels.int8_probe"
        total = compiled(legacy, 1)(0) + compiled(legacy, 2)(0) + compiled(int8, 3)(0)
        total += compiled("numba.np.probe", 4)(0)
        return total - 10

    assert run_guarded("qwen-run", main) == 0
    assert capsys.readouterr().err.splitlines() == [
        "qwen-run: numba is compiling the Q4_0/Q4_1/Q5_0/Q5_1 kernels (once per machine and version, up to a few "
        "minutes; later runs load them from its cache)",
        f"qwen-run: {COMPILING.format(what='the 8-bit-activation kernels')}"]
    assert [describe(m) for m in ("qwen_runtime.backend.kernels.kquants", "qwen_runtime.models.step_jit",
                                  "qwen_convert.quant_search", "elsewhere")] == [
        "the K-quant (Q2_K..Q6_K) kernels", "the compiled decode step", "the quantizers' rounding searches", "kernels"]


COMPILING_SCRIPT = """
import sys
from qwen_runtime.cli_support import run_guarded
from qwen_runtime.backend.compile_events import listen
listen()
import cached
sys.exit(run_guarded("qwen-x", lambda: cached.add(1) - 2))
"""


def test_a_cached_compile_says_so_once_per_machine(tmp_path: Path) -> None:
    """Two commands in a fresh NUMBA_CACHE_DIR: the first compiles and says so, the second loads the function
    from numba's cache and says nothing (test_kernels_compile_once_per_machine does this with a model)."""
    (tmp_path / "cached.py").write_text("import numba\n\n\n@numba.njit(cache=True)\ndef add(x):\n    return x + 1\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", COMPILING_SCRIPT], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=120) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    assert runs[0].stderr == f"qwen-x: {COMPILING.format(what='kernels')}\n"
    assert runs[1].stderr == ""


@pytest.mark.slow
def test_kernels_compile_once_per_machine() -> None:
    """A model's kernels are all cached: in the machine's NUMBA_CACHE_DIR (the one scripts/warm_kernels.py and
    every test fill), a first run either loads them or compiles them and names them, and a second run loads every
    one and says nothing.  (In an empty cache the first run compiles for about a minute on 2 cores: the note's
    wording and the once-per-machine mechanism are held by the tests above.)"""
    cmd = [sys.executable, "-m", "qwen_runtime.cli", str(fixture_dir("qwen2-tiny")), "-p", "ab", "-n", "2",
           "--kernels", "numba"]
    runs = [subprocess.run(cmd, capture_output=True, text=True, timeout=900) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    assert "numba" not in runs[0].stderr or \
        "qwen-run: numba is compiling the F32/F16 kernels (once per machine" in runs[0].stderr
    assert "numba" not in runs[1].stderr
