"""qwen-serve on Ray Serve: replicas of :func:`qwen_serve.app.create_app`'s app behind Ray Serve's HTTP proxy.

    qwen-serve MODEL --ray --replicas 2 [--address ADDR]         # a local Ray instance, or a cluster
    serve run qwen_serve.ray_app:build model=MODEL replicas=2     # the same deployment from Ray's own CLI

Each replica is a Ray actor that builds the app once: it memory-maps the model (shared page cache between
replicas on one node) and runs its own continuous-batching engine.  Ray Serve's proxy spreads requests over
the replicas (to the less loaded of two, per request) and forwards up to ``max_batch + max_queue`` requests to
one replica at a time, so each engine batches and queues as a standalone server would and answers 503 when
full.  Every response carries the replica's id in the ``x-qwen-replica`` header.

Each replica declares the memory it needs: :func:`replica_memory`.  The model path must name the same files
on every node (one machine, or a shared filesystem).  ``ray`` is imported only by these functions.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from qwen_runtime.backend.limits import parse_memory_size
from qwen_runtime.backend.weights import weight_overhead
from qwen_runtime.formats import open_model_files
from qwen_runtime.formats.hub import resolve_model

from .protocol import MAX_BODY_BYTES

REPLICA_HEADER = "x-qwen-replica"
DEFAULT_REPLICA_MEMORY = 2 << 30  # the engine's cache + activations limit per replica when none is given
# Heap of a replica besides the engine's limit: the Ray Serve replica process with Starlette, the app and the
# model's tokenizer.  Measured (RssAnon after three 16-token chat requests, ray 2.60.0): 100 MiB serving a
# model with a 480-token vocabulary, 222 MiB with Qwen's 151,936 (its cache and activations included).
REPLICA_BASE_BYTES = 384 << 20

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Scope]]
Send = Callable[[Scope], Awaitable[None]]


def replica_memory(model: str | Path, max_memory: int) -> int:
    """Bytes of heap one replica needs: the base, the engine's ``max_memory`` and what the weights keep beside
    their memory map (:func:`~qwen_runtime.backend.weights.weight_overhead`, the numpy kernels' upper bound)."""
    return REPLICA_BASE_BYTES + max_memory + weight_overhead(open_model_files(model).tensors.values())


class ReplicaHeader:
    """ASGI middleware: adds ``x-qwen-replica: <replica id>`` to every HTTP response of ``app``."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], replica: str) -> None:
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Scope) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.encode(), self.replica)]}
            await send(message)

        await self.app(scope, receive, tagged)


def deployment(model: str | Path, *, replicas: int = 1, num_cpus: float = 1.0, max_batch: int = 8,
               max_queue: int = 64, max_memory: int | None = None, name: str = "qwen-serve",
               **app_options: Any) -> Any:
    """The Ray Serve application: ``replicas`` copies of ``create_app(model, ...)`` (``app_options`` are
    create_app's: model_name, api_key, prefill_chunk, max_body_bytes, cache_memory, threads, kernels, draft_tokens,
    cache_dir: replicas on one machine share its files, each bounding what it writes by cache_memory), each declaring
    ``num_cpus`` and :func:`replica_memory`.  Run it with ``serve.run(deployment(...), route_prefix="/")``.  A Hub
    id is resolved here, once: the replicas get its local path."""
    from ray import serve

    model = resolve_model(model)
    limit = max_memory or DEFAULT_REPLICA_MEMORY
    options = {**app_options, "max_batch": max_batch, "max_queue": max_queue, "max_memory": limit}

    @serve.ingress()
    class QwenServe:
        def __init__(self, model: str, options: dict[str, Any]) -> None:
            self.model, self.options = model, options

        def __serve_build_asgi_app__(self) -> Any:
            from .app import create_app

            replica = serve.get_replica_context().replica_id.unique_id
            return ReplicaHeader(create_app(self.model, **self.options), replica)

    actor = {"num_cpus": num_cpus, "memory": replica_memory(model, limit)}
    return serve.deployment(QwenServe, name=name, num_replicas=replicas, ray_actor_options=actor,
                            max_ongoing_requests=max_batch + max_queue).bind(str(model), options)


def build(args: dict[str, str]) -> Any:
    """Application builder for ``serve run qwen_serve.ray_app:build model=PATH [replicas=N] [num_cpus=C]
    [max_batch=N] [max_queue=N] [max_memory=SIZE] [model_name=NAME] [api_key=KEY] [prefill_chunk=N] [threads=N]
    [kernels=auto|numba|numpy]``."""
    known = {"model", "replicas", "num_cpus", "max_batch", "max_queue", "max_memory", "model_name", "api_key",
             "prefill_chunk", "max_body_bytes", "threads", "kernels"}
    unknown = sorted(set(args) - known)
    if unknown or "model" not in args:
        optional = ", ".join(sorted(known - {"model"}))
        raise ValueError(f"qwen_serve.ray_app:build takes model=PATH and optionally {optional}"
                         + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    ints = {k: int(args[k]) for k in ("replicas", "max_batch", "max_queue", "prefill_chunk", "max_body_bytes",
                                      "threads") if k in args}
    rest = {k: args[k] for k in ("model_name", "api_key", "kernels") if k in args}
    return deployment(args["model"], num_cpus=float(args.get("num_cpus", 1.0)),
                      max_memory=parse_memory_size(args["max_memory"]) if "max_memory" in args else None,
                      **ints, **rest)


def serve_on_ray(args: Any) -> None:
    """``qwen-serve MODEL --ray``: deploy on the cluster at ``args.address`` (or a local instance), serve HTTP on
    ``args.host:args.port`` until Ctrl-C, then delete the application."""
    import time

    from ray import serve

    from qwen_runtime.executor import connect

    connect(args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = deployment(args.model, replicas=args.replicas, num_cpus=args.replica_cpus, max_batch=args.max_batch,
                     max_queue=args.max_queue, max_memory=args.max_memory, model_name=args.model_name,
                     api_key=args.api_key, prefill_chunk=args.prefill_chunk,
                     max_body_bytes=getattr(args, "max_body", MAX_BODY_BYTES),
                     cache_memory=getattr(args, "cache_memory", None), threads=getattr(args, "threads", None),
                     kernels=getattr(args, "kernels", None), draft_tokens=getattr(args, "draft", 0),
                     cache_dir=getattr(args, "cache_dir", None), activations=getattr(args, "activations", "auto"),
                     cache_turns=getattr(args, "cache_turns", False))
    serve.run(app, name="qwen-serve", route_prefix="/")
    print(f"qwen-serve: {args.replicas} replica(s) of {args.model} on Ray Serve at http://{args.host}:{args.port}",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        serve.delete("qwen-serve")
