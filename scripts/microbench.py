"""Ceilings of the operations that bound decoding speed, on this machine, with numpy alone.

    python scripts/microbench.py [--rows 4864] [--cols 896] [--repeat 20] [--batch 8]

For ``[rows, cols]`` matrices (default: a Qwen2.5-0.5B MLP projection, 16 copies so that the weights come from
memory, not cache) and one activation row, it prints:

* the plain numpy way: a float32 GEMV ``x @ W.T`` straight from memory with 1 and 2 BLAS threads (what the
  numpy peer does for every matrix), and a Q8_0 matrix dequantized whole then multiplied (what a from-scratch
  numpy runtime does per token if it keeps the weights quantized);
* the pieces of our Q8_0 kernel: the contiguous int8 -> float32 cast of the stored bytes;
* the runtime's tiled Q8_0 / F16 / BF16 products with 1 row on one thread and on the 2-thread pool, and with
  ``--batch`` rows on the pool (batched decode).

Columns: wall ms per matrix (median), GB/s of stored bytes, G weights/s, "equivalent Qwen2.5-0.5B decode
tokens/s" (494 M weights per token at that rate, times the rows), and for one-thread lines the CPU time of the
calling thread (minimum) with its rate: on a shared machine that is the figure other people's load moves least.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType, quants
from threadpoolctl import threadpool_limits

from qwen_runtime.backend.pool import Workspace
from qwen_runtime.backend.weights import make_weight
from qwen_runtime.formats.tensors import QType, StoredTensor

QWEN25_WEIGHTS = 494e6
COPIES = 16  # matrices cycled through per timing: 16 x 17 MB of float32 is far beyond the L3 cache


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(median wall seconds, minimum calling-thread CPU seconds) of ``fn`` over ``repeat`` calls after a warm-up."""
    fn()
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    return float(np.median(wall)), float(min(cpu))


def report(name: str, seconds: tuple[float, float], nbytes: int, elements: int, rows: int = 1,
           cpu: bool = False) -> None:
    wall, thread = (s / COPIES for s in seconds)
    cpu_text = f"cpu {thread * 1e3:6.2f} ms = {elements / thread / 1e9:5.2f} G weights/s" if cpu else ""
    print(f"{name:50s} {wall * 1e3:7.2f} ms {nbytes / wall / 1e9:6.2f} GB/s {elements / wall / 1e9:6.2f} G weights/s "
          f"~{rows * elements / wall / QWEN25_WEIGHTS:6.1f} tok/s  {cpu_text}")


def stored(qtype: QType, w: np.ndarray) -> StoredTensor:
    if qtype == QType.F16:
        data = w.astype(np.float16)
    elif qtype == QType.BF16:
        data = (w.view(np.uint32) >> 16).astype(np.uint16)
    else:
        data = quants.quantize(w, GGMLQuantizationType(qtype))
    return StoredTensor("w", qtype, w.shape, "memory", data=data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4864)
    p.add_argument("--cols", type=int, default=896)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    ws = [rng.normal(0, 0.02, (args.rows, args.cols)).astype(np.float32) for _ in range(COPIES)]
    w = ws[0]
    x = rng.normal(0, 1, (1, args.cols)).astype(np.float32)
    xs = rng.normal(0, 1, (args.batch, args.cols)).astype(np.float32)
    for threads in (1, 2):
        with threadpool_limits(threads, user_api="blas"):
            t = timed(lambda: [np.matmul(x, m.T) for m in ws], args.repeat)
        report(f"plain: f32 GEMV x @ W.T, {threads} BLAS thread(s)", t, w.nbytes, w.size, cpu=threads == 1)
    q8 = [np.ascontiguousarray(stored(QType.Q8_0, m).data) for m in ws]
    with threadpool_limits(2, user_api="blas"):
        t = timed(lambda: [np.matmul(x, quants.dequantize(q, GGMLQuantizationType.Q8_0).T) for q in q8],
                  max(3, args.repeat // 4))
    report("plain: Q8_0 dequantized whole, then x @ W.T", t, q8[0].nbytes, w.size)
    out = np.empty(q8[0].shape, np.float32)
    t = timed(lambda: [np.copyto(out, q.view(np.int8), casting="unsafe") for q in q8], args.repeat)
    report("int8 -> f32 contiguous cast (Q8_0 bytes)", t, q8[0].nbytes, w.size, cpu=True)
    for qtype in (QType.Q8_0, QType.F16, QType.BF16):
        tensors = [stored(qtype, m) for m in ws]
        for threads, rows in ((1, 1), (2, 1), (2, args.batch)):
            weights = [make_weight(tensor, Workspace(threads=threads)) for tensor in tensors]
            act = x if rows == 1 else xs
            report(f"tiled {qtype.name} product, {rows} row(s), {threads} thread(s)",
                   timed(lambda: [m.matmul(act) for m in weights], args.repeat),  # noqa: B023 (used at once)
                   tensors[0].nbytes, w.size, rows, cpu=threads == 1)


if __name__ == "__main__":
    main()
