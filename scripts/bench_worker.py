"""One benchmark measurement in a fresh process; prints one JSON object on stdout's last line.

    python scripts/bench_worker.py ENGINE MODEL_FILE --prompt N --new N [--batch B] [--threads 2] [--kernels K]
                                  [--cache-type T]
    python scripts/bench_worker.py jit -          import numba and every compiled-kernel module, timed
    python scripts/bench_worker.py start FILE     load FILE (--kernels K) and generate one token: CPU seconds
    python scripts/bench_worker.py floor -        numba alone: import it and call one cached function, CPU seconds
    python scripts/bench_worker.py read FILE      plain read bandwidth: numpy sums over FILE on --threads threads

ENGINE is ``ours`` (qwen_runtime, with ``--kernels`` numba, numba-q8 or numpy), ``numpy`` (the plain numpy peer,
``numpy_peer.py``) or ``llama`` (llama-cpp-python).  It loads the model, prefills ``--batch``
prompts of ``--prompt`` tokens and greedily decodes ``--new`` tokens per row, and reports load time, time
to first token, prefill tokens/s and (aggregate) decode tokens/s.  Prompts are seeded random token ids
(the same for both engines) and decoding never stops early, so both engines do exactly the same work.
Memory comes from /proc/self/status after the last token, while the model is still loaded: VmHWM (peak RSS),
RssAnon and RssFile.

Each engine runs on its own defaults unless ``--cache-type`` names the KV cache type of keys and values for both
(f32, f16, bf16, q8_0, q4_0: ours ``load(cache_type_k=, cache_type_v=)``, llama.cpp's ``-ctk/-ctv``).  llama.cpp
runs with flash attention on: its library's default (``LLAMA_FLASH_ATTN_TYPE_AUTO``, which llama-cli and
llama-server keep) turns it on for the CPU, and it is required for a quantized V cache; llama-cpp-python's
``Llama(flash_attn=False)`` default would turn it off and leave llama.cpp's long-context attention slower than its
users see it.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import qwen_runtime

FIRST_ID, LAST_ID = 1000, 100000  # ordinary BPE tokens in every Qwen vocabulary


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_ID, LAST_ID, (batch, length)).tolist()


def memory_mib() -> dict[str, float]:
    """Peak RSS and the anonymous / file-backed resident memory now, in MiB (sampled while the model lives)."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile"):
                values[key] = int(rest.split()[0]) / 1024
    return values


def weight_bytes_per_token(model: qwen_runtime.Model) -> int:
    """Stored bytes of the matrices one decode step reads: every matrix but the embedding, which only gives
    rows, unless it is also the (tied) output matrix."""
    matrices = {t.name: t.nbytes for t in model.files.tensors.values() if len(t.shape) == 2}
    tied = "output.weight" not in matrices
    return sum(n for name, n in matrices.items() if tied or name != "token_embd.weight")


def run_ours(path: str, batch: int, prompt: int, new: int, threads: int, kernels: str,
             cache_type: str | None = None) -> dict[str, float]:
    import qwen_runtime

    t0 = time.perf_counter()
    name, _, activations = kernels.partition("-")  # numba-q8: compiled kernels with 8-bit activations
    caches = {} if cache_type is None else {"cache_type_k": cache_type, "cache_type_v": cache_type}
    model = qwen_runtime.load(path, threads=threads, kernels=name, activations=activations or "auto", **caches)
    loaded = time.perf_counter()
    gen = qwen_runtime.stream(model, prompts(batch, prompt), max_new_tokens=new, use_tokenizer=False)
    next(iter(gen))
    first = time.perf_counter()
    gen.run()
    s = gen.stats
    return {"load_s": loaded - t0, "ttft_s": first - loaded, "prefill_tps": s.prefill_tokens_per_second,
            "decode_tps": s.decode_tokens_per_second, "weight_gb_per_token": weight_bytes_per_token(model) / 1e9,
            **memory_mib()}


def run_jit() -> dict[str, float]:
    """Seconds to import numba, then each compiled-kernel module (compiling, or loading numba's cache)."""
    import importlib

    t0 = time.perf_counter()
    import numba  # noqa: F401

    out = {"import_numba_s": time.perf_counter() - t0}
    for module in ("base", "q8_0", "kquants", "legacy", "iq4", "dense", "int8",
                   "int8_k"):
        t = time.perf_counter()
        importlib.import_module(f"qwen_runtime.backend.kernels.{module}")
        out[f"{module}_s"] = time.perf_counter() - t
    out["total_s"] = time.perf_counter() - t0
    return out


