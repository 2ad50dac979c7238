"""The large-model row of the benchmarks: a Qwen2.5-7B-shaped Q4_K_M file, ours against llama.cpp, with and
without a memory limit smaller than the file.

    python scripts/bench_large.py [--cache-dir ~/.cache/qwen-numpy-bench] [--memory-limit 3G]
                                  [--prompt 16] [--new 16] [--repeat 1] [--threads 2] [--json FILE]

1. Builds (once, cached) a bf16 checkpoint with Qwen2.5-7B-Instruct's published shape (``bench_models``:
   15.2 GB of random normal(0, 0.02) weights, the real Qwen2.5 tokenizer), converts it to an fp16 GGUF with
   ``qwen-convert`` and quantizes that with llama.cpp's own quantizer (``llama_model_quantize``, its Q4_K_M
   mixture); the fp16 GGUF is deleted once the Q4_K_M file (about 4.7 GB) exists.
2. Measures both runtimes on that file in fresh processes (``bench_worker.py``), in turn, the file read into the
   page cache first: a short prompt, greedy decode, peak RSS; ours also with ``--activations q8``.
3. Measures both again inside a memory cgroup limited to ``--memory-limit`` (less than the file): the mapped
   weights cannot all stay resident, so each token reads part of them from the page cache or disk again.  A run
   that the kernel kills for memory is recorded as failed, with its exit status.

Free disk needed while building: about 35 GB (checkpoint, fp16 GGUF, Q4_K_M); 20 GB afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_interop
import real_tokenizers
from bench import WORKER, bench_env, convert_ours, machine, run_measured
from bench_models import LARGE_MODELS, build_checkpoint

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
# The runs: (bench_worker engine, our --kernels); our 8-bit activations only without the limit (in turn with the
# others), as they read the same bytes per token.
ENGINES = {"ours": ("ours", None), "ours_q8": ("ours", "numba-q8"), "llama": ("llama", None)}
LIMITED = ("ours", "llama")
FREE_DISK_GB = 35


def parse_size(text: str) -> int:
    """``3G``, ``2500M`` or a byte count -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[list[str]]:
    """A command prefix that runs a process under a memory limit of ``limit`` bytes (page cache included).

    cgroup v1's memory controller where it is writable (a group made and removed here), else
    ``systemd-run --scope -p MemoryMax=``; :class:`RuntimeError` when neither is available.
    """
    if CGROUP_V1.is_dir() and os.access(CGROUP_V1, os.W_OK):
        group = CGROUP_V1 / f"qwen-bench-{os.getpid()}"
        group.mkdir()
        try:
            (group / "memory.limit_in_bytes").write_text(str(limit))
            yield ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh"]
        finally:
            group.rmdir()  # its processes have ended; the pages they charged move to the parent
    elif shutil.which("systemd-run"):
        yield ["systemd-run", "--scope", "--quiet", "-p", f"MemoryMax={limit}"]
    else:
        raise RuntimeError("no writable memory cgroup and no systemd-run: cannot run under a memory limit")


def drop_page_cache(path: Path) -> None:
    """Evict ``path``'s clean pages from the page cache, so a limited run cannot use pages charged elsewhere."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_through(path: Path) -> None:
    """Read ``path`` once, so that the unlimited runs find it in the page cache whatever ran before."""
    with path.open("rb") as handle:
        while handle.read(1 << 24):
            pass


def measure(engine: str, gguf: Path, args: argparse.Namespace, env: dict[str, str],
            prefix: list[str] = ()) -> dict[str, Any]:
    """One fresh-process measurement (``bench_worker.py``) of a name of :data:`ENGINES`; a failed run is recorded
    with its error."""
    worker, kernels = ENGINES[engine]
    cmd = [*prefix, sys.executable, str(WORKER), worker, str(gguf), "--prompt", str(args.prompt),
           "--new", str(args.new), "--threads", str(args.threads), *(["--kernels", kernels] if kernels else [])]
    try:
        wall, rss, out = run_measured(cmd, env)
    except RuntimeError as exc:
        return {"failed": str(exc)[-500:]}
    sample = json.loads(out.strip().splitlines()[-1])
    sample.update(wall_s=wall, process_peak_rss_mib=rss, loadavg_1min=os.getloadavg()[0])
    return sample


def build_q4_k_m(args: argparse.Namespace, env: dict[str, str]) -> tuple[Path, dict[str, Any]]:
    """The cached Q4_K_M GGUF of the 7B shape, built (checkpoint, fp16 GGUF, llama.cpp's quantizer) if absent."""
    gguf = args.cache_dir / "gguf" / "qwen2.5-7b-q4_k_m.gguf"
    steps: dict[str, Any] = {}
    if gguf.is_file():
        return gguf, steps
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.cache_dir).free / 1e9
    if free < FREE_DISK_GB:
        raise SystemExit(f"bench_large: {free:.0f} GB free under {args.cache_dir}, {FREE_DISK_GB} GB needed")
    tokenizers = args.tokenizers or real_tokenizers.tokenizers_dir()
    start = time.perf_counter()
    src = build_checkpoint(LARGE_MODELS["qwen2.5-7b"], args.cache_dir / "hf", tokenizers, args.configs)
    steps["checkpoint_s"] = time.perf_counter() - start
    f16 = args.cache_dir / "gguf" / "qwen2.5-7b-fp16.gguf"
    f16.parent.mkdir(parents=True, exist_ok=True)
    steps["convert_fp16"] = convert_ours(src, f16, "fp16", env)
    start = time.perf_counter()
    partial = gguf.with_suffix(".partial")
    llama_interop.llama_quantize(f16, partial, "Q4_K_M", threads=args.threads)
    partial.rename(gguf)
    steps["llama_quantize_s"] = time.perf_counter() - start
    f16.unlink()
    return gguf, steps


