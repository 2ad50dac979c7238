"""Ceilings of the operations that bound decoding speed, on this machine, with numpy alone.

    python scripts/microbench.py [--rows 4864] [--cols 896] [--repeat 20]

Prints, for one ``[rows, cols]`` matrix (default: a Qwen2.5-0.5B MLP projection) and one activation row:
float32 GEMV straight from memory with 1 and 2 BLAS threads, the contiguous int8 -> float32 cast, and the
runtime's tiled Q8_0 / F16 / BF16 products serial and on the 2-thread pool, in GB/s of stored bytes and
in "equivalent Qwen2.5-0.5B decode tokens/s" (494 M weights at that rate).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numpy as np
from gguf import GGMLQuantizationType, quants
from threadpoolctl import threadpool_limits

from qwen_runtime.pool import Workspace
from qwen_runtime.tensors import QType, StoredTensor
from qwen_runtime.weights import make_weight

QWEN25_WEIGHTS = 494e6


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def report(name: str, seconds: float, nbytes: int, elements: int) -> None:
    per_weight = seconds / elements
    print(f"{name:44s} {seconds * 1e3:8.2f} ms {nbytes / seconds / 1e9:7.2f} GB/s "
          f"{elements / seconds / 1e9:6.2f} G weights/s  ~{1 / (per_weight * QWEN25_WEIGHTS):6.1f} tok/s")


def stored(qtype: QType, w: np.ndarray) -> StoredTensor:
    if qtype == QType.F16:
        data = w.astype(np.float16)
    elif qtype == QType.BF16:
        data = (w.view(np.uint32) >> 16).astype(np.uint16)
    else:
        data = quants.quantize(w, GGMLQuantizationType.Q8_0)
    return StoredTensor("w", qtype, w.shape, "memory", data=data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4864)
    p.add_argument("--cols", type=int, default=896)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, (args.rows, args.cols)).astype(np.float32)
    x = rng.normal(0, 1, (1, args.cols)).astype(np.float32)
    big = [rng.normal(0, 0.02, w.shape).astype(np.float32) for _ in range(16)]  # 16 copies: out of cache
    for threads in (1, 2):
        with threadpool_limits(threads, user_api="blas"):
            t = timed(lambda: [np.matmul(x, m.T) for m in big], args.repeat) / len(big)
        report(f"f32 GEMV from memory, {threads} BLAS thread(s)", t, w.nbytes, w.size)
    q8 = np.ascontiguousarray(stored(QType.Q8_0, w).data)
    ints, out = q8.view(np.int8), np.empty(q8.shape, np.float32)
    report("int8 -> f32 contiguous cast (Q8_0 bytes)", timed(lambda: np.copyto(out, ints, casting="unsafe"),
                                                              args.repeat), q8.nbytes, w.size)
    for qtype in (QType.Q8_0, QType.F16, QType.BF16):
        tensor = stored(qtype, w)
        for threads in (1, 2):
            product = make_weight(tensor, Workspace(threads=threads)).matmul
            report(f"tiled {qtype.name} product, {threads} thread(s)", timed(partial(product, x), args.repeat),
                   tensor.nbytes, w.size)


if __name__ == "__main__":
    main()