def run_start(path: str, kernels: str) -> dict[str, float]:
    """CPU seconds (user + system, every thread) from process start to the first token of one 5-token prompt:
    the start-up a user waits for.  ``--kernels numba`` minus ``numpy`` is the compiled kernels' start-up."""
    import qwen_runtime

    model = qwen_runtime.load(path, threads=1, kernels=kernels)
    prompt = [list(range(1, 6))]  # ids below any vocabulary's size (the bundled model has 4,160)
    next(iter(qwen_runtime.stream(model, prompt, max_new_tokens=2, use_tokenizer=False)))
    return {"cpu_s": cpu_seconds()}


def run_floor() -> dict[str, float]:
    """CPU seconds numba itself adds to a process (numpy already imported): its import and its CPU target's set-up,
    up to the first call of one trivial compiled function read from its cache.  The floor under the compiled
    kernels' warm start-up (``start`` with numba minus numpy)."""
    before = cpu_seconds()
    import numba

    numba.njit(cache=True)(_one_more)(1)
    return {"cpu_s": cpu_seconds() - before}


def cpu_seconds() -> float:
    """CPU seconds of this process so far, user and system, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _one_more(x: int) -> int:
    return x + 1


def run_read(path: str, threads: int) -> dict[str, float]:
    """GB/s of plain numpy sums over the memory-mapped ``path`` (read once first so it is in the page cache),
    split over ``threads`` threads (numpy releases the GIL in reductions): the physical limit of a decode step
    that reads its weights once."""
    from concurrent.futures import ThreadPoolExecutor

    data = np.memmap(path, np.uint8, "r")
    words = data[: data.size // 8 * 8].view(np.int64)  # integer sums: no subnormal slow paths
    parts = np.array_split(words, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(4):  # the first pass faults the pages in
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, words.nbytes / (time.perf_counter() - t) / 1e9)
    return {"read_gbps": best, "file_gb": words.nbytes / 1e9}


def run_numpy(path: str, batch: int, prompt: int, new: int) -> dict[str, float]:
    import numpy_peer

    if batch != 1:
        raise SystemExit("numpy: only single-stream measurements")
    return {**numpy_peer.run(path, prompts(1, prompt)[0], new), **memory_mib()}


def run_llama(path: str, batch: int, prompt: int, new: int, threads: int,
              cache_type: str | None = None) -> dict[str, float]:
    import gguf
    import llama_cpp

    if batch != 1:
        raise SystemExit("llama: only single-stream measurements")
    caches = {} if cache_type is None else dict.fromkeys(("type_k", "type_v"),
                                                          int(gguf.GGMLQuantizationType[cache_type.upper()]))
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=prompt + new, n_batch=512, n_threads=threads, n_threads_batch=threads,
                          flash_attn=True, verbose=False, **caches)
    loaded = time.perf_counter()
    n_vocab = llm.n_vocab()
    ids = prompts(1, prompt)[0]

    def next_token() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits))

    llm.eval(ids)
    token = next_token()
    first = time.perf_counter()
    for _ in range(new - 1):
        llm.eval([token])
        token = next_token()
    done = time.perf_counter()
    return {"load_s": loaded - t0, "ttft_s": first - loaded, "prefill_tps": prompt / (first - loaded),
            "decode_tps": (new - 1) / (done - first), **memory_mib()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine", choices=("ours", "numpy", "llama", "jit", "start", "floor", "read"))
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=0)
    p.add_argument("--new", type=int, default=0)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernels", default="numba",
                   choices=("numba", "numba-float", "numba-q8-prompts", "numba-q8", "numpy"),
                   help="ours: the kernels to use, with the command lines' default activations (auto), or numba-X: "
                   "load(..., activations=X)")
    p.add_argument("--cache-type", help="ours and llama: the KV cache type of keys and values, one of "
                   "qwen_runtime.backend.cache.CACHE_TYPES (default: each engine's own)")
    args = p.parse_args()
    if args.engine == "jit":
        result = run_jit()
    elif args.engine == "start":
        result = run_start(args.model, args.kernels)
    elif args.engine == "floor":
        result = run_floor()
    elif args.engine == "read":
        result = run_read(args.model, args.threads)
    elif args.engine == "ours":
        result = run_ours(args.model, args.batch, args.prompt, args.new, args.threads, args.kernels, args.cache_type)
    elif args.engine == "numpy":
        result = run_numpy(args.model, args.batch, args.prompt, args.new)
    else:
        result = run_llama(args.model, args.batch, args.prompt, args.new, args.threads, args.cache_type)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
