"""One vocabulary of flags across the tools: ``--version`` everywhere, usage errors in one line with README's exit
code, broken pipes quiet, flags that cannot apply refused or noted, ``-c/--ctx`` cut to the model's context with a
note in qwen-run, qwen-serve and qwen-eval alike, and messages that name flags rather than internal names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from runtime_helpers import fixture_dir

from qwen_convert import cli as convert_cli
from qwen_convert import demo_cli, imatrix_cli
from qwen_runtime import cli as run_cli
from qwen_runtime import eval_cli
from qwen_runtime.cli_support import BROKEN_PIPE, INTERRUPTED, USAGE_ERROR, package_version, run_guarded
from qwen_runtime.errors import EXIT_CODES, UsageError
from qwen_serve import cli as serve_cli

PARSERS = {"qwen-run": run_cli.configure_parser, "qwen-eval": eval_cli.configure_parser,
           "qwen-convert": convert_cli.convert_parser, "qwen-inspect": convert_cli.inspect_parser,
           "qwen-demo": demo_cli.configure_parser, "qwen-serve": serve_cli.configure_parser,
           "qwen-imatrix": imatrix_cli.imatrix_parser}
MAINS = {"qwen-run": run_cli.main, "qwen-eval": eval_cli.main, "qwen-convert": convert_cli.convert_main,
         "qwen-inspect": convert_cli.inspect_main, "qwen-demo": demo_cli.main, "qwen-serve": serve_cli.main,
         "qwen-imatrix": imatrix_cli.main}
README = Path(__file__).parent.parent / "README.md"
MODEL = str(fixture_dir("qwen3-tiny"))


def usage_error(capsys: pytest.CaptureFixture[str], main, argv: list[str]) -> str:
    """The one stderr line of a command line argparse (or the command before any work) refuses."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == USAGE_ERROR
    return one_line(capsys)


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("prog", sorted(MAINS))
def test_every_tool_prints_its_version(prog: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        MAINS[prog](["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"{prog} {package_version()} (qwen-numpy)\n"
    assert re.fullmatch(r"\d+\.\d+.*", package_version())


@pytest.mark.parametrize("prog", sorted(MAINS))
def test_argparse_errors_are_one_line_with_the_usage_code(prog: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = usage_error(capsys, MAINS[prog], ["M", "--no-such-flag"])
    assert line.startswith(f"{prog}: error: ") and line.endswith(f"(see {prog} --help)")


def readme_codes() -> dict[int, str]:
    section = README.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(code): text for code, text in re.findall(r"^\| (\d+) \| (.*) \|$", section, re.MULTILINE)}


def test_readme_exit_code_table_matches_the_code() -> None:
    """README's table lists exactly the codes the tools use: EXIT_CODES, argparse's usage code (the same as
    UsageError's), Ctrl-C's and a broken pipe's; and the row of each code names the errors that use it."""
    table = readme_codes()
    assert set(table) == {0, *EXIT_CODES.values(), USAGE_ERROR, INTERRUPTED, BROKEN_PIPE}
    assert USAGE_ERROR == EXIT_CODES[UsageError] == 2  # argparse's own code: one code for a bad command line
    for error, code in EXIT_CODES.items():
        if error.__name__ in ("FormatError", "UsageError"):
            assert f"`{error.__name__}`" in table[code]
    assert "usage" in table[USAGE_ERROR] and "interrupted" in table[INTERRUPTED] and "head" in table[BROKEN_PIPE]


def test_a_broken_pipe_exits_quietly() -> None:
    """``qwen-inspect --json | head``: the reader closes the pipe; the command stops with 141 and prints nothing
    (it printed 'error: Broken pipe' and exited 1)."""
    read, write = os.pipe()
    os.close(read)  # every write to the pipe now fails as it does once `head` has exited
    code = ("import sys; from qwen_convert.cli import inspect_main; "
            f"sys.exit(inspect_main(['--json', {MODEL!r}]))")
    try:
        done = subprocess.run([sys.executable, "-c", code], stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (BROKEN_PIPE, "")


def test_run_guarded_turns_a_broken_pipe_into_its_code(capsys: pytest.CaptureFixture[str]) -> None:
    def main() -> int:
        raise BrokenPipeError(32, "Broken pipe")

    assert run_guarded("qwen-x", main) == BROKEN_PIPE
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("main", "argv", "flag", "leak"), [
    (run_cli.main, [MODEL, "--max-memory", "3X"], "--max-memory", "parse_memory_size"),
    (serve_cli.main, [MODEL, "--max-memory", "3X"], "--max-memory", "parse_memory_size"),
    (serve_cli.main, [MODEL, "--cache-memory", "lots"], "--cache-memory", "cache_size"),
    (run_cli.main, [MODEL, "-n", "0"], "--max-new-tokens", "max_new_tokens"),
    (run_cli.main, [MODEL, "-t", "x"], "--threads", "positive_int"),
    (serve_cli.main, [MODEL, "--max-batch", "many"], "--max-batch", "positive"),
    (eval_cli.main, [MODEL, "-f", "t", "--stride", "0"], "--stride", "int"),
    (eval_cli.main, [MODEL, "-f", "t", "-c", "1"], "--ctx", "int"),
    (convert_cli.convert_main, [MODEL, "--output-dir", "x", "--jobs", "0"], "--jobs", "int"),
])
def test_bad_values_are_named_by_their_flag(capsys: pytest.CaptureFixture[str], main, argv: list[str], flag: str,
                                            leak: str) -> None:
    line = usage_error(capsys, main, argv)
    assert flag in line and f"invalid {leak} value" not in line and leak + "(" not in line


def test_sampling_errors_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli.main([MODEL, "-p", "x", "--repetition-penalty", "0"]) == USAGE_ERROR
    line = one_line(capsys)
    assert "--repetition-penalty must be" in line and "repetition_penalty" not in line


def test_run_cuts_ctx_to_the_model_with_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    """qwen-run -c above the model's context length runs with the model's, and says so (it was refused while
    qwen-serve clamped silently)."""
    limit = 40960  # qwen3-tiny's max_position_embeddings
    assert run_cli.main([MODEL, "-p", "def", "-n", "2", "-c", str(limit + 1), "--kernels", "numpy"]) == 0
    err = capsys.readouterr().err
    assert f"--ctx {limit + 1} is more than the model's context length of {limit}; using {limit}" in err


def test_serve_cuts_ctx_to_the_model_with_the_same_note(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    app_module = pytest.importorskip("qwen_serve.app")
    uvicorn = pytest.importorskip("uvicorn")
    engine = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=512,
                                                                          context_window=512)))
    passed = {}

    def fake_app(model: str, **kwargs: object) -> SimpleNamespace:
        passed.update(kwargs)
        return SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(engine=engine)))

    monkeypatch.setattr(app_module, "create_app", fake_app)
    monkeypatch.setattr(app_module, "startup_banner", lambda app, url: "banner")
    monkeypatch.setattr(uvicorn, "Server", lambda config: SimpleNamespace(run=lambda sockets: None))
    monkeypatch.setattr(serve_cli, "listen", lambda host, port: SimpleNamespace(getsockname=lambda: (host, port)))
    assert serve_cli.main([MODEL, "--ctx", "100000"]) == 0
    assert passed["max_context"] == 100000  # the engine cuts it; the note says so
    assert "qwen-serve: note: --ctx 100000 is more than the model's context length of 512; using 512" in \
        capsys.readouterr().err


