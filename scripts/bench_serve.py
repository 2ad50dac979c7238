"""qwen-serve against llama.cpp's own server: the same streaming clients, the same GGUF, the same thread count.

    python scripts/bench_serve.py                     # the full run (both servers, both models; docs/performance.md)
    python scripts/bench_serve.py --table docs/bench/2026-12-01-serve-abc1234.json   # the table rows of a run

Each model is served by ``qwen-serve`` (``python -m qwen_serve`` from this checkout) and then by the peer, one
server at a time, on a free port of 127.0.0.1.  The peer is ``llama-server`` built from the vendored llama.cpp
of the installed llama-cpp-python's sdist (``scripts/llama_tools.py``: its own build tree, without AMX on
CPUs that advertise it) or, with ``--servers qwen-serve,llama-cpp-python``, llama-cpp-python's ``llama_cpp.server`` (one
request at a time).  Both get ``--threads`` threads, ``--max-batch`` parallel rows (slots) of ``--ctx`` tokens
each, and their own defaults otherwise (llama-server keeps its prompt cache and context checkpoints).

Models (``--models``): the full-size random-weight checkpoints of ``bench_models.py`` converted to GGUF q8_0
with ``qwen-convert`` (built once into ``--cache-dir``), or GGUF files given by path.  Per server and model:

* **Client sweep** (``--clients 1,4,8,16``): each client is a thread streaming one greedy text completion of
  ``--max-tokens`` tokens over plain HTTP, each with a different prompt; one client runs three requests in
  turn, N > 1 clients one round of N at once.  Reported: aggregate tokens/s (completion tokens of the round /
  wall time from the first request to the last ``[DONE]``), time to first token (first content chunk) p50
  and p95, and each request's decode rate ((tokens - 1) / (last chunk - first chunk)), the median.
* **Multi-turn** (``--conversations 3``): a conversation whose turn 1 is ``--turn1-words`` random words (about
  as many tokens) is answered (``--turn-tokens`` tokens), then turn 2 (turn 1, the answer and a short
  question) is sent; reported: turn 1's and turn 2's time to first token, the median over conversations
  (turn 2 is where a prefix cache shows: the server restores turn 1 instead of prefilling it).

* **Hostile schemas** (``--hostile-rounds N``, qwen-serve only, a model with a chat template): while one chat
  completion streams ``--hostile-stream-tokens`` tokens, N rounds each send the audit's hostile
  ``response_format`` schemas of issue #42 (fan-out ``$ref``s, ``maxLength`` 10^5 and 10^9, 600 levels deep, a
  5,000-value enum) and one benign schema never seen before (compiled anew); reported: the stream's worst and
  median inter-token gap against the same stream alone, each hostile request's status and time, the benign
  requests' time to first token, and the server's resident memory (VmRSS) growth and peak (VmHWM).

Requests go to ``/v1/completions`` with the text as the prompt, so both servers see the same tokens whatever
their chat templates (the random-weight Qwen3.5 checkpoint has none).  Every request's numbers are written to
``--json`` (default ``docs/bench/<date>-serve-<commit>.json``, with the full ``git rev-parse HEAD`` and whether
the tree had changes, the machine and the load average), and the table rows are printed from it (``--table``
prints them again from a file).
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import MODELS, build_checkpoint  # noqa: E402

from qwen_runtime.backend.pool import ACTIVATION_CHOICES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["rivers", "prime numbers", "the moon", "sorting", "bread", "volcanoes", "chess", "tea", "bridges",
          "owls", "glass", "maps", "bees", "clocks", "salt", "comets"]
WORD_LIST = """time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number night point home
water room mother area money story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name president team minute idea kid
body information back parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education"""
WORDS = WORD_LIST.split()  # turn 1 of the multi-turn conversations: random picks, about a token each
OURS, LLAMA_SERVER, LLAMA_CPP_PYTHON = "qwen-serve", "llama-server", "llama-cpp-python"
DEFAULT_MODELS = "qwen2.5-0.5b,qwen3.5-0.8b"


@dataclass
class Sample:
    """One request as a client saw it."""

    kind: str  # "sweep", "turn1" or "turn2"
    clients: int  # concurrent clients of its round
    index: int  # the request's number in its round (sweep) or its conversation (turns)
    ttft: float  # seconds from sending to the first content chunk
    seconds: float  # sending to [DONE]
    tokens: int  # completion tokens (usage, else content chunks)
    prompt_tokens: int  # usage's, -1 when the server does not say
    decode_tps: float  # (tokens - 1) / (last chunk - first chunk)
    round: int = 0  # the sweep round it belongs to
    wall: float = 0.0  # the round's wall time (sweep)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_completion(port: int, prompt: str, max_tokens: int) -> tuple[Sample, str]:
    """Stream one greedy text completion: its sample and its text."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    first = last = None
    chunks, usage, text = 0, None, []
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            if choice.get("text"):
                last = time.perf_counter()
                first = first or last
                chunks += 1
                text.append(choice["text"])
    end = time.perf_counter()
    conn.close()
    first, last = first or end, last or end
    tokens = usage["completion_tokens"] if usage else chunks
    prompt_tokens = usage["prompt_tokens"] if usage else -1
    tps = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return Sample("", 0, 0, first - t0, end - t0, tokens, prompt_tokens, tps), "".join(text)


