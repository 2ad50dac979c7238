"""qwen-serve against hostile or careless clients and operators: what /health and /metrics show without the key,
slow clients, malformed bodies, context errors with the right numbers, and the --port and --host checks."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import fixture_dir
from serve_helpers import RunningServer, free_port, http, running_server

from qwen_serve.cli import configure_parser, exposure_warning

ROOT = Path(__file__).resolve().parents[2]
KEY = {"Authorization": "Bearer sesame"}


@pytest.fixture(scope="module")
def guarded() -> RunningServer:
    """A server with an API key and a read timeout short enough for the slow-client tests."""
    with running_server(fixture_dir("qwen3-tiny"), api_key="sesame", max_context=64, read_timeout=1.0) as srv:
        yield srv


def error_of(status: int, body: Any) -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}, (status, body)
    return body["error"]


# --- what needs the key -----------------------------------------------------------------------------------


def test_health_without_the_key_says_only_ok(guarded: RunningServer) -> None:
    status, _, reply = http("GET", f"{guarded.url}/health")
    assert (status, reply) == (200, {"status": "ok"})  # no last_error, cache, model or kernels for strangers
    status, _, reply = http("GET", f"{guarded.url}/health", headers={"Authorization": "Bearer wrong"})
    assert (status, reply) == (200, {"status": "ok"})
    status, _, reply = http("GET", f"{guarded.url}/health", headers=KEY)
    assert status == 200 and reply["status"] == "ok" and "last_error" in reply and reply["model"] == "qwen3-tiny"


def test_metrics_need_the_key_when_one_is_set(guarded: RunningServer) -> None:
    status, _, reply = http("GET", f"{guarded.url}/metrics")
    assert status == 401 and error_of(status, reply)["code"] == "invalid_api_key"
    status, _, text = http("GET", f"{guarded.url}/metrics", headers=KEY)
    assert status == 200 and b"qwen_serve_requests_total" in text


def test_a_warning_when_listening_beyond_loopback_without_a_key() -> None:
    assert "warning: listening on 0.0.0.0, beyond this machine, without an API key" in exposure_warning("0.0.0.0",
                                                                                                        None)
    assert exposure_warning("::", None) is not None
    assert exposure_warning("0.0.0.0", "sesame") is None
    for loopback in ("127.0.0.1", "localhost", "::1"):
        assert exposure_warning(loopback, None) is None


def test_the_cli_prints_the_warning_before_anything_else(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "QWEN_API_KEY"}
    proc = subprocess.run([sys.executable, "-m", "qwen_serve", str(tmp_path / "missing"), "--host", "0.0.0.0",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**env, "PYTHONPATH": str(ROOT)})
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 2, proc.stderr
    assert lines[0].startswith("qwen-serve: warning: listening on 0.0.0.0, beyond this machine, without an API key")


# --- slow clients -----------------------------------------------------------------------------------------


def read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (seconds)."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def test_a_body_that_trickles_in_gets_408_and_the_connection_closes(guarded: RunningServer) -> None:
    conns = []
    for _ in range(8):
        sock = socket.create_connection(("127.0.0.1", guarded.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        conns.append(sock)
    for sock in conns:
        data, seconds = read_until_closed(sock, 5)
        sock.close()
        assert data.startswith(b"HTTP/1.1 408 ") and b'"code":"request_timeout"' in data, data
        assert seconds < 3


def test_headers_that_trickle_in_close_the_connection(guarded: RunningServer) -> None:
    conns = []
    for _ in range(8):
        sock = socket.create_connection(("127.0.0.1", guarded.port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        conns.append(sock)
    for sock in conns:
        data, seconds = read_until_closed(sock, 5)
        sock.close()
        assert data == b"" and seconds < 3
    silent = socket.create_connection(("127.0.0.1", guarded.port))  # nothing sent at all
    assert read_until_closed(silent, 5)[0] == b""
    silent.close()
    assert http("GET", f"{guarded.url}/health")[0] == 200  # others are served as before


def test_a_request_slower_than_the_timeout_to_answer_is_not_cut(guarded: RunningServer) -> None:
    """The timeouts bound reading a request, not answering it: a keep-alive connection that sent a request
    whose answer takes longer than the timeout gets it."""
    original = guarded.engine.status

    def slow_status() -> dict:
        time.sleep(1.5)
        return original()

    guarded.engine.status = slow_status
    try:
        assert http("GET", f"{guarded.url}/health", headers=KEY)[0] == 200
    finally:
        del guarded.engine.status


# --- malformed bodies -------------------------------------------------------------------------------------


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logged() -> list[logging.LogRecord]:
    """Records of the server's and uvicorn's loggers (uvicorn's do not reach the root logger)."""
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("qwen_serve", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.records
    for logger in loggers:
        logger.removeHandler(handler)


MALFORMED = [  # for every route
    b'{"prompt": "\\ud800", "messages": [{"role": "user", "content": "\\ud800"}], "tokens": [1], "max_tokens": 1}',
    b'{"prompt": "x", "messages": [{"role": "user", "content": "a\\udfffb"}], "tokens": [1]}',
    b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "tokens": [1], "\\udc00": 1}',
    b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "tokens": [1], "model": "\\ud83d"}',
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}",
    b'{"prompt": ' + b"[" * 700 + b"]" * 700 + b"}",  # parsed, then refused by the depth check
    b"{" + b'"a":{' * 5000 + b"}" * 5001,
    b'{"prompt": "caf\xe9"}',
    b'\xef\xbb\xbf{"prompt": "x"}',
    b'{"prompt": "x"',
    b"",
]
WRONG_TYPES = {
    "/v1/chat/completions": [
        b'{"messages": "hi"}',
        b'{"messages": [{"role": "user", "content": 5}]}',
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        b'{"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}',
        b'{"messages": [{"role": "user", "content": "x"}], "response_format": "json"}',
        b'{"messages": [{"role": "user", "content": "x"}], "stop": {"a": 1}}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}',
    ],
    "/v1/completions": [
        b'{"prompt": [1.5, 2]}',
        b'{"prompt": {"a": 1}}',
        b'{"prompt": [[1], {"a": 1}]}',
        b'{"prompt": "x", "seed": 1e400}',
        b'{"prompt": "x", "n": "2"}',
    ],
    "/tokenize": [b'{"prompt": 5}', b'{"messages": "hi"}', b'{"messages": [{"role": 1, "content": "x"}]}'],
    "/detokenize": [b'{"tokens": "12"}', b'{"tokens": [1e3]}', b'{"tokens": [-1]}', b'{"tokens": [[1]]}'],
}


