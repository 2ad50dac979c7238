"""Throughput of qwen-serve under N concurrent streaming clients (continuous batching at work).

    python scripts/bench_serve.py [--model PATH] [--clients 1,4,8,16] [--max-tokens 64] [--max-batch 16]
                                  [--cache-dir ~/.cache/qwen-numpy-bench] [--json out.json]

Without ``--model`` it builds (once, cached) the full-size random-weight Qwen2.5-0.5B checkpoint of
``bench_models.py`` and converts it to GGUF q8_0 with ``qwen-convert``.  The server runs as its own process
(``python -m qwen_serve``) on a free port of 127.0.0.1; each client is a thread streaming one greedy chat
completion over plain HTTP (a light client: the two share the machine), each with a different prompt.  Per
N it reports:

* aggregate tokens/s: completion tokens of the round / wall time from the first request to the last [DONE];
* time to first token (first content chunk) p50 / p95 over the round's requests;
* per-request tokens/s: each request's (tokens - 1) / (last chunk - first chunk), the median.

One client runs three requests in turn; N > 1 clients run one round of N requests at once.

The target is an aggregate at 8 clients of at least 3x the single-client rate.

``--draft N`` runs the editing workload instead, once with plain decoding and once with ``qwen-serve --draft N``
(speculative decoding by prompt lookup): each request is a greedy text completion whose prompt holds a passage
of the bundled model's held-out Python source and then the passage's first lines again, so a model that copies
repeats the passage (as a summary quoting its source or an edit of a text does).  Per client count it reports
aggregate tok/s of both, the speed-up, the share of draft tokens accepted (``/metrics``), and whether the texts
are identical (they must be).  A trained model shows the effect (``--model`` the bundled ``qwen3-stdlib`` in
GGUF, or a real Qwen); random weights copy nothing and measure the cost of refused drafts.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import MODELS, build_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["rivers", "prime numbers", "the moon", "sorting", "bread", "volcanoes", "chess", "tea", "bridges",
          "owls", "glass", "maps", "bees", "clocks", "salt", "comets"]


@dataclass
class RequestResult:
    ttft: float  # seconds from sending to the first content chunk
    seconds: float  # sending to [DONE]
    tokens: int  # completion tokens (usage)
    decode_tps: float  # (tokens - 1) / (last chunk - first chunk)


@dataclass
class RoundResult:
    clients: int
    rounds: int
    requests: int
    aggregate_tps: float
    ttft_p50: float
    ttft_p95: float
    request_tps_median: float
    tokens: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_chat(port: int, prompt: str, max_tokens: int) -> RequestResult:
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    first = last = None
    tokens = 0
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", []):
            if choice["delta"].get("content") or choice["delta"].get("reasoning_content"):
                last = time.perf_counter()
                first = first or last
    end = time.perf_counter()
    conn.close()
    first, last = first or end, last or end
    tps = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return RequestResult(first - t0, end - t0, tokens, tps)


def run_round(port: int, clients: int, max_tokens: int, offset: int) -> tuple[float, list[RequestResult]]:
    results: list[RequestResult | None] = [None] * clients
    errors: list[BaseException] = []

    def work(i: int) -> None:
        prompt = f"Write a long story about {TOPICS[(offset + i) % len(TOPICS)]}, number {offset + i}."
        try:
            results[i] = stream_chat(port, prompt, max_tokens)
        except BaseException as exc:  # reported after the round
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]}")
    return wall, [r for r in results if r is not None]


def measure(port: int, clients: int, max_tokens: int) -> RoundResult:
    rounds = 3 if clients == 1 else 1  # a single client: three requests, so TTFT has a median
    walls, results = [], []
    for r in range(rounds):
        wall, got = run_round(port, clients, max_tokens, offset=r * clients + clients)
        walls.append(wall)
        results += got
    tokens = sum(r.tokens for r in results)
    ttft = np.array([r.ttft for r in results])
    return RoundResult(clients, rounds, len(results), tokens / sum(walls), float(np.percentile(ttft, 50)),
                       float(np.percentile(ttft, 95)), float(np.median([r.decode_tps for r in results])), tokens)


def default_model(cache: Path, tokenizers: Path, configs: Path) -> Path:
    out = cache / "gguf" / "qwen2.5-0.5b-q8_0.gguf"
    if not out.is_file():
        src = build_checkpoint(MODELS["qwen2.5-0.5b"], cache / "hf", tokenizers, configs)
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "qwen_convert", str(src), "-o", str(out), "--dtype", "q8_0"], check=True)
    return out


def start_server(model: Path, port: int, max_batch: int, extra: Sequence[str] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "qwen_serve", str(model), "--port", str(port), "--max-batch", str(max_batch),
           "--model-name", "bench", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not come up")


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# --- the editing workload (speculative decoding) ---------------------------------------------------------------

HELDOUT = ROOT / "qwen_runtime" / "assets" / "qwen3-stdlib" / "heldout.txt"


def edit_prompts(count: int, chars: int = 320) -> list[str]:
    """``count`` prompts: a passage of held-out source, a blank line, and the passage's first three lines again."""
    text = HELDOUT.read_text()
    blocks = [b for b in text.split("\n\n\n") if len(b) > 200]
    prompts = []
    for i in range(count):
        passage = blocks[i % len(blocks)][:chars]
        prompts.append(passage + "\n\n\n" + "\n".join(passage.splitlines()[:3]) + "\n")
    return prompts


