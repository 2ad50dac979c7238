"""Speculative decoding by prompt lookup under an editing workload: qwen-serve plain against ``--draft N``.

    python scripts/bench_draft.py [--model PATH|SHAPE] [--draft 8] [--clients 1,4] [--repeats 3]
                                  [--max-tokens 64] [--json out.json]

Each request is a greedy text completion whose prompt holds a passage of the bundled model's held-out Python
source and then the passage's first lines again, so a model that copies repeats the passage (as a summary
quoting its source or an edit of a text does).  Two servers run side by side, plain and ``--draft N``, and each
round goes to both, alternating which goes first, so a pair sees the same machine load.  Per client count it
reports aggregate tok/s of both, the median of the pairs' speed-ups, the share of draft tokens accepted (from
``/metrics``) and whether the texts are identical (they must be: drafting never changes greedy output).  A
trained model shows the effect (``--model`` the bundled ``qwen3-stdlib`` in GGUF, or a real Qwen); random
weights copy nothing and measure the cost of refused drafts.  Server processes, clients and models are
``bench_serve.py``'s.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from bench_serve import (
    OURS,
    ROOT,
    concurrently,
    free_port,
    git,
    machine,
    model_path,
    our_command,
    start_server,
    stream_completion,
)

HELDOUT = ROOT / "qwen_runtime" / "assets" / "qwen3-stdlib" / "heldout.txt"


def edit_prompts(count: int, chars: int = 320) -> list[str]:
    """``count`` prompts: a passage of held-out source, a blank line, and the passage's first three lines again."""
    blocks = [b for b in HELDOUT.read_text().split("\n\n\n") if len(b) > 200]
    prompts = []
    for i in range(count):
        passage = blocks[i % len(blocks)][:chars]
        prompts.append(passage + "\n\n\n" + "\n".join(passage.splitlines()[:3]) + "\n")
    return prompts


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
    wall, done = concurrently(port, prompts, max_tokens)
    return wall, sum(s.tokens for s, _ in done), [text for _, text in done]


def bench_drafting(model: Path, args: argparse.Namespace) -> tuple[list[EditResult], bool]:
    """The editing workload on a plain and a ``--draft`` server, alternately; whether every text was the same."""
    ports = [free_port(), free_port()]
    logs = args.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers = [start_server([*our_command(model, port, args), "--draft", str(n)], port, logs / f"draft-{n}.log")
               for port, n in zip(ports, (0, args.draft), strict=True)]
    results, same = [], True
    try:
        for port in ports:
            stream_completion(port, "warm up", 4)
        for n in args.clients:
            prompts = edit_prompts(n)
            tps: list[list[float]] = [[], []]
            before = draft_counts(ports[1])
            for r in range(args.repeats):
                texts = {}
                for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                    wall, tokens, texts[k] = edit_round(ports[k], prompts, args.max_tokens)
                    tps[k].append(tokens / wall)
                same = same and texts[0] == texts[1]
            after = draft_counts(ports[1])
            results.append(EditResult(n, tps[0], tps[1], after[0] - before[0], after[1] - before[1]))
            e = results[-1]
            print(f"{n:>2} clients: plain {np.median(e.plain_tps):6.2f} tok/s, --draft {args.draft} "
                  f"{np.median(e.draft_tps):6.2f} tok/s (medians of {args.repeats}), speed-up {e.speedup:.2f}x, "
                  f"drafts {e.accepted:.0f} of {e.proposed:.0f} accepted", flush=True)
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=60)
    return results, same


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b",
                   help="a GGUF path or a bench_models shape, built as q8_0 (default qwen2.5-0.5b)")
    p.add_argument("--draft", type=int, default=8, metavar="N", help="qwen-serve --draft of the drafting server "
                   "(default 8)")
    p.add_argument("--clients", default="1,4", help="comma list of concurrent client counts (default 1,4)")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats per client count (default 3)")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request (default 64)")
    p.add_argument("--max-batch", type=int, default=16, help="rows (slots) of each server (default 16)")
    p.add_argument("--ctx", type=int, default=4096, help="tokens per row (slot) of each server (default 4096)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of each server (default: all CPUs)")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "qwen-numpy-bench",
                   help="where models are built and server logs go (default ~/.cache/qwen-numpy-bench)")
    p.add_argument("--tokenizers", type=Path, default=ROOT.parent / "shared" / "data" / "tokenizers")
    p.add_argument("--configs", type=Path, default=ROOT.parent / "shared" / "data" / "model-configs")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()
    args.clients = [int(c) for c in args.clients.split(",") if c]
    model = model_path(args.model, args.cache_dir, args.tokenizers, args.configs)
    results, same = bench_drafting(model, args)
    commit = git("rev-parse", "HEAD")
    print(f"\nmodel {model.name}, editing workload, {args.max_tokens} tokens per request, --draft {args.draft}, "
          f"{args.repeats} alternating repeats, {OURS} at commit {commit[:7]}; machine: {machine()}; "
          f"load average {os.getloadavg()[0]:.2f}\n")
    print("| clients | plain tok/s | draft tok/s | speed-up (median of pairs) | drafts accepted | same text |")
    print("|---:|---:|---:|---:|---:|:---|")
    for e in results:
        share = f"{e.accepted / e.proposed:.0%}" if e.proposed else "none proposed"
        print(f"| {e.clients} | {np.median(e.plain_tps):.2f} | {np.median(e.draft_tps):.2f} | {e.speedup:.2f}x "
              f"| {share} | {'yes' if same else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "commit": commit, "machine": machine(),
                                         "workload": "edit", "draft": args.draft, "max_tokens": args.max_tokens,
                                         "same_text": same, "results": [asdict(r) for r in results]}, indent=2))
    if not same:
        print("the texts with and without --draft differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