def concurrently(port: int, prompts: list[str], max_tokens: int) -> tuple[float, list[tuple[Sample, str]]]:
    """One streamed completion per prompt, all at once: the wall time from the first request to the last
    [DONE], and each request's sample and text in the prompts' order."""
    results: list[tuple[Sample, str] | None] = [None] * len(prompts)
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
    return wall, [r for r in results if r is not None]


def run_round(port: int, clients: int, max_tokens: int, offset: int) -> list[Sample]:
    """``clients`` requests at once, each with its own prompt."""
    prompts = [f"Write a long story about {TOPICS[(offset + i) % len(TOPICS)]}, number {offset + i}."
               for i in range(clients)]
    wall, done = concurrently(port, prompts, max_tokens)
    out = [s for s, _ in done]
    for i, s in enumerate(out):
        s.kind, s.clients, s.index, s.round, s.wall = "sweep", clients, offset + i, offset, wall
    return out


def sweep(port: int, clients: int, max_tokens: int) -> list[Sample]:
    rounds = 3 if clients == 1 else 1  # a single client: three requests in turn, so TTFT has a median
    return [s for r in range(rounds) for s in run_round(port, clients, max_tokens, offset=r * clients + clients)]


def multi_turn(port: int, conversations: int, words: int, max_tokens: int) -> list[Sample]:
    """Turn 1 (``words`` random words) and turn 2 (turn 1 + answer + a question) of each conversation."""
    out = []
    for c in range(conversations):
        rng = np.random.default_rng(1000 + c)
        turn1 = f"Read this and say what it is about: {' '.join(rng.choice(WORDS, words))}\nAnswer:"
        first, answer = stream_completion(port, turn1, max_tokens)
        second, _ = stream_completion(port, f"{turn1}{answer}\nSay that in one line.\nAnswer:", max_tokens)
        for kind, s in (("turn1", first), ("turn2", second)):
            s.kind, s.clients, s.index = kind, 1, c
            out.append(s)
    return out


def hostile_schema_set() -> list[dict[str, Any]]:
    """The audit's schemas (issue #42): each must be a 400 naming the limit it breaks, at once."""
    defs: dict[str, Any] = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(20)}
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(600):
        deep = {"type": "array", "items": deep}
    return [{"$defs": {**defs, "d20": {"type": "string"}}, "$ref": "#/$defs/d0"},
            {"type": "string", "maxLength": 100_000}, {"type": "string", "maxLength": 1_000_000_000}, deep,
            {"enum": list(range(5000))}]


def benign_schema(round_: int) -> dict[str, Any]:
    """A small object schema, different each round (so compiled each round)."""
    return {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "maxLength": 12, "description": f"round {round_}"},
        "age": {"type": "integer"}, "role": {"enum": ["admin", "user"]}}}


