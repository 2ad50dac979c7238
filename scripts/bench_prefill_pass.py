"""Eight prompts' chunks prefilled one forward pass each (the engine before issue #46) against one
``Model.prefill_many`` pass, in paired rounds in one process: the ratio is what a server's joining prompts gain.

    python scripts/bench_prefill_pass.py MODEL.gguf TOKENS ROUNDS
"""

from __future__ import annotations

import sys
import time

import numpy as np

import qwen_runtime
from qwen_serve.slots import SlotCache

PROMPTS = 8


def main(path: str, tokens: int, rounds: int) -> None:
    model = qwen_runtime.load(path, kernels="numba")
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, model.config.vocab_size, tokens).tolist() for _ in range(PROMPTS)]
    slots = SlotCache(model, PROMPTS, tokens + 1)

    def alone() -> None:
        for i, chunk in enumerate(chunks):
            slots.reset(i)
            model.forward(np.asarray([chunk]), slots.rows(i, i + 1), last_only=True)

    def together() -> None:
        for i in range(PROMPTS):
            slots.reset(i)
        model.prefill_many(chunks, [slots.rows(i, i + 1) for i in range(PROMPTS)])

    one, both = [], []
    with model.workspace.keep_scratch():
        alone()
        together()  # compiled code and scratch buffers loaded before the rounds
        for _ in range(rounds):
            t0 = time.perf_counter()
            alone()
            t1 = time.perf_counter()
            together()
            one.append(t1 - t0)
            both.append(time.perf_counter() - t1)
    ratios = np.asarray(one) / np.asarray(both)
    print(f"{tokens}-token prompts x {PROMPTS}: one pass each median {np.median(one):.3f} s, together median "
          f"{np.median(both):.3f} s, speed-up min/median/max {ratios.min():.2f}/{np.median(ratios):.2f}/"
          f"{ratios.max():.2f} over {rounds} paired rounds")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