@pytest.mark.parametrize("route", list(WRONG_TYPES))
def test_every_malformed_body_is_a_400_never_a_500(guarded: RunningServer, logged: list, route: str) -> None:
    for body in MALFORMED + WRONG_TYPES[route]:
        status, _, reply = http("POST", f"{guarded.url}{route}", body, {**KEY, "Content-Type": "application/json"})
        assert status == 400 and error_of(status, reply)["type"] == "invalid_request_error", (body[:60], reply)
    assert not [r for r in logged if r.levelno >= logging.ERROR]


def test_a_lone_surrogate_and_deep_nesting_say_what_is_wrong(guarded: RunningServer) -> None:
    status, _, reply = http("POST", f"{guarded.url}/v1/completions", MALFORMED[0], KEY)
    assert error_of(status, reply)["message"] == ("the request body is not valid JSON: a string has a lone "
                                                  "surrogate (\\ud800)")
    for deep in (MALFORMED[4], MALFORMED[6]):  # 100,000 levels (the parser gives up), 700 (parsed)
        status, _, reply = http("POST", f"{guarded.url}/v1/completions", deep, KEY)
        assert error_of(status, reply)["message"] == "the request body is nested more than 640 levels deep"


def test_a_server_error_is_logged_once(guarded: RunningServer, logged: list) -> None:
    def broken() -> dict:
        raise RuntimeError("boom")

    guarded.engine.status = broken
    try:
        status, _, reply = http("GET", f"{guarded.url}/health", headers=KEY)
    finally:
        del guarded.engine.status
    assert status == 500 and error_of(status, reply)["code"] == "internal_error"
    errors = [r for r in logged if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].name == "qwen_serve", [(r.name, r.getMessage()) for r in errors]


# --- context errors ---------------------------------------------------------------------------------------


def tokens(server: RunningServer, prompt: str) -> int:
    return len(http("POST", f"{server.url}/tokenize", {"prompt": prompt}, KEY)[2]["tokens"])


def test_context_errors_name_the_prompt_the_max_tokens_and_the_context(guarded: RunningServer) -> None:
    """Were "the request has more than -1488 prompt tokens" (max_tokens above the context) and "more than 112"
    (the context less max_tokens) for prompts of known, smaller length."""
    prompt = "def fib(n): return n"
    count = tokens(guarded, prompt)
    for max_tokens in (60, 2000):
        status, _, reply = http("POST", f"{guarded.url}/v1/completions", {"prompt": prompt, "max_tokens": max_tokens},
                                KEY)
        assert error_of(status, reply)["message"] == (
            f"the maximum context length is 64 tokens; the request has {count} prompt tokens + {max_tokens} "
            f"max_tokens = {count + max_tokens}")
    long_prompt = "word " * 100
    assert tokens(guarded, long_prompt) > 64
    status, _, reply = http("POST", f"{guarded.url}/v1/completions", {"prompt": long_prompt, "max_tokens": 4}, KEY)
    assert error_of(status, reply)["message"] == ("the maximum context length is 64 tokens; the prompt alone has "
                                                  "more than 64 tokens (500 characters), before the 4 max_tokens")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}
    count = len(http("POST", f"{guarded.url}/tokenize", chat, KEY)[2]["tokens"])
    status, _, reply = http("POST", f"{guarded.url}/v1/chat/completions", chat, KEY)
    assert error_of(status, reply)["message"] == (
        f"the maximum context length is 64 tokens; the request has {count} prompt tokens + 5000 max_tokens = "
        f"{count + 5000}")


# --- the command line -------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["0", "-1", "65536", "99999", "http"])
def test_a_port_outside_1_to_65535_is_a_usage_error(port: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        configure_parser().parse_args(["model", "--port", port])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert f"expected a TCP port from 1 to 65535, got {port!r}" in err


def test_ports_and_the_read_timeout_in_range_are_taken() -> None:
    args = configure_parser().parse_args(["model", "--port", "65535", "--read-timeout", "2.5"])
    assert (args.port, args.read_timeout) == (65535, 2.5)
    assert configure_parser().parse_args(["model", "--port", "1"]).port == 1
    with pytest.raises(SystemExit):
        configure_parser().parse_args(["model", "--read-timeout", "0"])