def has_content(line: bytes) -> bool:
    """Whether a server-sent line is a chat chunk with new content."""
    if not line.startswith(b"data: ") or line[6:].strip() == b"[DONE]":
        return False
    return any(c.get("delta", {}).get("content") for c in json.loads(line[6:]).get("choices", []))


def post_chat(port: int, schema: dict[str, Any], max_tokens: int, stream: bool) -> tuple[int, float, float]:
    """One chat request constrained by ``schema``: HTTP status, seconds to the first content (stream) or to
    the answer, and to the end."""
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "Describe a person."}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    first = None
    for line in response:
        if first is None and (not stream or has_content(line)):
            first = time.perf_counter() - t0
    conn.close()
    end = time.perf_counter() - t0
    return response.status, first if first is not None else end, end


def chunk_times(port: int, max_tokens: int, started: threading.Event | None = None) -> list[float]:
    """The arrival time of every content chunk of one streamed greedy chat completion."""
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "Tell a long story."}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    times = []
    for line in conn.getresponse():
        if has_content(line):
            times.append(time.perf_counter())
            if started is not None:
                started.set()
    conn.close()
    return times


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of process ``pid`` in KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM")}


def gaps_ms(times: list[float]) -> dict[str, float]:
    gaps = np.diff(times) * 1000 if len(times) > 1 else np.zeros(1)
    return {"chunks": len(times), "worst_gap_ms": float(gaps.max()), "median_gap_ms": float(np.median(gaps))}


def hostile_schemas(port: int, pid: int, rounds: int, stream_tokens: int) -> dict[str, Any]:
    """One stream alone, then the same stream beside ``rounds`` rounds of hostile and new benign schemas."""
    post_chat(port, benign_schema(-1), 8, stream=False)  # the vocabulary is read once, not measured
    alone = gaps_ms(chunk_times(port, stream_tokens))
    before = memory_kib(pid)
    times: list[float] = []
    started = threading.Event()
    streamer = threading.Thread(target=lambda: times.extend(chunk_times(port, stream_tokens, started)))
    streamer.start()
    started.wait(600)
    hostile, benign = [], []
    for r in range(rounds):
        for i, schema in enumerate(hostile_schema_set()):
            status, _, seconds = post_chat(port, schema, 16, stream=False)
            hostile.append({"round": r, "schema": i, "status": status, "seconds": seconds})
        status, ttft, _ = post_chat(port, benign_schema(r), 24, stream=True)
        benign.append({"round": r, "status": status, "ttft": ttft})
    streamer.join()
    return {"alone": alone, "beside": gaps_ms(times), "memory_before_kib": before, "memory_after_kib": memory_kib(pid),
            "hostile": hostile, "benign": benign}


def hostile_line(run: dict[str, Any]) -> str:
    alone, beside = run["alone"], run["beside"]
    growth = (run["memory_after_kib"]["VmRSS"] - run["memory_before_kib"]["VmRSS"]) / 1024
    statuses = sorted({h["status"] for h in run["hostile"]})
    return (f"hostile schemas: stream worst gap {beside['worst_gap_ms']:.0f} ms beside them "
            f"({alone['worst_gap_ms']:.0f} alone), median {beside['median_gap_ms']:.1f} ms; "
            f"hostile statuses {statuses}, slowest "
            f"{max(h['seconds'] for h in run['hostile']):.3f} s; benign TTFT max "
            f"{max(b['ttft'] for b in run['benign']):.2f} s; RSS growth {growth:.1f} MiB")


# --- the servers --------------------------------------------------------------------------------------------


def our_command(model: Path, port: int, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "qwen_serve", str(model), "--port", str(port), "--max-batch", str(args.max_batch),
            "--threads", str(args.threads), "--ctx", str(args.ctx), "--model-name", "bench", "--log-level", "warning",
            "--activations", args.activations, *args.serve_args.split()]


