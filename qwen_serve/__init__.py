"""qwen_serve: an OpenAI-compatible HTTP server for qwen_runtime models, with continuous batching.

    from qwen_serve import create_app
    app = create_app("model.gguf", max_batch=8)      # an ASGI app: run it with uvicorn, Ray Serve, ...

The server is a tool built on the runtime: it imports ``qwen_runtime``, never the other way round, and its
web stack (Starlette, uvicorn) is the optional ``serve`` extra.  :class:`Engine` is usable without HTTP.
"""

from .app import create_app
from .engine import Engine, Job

__all__ = ["Engine", "Job", "create_app"]
