"""``qwen-serve``: an OpenAI-compatible HTTP server for a Qwen model (numpy runtime, continuous batching).

    qwen-serve qwen2.5-0.5b-q8_0.gguf --port 8000 --max-batch 8
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

It binds 127.0.0.1 unless ``--host`` says otherwise, before loading the model (a busy port fails at once), and
logs a banner once it listens.  The API key comes from ``--api-key`` or the ``QWEN_API_KEY`` environment
variable (which, unlike argv, ``ps`` does not show).  Errors print one line and exit with the code of
:func:`qwen_runtime.errors.exit_code`.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from qwen_runtime.cli_support import (
    ArgumentParser,
    add_activations_option,
    add_cache_type_options,
    add_draft_option,
    add_machine_options,
    add_rope_scaling_options,
    cache_types,
    clamp_context,
    count,
    integer,
    memory_size,
    positive_int,
    require_extra,
    rope_scaling_arg,
    run_guarded,
)
from qwen_runtime.errors import QwenError

from .protocol import MAX_BODY_BYTES, READ_TIMEOUT

API_KEY_ENV = "QWEN_API_KEY"
MAX_PORT = 65535


def port(text: str) -> int:
    """``--port``: a TCP port, 1 to 65535 (a larger number would wrap around, 0 picks any free port)."""
    value = integer(text, 1, "a TCP port from 1 to 65535")
    if value > MAX_PORT:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got {text!r}")
    return value


def seconds(text: str) -> float:
    """``--read-timeout``: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def cache_size(text: str) -> int:
    """``--cache-memory``: a memory size, or 0 (no prefix cache)."""
    return 0 if text.strip() == "0" else memory_size(text)


def context(text: str) -> int:
    """``-c/--ctx``: at least 2 tokens (a prompt token and a completion token)."""
    return integer(text, 2, "a context of at least 2 tokens")


