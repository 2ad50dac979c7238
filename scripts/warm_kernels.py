"""Compile every compiled kernel into numba's on-disk cache ahead of time, on every core at once.

    python scripts/warm_kernels.py [--jobs N]

The kernel modules compile their kernels when first imported (explicit signatures) and the compiled decode step
when a model first runs; one process does that one function after another (about 4 minutes of CPU on this
machine from a cold cache).  Here independent groups of modules compile in parallel processes, each group's
modules in import order so that no two processes compile the same function; a model fixture of each decode-step
kind (attention; Gated DeltaNet) then runs a few tokens.  `.ci/run` calls this before the tests, which then load
every kernel from the cache.  With a warm cache it only loads them (seconds).  NUMBA_CACHE_DIR moves the cache.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
# Groups of kernel modules that import no kernel module of another group (jit_base is shared: it compiles in
# seconds), the longest first; the last group's modules import the others' and run when those are cached.
GROUPS = (
    ("qwen_runtime.quants.jit_legacy", "qwen_runtime.quants.jit_iq4", "qwen_runtime.quants.jit_int8"),
    ("qwen_runtime.quants.jit_kquants", "qwen_runtime.quants.jit_dense", "qwen_runtime.quants.jit_q8_0",
     "qwen_runtime.models.step_jit"),
)
LAST = ("qwen_runtime.quants.jit_int8_k",)
MODELS = ("qwen2-tiny", "qwen35-tiny")  # one of each decode-step kind


def warm(modules: list[str], models: list[str]) -> dict[str, float]:
    """Seconds to import each module, then to run 3 tokens of each fixture model with the compiled kernels."""
    import importlib

    times = {}
    for module in modules:
        t = time.perf_counter()
        importlib.import_module(module)
        times[module] = time.perf_counter() - t
    if models:
        import qwen_runtime

        for name in models:
            t = time.perf_counter()
            model = qwen_runtime.load(FIXTURES / name, threads=1, kernels="numba")
            for _ in qwen_runtime.stream(model, [[1, 2, 3]], max_new_tokens=3, use_tokenizer=False):
                pass
            times[name] = time.perf_counter() - t
    return times


def spawn(modules: tuple[str, ...], models: tuple[str, ...]) -> subprocess.Popen:
    args = [sys.executable, __file__, "--worker", json.dumps([list(modules), list(models)])]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=2, help="processes compiling at once (default 2)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        modules, models = json.loads(args.worker)
        print(json.dumps(warm(modules, models)))
        return
    t0 = time.perf_counter()
    plan = [(group, MODELS if i == len(GROUPS) - 1 else ()) for i, group in enumerate(GROUPS)]
    waves = [plan[i:i + max(1, args.jobs)] for i in range(0, len(plan), max(1, args.jobs))] + [[(LAST, ())]]
    times: dict[str, float] = {}
    for wave in waves:
        workers = [spawn(modules, models) for modules, models in wave]
        for worker in workers:
            out, _ = worker.communicate()
            if worker.returncode:
                sys.exit(f"warm_kernels: a worker failed (exit status {worker.returncode})")
            times.update(json.loads(out.splitlines()[-1]))
    for name, seconds in times.items():
        print(f"{name:40s} {seconds:7.1f} s")
    print(f"{'wall':40s} {time.perf_counter() - t0:7.1f} s")


if __name__ == "__main__":
    main()
