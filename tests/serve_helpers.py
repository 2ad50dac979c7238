"""A qwen-serve app running in a background thread on 127.0.0.1 (a free port), for the openai-client tests."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

uvicorn = pytest.importorskip("uvicorn", reason="qwen-serve needs the serve extra (starlette, uvicorn)")
openai = pytest.importorskip("openai", reason="the serve tests use the official openai client (test extra)")

from qwen_serve import create_app  # noqa: E402


class RunningServer:
    """``create_app(model, **options)`` served by uvicorn on a free port until :meth:`close`."""

    def __init__(self, model: Any, **options: Any) -> None:
        self.app = create_app(model, **options)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self):
        return self.app.state.server.engine

    def client(self, api_key: str = "unused", **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **options)

    def wait_idle(self, timeout: float = 30) -> None:
        """Until no row runs, nothing is prefilled and nothing waits."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.engine.status()
            if not status["running_rows"] and not status["waiting"] and not status["prefilling"]:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine is still busy: {status}")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def http(method: str, url: str, body: bytes | dict | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """A raw HTTP request (for what the openai client cannot send): status, headers and the parsed JSON body."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, head, raw = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        status, head, raw = err.code, dict(err.headers), err.read()
    try:
        return status, head, json.loads(raw)
    except ValueError:
        return status, head, raw


@contextmanager
def running_server(model: Any, **options: Any) -> Iterator[RunningServer]:
    server = RunningServer(model, **options)
    try:
        yield server
    finally:
        server.close()
