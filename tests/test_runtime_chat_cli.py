"""``qwen-run MODEL --chat`` without ``-p``: an interactive multi-turn chat (history, /reset, /exit, Ctrl-C)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runtime_helpers import fixture_dir

from qwen_runtime import chat_format, cli, load

ROOT = Path(__file__).resolve().parents[1]


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


def test_end_of_input_quits() -> None:
    proc = subprocess.run([sys.executable, "-m", "qwen_runtime.cli", str(fixture_dir("qwen3-tiny")), "--chat",
                           "--max-new-tokens", "2"], input="hello\n", capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") == 2


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs POSIX signals")
def test_ctrl_c_stops_the_reply_not_the_program() -> None:
    proc = subprocess.Popen([sys.executable, "-u", "-m", "qwen_runtime.cli", str(fixture_dir("qwen35-tiny")), "--chat",
                             "--max-new-tokens", "100000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        proc.stdin.write(b"Tell me everything\n")
        proc.stdin.flush()
        seen, deadline = b"", time.monotonic() + 60
        while seen.count(b"> ") < 1 or len(seen.split(b"> ", 1)[1]) < 20:  # the reply is being written
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk and time.monotonic() < deadline, (seen, proc.stderr.read() if not chunk else b"")
            seen += chunk
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        proc.stdin.write(b"/exit\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    assert b"[stopped]" in seen + out and (seen + out).count(b"> ") == 2
