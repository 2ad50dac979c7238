"""A qwen-serve app running in a background thread on 127.0.0.1 (a free port), for the openai-client tests."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

uvicorn = pytest.importorskip("uvicorn", reason="qwen-serve needs the serve extra (starlette, uvicorn)")
openai = pytest.importorskip("openai", reason="the serve tests use the official openai client (test extra)")

from qwen_serve import create_app  # noqa: E402
from qwen_serve.cli import server_config  # noqa: E402


class RunningServer:
    """``create_app(model, **options)`` served by uvicorn on a free port until :meth:`close`."""

    def __init__(self, model: Any, **options: Any) -> None:
        self.app = create_app(model, **options)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = server_config(self.app, "warning", self.app.state.server.read_timeout)  # qwen-serve's
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


def free_port() -> int:
    """A port free now (for a command that must be given one: --port is 1 to 65535)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(method: str, url: str, body: bytes | dict | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    """A raw HTTP request (for what the openai client cannot send): status, headers (case-insensitive) and the
    parsed JSON body."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, head, raw = response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        status, head, raw = err.code, err.headers, err.read()
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


def _read_safetensors_f32(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        data = raw[8 + size + begin:8 + size + end]
        if info["dtype"] == "BF16":
            array = (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(data, {"F16": np.float16, "F32": np.float32}[info["dtype"]]).astype(np.float32)
        out[name] = array.reshape(info["shape"])
    return out


def send_oversized(port: int, path: str, size: int, chunked: bool) -> tuple[int, Any]:
    """POST ``size`` bytes (declared in Content-Length, or chunked without a length) and read the answer; the
    server may answer and close before the body is sent, which is the point."""
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    conn.putrequest("POST", path)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding" if chunked else "Content-Length", "chunked" if chunked else str(size))
    conn.endheaders()
    block = b" " * (1 << 16)
    with contextlib.suppress(OSError):
        for _ in range(size // len(block)):
            conn.send(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
    response = conn.getresponse()
    status, raw = response.status, response.read()
    conn.close()
    return status, json.loads(raw)


def scripted_qwen3(source: Path, out: Path, script: list[str]) -> Path:
    """A Qwen3 checkpoint (the real Qwen3 chat template of ``source``) that greedily says ``script``.

    Every piece of ``script`` becomes one token (pieces missing from the vocabulary are added as plain added
    tokens); the first piece follows the last token of a chat prompt ("\\n" after ``assistant``).  The decoder
    blocks add nothing (zero output projections), so the logits are a function of the current token alone:
    the LM head row of each piece's successor points along the piece's embedding.
    """
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((source / "config.json").read_text())
    known = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    next_id = max([*known.values(), *tokenizer["model"]["vocab"].values()]) + 1
    for piece in script:
        if piece not in known and piece not in tokenizer["model"]["vocab"]:
            tokenizer["added_tokens"].append({"id": next_id, "content": piece, "single_word": False,
                                              "lstrip": False, "rstrip": False, "normalized": False,
                                              "special": False})
            known[piece] = next_id
            next_id += 1
    assert next_id <= config["vocab_size"]
    ids = [tokenizer["model"]["vocab"]["Ċ"]] + [known.get(p, tokenizer["model"]["vocab"].get(p)) for p in script]
    tensors = _read_safetensors_f32(source / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    head = np.zeros_like(embed)
    for current, following in zip(ids, ids[1:], strict=False):
        head[following] += 20 * embed[current] / np.linalg.norm(embed[current])
    tensors["lm_head.weight"] = head
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = np.zeros_like(tensors[name])
    tensors["model.norm.weight"] = np.ones_like(tensors["model.norm.weight"])
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, str(out / "model.safetensors"))
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    for name in ("tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((source / name).read_bytes())
    return out
