"""Time to first token of a chat's turn 2 with qwen-serve's prefix cache off and on (the engine, one process).

    python scripts/bench_prefix_cache.py MODEL [MODEL ...] [--turn1 1500] [--json out.json]

Turn 1 is ``--turn1`` random token ids, answered greedily with 8 tokens; turn 2 is turn 1, its answer and 40
more ids, as a chat's next prompt is the whole history.  The same model runs once with the cache off and
once on (a fresh engine each, batch of one); the cache turns turn 2's prefill into a restore of turn 1's
blocks plus the rest.  A third run has ``cache_turns`` on (``qwen-serve --cache-turns``): turn 2 resumes where
turn 1's answer stopped and prefills only the 40 new ids and the answer's last token.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np

import qwen_runtime
from qwen_runtime.generation.sampling import SamplingParams
from qwen_runtime.text.chat import chat_format
from qwen_serve.engine import Delta, Done, Engine, Failed, Job


def first_token(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Seconds from submitting ``prompt`` to its first token, and the tokens generated."""
    first: list[float] = []
    out: list[int] = []
    done = threading.Event()
    start = time.perf_counter()

    def emit(event: object) -> None:
        if isinstance(event, Delta):
            if not first:
                first.append(time.perf_counter() - start)
            out.extend(event.token_ids)
        elif isinstance(event, (Done, Failed)):
            done.set()

    engine.submit(Job(prompt, tokens, SamplingParams(), emit))
    done.wait()
    return first[0], out


def measure(path: str, turn1_tokens: int) -> dict[str, object]:
    model = qwen_runtime.load(path)
    tokenizer = chat_format(model).tokenizer
    rng = np.random.default_rng(0)
    turn1 = rng.integers(1000, min(100000, model.config.vocab_size), turn1_tokens).tolist()
    extra = rng.integers(1000, min(100000, model.config.vocab_size), 40).tolist()
    runs = []
    for name, cache, turns in (("off", 0, False), ("on", None, False), ("turns", None, True)):
        engine = Engine(model, tokenizer, frozenset(), max_batch=1, max_context=turn1_tokens + 512,
                        cache_memory=cache, cache_turns=turns)
        engine.start()
        try:
            t1, answer = first_token(engine, turn1, 8)
            t2, _ = first_token(engine, turn1 + answer + extra, 4)
        finally:
            engine.stop()
        runs.append({"cache": name, "turn1_ttft_s": t1, "turn2_ttft_s": t2})
        print(json.dumps({"model": path, **runs[-1]}), flush=True)
    return {"model": path, "turn1_tokens": turn1_tokens, "runs": runs,
            "turn2_speedup": runs[0]["turn2_ttft_s"] / runs[1]["turn2_ttft_s"],
            "turn2_speedup_turns": runs[0]["turn2_ttft_s"] / runs[2]["turn2_ttft_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--turn1", type=int, default=1500, help="tokens of turn 1 (default 1500)")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()
    results = [measure(m, args.turn1) for m in args.models]
    for r in results:
        print(f"{r['model']}: turn-2 TTFT {r['runs'][0]['turn2_ttft_s']:.2f} s off, "
              f"{r['runs'][1]['turn2_ttft_s']:.2f} s on: {r['turn2_speedup']:.1f}x, "
              f"{r['runs'][2]['turn2_ttft_s']:.2f} s with turns: {r['turn2_speedup_turns']:.1f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
