"""``qwen-serve``: an OpenAI-compatible HTTP server for a Qwen model (numpy runtime, continuous batching).

    qwen-serve qwen2.5-0.5b-q8_0.gguf --port 8000 --max-batch 8
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

It binds 127.0.0.1 unless ``--host`` says otherwise.  Errors loading the model print one line and exit with
the code of :func:`qwen_runtime.errors.exit_code`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from qwen_runtime.cli_support import add_machine_options, run_guarded
from qwen_runtime.limits import parse_memory_size

from .app import MAX_BODY_BYTES, create_app


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def configure_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qwen-serve", description="Serve a Qwen model over OpenAI's HTTP API "
                                "(chat and text completions, streaming, continuous batching).")
    p.add_argument("model", help="HF model directory, npy model directory or GGUF file")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=positive, default=8, help="rows decoded together (default 8)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting beyond the batch before the server answers 503 (default 64)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 request")
    p.add_argument("--max-memory", type=parse_memory_size, default=None, metavar="SIZE",
                   help="memory for cache and activations, e.g. 4G (default: 80%% of MemAvailable)")
    p.add_argument("--model-name", default=None, help="the name clients use (default: the file or directory name)")
    p.add_argument("--max-context", type=positive, default=None, metavar="TOKENS",
                   help="tokens one request may hold, prompt + completion (default: the model's context)")
    p.add_argument("--prefill-chunk", type=positive, default=128,
                   help="prompt tokens prefilled between two decode steps (default 128)")
    p.add_argument("--max-body", type=positive, default=MAX_BODY_BYTES, metavar="BYTES",
                   help=f"largest request body accepted (default {MAX_BODY_BYTES})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_machine_options(p)
    ray = p.add_argument_group("Ray Serve (the ray extra; qwen_serve/ray_app.py)")
    ray.add_argument("--ray", action="store_true", help="serve through Ray Serve: --replicas copies of the app, "
                     "each with its own engine, behind Ray's HTTP proxy on --host:--port")
    ray.add_argument("--replicas", type=positive, default=1, help="with --ray: replicas (default 1)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray: CPUs each replica declares")
    ray.add_argument("--address", metavar="ADDR", help="with --ray: the Ray cluster (default: RAY_ADDRESS, else "
                     "a local instance)")
    return p


def run(args: argparse.Namespace) -> None:
    if args.ray:
        from .ray_app import serve_on_ray

        serve_on_ray(args)
        return
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(args.model, model_name=args.model_name, max_batch=args.max_batch, max_queue=args.max_queue,
                     max_memory=args.max_memory, api_key=args.api_key, prefill_chunk=args.prefill_chunk,
                     max_context=args.max_context, max_body_bytes=args.max_body, threads=args.threads,
                     kernels=args.kernels)
    ws = app.state.server.engine.model.workspace
    logging.getLogger("qwen_serve").info("%s: %s kernels, %d thread(s)", args.model, ws.kernels, ws.threads)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    parser = configure_parser()
    args = parser.parse_args(argv)
    if not args.ray and (args.address is not None or args.replicas != 1):
        parser.error("--replicas and --address need --ray")
    return run_guarded("qwen-serve", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