def llama_server_command(model: Path, port: int, args: argparse.Namespace) -> list[str]:
    from llama_tools import SERVER, build_tools

    binary = build_tools([SERVER])[SERVER]
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
            "-tb", str(args.threads), "-np", str(args.max_batch), "-c", str(args.max_batch * args.ctx),
            "--alias", "bench", "--no-webui", *args.llama_args.split()]


def llama_cpp_python_command(model: Path, port: int, args: argparse.Namespace) -> list[str]:
    missing = [m for m in ("sse_starlette", "starlette_context") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"llama_cpp.server needs {', '.join(missing)} (llama-cpp-python's server extra: "
                           "pip install sse-starlette starlette-context)")
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port",
            str(port), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx",
            str(args.ctx), "--model_alias", "bench"]


COMMANDS = {OURS: our_command, LLAMA_SERVER: llama_server_command, LLAMA_CPP_PYTHON: llama_cpp_python_command}


def version(server: str, command: list[str]) -> str:
    """What the server is: its package's version (llama-server: the llama-cpp-python whose source built it, and
    what ``--version`` says)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        text = package_version("qwen-numpy" if server == OURS else "llama-cpp-python")
    except PackageNotFoundError:
        text = "unknown"
    if server == LLAMA_SERVER:
        done = subprocess.run([command[0], "--version"], capture_output=True, text=True)
        text = f"vendored in llama-cpp-python {text}: {' '.join((done.stdout + done.stderr).split())}"
    return text


def start_server(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    """Start ``cmd`` (output to ``log``) and wait until ``/health`` answers 200."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with code {proc.returncode}; its log: {log}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} did not come up; its log: {log}")


