"""``qwen-run``: the interactive chat (history trimmed to the context, /help, /reset, /exit, Ctrl-C), prompt
sources (-p, -f, stdin), --max-new-tokens cut to the context, and stats after an interrupt."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import fixture_dir

from qwen_convert.demo import MissingAssetError, bundled_model_path
from qwen_runtime import chat_format, cli, load, stream
from qwen_runtime.errors import EXIT_CODES, ContextOverflowError, KernelsError, exit_code

ROOT = Path(__file__).resolve().parents[2]


def test_history_reset_and_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    model = load(fixture_dir("qwen3-tiny"))
    prompts = []
    real_stream = cli.stream

    def recording_stream(model, ids, **options):
        prompts.append(chat_format(model).tokenizer.decode(ids[0], skip_special=False))
        return real_stream(model, ids, **options)

    monkeypatch.setattr(cli, "stream", recording_stream)
    args = cli.configure_parser().parse_args([str(fixture_dir("qwen3-tiny")), "--chat", "--max-new-tokens", "3",
                                              "--system", "Be brief."])
    out = io.StringIO()
    lines = io.StringIO("first\n\nsecond\n/reset\nthird\n/exit\nlost\n")
    cli.interactive_chat(model, args, cli.SamplingParams(), lines, out)
    assert len(prompts) == 3  # the empty line asks again, /exit stops before "lost"
    assert "first" in prompts[1] and "second" in prompts[1] and prompts[1].count("<|im_start|>assistant") == 2
    assert "first" not in prompts[2] and "third" in prompts[2] and "Be brief." in prompts[2]
    text = out.getvalue()
    assert cli.CHAT_HELP in text and "(conversation cleared)" in text and text.count("> ") == 6


@pytest.mark.slow
def test_end_of_input_quits() -> None:
    proc = subprocess.run([sys.executable, "-m", "qwen_runtime.cli", str(fixture_dir("qwen3-tiny")), "--chat",
                           "--max-new-tokens", "2"], input="hello\n", capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") == 2


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs POSIX signals")
def test_ctrl_c_stops_the_reply_not_the_program() -> None:
    # SIGINT's default action in the child, as a terminal gives it: a test run started in the background by a
    # shell without job control inherits it ignored, and Python then keeps it ignored (no KeyboardInterrupt)
    proc = subprocess.Popen([sys.executable, "-u", "-m", "qwen_runtime.cli", str(fixture_dir("qwen35-tiny")), "--chat",
                             "--max-new-tokens", "100000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # the tiny model's greedy reply to this ends after 1,264 tokens (~0.65 s on 2 cores): interrupt it as soon
        # as it is being written
        proc.stdin.write(b"Tell me everything, at length\n")
        proc.stdin.flush()
        seen, deadline = b"", time.monotonic() + 60
        while seen.count(b"> ") < 1 or len(seen.split(b"> ", 1)[1]) < 20:  # the reply is being written
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk and time.monotonic() < deadline, (seen, proc.stderr.read() if not chunk else b"")
            seen += chunk
        proc.send_signal(signal.SIGINT)
        proc.stdin.write(b"/exit\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    assert b"[stopped]" in seen + out and (seen + out).count(b"> ") == 2


def recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], int]]:
    """Every generation the CLI starts: its prompt ids and its max_new_tokens."""
    calls: list[tuple[list[int], int]] = []
    real_stream = cli.stream

    def recording_stream(model, ids, **options):
        calls.append((list(ids[0]), options["max_new_tokens"]))
        return real_stream(model, ids, **options)

    monkeypatch.setattr(cli, "stream", recording_stream)
    return calls


def test_ten_turns_through_the_demo_model_trim_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        path = bundled_model_path()
    except MissingAssetError:
        pytest.skip("the bundled model is not committed")
    model, ctx, new = load(path), 96, 24
    calls = recording(monkeypatch)
    args = cli.configure_parser().parse_args([str(path), "--chat", "-c", str(ctx), "-n", str(new),
                                              "--system", "You write Python."])
    turns = [f"def function_{i}(" for i in range(10)]
    out, err = io.StringIO(), io.StringIO()
    cli.interactive_chat(model, args, cli.SamplingParams(), io.StringIO("\n".join(turns) + "\n"), out, err)
    decode = chat_format(model).tokenizer.decode
    prompts = [decode(ids, skip_special=False) for ids, _ in calls]
    assert len(calls) == 10 and out.getvalue().count("> ") == 11  # ten replies, then end of input
    for i, ((ids, max_new), prompt) in enumerate(zip(calls, prompts, strict=True)):
        assert 1 <= max_new <= new and len(ids) + max_new <= ctx  # the reply always fits the context
        assert "You write Python." in prompt and turns[i] in prompt  # system message and this turn are kept
    assert turns[0] not in prompts[-1]  # the oldest turns went first ...
    kept = [t for t in turns if t in prompts[-1]]
    assert kept == turns[len(turns) - len(kept):] and len(kept) >= 2  # ... the newest stayed, in order
    assert "dropped the oldest" in err.getvalue()


def test_help_and_unknown_commands_are_not_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = recording(monkeypatch)
    args = cli.configure_parser().parse_args([str(fixture_dir("qwen3-tiny")), "--chat", "-n", "2"])
    out = io.StringIO()
    cli.interactive_chat(load(fixture_dir("qwen3-tiny")), args, cli.SamplingParams(),
                         io.StringIO("/help\n/bogus\nhello\n/exit\n"), out, io.StringIO())
    assert len(calls) == 1
    assert out.getvalue().count(cli.CHAT_HELP) == 2 and "unknown command /bogus" in out.getvalue()


def test_a_message_too_long_for_the_context_is_refused_and_the_chat_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = recording(monkeypatch)
    args = cli.configure_parser().parse_args([str(fixture_dir("qwen3-tiny")), "--chat", "-n", "2", "-c", "40"])
    err = io.StringIO()
    cli.interactive_chat(load(fixture_dir("qwen3-tiny")), args, cli.SamplingParams(),
                         io.StringIO("word " * 50 + "\nhi\n"), io.StringIO(), err)
    assert len(calls) == 1 and "no room for a reply" in err.getvalue() and "not sent" in err.getvalue()


def test_one_shot_cuts_max_new_tokens_to_the_context_with_a_note(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    calls = recording(monkeypatch)
    assert cli.main([str(fixture_dir("qwen3-tiny")), "-p", "one two three", "-n", "1000", "-c", "20"]) == 0
    [(ids, max_new)] = calls
    assert max_new == 20 - len(ids)
    err = capsys.readouterr().err
    assert f"--max-new-tokens cut from 1000 to {max_new}" in err and "context of 20" in err


def test_a_prompt_longer_than_the_context_exits_8(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main([str(fixture_dir("qwen3-tiny")), "-p", "word " * 30, "-c", "10"])
    assert code == EXIT_CODES[ContextOverflowError]
    assert "no room for a reply" in capsys.readouterr().err


def test_prompt_file_and_stdin_give_the_prompt(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    model = str(fixture_dir("qwen3-tiny"))
    assert cli.main([model, "-p", "def f(x):", "-n", "6"]) == 0
    expected = capsys.readouterr().out
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f(x):", encoding="utf-8")
    assert cli.main([model, "-f", str(prompt), "-n", "6"]) == 0
    assert capsys.readouterr().out == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):"))
    assert cli.main([model, "--file", "-", "-n", "6"]) == 0
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("option", [["--system", "Be brief."], ["--no-think"]])
def test_chat_options_without_chat_are_a_usage_error(capsys: pytest.CaptureFixture[str], option: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([str(fixture_dir("qwen3-tiny")), "-p", "x", *option])
    assert exc.value.code == 2 and f"{option[0]} needs --chat" in capsys.readouterr().err


def test_stats_survive_an_interrupt_in_the_decode_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    model = load(fixture_dir("qwen3-tiny"))
    gen = stream(model, [[1, 2, 3]], max_new_tokens=50)
    real_forward, passes = model.forward, []

    def interrupted_forward(*a, **k):
        passes.append(1)
        if len(passes) > 6:  # one prefill pass, five decode passes, then Ctrl-C
            raise KeyboardInterrupt
        return real_forward(*a, **k)

    monkeypatch.setattr(model, "forward", interrupted_forward)
    with pytest.raises(KeyboardInterrupt):
        for _ in gen:
            pass
    s = gen.stats
    assert s.decoded_tokens == 5 and s.decode_seconds > 0 and s.decode_tokens_per_second > 0
    assert s.prefill_seconds > 0 and np.isfinite(s.decode_tokens_per_second)


def test_stats_survive_a_stop_between_steps() -> None:
    gen = stream(load(fixture_dir("qwen3-tiny")), [[1, 2, 3]], max_new_tokens=50)
    for step, _ in enumerate(gen):
        if step == 3:  # the caller is interrupted while it writes the fourth token
            break
    gen.close()
    assert gen.stats.decoded_tokens == 3 and gen.stats.decode_seconds > 0 and gen.stats.prefill_seconds > 0


def test_activations_q8_is_said_in_the_stats_and_needs_compiled_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("numba")
    model = str(fixture_dir("qwen3-tiny"))
    assert cli.main([model, "-p", "def f(x):", "-n", "3", "--activations", "q8", "--kernels", "numba", "--stats"]) == 0
    err = capsys.readouterr().err
    assert "kernels: numba, activations q8" in err and "\ndecode step: compiled\n" in err
    code = cli.main([model, "-p", "x", "-n", "3", "--activations", "q8", "--kernels", "numpy"])
    assert code == exit_code(KernelsError("x"))
    assert "activations='q8' needs the compiled kernels" in capsys.readouterr().err
