"""The streaming channel: a request's jobs handed to the engine, and their events moved from the engine thread to
the event loop, collected whole or sent as server-sent events (:func:`sse`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request

from qwen_runtime.generation.stepper import Constraint

from .engine import Delta, Done, EngineStoppedError, Event, Failed, Finished, Job, QueueFullError, RequestTooLargeError
from .handling import ServerState
from .metrics import Metrics
from .protocol import APIError, GenerationFields

RETRY_AFTER_SECONDS = 2

class JobChannel:
    """The events of a request's jobs (one per prompt), moved from the engine thread to the event loop.

    Job ``i``'s choices are numbered after those of the jobs before it; the jobs' :class:`Done` events are
    summed into one, sent after the last.  The time to the first token and to the end, from ``started`` (the
    request's arrival), go to ``metrics``.
    """

    def __init__(self, jobs: int, metrics: Metrics, started: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.jobs: list[Job] = []
        self.pending = jobs
        self.metrics, self.started, self.first_token = metrics, started, True

    def emitter(self, offset: int) -> Callable[[Event], None]:
        def emit(event: Event) -> None:  # engine thread
            if offset and isinstance(event, (Delta, Finished)):
                event = dataclasses.replace(event, choice=event.choice + offset)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
                self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

        return emit

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()

    async def events(self) -> AsyncIterator[Event]:
        """Every event up to the summed :class:`Done`; raises APIError on :class:`Failed`."""
        prompt_tokens = completion_tokens = 0
        while True:
            event = await self.queue.get()
            if isinstance(event, Failed):
                self.cancel()
                raise APIError(500, event.message, None, "internal_error", "server_error")
            if not isinstance(event, Done):
                if self.first_token and isinstance(event, Delta):
                    self.first_token = False
                    self.metrics.ttft.observe(time.monotonic() - self.started)
                yield event
                continue
            prompt_tokens += event.prompt_tokens
            completion_tokens += event.completion_tokens
            self.pending -= 1
            if self.pending == 0:
                self.metrics.latency.observe(time.monotonic() - self.started)
                yield Done(prompt_tokens, completion_tokens)
                return


def submit(state: ServerState, prompts: list[list[int]], fields: GenerationFields, max_tokens: list[int],
           logprobs: int | None, started: float, constraint: Callable[[], Constraint] | None = None) -> JobChannel:
    """One job per prompt, all or none (a refused job cancels those already queued)."""
    channel = JobChannel(len(prompts), state.metrics, started)
    try:
        for i, (ids, limit) in enumerate(zip(prompts, max_tokens, strict=True)):
            job = Job(ids, limit, fields.sampling, channel.emitter(i * fields.n), n=fields.n, seed=fields.seed,
                      stop=fields.stop, logprobs=logprobs, constraint=constraint)
            state.engine.submit(job)
            channel.jobs.append(job)
    except QueueFullError as exc:
        channel.cancel()
        raise APIError(503, f"the server is busy ({exc}); retry later", None, "server_overloaded", "server_error",
                       {"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except EngineStoppedError as exc:
        channel.cancel()
        raise APIError(503, str(exc), None, "engine_stopped", "server_error") from None
    except RequestTooLargeError as exc:
        channel.cancel()
        raise APIError(400, str(exc), "n" if "n=" in str(exc) else "max_tokens", "request_too_large") from None
    return channel


async def until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only a disconnect can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, channel: JobChannel) -> list[Event]:
    """All events of a non-streamed request; cancels its jobs if the client disconnects first."""

    async def gather() -> list[Event]:
        return [event async for event in channel.events()]

    work = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            channel.cancel()
            work.cancel()
    if work.cancelled():
        raise APIError(499, "client disconnected", None, "client_disconnected")
    return work.result()


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def usage(done: Done) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


