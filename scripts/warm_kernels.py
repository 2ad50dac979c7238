"""Compile every compiled kernel into numba's on-disk cache ahead of time, on every core at once.

    python scripts/warm_kernels.py [--jobs N] [--other-forms]

Each kernel compiles (explicit signature) when a weight that uses it is built, and the compiled decode step when a
model first runs; a process does that one function after another (minutes of CPU from a cold cache, for
every kernel: docs/performance.md).  Here every kernel of each module is compiled, independent groups of modules in
parallel processes, so that no two processes compile the same function; a model fixture of each decode-step
kind (attention; Gated DeltaNet) then runs a few tokens.  ``--other-forms`` also compiles every kernel module for
the kernels' other instruction forms this CPU runs (``jit_setup.other_instruction_forms``: AVX2, AVX-512 without
VNNI), which the tests check in processes of their own.  `.ci/run` calls this before the tests, which then load
every kernel from the cache; with a warm cache it only loads them (seconds).  NUMBA_CACHE_DIR moves the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
KERNELS = "qwen_runtime.backend.kernels."
MODELS = ("qwen2-tiny", "qwen35-tiny")  # one of each decode-step kind


@dataclass
class Task:
    """Modules to import and fixture models to run in one process (``features``: its NUMBA_CPU_FEATURES), once
    the tasks named in ``after`` are done (they compile what its modules import)."""

    name: str
    modules: tuple[str, ...]
    models: tuple[str, ...] = ()
    features: str | None = None
    after: tuple[str, ...] = ()
    process: subprocess.Popen | None = field(default=None, repr=False)
    started: float = 0.0


def plan(other_forms: bool) -> list[Task]:
    """The tasks, the longest first: two groups of kernel modules that import no kernel module of the other
    (kernels.base, shared, compiles in seconds), then the AMX and integer-dot modules (they import both); with
    ``other_forms`` every kernel module again for each other instruction form."""
    groups = [Task("legacy, iq4, lattice", tuple(KERNELS + m for m in ("legacy", "iq4", "lattice"))),
              Task("kquants, dense, q8_0, step", (*(KERNELS + m for m in ("kquants", "dense", "q8_0")),
                                                  "qwen_runtime.models.step_jit"), MODELS)]
    tasks = [*groups, Task("int8, amx", tuple(KERNELS + m for m in ("lanes", "amx", "amx_k", "amx_blocks", "int8",
                                                                    "int8_k", "lattice_int8")),
                           after=tuple(g.name for g in groups))]
    if other_forms:
        from llvmlite import binding as llvm

        from qwen_runtime.backend.jit_setup import other_instruction_forms

        for name, features in other_instruction_forms(llvm.get_host_cpu_features().flatten()).items():
            modules = tuple(KERNELS + m for m in ("q8_0", "dense", "kquants", "iq4", "legacy", "lattice", "lanes",
                                                  "int8", "int8_k"))
            tasks.append(Task(name, modules, features=features))
    return tasks


def warm(modules: list[str], models: list[str]) -> dict[str, float]:
    """Seconds to import each module, then to run 3 tokens of each fixture model with the compiled kernels."""
    import importlib

    from qwen_runtime.backend.kernels.base import ready_module

    times = {}
    for module in modules:
        t = time.perf_counter()
        ready_module(importlib.import_module(module))
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


def start(task: Task) -> None:
    env = dict(os.environ)
    if task.features:
        env["NUMBA_CPU_FEATURES"] = task.features
    args = [sys.executable, __file__, "--worker", json.dumps([list(task.modules), list(task.models)])]
    task.process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)


def run(tasks: list[Task], jobs: int) -> dict[str, float]:
    """Run the tasks, at most ``jobs`` at once, each as soon as the tasks it comes after are done."""
    done: dict[str, float] = {}
    times: dict[str, float] = {}
    waiting, running = list(tasks), []
    while waiting or running:
        ready = [t for t in waiting if all(a in done for a in t.after)]
        while ready and len(running) < jobs:
            task = ready.pop(0)
            waiting.remove(task)
            task.started = time.perf_counter()
            start(task)
            running.append(task)
        finished = next((t for t in running if t.process.poll() is not None), None)
        if finished is None:
            time.sleep(0.05)
            continue
        running.remove(finished)
        out, _ = finished.process.communicate()
        if finished.process.returncode:
            sys.exit(f"warm_kernels: {finished.name} failed (exit status {finished.process.returncode})")
        done[finished.name] = time.perf_counter() - finished.started
        label = f" ({finished.name})" if finished.features else ""
        times.update({f"{name}{label}": s for name, s in json.loads(out.splitlines()[-1]).items()})
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes compiling at once (default: the "
                   "cores)")
    p.add_argument("--other-forms", action="store_true", help="also compile for the other instruction forms")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        modules, models = json.loads(args.worker)
        print(json.dumps(warm(modules, models)))
        return
    t0 = time.perf_counter()
    for name, seconds in run(plan(args.other_forms), max(1, args.jobs)).items():
        print(f"{name:60s} {seconds:7.1f} s")
    print(f"{'wall':60s} {time.perf_counter() - t0:7.1f} s")


if __name__ == "__main__":
    main()