def test_draft_on_the_numpy_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    """qwen-run --draft 4 --kernels numpy drafts too (verification one step at a time): the greedy text of a plain
    decode, and no note that drafting is off."""
    assert run_cli.main([MODEL, "-p", "def", "-n", "8", "--kernels", "numpy"]) == 0
    plain = capsys.readouterr()
    assert run_cli.main([MODEL, "-p", "def", "-n", "8", "--draft", "4", "--kernels", "numpy"]) == 0
    drafted = capsys.readouterr()
    assert drafted.out == plain.out
    assert "--draft" not in drafted.err


def test_eval_refuses_a_stride_beyond_the_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--stride 0 ran with ctx/2; a stride above --ctx would leave tokens unscored: both refused."""
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x\n" * 20)
    assert eval_cli.main([MODEL, "-f", str(text), "-c", "16", "--stride", "32", "--kernels", "numpy"]) == USAGE_ERROR
    assert "--stride 32 is more than the window of 16 tokens" in one_line(capsys)
    assert "--stride" in usage_error(capsys, eval_cli.main, [MODEL, "-f", str(text), "--stride", "0"])


def test_demo_refuses_a_stride_beyond_the_window(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--stride 300 is more than the window --ctx 256" in usage_error(capsys, demo_cli.main, ["--stride", "300"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--meta", "--verify"], "--meta and --verify are different reports"),
    (["--imatrix", "x.gguf"], "--imatrix weights --sensitivity's errors"),
    (["--meta", "--filter", "attn"], "--filter selects tensors"),
    (["--verify", "--json"], "--json: --verify prints a table only"),
])
def test_inspect_refuses_flags_that_cannot_apply(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                 message: str) -> None:
    assert message in usage_error(capsys, convert_cli.inspect_main, [MODEL, *argv])


def test_a_usage_error_found_by_a_command_has_argparses_code(capsys: pytest.CaptureFixture[str]) -> None:
    def main() -> int:
        raise UsageError("--x: bad")

    assert run_guarded("qwen-x", main) == USAGE_ERROR
    assert capsys.readouterr().err == "qwen-x: error: --x: bad\n"