def stream_completion(port: int, prompt: str, max_tokens: int) -> tuple[RequestResult, str]:
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    first = last = None
    tokens, text = 0, ""
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", []):
            if choice.get("text"):
                text += choice["text"]
                last = time.perf_counter()
                first = first or last
    end = time.perf_counter()
    conn.close()
    first, last = first or end, last or end
    tps = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return RequestResult(first - t0, end - t0, tokens, tps), text


def draft_counts(port: int) -> tuple[float, float]:
    """The server's draft tokens proposed and accepted so far (``/metrics``)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    values = dict(line.rsplit(" ", 1) for line in conn.getresponse().read().decode().splitlines()
                  if line and not line.startswith("#"))
    conn.close()
    return (float(values.get("qwen_serve_draft_tokens_proposed_total", 0)),
            float(values.get("qwen_serve_draft_tokens_accepted_total", 0)))


@dataclass
class EditResult:
    clients: int
    plain_tps: list[float]  # aggregate tok/s of each repeat, plain decoding
    draft_tps: list[float]  # and with --draft (the same repeat ran both, one after the other)
    proposed: float  # draft tokens over all repeats (/metrics)
    accepted: float

    @property
    def speedup(self) -> float:
        """Median over repeats of draft / plain: each pair ran under the same machine load."""
        return float(np.median([d / p for d, p in zip(self.draft_tps, self.plain_tps, strict=True)]))


def edit_round(port: int, prompts: list[str], max_tokens: int) -> tuple[float, int, list[str]]:
    """One request per prompt at once: the wall time, the completion tokens and the texts."""
    results: list[tuple[RequestResult, str] | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = stream_completion(port, prompts[i], max_tokens)
        except BaseException as exc:  # reported after the round
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]}")
    done = [r for r in results if r is not None]
    return wall, sum(r.tokens for r, _ in done), [text for _, text in done]


def bench_drafting(model: Path, clients: list[int], max_tokens: int, max_batch: int, draft: int, repeats: int,
                   ) -> tuple[list[EditResult], bool]:
    """The editing workload on two servers, plain and ``--draft``, run alternately (A/B, then B/A, ...) so both
    see the same load; whether every text was the same."""
    ports = [free_port(), free_port()]
    servers = [start_server(model, port, max_batch, ["--draft", str(n)])
               for port, n in zip(ports, (0, draft), strict=True)]
    results, same = [], True
    try:
        for port in ports:
            stream_completion(port, "warm up", 4)
        for n in clients:
            prompts = edit_prompts(n)
            tps: list[list[float]] = [[], []]
            before = draft_counts(ports[1])
            for r in range(repeats):
                order = (0, 1) if r % 2 == 0 else (1, 0)
                texts = {}
                for k in order:
                    wall, tokens, texts[k] = edit_round(ports[k], prompts, max_tokens)
                    tps[k].append(tokens / wall)
                same = same and texts[0] == texts[1]
            after = draft_counts(ports[1])
            results.append(EditResult(n, tps[0], tps[1], after[0] - before[0], after[1] - before[1]))
            e = results[-1]
            print(f"{n:>2} clients: plain {np.median(e.plain_tps):6.2f} tok/s, --draft {draft} "
                  f"{np.median(e.draft_tps):6.2f} tok/s (medians of {repeats}), speed-up {e.speedup:.2f}x, "
                  f"drafts {e.accepted:.0f} of {e.proposed:.0f} accepted", flush=True)
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=60)
    return results, same


def report_drafting(model: Path, args: argparse.Namespace, clients: list[int]) -> None:
    results, same = bench_drafting(model, clients, args.max_tokens, args.max_batch, args.draft, args.repeats)
    print(f"\nmodel {model.name}, editing workload, {args.max_tokens} tokens per request, --draft {args.draft}, "
          f"{args.repeats} alternating repeats, commit {commit()}; machine: {machine()}\n")
    print("| clients | plain tok/s | draft tok/s | speed-up (median of pairs) | drafts accepted | same text |")
    print("|---:|---:|---:|---:|---:|:---|")
    for e in results:
        share = f"{e.accepted / e.proposed:.0%}" if e.proposed else "none proposed"
        print(f"| {e.clients} | {np.median(e.plain_tps):.2f} | {np.median(e.draft_tps):.2f} | {e.speedup:.2f}x "
              f"| {share} | {'yes' if same else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "commit": commit(), "machine": machine(),
                                         "workload": "edit", "draft": args.draft, "max_tokens": args.max_tokens,
                                         "same_text": same, "results": [asdict(r) for r in results]}, indent=2))
    if not same:
        raise SystemExit("the texts with and without --draft differ")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="model to serve (default: the Qwen2.5-0.5B shape in q8_0, built)")
    p.add_argument("--clients", default="1,4,8,16", help="comma list of concurrent client counts")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request")
    p.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "qwen-numpy-bench")
    p.add_argument("--tokenizers", type=Path, default=ROOT.parent / "shared" / "data" / "tokenizers")
    p.add_argument("--configs", type=Path, default=ROOT.parent / "shared" / "data" / "model-configs")
    p.add_argument("--json", type=Path, help="write the results here too")
    p.add_argument("--draft", type=int, default=0, metavar="N",
                   help="run the editing workload, plain against qwen-serve --draft N (default 0: the chat workload)")
    p.add_argument("--repeats", type=int, default=3, help="with --draft: alternating repeats per client count")
    args = p.parse_args()
    model = args.model or default_model(args.cache_dir, args.tokenizers, args.configs)
    if args.draft:
        report_drafting(model, args, [int(c) for c in args.clients.split(",")])
        return 0
    port = free_port()
    load_before = os.getloadavg()
    server = start_server(model, port, args.max_batch)
    try:
        stream_chat(port, "warm up", 4)
        results = []
        for n in (int(c) for c in args.clients.split(",")):
            results.append(measure(port, n, args.max_tokens))
            r = results[-1]
            print(f"{n:>3} clients: {r.aggregate_tps:6.2f} tok/s aggregate, TTFT p50 {r.ttft_p50:.2f} s "
                  f"p95 {r.ttft_p95:.2f} s, per request {r.request_tps_median:.2f} tok/s", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    load_after = os.getloadavg()
    base = results[0].aggregate_tps if results and results[0].clients == 1 else None
    print(f"\nmodel {model.name}, {args.max_tokens} tokens per request, --max-batch {args.max_batch}, "
          f"commit {commit()}")
    print(f"machine: {machine()}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}\n")
    print("| clients | aggregate tok/s | vs 1 client | TTFT p50 (s) | TTFT p95 (s) | per-request tok/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        speedup = f"{r.aggregate_tps / base:.2f}x" if base else ""
        print(f"| {r.clients} | {r.aggregate_tps:.2f} | {speedup} | {r.ttft_p50:.2f} | {r.ttft_p95:.2f} "
              f"| {r.request_tps_median:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "commit": commit(), "machine": machine(),
                                         "load_before": load_before, "load_after": load_after,
                                         "results": [asdict(r) for r in results]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
