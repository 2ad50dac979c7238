"""qwen_serve: an OpenAI-compatible HTTP server for qwen_runtime models, with continuous batching.

    from qwen_serve import create_app
    app = create_app("model.gguf", max_batch=8)      # an ASGI app: run it with uvicorn, Ray Serve, ...

The server is a tool built on the runtime: it imports ``qwen_runtime``, never the other way round, and its
web stack (Starlette, uvicorn) is the optional ``serve`` extra, imported only by :func:`create_app`;
:class:`Engine` (continuous batching, no HTTP) needs the runtime alone.
"""

from typing import Any

from .engine import Engine, Job

__all__ = ["Engine", "Job", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module 'qwen_serve' has no attribute {name!r}")
