"""The server's counters and histograms, rendered in Prometheus' text exposition format on ``GET /metrics``.

Written here rather than taken from ``prometheus_client``: the format is a few lines of text per metric, and
the server needs only counters (with labels), histograms and gauges read when scraped.  Every metric is
safe to update from any thread (the engine thread counts tokens and steps, the event loop requests).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Sequence

PREFIX = "qwen_serve_"
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in values)
    return "{" + ",".join(f'{n}="{v}"' for n, v in zip(names, escaped, strict=True)) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if float(value).is_integer() else repr(float(value))


class Counter:
    """A monotonically increasing count, one per combination of label values."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.labels = PREFIX + name, help_text, tuple(labels)
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1, *labels: str) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0) + amount

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0)

    def render(self) -> list[str]:
        with self._lock:
            values = sorted(self._values.items()) or ([((), 0)] if not self.labels else [])
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter",
                *(f"{self.name}{_labels(self.labels, k)} {_number(v)}" for k, v in values)]


class Gauge:
    """A value read when scraped (queue depth, running rows, ...)."""

    def __init__(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.name, self.help, self.read = PREFIX + name, help_text, read

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge", f"{self.name} {_number(self.read())}"]


class Histogram:
    """Observations counted in cumulative buckets (upper bounds ``buckets``, then +Inf), with their sum."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name, self.help = PREFIX + name, help_text
        self.bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, value)] += 1
            self._sum += value

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def render(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip((*self.bounds, math.inf), counts, strict=True):
            running += count
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {running}')
        return [*lines, f"{self.name}_sum {_number(total)}", f"{self.name}_count {running}"]


class Metrics:
    """Everything ``/metrics`` shows; the engine and the HTTP layer update it, gauges are added by the app."""

    def __init__(self) -> None:
        self.requests = Counter("requests_total", "HTTP requests answered, by route and status code",
                                ("route", "status"))
        self.prompt_tokens = Counter("prompt_tokens_total", "prompt tokens of finished requests")
        self.completion_tokens = Counter("completion_tokens_total", "tokens generated (every choice)")
        self.failed_jobs = Counter("failed_requests_total", "requests failed inside the engine (a bug)")
        self.ttft = Histogram("time_to_first_token_seconds", "from a completion request's arrival to its first "
                              "token", SECONDS_BUCKETS)
        self.latency = Histogram("request_duration_seconds", "from a completion request's arrival to its last "
                                 "token", SECONDS_BUCKETS)
        self.decode_step = Histogram("decode_step_seconds", "one decode step of every running row", STEP_BUCKETS)
        self.prefill_step = Histogram("prefill_step_seconds", "one prefill chunk of one prompt", STEP_BUCKETS)
        self.batch_rows = Histogram("decode_batch_rows", "rows decoded together per step", ROW_BUCKETS)
        self.draft_proposed = Counter("draft_tokens_proposed_total", "speculative decoding: draft tokens verified")
        self.draft_accepted = Counter("draft_tokens_accepted_total", "speculative decoding: draft tokens taken")
        self.gauges: list[Gauge] = []

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.gauges.append(Gauge(name, help_text, read))

    def render(self) -> str:
        metrics = [self.requests, self.prompt_tokens, self.completion_tokens, self.failed_jobs, self.ttft,
                   self.latency, self.decode_step, self.prefill_step, self.batch_rows, self.draft_proposed,
                   self.draft_accepted, *self.gauges]
        return "\n".join(line for m in metrics for line in m.render()) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

__all__ = ["CONTENT_TYPE", "Counter", "Gauge", "Histogram", "Metrics"]