def configure_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="qwen-serve", description="Serve a Qwen model over OpenAI's HTTP API "
                                "(chat and text completions, streaming, continuous batching; the serve extra). "
                                "Fields a request leaves out take the model's generation_config.json defaults, "
                                "then OpenAI's, so it samples unless told otherwise (qwen-run is greedy by default).")
    p.add_argument("model", metavar="MODEL", help="HF model directory, npy model directory, GGUF file or Hub id "
                   "ORG/NAME[:QUANT][@REVISION]")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port, default=8000, help="TCP port, 1 to 65535 (default 8000)")
    p.add_argument("--max-batch", type=positive_int, default=8, help="rows decoded together (default 8)")
    p.add_argument("--max-queue", type=count, default=64,
                   help="requests waiting beyond the batch before the server answers 503 (default 64)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 request, "
                   "/tokenize, /detokenize and /metrics, and for /health's details "
                   f"(default: the {API_KEY_ENV} environment variable, which ps does not show; else no key)")
    p.add_argument("--max-memory", type=memory_size, default=None, metavar="SIZE",
                   help="memory for cache and activations, e.g. 4G (default: 80%% of MemAvailable)")
    p.add_argument("--cache-memory", type=cache_size, default=None, metavar="SIZE",
                   help="prefix cache bound, e.g. 1G; 0 turns it off (default: a quarter of --max-memory)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="also keep the prefix cache on disk in DIR (bounded by --cache-memory, written as blocks are "
                   "cached) and start with what an earlier server of the same model files and kernels left there; "
                   "DIR must be new, empty or an earlier --cache-dir (default: none, memory only)")
    p.add_argument("--cache-turns", action="store_true",
                   help="the prefix cache also keeps where each request stopped (prompt end, answer end), so a chat's "
                   "next turn prefills only its new tokens, not everything after the last whole --prefill-chunk "
                   "block; in memory only; not bit-identical to no cache (the answer was decoded token by token, "
                   "a prompt without the cache prefills it in one chunk)")
    p.add_argument("--model-name", default=None, help="the name clients use (default: the file or directory name)")
    p.add_argument("-c", "--ctx", "--max-context", dest="max_context", type=context, default=None, metavar="TOKENS",
                   help="tokens one request may hold, prompt + completion; more than the model's context is cut to "
                   "it, with a note, as in qwen-run (default: the model's context)")
    p.add_argument("--prefill-chunk", type=positive_int, default=128,
                   help="a prompt is prefilled in chunks of this many tokens (default 128)")
    p.add_argument("--prefill-budget", type=positive_int, default=None, metavar="TOKENS",
                   help="prompt tokens prefilled between two decode steps, the next chunks of several prompts: "
                   "bounds a running stream's pause while prompts join (default: 256, or --prefill-chunk if larger)")
    add_draft_option(p)
    p.add_argument("--max-body", type=positive_int, default=MAX_BODY_BYTES, metavar="BYTES",
                   help="largest request body accepted, in bytes (default %(default)s)")
    p.add_argument("--read-timeout", type=seconds, default=READ_TIMEOUT, metavar="SECONDS",
                   help="time a client has to send a request's headers, and then its body, before the "
                   "connection is closed (the body: with 408) (default %(default)g)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's and the server's log level")
    add_machine_options(p)
    add_activations_option(p)
    add_cache_type_options(p)
    add_rope_scaling_options(p)
    ray = p.add_argument_group("Ray Serve (the ray extra; qwen_serve/ray_app.py)")
    ray.add_argument("--ray", action="store_true", help="serve through Ray Serve: --replicas copies of the app, "
                     "each with its own engine, behind Ray's HTTP proxy on --host:--port")
    ray.add_argument("--replicas", type=positive_int, default=1, help="with --ray: replicas (default 1)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray: CPUs each replica declares "
                     "(default 1)")
    ray.add_argument("--address", metavar="ADDR", help="with --ray: the Ray cluster (default: RAY_ADDRESS, else "
                     "a local instance)")
    return p


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The start-up warning for a server reachable from other machines (``host`` is not only loopback
    addresses) that answers anyone (no API key), else None."""
    if api_key is not None:
        return None
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:  # listen() says why
        return None
    if all(_is_loopback(address) for address in addresses):
        return None
    return (f"qwen-serve: warning: listening on {host}, beyond this machine, without an API key: anyone who "
            f"reaches it can use the model (set --api-key or {API_KEY_ENV})")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def server_config(app: Any, log_level: str, read_timeout: float) -> Any:
    """uvicorn's Config for ``app``, with ``read_timeout`` (the app's for request bodies) on the request headers
    too: uvicorn's own timeout covers only idle keep-alive connections, so a client sending its headers a byte
    at a time would hold a connection as long as it likes."""
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, lifespan="on", http=header_timeout_protocol(read_timeout))


def header_timeout_protocol(timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, closing a connection whose next request's headers are not complete within
    ``timeout`` seconds of its opening or of the previous response."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self.arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            super().connection_lost(exc)

        def arm_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            self.header_timer = self.loop.call_later(timeout, self.headers_late, self.cycle)

        def headers_late(self, cycle: Any) -> None:
            """No request began since the timer was armed (a running one has a new cycle, or its own
            response still to complete)."""
            waiting = self.cycle is cycle and (cycle is None or cycle.response_complete)
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def run(args: argparse.Namespace) -> None:
    warning = exposure_warning(args.host, args.api_key)
    if warning:
        print(warning, file=sys.stderr)
    if args.ray:
        require_extra("ray", "ray", "qwen-serve --ray")
        require_extra("starlette", "serve", "qwen-serve --ray")
        from .ray_app import serve_on_ray

        serve_on_ray(args)
        return
    require_extra("starlette", "serve", "qwen-serve")
    require_extra("uvicorn", "serve", "qwen-serve")
    import uvicorn

    from .app import create_app, startup_banner

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sock = listen(args.host, args.port)
    app = create_app(args.model, model_name=args.model_name, max_batch=args.max_batch, max_queue=args.max_queue,
                     max_memory=args.max_memory, api_key=args.api_key, prefill_chunk=args.prefill_chunk,
                     prefill_budget=args.prefill_budget,
                     max_context=args.max_context, max_body_bytes=args.max_body, cache_memory=args.cache_memory,
                     threads=args.threads, kernels=args.kernels, draft_tokens=args.draft, cache_dir=args.cache_dir,
                     activations=args.activations, cache_turns=args.cache_turns, read_timeout=args.read_timeout,
                     rope_scaling=rope_scaling_arg(args), **cache_types(args))
    clamp_context("qwen-serve", args.max_context, app.state.server.engine.model.config.context_window, sys.stderr)
    host, port = sock.getsockname()[:2]
    logging.getLogger("qwen_serve").info(startup_banner(app, f"http://{host}:{port}"))
    uvicorn.Server(server_config(app, args.log_level, args.read_timeout)).run(sockets=[sock])


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (uvicorn serves it); a busy port is a one-line error, exit code 1."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen()  # connections wait in the backlog until uvicorn serves
    except OSError as exc:
        sock.close()
        raise QwenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def main(argv: Sequence[str] | None = None) -> int:
    parser = configure_parser()
    args = parser.parse_args(argv)
    if not args.ray and (args.address is not None or args.replicas != 1):
        parser.error("--replicas and --address need --ray")
    if args.cache_dir is not None and args.cache_memory == 0:
        parser.error("--cache-dir needs the prefix cache (--cache-memory 0 turns it off)")
    if args.cache_turns and args.cache_memory == 0:
        parser.error("--cache-turns needs the prefix cache (--cache-memory 0 turns it off)")
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    return run_guarded("qwen-serve", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