def bench_server(server: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    log = args.cache_dir / "logs" / f"{server}-{model.stem}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    command = COMMANDS[server](model, port, args)
    proc = start_server(command, port, log)
    samples: list[Sample] = []
    hostile = None
    try:
        stream_completion(port, "warm up", 4)
        for n in args.clients:
            got = sweep(port, n, args.max_tokens)
            samples += got
            r = summarize_sweep(got)
            print(f"  {server:>16} {n:>3} clients: {r['aggregate_tps']:7.2f} tok/s, TTFT p50 {r['ttft_p50']:.2f} s "
                  f"p95 {r['ttft_p95']:.2f} s", flush=True)
        if args.conversations:
            got = multi_turn(port, args.conversations, args.turn1_words, args.turn_tokens)
            samples += got
            r = summarize_turns(got)
            print(f"  {server:>16} multi-turn: turn 1 TTFT {r['turn1_ttft_p50']:.2f} s, turn 2 "
                  f"{r['turn2_ttft_p50']:.2f} s ({r['prompt_tokens']} prompt tokens in turn 1)", flush=True)
        if args.hostile_rounds and server == OURS:
            hostile = hostile_schemas(port, proc.pid, args.hostile_rounds, args.hostile_stream_tokens)
            print(f"  {server:>16} {hostile_line(hostile)}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    run = {"server": server, "model": str(model), "command": command, "version": version(server, command),
           "load_before": load_before, "load_after": os.getloadavg(), "samples": [asdict(s) for s in samples]}
    if hostile is not None:
        run["hostile"] = hostile
    return run


# --- summaries and the table rows ----------------------------------------------------------------------------


def summarize_sweep(samples: list[Sample]) -> dict[str, float]:
    walls = {s.round: s.wall for s in samples}
    ttft = np.array([s.ttft for s in samples])
    return {"aggregate_tps": sum(s.tokens for s in samples) / sum(walls.values()),
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p95": float(np.percentile(ttft, 95)),
            "request_tps_median": float(np.median([s.decode_tps for s in samples]))}


def summarize_turns(samples: list[Sample]) -> dict[str, float]:
    one = [s for s in samples if s.kind == "turn1"]
    two = [s for s in samples if s.kind == "turn2"]
    return {"turn1_ttft_p50": float(np.median([s.ttft for s in one])),
            "turn2_ttft_p50": float(np.median([s.ttft for s in two])),
            "prompt_tokens": int(np.median([s.prompt_tokens for s in one]))}


def load_samples(run: dict[str, Any]) -> list[Sample]:
    return [Sample(**s) for s in run["samples"]]


def table(result: dict[str, Any]) -> str:
    """The table rows of a run (docs/performance.md): per model, the sweep of both servers side by side, then the
    multi-turn rows."""
    dirty = " (with uncommitted changes)" if result["dirty"] else ""
    flags = " ".join(a for a in (f"--activations {result.get('activations', 'float')}", result.get("serve_args"))
                    if a and a != "--activations float")
    lines = [f"{result['date']}, commit {result['commit'][:7]}{dirty}, {result['machine']}, "
             f"{result['threads']} threads each, --max-batch/-np {result['max_batch']}, "
             + (f"qwen-serve {flags}, " if flags else "") +
             f"{result['max_tokens']} tokens per request; load average "
             + ", ".join(f"{r['server']} {r['load_before'][0]:.1f}->{r['load_after'][0]:.1f}" for r in result["runs"]),
             ""]
    for model in dict.fromkeys(r["model"] for r in result["runs"]):
        runs = {r["server"]: load_samples(r) for r in result["runs"] if r["model"] == model}
        ours = runs.get(OURS, [])
        peer_name = next((name for name in runs if name != OURS), None)
        peer = runs.get(peer_name, []) if peer_name else []
        lines += [f"{Path(model).name}:", ""]
        if peer_name:
            lines += [f"| clients | {OURS} tok/s | {peer_name} tok/s | ratio | {OURS} TTFT p50 / p95 (s) | "
                      f"{peer_name} TTFT p50 / p95 (s) |", "|---:|---:|---:|---:|---:|---:|"]
        else:
            lines += [f"| clients | {OURS} tok/s | {OURS} TTFT p50 / p95 (s) |", "|---:|---:|---:|"]
        for n in dict.fromkeys(s.clients for s in ours if s.kind == "sweep"):
            a = summarize_sweep([s for s in ours if s.kind == "sweep" and s.clients == n])
            cells = [f"{a['aggregate_tps']:.2f}", f"{a['ttft_p50']:.2f} / {a['ttft_p95']:.2f}"]
            if peer_name:
                theirs = [s for s in peer if s.kind == "sweep" and s.clients == n]
                b = summarize_sweep(theirs) if theirs else None
                cells[1:1] = [f"{b['aggregate_tps']:.2f}", f"{a['aggregate_tps'] / b['aggregate_tps']:.2f}x"] if b \
                    else ["", ""]
                cells.append(f"{b['ttft_p50']:.2f} / {b['ttft_p95']:.2f}" if b else "")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        turns = {name: summarize_turns(s) for name, s in runs.items() if any(x.kind == "turn2" for x in s)}
        if turns:
            lines += ["", "| server | turn-1 prompt tokens | turn-1 TTFT (s) | turn-2 TTFT (s) | turn 1 / turn 2 |",
                      "|---|---:|---:|---:|---:|"]
            for name, t in turns.items():
                lines.append(f"| {name} | {t['prompt_tokens']} | {t['turn1_ttft_p50']:.2f} | {t['turn2_ttft_p50']:.2f} "
                             f"| {t['turn1_ttft_p50'] / t['turn2_ttft_p50']:.1f}x |")
        lines += [f"{r['server']} {hostile_line(r['hostile'])}" for r in result["runs"]
                  if r["model"] == model and "hostile" in r]
        lines.append("")
    return "\n".join(lines)


# --- the run --------------------------------------------------------------------------------------------------


def model_path(name: str, cache: Path, tokenizers: Path, configs: Path) -> Path:
    """A GGUF path as given, or the q8_0 GGUF of a bench_models shape (built and converted once)."""
    if name not in MODELS:
        return Path(name)
    out = cache / "gguf" / f"{name}-q8_0.gguf"
    if not out.is_file():
        src = build_checkpoint(MODELS[name], cache / "hf", tokenizers, configs)
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "qwen_convert", str(src), "-o", str(out), "--dtype", "q8_0"],
                       cwd=ROOT, check=True)
    return out


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}"


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def default_json(commit: str) -> Path:
    stem = f"{datetime.date.today().isoformat()}-serve-{commit[:7]}"
    path, i = ROOT / "docs" / "bench" / f"{stem}.json", 2
    while path.exists():  # never overwrite an earlier run's samples
        path, i = ROOT / "docs" / "bench" / f"{stem}-{i}.json", i + 1
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", type=Path, metavar="JSON", help="only print the table rows of a run's JSON")
    p.add_argument("--models", default=DEFAULT_MODELS,
                   help=f"comma list of bench_models shapes (built as q8_0 GGUF) or GGUF paths "
                   f"(default {DEFAULT_MODELS})")
    p.add_argument("--servers", default=f"{OURS},{LLAMA_SERVER}",
                   help=f"comma list of {OURS}, {LLAMA_SERVER}, {LLAMA_CPP_PYTHON} (default: {OURS},{LLAMA_SERVER})")
    p.add_argument("--clients", default="1,4,8,16", help="comma list of concurrent client counts")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request (default 64)")
    p.add_argument("--max-batch", type=int, default=16, help="rows (slots) of each server (default 16)")
    p.add_argument("--ctx", type=int, default=4096, help="tokens per row (slot) of each server (default 4096)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of each server (default: all CPUs)")
    p.add_argument("--llama-args", default="", metavar="ARGS",
                   help="more llama-server arguments, one string (default: none, its own defaults)")
    p.add_argument("--activations", choices=ACTIVATION_CHOICES, default="float",
                   help="qwen-serve's --activations (default float)")
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help="more qwen-serve arguments, one string, e.g. '--cache-turns' (default: none)")
    p.add_argument("--conversations", type=int, default=3, help="multi-turn conversations (default 3; 0: none)")
    p.add_argument("--turn1-words", type=int, default=1500, help="random words of turn 1 (default 1500)")
    p.add_argument("--turn-tokens", type=int, default=16, help="completion tokens of each turn (default 16)")
    p.add_argument("--hostile-rounds", type=int, default=0, metavar="N",
                   help="rounds of issue #42's hostile schemas beside a stream (qwen-serve only; default 0: none)")
    p.add_argument("--hostile-stream-tokens", type=int, default=256, metavar="N",
                   help="tokens of the stream measured beside the hostile schemas (default 256)")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "qwen-numpy-bench",
                   help="where models are built and server logs go (default ~/.cache/qwen-numpy-bench)")
    p.add_argument("--tokenizers", type=Path, default=ROOT.parent / "shared" / "data" / "tokenizers")
    p.add_argument("--configs", type=Path, default=ROOT.parent / "shared" / "data" / "model-configs")
    p.add_argument("--json", type=Path, help="where the samples go (default docs/bench/<date>-serve-<commit>.json)")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    args.clients = [int(c) for c in args.clients.split(",") if c]
    servers = [s for s in args.servers.split(",") if s]
    if unknown := set(servers) - set(COMMANDS):
        p.error(f"unknown servers {sorted(unknown)}")
    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    if dirty:
        print("warning: the tree has uncommitted changes; the samples name HEAD but ran other code", file=sys.stderr)
    started = datetime.datetime.now(datetime.timezone.utc)
    runs = []
    for name in [m for m in args.models.split(",") if m]:
        model = model_path(name, args.cache_dir, args.tokenizers, args.configs)
        print(f"{model.name}:", flush=True)
        for server in servers:
            runs.append(bench_server(server, model, args))
    result = {"date": started.strftime("%Y-%m-%d %H:%M UTC"), "commit": commit, "dirty": dirty, "machine": machine(),
              "threads": args.threads, "max_batch": args.max_batch, "ctx": args.ctx, "max_tokens": args.max_tokens,
              "clients": args.clients, "conversations": args.conversations, "turn1_words": args.turn1_words,
              "turn_tokens": args.turn_tokens, "activations": args.activations, "serve_args": args.serve_args,
              "seconds": (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), "runs": runs}
    out = args.json or default_json(commit)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nsamples: {out} ({result['seconds']:.0f} s)\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