def report(results: dict[str, Any]) -> list[str]:
    def cell(sample: dict[str, Any], key: str, digits: int = 1) -> str:
        return "failed" if "failed" in sample else f"{sample[key]:.{digits}f}"

    lines = [f"Qwen2.5-7B shape, Q4_K_M ({results['file_gb']:.2f} GB), {results['threads']} threads, "
             f"{results['prompt']}-token prompt + {results['new']} tokens:", "",
             "| run | decode tok/s ours / llama | peak RSS MiB ours / llama | wall s ours / llama |",
             "|---|---|---|---|"]
    rows = [("unlimited", "ours", "unlimited"), ("unlimited", "ours_q8", "unlimited, ours with --activations q8"),
            ("limited", "ours", f"memory limit {results['memory_limit']}")]
    for name, engine, label in rows:
        ours, llama = results[name][engine], results[name]["llama"]
        lines.append(f"| {label} | {cell(ours, 'decode_tps', 2)} / {cell(llama, 'decode_tps', 2)} | "
                     f"{cell(ours, 'VmHWM', 0)} / {cell(llama, 'VmHWM', 0)} | "
                     f"{cell(ours, 'wall_s')} / {cell(llama, 'wall_s')} |")
    return lines


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = bench_env(args.threads)
    gguf, steps = build_q4_k_m(args, env)
    results: dict[str, Any] = {"machine": machine(), "file_gb": gguf.stat().st_size / 1e9, "build": steps,
                               "threads": args.threads, "prompt": args.prompt, "new": args.new,
                               "memory_limit": args.memory_limit, "unlimited": {}, "limited": {}}
    read_through(gguf)
    for _ in range(args.repeat):
        for engine in ENGINES:
            results["unlimited"].setdefault(engine, []).append(measure(engine, gguf, args, env))
    with memory_cgroup(parse_size(args.memory_limit)) as prefix:
        for _ in range(args.repeat):
            for engine in LIMITED:
                drop_page_cache(gguf)
                results["limited"].setdefault(engine, []).append(measure(engine, gguf, args, env, prefix))
    for name in ("unlimited", "limited"):  # the median sample by decode speed (failed runs sort first)
        for engine, samples in results[name].items():
            ranked = sorted(samples, key=lambda s: s.get("decode_tps", -1.0))
            results[name][engine] = {**ranked[len(ranked) // 2], "samples": samples}
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "qwen-numpy-bench")
    p.add_argument("--tokenizers", type=Path, default=None, help="folder of the real tokenizers (default: shared)")
    p.add_argument("--configs", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "data"
                   / "model-configs", help="model-configs folder (its Qwen2.5-0.5B text files are reused)")
    p.add_argument("--memory-limit", default="3G", help="memory limit of the limited runs (default 3G)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--new", type=int, default=16, help="greedy tokens decoded (default 16)")
    p.add_argument("--repeat", type=int, default=1, help="repetitions of each measurement (default 1)")
    p.add_argument("--threads", type=int, default=2, help="threads of both runtimes (default 2)")
    p.add_argument("--json", type=Path, default=None, help="results file (default: CACHE_DIR/bench-large-<date>.json)")
    args = p.parse_args()
    results = run(args)
    out = args.json or args.cache_dir / f"bench-large-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=1))
    sys.stdout.write("\n".join(report(results)) + f"\n\nresults written to {out}\n")


if __name__ == "__main__":
    main()
