"""Where a decode step's time goes outside the matrix products, per op, numpy kernels against numba ones.

    OPENBLAS_NUM_THREADS=1 python scripts/profile_decode.py MODEL.gguf [--prompt 128] [--steps 32]
                                                            [--kernels numpy,numba] [--batch 1]

Loads the model, prefills one seeded random prompt, then runs ``--steps`` greedy decode steps per kernel set,
alternating the sets step by step on the same cache (A/B in one process, so both see the same machine load).
Every op named in ``OPS`` (the numpy functions and their compiled twins under the same labels) is wrapped in a
timer that counts its own wall time only (time in a nested timed call is charged to the inner op).  Prints the
median ms per step of each op per kernel set and, as "outside the products", the sum of those medians but the
products': on a shared machine a step's total moves with other processes' load, an op's median much less.  A
wrapper costs about a microsecond per call (``time.thread_time`` cost several), charged to its caller.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

import qwen_runtime
from qwen_runtime.backend import cache as cache_module
from qwen_runtime.backend import ops_jit, weights
from qwen_runtime.models import attention, attention_jit, gated_delta_jit, qwen35, transformer
from qwen_runtime.models import gated_delta as gd

PRODUCTS = "matrix products"
# (owner, attribute, label): module functions are wrapped where the model code looks them up.
OPS: list[tuple[Any, str, str]] = [
    (weights.Weight, "matmul", PRODUCTS), (weights.F32Weight, "rows", PRODUCTS),
    (weights.TiledWeight, "rows", PRODUCTS), (attention, "matmul_many", PRODUCTS),
    (qwen35, "matmul_many", PRODUCTS), (transformer, "gated_matmul", PRODUCTS),
    (transformer, "rms_norm", "rms_norm (block, final)"), (attention, "rms_norm", "rms_norm (q/k)"),
    (qwen35, "rms_norm", "rms_norm (q/k)"), (attention, "apply_rope", "rope"), (qwen35, "apply_rope", "rope"),
    (cache_module.KVCache, "update", "kv cache write"), (attention, "attend", "attention over the cache"),
    (qwen35, "attend", "attention over the cache"), (qwen35, "sigmoid", "sigmoid gate"),
    (gd, "causal_conv1d_inplace", "conv1d step"), (gd, "prepare_qk", "q/k l2 norm"), (gd, "gates", "gates"),
    (gd, "delta_rule", "delta rule step"), (gd, "gated_rms_norm", "gated rms_norm"),
    (attention.Attention, "__call__", "attention glue"), (qwen35.GatedAttention, "__call__", "attention glue"),
    (qwen35.GatedDeltaNet, "__call__", "delta-net glue"), (qwen35.GatedDeltaNet, "_heads", "delta-net glue"),
    (ops_jit, "rms_norm", "rms_norm (block, final)"), (ops_jit, "add_rms_norm", "rms_norm (block, final)"),
    (attention_jit, "prepare_heads", "q/k/v: bias, norm, rope, cache write"),
    (attention_jit, "attend", "attention over the cache"), (attention_jit, "gate", "sigmoid gate"),
    (attention_jit, "attention_step", "q/k/v prep + attention (one compiled call)"),
    (gated_delta_jit, "conv_step", "conv1d step"),
    (gated_delta_jit, "delta_heads", "delta rule step (+ l2 norms, gates, gated norm)"),
    (transformer.Block, "__call__", "block glue (residual adds)"),
    (transformer.Model, "forward", "model glue (embedding ids, head slicing)"),
]


class Timers:
    """Own time per label: a call's time minus the time of timed calls nested in it."""

    def __init__(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self.stack: list[float] = []  # time of nested timed calls, one entry per open call

    def wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                nested = self.stack.pop()
                self.own[label] += spent - nested
                if self.stack:
                    self.stack[-1] += spent
        return timed

    def install(self) -> None:
        for owner, name, label in OPS:
            setattr(owner, name, self.wrap(getattr(owner, name), label))


def stub_products() -> None:
    """Every matrix product returns a fresh array of 0.01 of its result's shape (the ops after it run as usual)."""
    def product(w: weights.Weight, x: np.ndarray) -> np.ndarray:
        return np.full((x.shape[0], w.out_features), 0.01, np.float32)

    def many(ws: list[weights.Weight], x: np.ndarray) -> list[np.ndarray]:
        return [product(w, x) for w in ws]

    weights.Weight.matmul = product
    for module in (attention, qwen35):
        module.matmul_many = many
    transformer.gated_matmul = lambda gate, up, x: product(gate, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kernels", default="numpy,numba")
    parser.add_argument("--stub-products", action="store_true",
                        help="after the prefill, replace every matrix product by an array of 0.01 of its shape, so "
                             "that a step is all outside the products (no wrappers either: one clean number)")
    args = parser.parse_args()
    kernel_sets = args.kernels.split(",")
    model = qwen_runtime.load(args.model)
    timers = Timers()
    if not args.stub_products:
        timers.install()
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 100000, (args.batch, args.prompt))
    cache = model.make_cache(args.batch, args.prompt + args.steps * len(kernel_sets) + 2)
    logits = model.forward(ids, cache, last_only=True)
    if args.stub_products:
        stub_products()
    for kernels in kernel_sets:  # warm-up: compile (or load from numba's cache) and grow the scratch
        model.workspace.kernels = kernels
        logits = model.forward(logits.argmax(-1)[:, None], cache, last_only=True)
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in kernel_sets}
    for _ in range(args.steps):
        for kernels in kernel_sets:
            model.workspace.kernels = kernels
            timers.own.clear()
            start = time.perf_counter()
            logits = model.forward(logits.argmax(-1)[:, None], cache, last_only=True)
            total = time.perf_counter() - start
            step = dict(timers.own)
            step["step total"] = total
            samples[kernels].append(step)
    labels = sorted({label for runs in samples.values() for s in runs for label in s},
                    key=lambda label: (label in ("step total", PRODUCTS), label))
    print(f"{args.model}: prompt {args.prompt}, batch {args.batch}, {args.steps} steps per set, "
          f"median ms per step")
    print(f"{'op':44s}" + "".join(f"{k:>10s}" for k in kernel_sets))
    medians = {k: {label: statistics.median(s.get(label, 0.0) for s in samples[k]) * 1e3 for label in labels}
               for k in kernel_sets}
    for label in labels:
        print(f"{label:44s}" + "".join(f"{medians[k][label]:10.3f}" for k in kernel_sets))
    totals = ("step total", PRODUCTS)
    outside = [sum(v for label, v in medians[k].items() if label not in totals) for k in kernel_sets]
    print(f"{'outside the products':44s}" + "".join(f"{c:10.3f}" for c in outside))


if __name__ == "__main__":
    main()
