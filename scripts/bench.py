"""Benchmark qwen_runtime and qwen-convert against llama.cpp, in one run, on full-size random-weight models.

    python scripts/bench.py [--quick] [--models qwen2.5-0.5b,...] [--dtypes fp32,fp16,q8_0,q4_0,q4_k_m] [--repeat 3]
                            [--kernels numba,numpy] [--cache-dir ~/.cache/qwen-numpy-bench] [--tokenizers DIR]

1. Builds (once, cached) bf16 checkpoints with the shapes of Qwen2.5-0.5B, Qwen3-0.6B and Qwen3.5-0.8B.
2. Converts each to GGUF fp32 / fp16 / q8_0 with ``qwen-convert`` and with llama.cpp's ``convert_hf_to_gguf.py``
   (from the installed llama-cpp-python's sdist, fetched with ``pip download`` into the cache), measuring
   wall time and peak RSS of each converter process.  q4_0: ``qwen-convert --dtype q4_0`` against llama.cpp's
   quantizer (``llama_model_quantize``, Q4_0 with its Q6_K output, from the fp32 GGUF: the same bytes);
   q4_k_m: end to end from the HF bf16 checkpoint, ``qwen-convert --dtype q4_k_m`` against llama.cpp's two
   steps (its converter to a bf16 GGUF, then its quantizer to Q4_K_M), timed together (wall: the sum; peak
   RSS: the larger of the two processes'); our file is the one both runtimes then run.
3. Runs every measurement in a fresh process (``bench_worker.py``), for our runtime, the plain numpy peer
   (``numpy_peer.py``: whole-matrix ``x @ W.T`` with BLAS's own threads; Qwen2/Qwen3 only) and llama.cpp on
   *our* GGUF with the same thread count, interleaved, ``--repeat`` times: a 128-token prompt + 128 greedy
   tokens, 8 such prompts at once (ours), and decoding after a 2,048-token prompt.
   ``--kernels``: the first (default numba) runs every measurement; the others (default numpy, the reference
   path) the single-stream prompt + decode, as a column beside it.
4. Measures, once per run: the compiled kernels' first-ever compile (importing numba and every kernel module,
   with a fresh ``NUMBA_CACHE_DIR``) and warm-cache start-up (from that cache: process start to the first token
   of the bundled model in q8_0, numba minus numpy, CPU and wall seconds), and a plain read
   bandwidth (numpy sums over the largest GGUF, larger than any cache, on ``--threads`` threads; the fastest of
   samples taken before, between and after the models: :func:`best_read`), printed
   beside each decode row with that row's decode bandwidth (stored bytes of the matrices read per token x
   tokens/s).
5. Prints medians and ours/llama.cpp ratios (and ours / plain numpy / llama.cpp side by side), the ratios
   paired round by round (:func:`paired_ratios`: the two engines' processes of a round run back to back, so on a
   machine whose speed drifts the median of many rounds' ratios is steadier than the ratio of two medians), and
   writes everything (with every sample) to a JSON file.

For stable numbers run it alone on the machine; ratios within one run are what to compare.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_interop  # fetching llama.cpp's converter, its --outtype names (shared with the interop tests)
import real_tokenizers
from bench_models import LARGE_MODELS, MODELS, build_checkpoint, tensor_shapes

REPO = Path(__file__).resolve().parents[1]

WORKER = Path(__file__).resolve().with_name("bench_worker.py")
DATA = REPO / "tests" / "data"
BUNDLED = REPO / "qwen_runtime" / "assets" / "qwen3-stdlib"
DTYPES = ("fp32", "fp16", "q8_0", "q4_0", "q4_k_m")
# dtype -> llama.cpp's quantizer file type (and pure or not) for the rows quantized from the fp32 GGUF.
LLAMA_QUANTIZED = {"q4_0": ("Q4_0", False)}
# dtype -> (llama.cpp converter --outtype, quantizer file type): the rows made by its two steps from HF.
LLAMA_TWO_STEP = {"q4_k_m": ("bf16", "Q4_K_M")}
OURS = ("fp32", "fp16", "q8_0", "q4_0", "q4_k_m")  # the dtypes qwen-convert writes here
# dtype -> llama-quantize's file type of the low-bit rows (issue #45): llama.cpp's own files, quantized from the fp32
# GGUF with an importance matrix that llama-imatrix computed on that GGUF (IMATRIX_TEXT), as users download them.
LLAMA_IMATRIX = {"iq1_m": "IQ1_M", "iq2_xxs": "IQ2_XXS", "iq2_m": "IQ2_M", "iq3_xxs": "IQ3_XXS", "iq3_m": "IQ3_M",
                 "tq2_0": "TQ2_0"}
IMATRIX_TEXT = BUNDLED / "heldout.txt"
IMATRIX_CTX, IMATRIX_CHUNKS = 256, 8  # llama-imatrix's --ctx and --chunks: 2,048 calibration tokens
TWO_STEP_NOTE = " (from HF bf16; llama: convert to bf16 + quantize)"


@dataclass(frozen=True)
class Plan:
    """Token counts of one run."""

    prompt: int = 128
    new: int = 128
    batch: int = 8
    batch_new: int = 32
    context: int = 2048
    context_new: int = 32
    prefills: tuple[int, ...] = ()  # prompt lengths measured for prefill alone, ours and llama.cpp back to back
    context_caches: tuple[str, ...] = ()  # KV cache types of both engines' long prompt, beside their defaults


LONG_CONTEXT = 16384  # prompts from this length are judged by issue #44's long-context targets
QUICK = Plan(prompt=64, new=32, batch=8, batch_new=8, context=512, context_new=8)


# ------------------------------------------------------------------------------------------- processes

def run_measured(cmd: Sequence[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """Run ``cmd``; return (wall seconds, peak RSS MiB of that process, stdout).  Raises on failure.

    The child is reaped with ``os.wait4`` so its own peak RSS is known (``RUSAGE_CHILDREN`` is a running max).
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{err.read()[-3000:]}")
        return wall, usage.ru_maxrss / 1024, out.read()


def bench_env(threads: int) -> dict[str, str]:
    """The environment of every measured process: ``threads`` BLAS/OpenMP threads."""
    env = dict(os.environ)
    env.update(OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    return env


# ------------------------------------------------------------------------------------------- converters

def warm_page_cache(src: Path) -> None:
    """Read every file of a checkpoint once, so that neither converter (ours runs first) pays for the disk."""
    for path in sorted(src.iterdir()):
        with path.open("rb") as f:
            while f.read(1 << 24):
                pass


def convert_ours(src: Path, out: Path, dtype: str, env: dict[str, str]) -> dict[str, float]:
    cmd = [sys.executable, "-m", "qwen_convert", str(src), "-o", str(out), "--dtype", dtype, "--force"]
    wall, rss, _ = run_measured(cmd, env)
    return {"wall_s": wall, "peak_rss_mib": rss, "file_gb": out.stat().st_size / 1e9}


def convert_llama(script: Path, src: Path, out: Path, dtype: str, env: dict[str, str], keep: bool = False
                  ) -> dict[str, float]:
    """llama.cpp's converter in its own process to ``out`` (``dtype``: ours, or one of its --outtype names),
    deleted afterwards unless ``keep``."""
    outtype = llama_interop.OUTTYPES.get(dtype, dtype)
    cmd = [sys.executable, str(script), str(src), "--outtype", outtype, "--outfile", str(out)]
    if "qwen3.5" in src.name and llama_interop.supports_flag(script, "--no-mtp"):
        cmd.append("--no-mtp")
    try:
        wall, rss, _ = run_measured(cmd, env)
        return {"wall_s": wall, "peak_rss_mib": rss, "file_gb": out.stat().st_size / 1e9}
    finally:
        if not keep:
            out.unlink(missing_ok=True)


def quantize_llama(f32: Path, out: Path, dtype: str, env: dict[str, str], ftype: str | None = None,
                   pure: bool = False) -> dict[str, float]:
    """llama.cpp's quantizer in its own process (wall time and peak RSS measured), GGUF -> ``out``: the file
    type of :data:`LLAMA_QUANTIZED` for ``dtype`` unless ``ftype`` (and ``pure``) are given."""
    if ftype is None:
        ftype, pure = LLAMA_QUANTIZED[dtype]
    code = ("import sys, pathlib, llama_interop; llama_interop.llama_quantize(pathlib.Path(sys.argv[1]), "
            "pathlib.Path(sys.argv[2]), sys.argv[3], pure=sys.argv[4] == '1')")
    scripts = str(Path(__file__).resolve().parent)
    cmd = [sys.executable, "-c", code, str(f32), str(out), ftype, "1" if pure else "0"]
    wall, rss, _ = run_measured(cmd, {**env, "PYTHONPATH": os.pathsep.join([env["PYTHONPATH"], scripts])})
    return {"wall_s": wall, "peak_rss_mib": rss, "file_gb": out.stat().st_size / 1e9}


def imatrix_llama(f32: Path, out: Path, env: dict[str, str]) -> Path:
    """llama-imatrix's importance matrix of ``f32`` on :data:`IMATRIX_TEXT` (once: kept beside the GGUFs)."""
    if not out.is_file():
        import llama_tools

        tool = llama_tools.build_tools(["llama-imatrix"])["llama-imatrix"]
        partial = out.with_name(f"{out.name}.partial")
        run_measured([str(tool), "-m", str(f32), "-f", str(IMATRIX_TEXT), "-o", str(partial), "-c", str(IMATRIX_CTX),
                      "--chunks", str(IMATRIX_CHUNKS), "-t", env["OMP_NUM_THREADS"], "--no-ppl", "--output-format",
                      "gguf"], env)
        partial.rename(out)
    return out


def quantize_imatrix_llama(f32: Path, out: Path, dtype: str, env: dict[str, str]) -> dict[str, float]:
    """llama-quantize with llama-imatrix's matrix of ``f32`` (:data:`LLAMA_IMATRIX`), timed alone (the matrix is
    computed once per model and not counted)."""
    import llama_tools

    imatrix = imatrix_llama(f32, f32.with_name(f"{f32.stem}-imatrix.gguf"), env)
    tool = llama_tools.build_tools(["llama-quantize"])["llama-quantize"]
    wall, rss, _ = run_measured([str(tool), "--imatrix", str(imatrix), str(f32), str(out), LLAMA_IMATRIX[dtype],
                                 env["OMP_NUM_THREADS"]], env)
    return {"wall_s": wall, "peak_rss_mib": rss, "file_gb": out.stat().st_size / 1e9}


def two_step_llama(script: Path, src: Path, out: Path, dtype: str, env: dict[str, str]) -> dict[str, float]:
    """llama.cpp's way from a HF checkpoint to ``dtype`` (:data:`LLAMA_TWO_STEP`): its converter to an
    intermediate GGUF, then its quantizer; wall time summed, peak RSS the larger of the two processes'."""
    outtype, ftype = LLAMA_TWO_STEP[dtype]
    middle = out.with_name(f"{out.stem}-{outtype}.gguf")
    try:
        first = convert_llama(script, src, middle, outtype, env, keep=True)
        second = quantize_llama(middle, out, dtype, env, ftype)
    finally:
        middle.unlink(missing_ok=True)
    return {"wall_s": first["wall_s"] + second["wall_s"],
            "peak_rss_mib": max(first["peak_rss_mib"], second["peak_rss_mib"]), "file_gb": second["file_gb"],
            "convert_wall_s": first["wall_s"], "quantize_wall_s": second["wall_s"],
            "convert_peak_rss_mib": first["peak_rss_mib"], "quantize_peak_rss_mib": second["peak_rss_mib"]}


# ------------------------------------------------------------------------------------------- measurements

def measure(engine: str, gguf: Path, prompt: int, new: int, batch: int, env: dict[str, str],
            threads: int, kernels: str = "numba", cache_type: str | None = None) -> dict[str, float]:
    cmd = [sys.executable, str(WORKER), engine, str(gguf), "--prompt", str(prompt), "--new", str(new),
           "--batch", str(batch), "--threads", str(threads), "--kernels", kernels,
           *(("--cache-type", cache_type) if cache_type else ())]
    sample = json.loads(run_measured(cmd, env)[2].strip().splitlines()[-1])
    sample["loadavg_1min"] = os.getloadavg()[0]  # the machine's load while it ran (shared machines)
    return sample


def runtime_round(gguf: Path, plan: Plan, llama: bool, peer: bool, env: dict[str, str],
                  threads: int, with_batch: bool = True, with_context: bool = True,
                  kernels: Sequence[str] = ("numba",)) -> dict[str, dict]:
    """One repetition of every runtime measurement of one file, ours, the numpy peer and llama.cpp interleaved.

    Keys: ``ours``/``numpy``/``llama`` (prompt + decode), ``ours_batch`` (``plan.batch`` rows), ``*_context``
    (long prompt, each engine's default cache) and ``*_context_<type>`` (both on that KV cache type), all of ours
    with ``kernels[0]``; ``ours_<k>`` (prompt + decode) for each other kernel ``k``.
    """
    main_kernels = kernels[0]
    jobs = {"ours": ("ours", plan.prompt, plan.new, 1), "numpy": ("numpy", plan.prompt, plan.new, 1),
            "llama": ("llama", plan.prompt, plan.new, 1),
            "ours_batch": ("ours", plan.prompt, plan.batch_new, plan.batch)}
    for cache in (None, *plan.context_caches):
        jobs.update({context_key(engine, cache): (engine, plan.context, plan.context_new, 1, cache)
                     for engine in ("ours", "llama")})
    for length in plan.prefills:
        jobs.update({prefill_key("ours", length): ("ours", length, 1, 1),
                     prefill_key("llama", length): ("llama", length, 1, 1)})
    results = {}
    for name, (engine, prompt, new, batch, *cache) in jobs.items():
        if (name == "ours_batch" and not with_batch) or ("_context" in name and not with_context):
            continue
        if engine == "ours" or (engine == "llama" and llama) or (engine == "numpy" and peer):
            results[name] = measure(engine, gguf, prompt, new, batch, env, threads, main_kernels, *cache)
    for other in kernels[1:]:
        results[f"ours_{other}"] = measure("ours", gguf, plan.prompt, plan.new, 1, env, threads, other)
    return results


def context_key(engine: str, cache: str | None) -> str:
    """The measurement name of ``engine``'s long prompt on KV cache type ``cache`` (None: the engine's default)."""
    return f"{engine}_context" + (f"_{cache}" if cache else "")


def jit_startup(env: dict[str, str], cache_dir: Path, pairs: int = 5) -> dict[str, Any]:
    """The compiled kernels' start-up.  ``first``: seconds to import numba and compile each kernel module, with a
    fresh, empty numba cache, and CPU seconds of the first model's start after them (the decode step's compiled
    ops and :mod:`qwen_runtime.models.step_jit`, compiled on first use).  ``warm``: the start-up they add with that
    cache warm, process start to the first token of the bundled model (q8_0) with ``kernels="numba"`` minus the
    same with ``"numpy"``, in CPU seconds (the fair measure on a shared machine: it does not count waiting for a
    core) and wall seconds, medians over ``pairs`` alternating pairs of processes."""
    model = cache_dir / "qwen3-stdlib-q8_0.gguf"
    if not model.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "qwen_convert", str(BUNDLED), "-o", str(model), "--dtype", "q8_0"]
        subprocess.run(cmd, env=env, check=True, capture_output=True)
    with tempfile.TemporaryDirectory() as cache:
        cold_env = {**env, "NUMBA_CACHE_DIR": cache}
        out = run_measured([sys.executable, str(WORKER), "jit", "-"], cold_env)[2]
        first = json.loads(out.strip().splitlines()[-1])

        def start(kernels: str) -> dict[str, float]:
            cmd = [sys.executable, str(WORKER), "start", str(model), "--kernels", kernels]
            wall, _, out = run_measured(cmd, cold_env)
            return {**json.loads(out.strip().splitlines()[-1]), "wall_s": wall}

        # the first model's start compiles the decode step's ops and the compiled step into the cache: CPU seconds
        first["first_model_start_s"] = start("numba")["cpu_s"]
        def floor() -> dict[str, float]:
            wall, _, out = run_measured([sys.executable, str(WORKER), "floor", "-"], cold_env)
            return {**json.loads(out.strip().splitlines()[-1]), "wall_s": wall}

        samples = [{"numba": start("numba"), "numpy": start("numpy"), "floor": floor()} for _ in range(pairs)]
    added = [{key: s["numba"][key] - s["numpy"][key] for key in ("cpu_s", "wall_s")} for s in samples]
    return {"first": first, "warm": medians(added), "numpy": medians([s["numpy"] for s in samples]),
            "floor": medians([s["floor"] for s in samples]), "samples": samples}


def read_bandwidth(files: Sequence[Path], env: dict[str, str], threads: int) -> dict[str, float]:
    """Plain read bandwidth over the largest of ``files`` (see bench_worker.run_read)."""
    largest = max(files, key=lambda f: f.stat().st_size)
    cmd = [sys.executable, str(WORKER), "read", str(largest), "--threads", str(threads)]
    return {**json.loads(run_measured(cmd, env)[2].strip().splitlines()[-1]), "file": largest.name}


PEAK = Path(__file__).with_name("int8_peak.py")


def machine_peak(env: dict[str, str], threads: int) -> dict[str, Any]:
    """This machine's one-thread int8 and float32 multiply-add peaks (``int8_peak.py --peak-only``), with the
    threads the runtimes use: prefill is reported as a fraction of ``threads`` times the int8 peak."""
    out = run_measured([sys.executable, str(PEAK), "--peak-only"], env)[2]
    return {**json.loads(out.strip().splitlines()[-1]), "threads": threads}


def layer_macs(config: dict[str, Any]) -> int:
    """Multiply-adds per prompt token of the layers' matrices (every 2-D weight of ``bench_models.tensor_shapes``
    inside a layer: attention or Gated DeltaNet projections and the MLP; attention's own products and the LM head,
    which a prompt runs on its last token, left out)."""
    return sum(math.prod(shape) for name, shape in tensor_shapes(config).items()
               if name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2)


def best_read(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run's plain read: the fastest of ``samples`` (read_bandwidth results taken before, between and after the
    models), with all of them.  A physical limit, so the best sample: one taken while the machine was busy read
    less than the decode steps of the same run (run 19: 27.2 GB/s once, against 37.0 read by the fp16 decode)."""
    return {**max(samples, key=lambda r: r["read_gbps"]), "samples": list(samples)}


def cache_mib(config: dict[str, Any], slots: int, batch: int = 1) -> float:
    """Our runtime's cache for ``slots`` tokens: float32 K/V of full-attention layers + Qwen3.5's recurrent state."""
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    full = types.count("full_attention")
    total = full * 2 * config["num_key_value_heads"] * hd * slots * 4
    if "linear_num_value_heads" in config:
        conv = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"] + \
            config["linear_num_value_heads"] * config["linear_value_head_dim"]
        state = config["linear_num_value_heads"] * config["linear_key_head_dim"] * config["linear_value_head_dim"]
        total += (len(types) - full) * (state + conv * (config["linear_conv_kernel_dim"] - 1)) * 4
    return total * batch / 2**20


# ------------------------------------------------------------------------------------------- summary

def median(samples: list[dict[str, float]], key: str) -> float:
    values = [s[key] for s in samples if key in s]
    return statistics.median(values) if values else float("nan")


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    return {key: median(samples, key) for key in samples[0]} if samples else {}


def summarize(raw: dict[str, dict[str, dict[str, list[dict]]]]) -> dict[str, dict[str, dict[str, dict]]]:
    """raw[model][dtype][measurement] = samples  ->  the same nesting with medians."""
    return {m: {d: {k: medians(v) for k, v in per.items()} for d, per in dtypes.items()} for m, dtypes in raw.items()}


NAN = float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b else NAN


def fmt(x: float, digits: int = 1) -> str:
    return "—" if x != x else f"{x:.{digits}f}"


def pair(ours: dict, peer: dict, key: str, digits: int = 1, with_ratio: bool = True) -> str:
    """``ours / peer (ratio)`` of one metric."""
    x, y = ours.get(key, NAN), peer.get(key, NAN)
    text = f"{fmt(x, digits)} / {fmt(y, digits)}"
    return f"{text} ({fmt(ratio(x, y), 2)})" if with_ratio else text


def triple(ours: dict, plain: dict, peer: dict, key: str) -> str:
    """``ours / plain numpy / llama (ours / llama)`` of one metric."""
    x, y = ours.get(key, NAN), peer.get(key, NAN)
    return f"{fmt(x)} / {fmt(plain.get(key, NAN))} / {fmt(y)} ({fmt(ratio(x, y), 2)})"


def bandwidth(ours: dict, run: dict | None = None) -> float:
    """Decode bandwidth in GB/s of ``run`` (default: ours) on the same file: stored bytes of the matrices read per
    token (our worker counts them) x tokens/s."""
    return ours.get("weight_gb_per_token", NAN) * (ours if run is None else run).get("decode_tps", NAN)


def decode_bandwidth(ours: dict, llama: dict, read_gbps: float) -> str:
    """``decode GB/s ours / llama (each x read bandwidth)``: llama.cpp's shows how near a decode gets."""
    gbps, theirs = bandwidth(ours), bandwidth(ours, llama)
    return f"{fmt(gbps)} / {fmt(theirs)} ({fmt(ratio(gbps, read_gbps), 2)} / {fmt(ratio(theirs, read_gbps), 2)})"


def runtime_row(model: str, dtype: str, m: dict[str, dict], others: Sequence[str] = (),
                read_gbps: float = NAN) -> str:
    o, ll, pl = m.get("ours", {}), m.get("llama", {}), m.get("numpy", {})
    ob, oc, lc = m.get("ours_batch", {}), m.get("ours_context", {}), m.get("llama_context", {})
    batch, single, context = (d.get("decode_tps", NAN) for d in (ob, ll, oc))
    other_cells = [f"{fmt(m.get(f'ours_{k}', {}).get('prefill_tps', NAN))} / "
                   f"{fmt(m.get(f'ours_{k}', {}).get('decode_tps', NAN))} "
                   f"({fmt(ratio(bandwidth(o, m.get(f'ours_{k}', {})), read_gbps), 2)})" for k in others]
    cells = [model, dtype, triple(o, pl, ll, "prefill_tps"), triple(o, pl, ll, "decode_tps"),
             decode_bandwidth(o, ll, read_gbps), *other_cells,
             f"{fmt(batch)} ({fmt(ratio(batch, single), 2)})",
             f"{pair(oc, lc, 'decode_tps', with_ratio=False)} ({fmt(ratio(context, o.get('decode_tps', NAN)), 2)})",
             pair(o, ll, "ttft_s", 2, False), pair(o, ll, "load_s", 2, False), pair(o, ll, "VmHWM", 0),
             pair(o, ll, "RssAnon", 0, False), fmt(o.get("loadavg_1min", NAN))]
    return "| " + " | ".join(cells) + " |"


def runtime_table(summary: dict, plan: Plan, kernels: Sequence[str] = ("numba",), read_gbps: float = NAN,
                  ) -> list[str]:
    others = list(kernels[1:])
    head = ["model", "type", f"prefill({plan.prompt}) tok/s ours / numpy / llama (× llama)",
            f"decode({plan.new}) tok/s ours / numpy / llama (× llama)",
            f"decode GB/s ours / llama (× read {fmt(read_gbps)} GB/s)",
            *(f"ours with {k} kernels: prefill / decode tok/s (decode GB/s × read)" for k in others),
            f"batch-{plan.batch} agg. tok/s ours (× llama 1-stream)",
            f"decode @{plan.context} ours / llama (ours × own decode)", "TTFT s ours / llama",
            "load s ours / llama", "peak RSS MiB ours / llama (×)", "anon MiB ours / llama",
            "machine load"]
    rows = [runtime_row(model, dtype, m, others, read_gbps) for model, dtypes in summary.items()
            for dtype, m in dtypes.items()]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows]


def context_table(summary: dict, plan: Plan) -> list[str]:
    """The long prompt per KV cache (each engine's default, then both on each of ``plan.context_caches``): prefill,
    decode after it and peak RSS, ours / llama.cpp (one line per model, type and cache)."""
    rows = []
    for model, dtypes in summary.items():
        for dtype, m in dtypes.items():
            for cache in (None, *plan.context_caches):
                ours, llama = m.get(context_key("ours", cache), {}), m.get(context_key("llama", cache), {})
                if ours or llama:
                    rows.append(f"| {model} | {dtype} | {cache or 'defaults'} | "
                                f"{pair(ours, llama, 'prefill_tps')} | {pair(ours, llama, 'ttft_s', 1, False)} | "
                                f"{pair(ours, llama, 'decode_tps')} | {pair(ours, llama, 'VmHWM', 0)} | "
                                f"{pair(ours, llama, 'RssAnon', 0, False)} |")
    if not rows:
        return []
    head = ["model", "type", "KV cache", f"prefill({plan.context}) tok/s ours / llama (×)", "TTFT s ours / llama",
            f"decode({plan.context_new}) @{plan.context} tok/s ours / llama (×)", "peak RSS MiB ours / llama (×)",
            "anon MiB ours / llama"]
    return [f"Long prompt, {plan.context} tokens:", "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *rows, ""]


def context_targets(runs: dict, plan: Plan) -> list[Target]:
    """Issue #44's long-context targets for one model, per KV cache: decode and prefill >= 0.9x llama.cpp's at the
    same context, peak RSS <= llama.cpp's."""
    out = []
    for dtype, m in runs.items():
        for cache in (None, *plan.context_caches):
            ours, llama = m.get(context_key("ours", cache), {}), m.get(context_key("llama", cache), {})
            where = f"{dtype} @{plan.context}, {cache or 'default'} cache"
            out += [Target(f"{where}: decode / llama", ratio(ours.get("decode_tps", NAN),
                                                             llama.get("decode_tps", NAN)), 0.9),
                    Target(f"{where}: prefill / llama", ratio(ours.get("prefill_tps", NAN),
                                                              llama.get("prefill_tps", NAN)), 0.9),
                    Target(f"{where}: peak RSS / llama", ratio(ours.get("VmHWM", NAN), llama.get("VmHWM", NAN)),
                           -1.0)]
    return out


def jit_lines(jit: dict[str, Any]) -> list[str]:
    """The compiled kernels' first-ever compile and warm-cache start-up, in seconds."""
    if not jit:
        return []
    keys = [k for k in jit["first"] if k.endswith("_s")]
    head = "| | " + " | ".join(k.removesuffix("_s").replace("_", " ") for k in keys) + " |"
    warm, numpy = jit["warm"], jit["numpy"]
    return ["Compiled kernels' first-ever compile, seconds (empty numba cache):", head,
            "|" + "---|" * (len(keys) + 1), "| first | " + " | ".join(fmt(jit["first"][k], 2) for k in keys) + " |",
            "",
            f"Compiled kernels' warm-cache start-up (bundled model, q8_0, process start to first token, numba minus "
            f"numpy, median of {len(jit['samples'])} alternating pairs): {fmt(warm['cpu_s'], 2)} s CPU "
            f"({fmt(numpy['cpu_s'], 2)} s with numpy), {fmt(warm['wall_s'], 2)} s wall "
            f"({fmt(numpy['wall_s'], 2)} s with numpy).  numba's own share, importing it and calling one cached "
            f"trivial function: {fmt(jit.get('floor', {}).get('cpu_s', NAN), 2)} s CPU.", ""]


PAIRED_KEYS = ("prefill_tps", "decode_tps")


def prefill_key(engine: str, length: int) -> str:
    """The measurement name of a prefill-only run of a ``length``-token prompt."""
    return f"{engine}_prefill{length}"


def prefill_ratios(raw: dict[str, dict[str, list[dict]]], lengths: Sequence[int]
                   ) -> dict[str, dict[int, dict[str, float]]]:
    """Per dtype and prompt length, ours / llama.cpp prefill tok/s paired round by round (:func:`paired_ratios`)."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for length in lengths:
        a, b = prefill_key("ours", length), prefill_key("llama", length)
        for dtype, row in paired_ratios(raw, a, b).items():
            if "prefill_tps" in row:
                out.setdefault(dtype, {})[length] = {k.removeprefix("prefill_tps").lstrip("_") or "median": v
                                                     for k, v in row.items() if k.startswith("prefill_tps")}
                out[dtype][length]["rounds"] = row["rounds"]
    return out


def prefill_lines(summary: dict, prefills: dict[str, dict[str, dict[int, dict[str, float]]]],
                  lengths: Sequence[int], configs: dict[str, dict[str, Any]] | None = None,
                  peak: dict[str, Any] | None = None) -> list[str]:
    """One table: prefill tok/s by prompt length, ours / llama.cpp (medians) and the paired ratio (min-max); with
    the machine's ``peak`` (:func:`machine_peak`), our layers' multiply-adds per second as a fraction of its int8
    peak on the runtimes' threads."""
    if not lengths or not any(prefills.values()):
        return []
    head = ["model", "type", *(f"prefill({n}) tok/s ours / llama (paired ×, min-max)" for n in lengths)]
    rows = []
    for model, dtypes in prefills.items():
        for dtype, by_length in dtypes.items():
            m = summary.get(model, {}).get(dtype, {})
            medians = {n: pair(m.get(prefill_key("ours", n), {}), m.get(prefill_key("llama", n), {}),
                               "prefill_tps", with_ratio=False) for n in lengths}
            cells = []
            for n in lengths:
                r = by_length.get(n)
                ours = m.get(prefill_key("ours", n), {}).get("prefill_tps", NAN)
                share = (ours * layer_macs(configs[model]) / (peak["int8"] * 1e12 * peak["threads"])
                         if peak and "int8" in peak and configs and model in configs else NAN)
                of_peak = f"; {share:.0%} of the {peak['int8_form']} int8 peak" if share == share else ""
                cells.append(f"{medians[n]} ({fmt(r['median'], 2)}, {fmt(r['min'], 2)}-{fmt(r['max'], 2)}{of_peak})"
                             if r else "-")
            rows.append("| " + " | ".join([model, dtype, *cells]) + " |")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows, ""]
    if peak and "int8" in peak:
        lines += [f"Machine peak, one thread: {peak['int8']:.3f} T int8 multiply-adds/s ({peak['int8_form']}), "
                  f"{peak.get('float', NAN):.3f} T float32 (FMA); prefill's share counts the layers' matrices "
                  f"on {peak['threads']} threads.", ""]
    return lines


def paired_ratios(raw: dict[str, dict[str, list[dict]]], a: str = "ours", b: str = "llama"
                  ) -> dict[str, dict[str, float]]:
    """Per dtype of one model (``raw[dtype][measurement]`` = samples, one per round), each round's ``a`` / ``b`` of
    :data:`PAIRED_KEYS`: ``{dtype: {key: median, key_min, key_max, rounds}}`` (dtypes where both ran)."""
    out: dict[str, dict[str, float]] = {}
    for dtype, runs in raw.items():
        pairs = list(zip(runs.get(a, []), runs.get(b, []), strict=False))
        if not pairs:
            continue
        row: dict[str, float] = {"rounds": len(pairs)}
        for key in PAIRED_KEYS:
            values = [ratio(x.get(key, NAN), y.get(key, NAN)) for x, y in pairs]
            values = [v for v in values if v == v]
            if values:
                row.update({key: statistics.median(values), f"{key}_min": min(values), f"{key}_max": max(values)})
        out[dtype] = row
    return out


def paired_lines(paired: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """The paired ratios of every model and dtype, a line each."""
    rows = [f"  {model} {dtype}: " + ", ".join(
        f"{key.removesuffix('_tps')} {fmt(r[key], 2)} ({fmt(r[key + '_min'], 2)}-{fmt(r[key + '_max'], 2)})"
        for key in PAIRED_KEYS if key in r) + f", {r['rounds']} rounds"
        for model, dtypes in paired.items() for dtype, r in dtypes.items()]
    return ["Ours / llama.cpp paired round by round (median of the rounds' ratios, min-max):", *rows, ""] \
        if rows else []


def conversion_table(summary: dict) -> list[str]:
    head = ["model", "type", "GGUF GB", "wall s ours / llama (×)", "peak RSS MiB ours / llama (×)"]
    rows = [f"| {model} | {dtype + (TWO_STEP_NOTE if dtype in LLAMA_TWO_STEP else '')} "
            f"| {fmt((m.get('ours') or m.get('llama', {})).get('file_gb', NAN), 2)} "
            f"| {pair(m.get('ours', {}), m.get('llama', {}), 'wall_s')} "
            f"| {pair(m.get('ours', {}), m.get('llama', {}), 'peak_rss_mib', 0)} |"
            for model, dtypes in summary.items() for dtype, m in dtypes.items()]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows]


@dataclass(frozen=True)
class Target:
    name: str
    value: float
    goal: float

    @property
    def met(self) -> bool:
        return self.value >= self.goal if self.goal > 0 else self.value <= -self.goal

    def line(self) -> str:
        bound = f">= {self.goal:g}" if self.goal > 0 else f"<= {-self.goal:g}"
        return f"{'met   ' if self.met else 'MISSED'} {self.name}: {fmt(self.value, 2)} (goal {bound})"


def prefill_targets(paired: dict[str, dict[int, dict[str, float]]]) -> list[Target]:
    """Issue #46's prefill targets on a VNNI CPU, as paired ratios: >= 1.5x llama.cpp from 512 tokens on, >= 1.0x
    for short prompts, for q8_0 and Q4_K_M."""
    return [Target(f"{dtype} prefill({length}) / llama (paired)", row["median"], 1.5 if length >= 512 else 1.0)
            for dtype in ("q8_0", "q4_k_m") for length, row in sorted(paired.get(dtype, {}).items())]


def _metric(runs: dict, dtype: str, name: str, key: str) -> float:
    return runs.get(dtype, {}).get(name, {}).get(key, NAN)


def targets(runs: dict, conversions: dict, config: dict[str, Any], plan: Plan, read_gbps: float = NAN
            ) -> list[Target]:
    """The issues' targets for one model (``runs``/``conversions``: that model's medians by dtype; ``read_gbps``:
    the run's plain read bandwidth)."""
    def r(dtype: str, key: str, a: str = "ours", b: str = "llama") -> float:
        return ratio(_metric(runs, dtype, a, key), _metric(runs, dtype, b, key))

    out = [Target(f"{dtype} decode / llama {dtype}", r(dtype, "decode_tps"), goal)  # issue #22
           for dtype, goal in (("q8_0", 0.8), ("q4_k_m", 0.8), ("q4_0", 0.8), ("fp16", 0.8), ("fp32", 1.0))]
    out += [Target(f"{dtype} prefill / llama {dtype}", r(dtype, "prefill_tps"), goal)
            for dtype, goal in (("q8_0", 1.0), ("fp32", 1.0), ("q4_k_m", 0.9))]
    out += [Target("q8_0 batch aggregate / llama q8_0 decode", r("q8_0", "decode_tps", "ours_batch"), 2.0),
            Target("fp32 decode / plain numpy fp32", r("fp32", "decode_tps", b="numpy"), 1.0)]
    for dtype in runs:
        ours, llama = runs[dtype].get("ours", {}), runs[dtype].get("llama", {})
        out.append(Target(f"{dtype} decode bandwidth / plain read (llama.cpp's: "
                          f"{fmt(ratio(bandwidth(ours, llama), read_gbps), 2)})",
                          ratio(bandwidth(ours), read_gbps), 0.8))
        q8 = runs[dtype].get("ours_numba-q8")
        if q8 and dtype not in ("fp16", "fp32"):  # 8-bit activations, as llama.cpp multiplies
            out.append(Target(f"{dtype} decode bandwidth with 8-bit activations / plain read",
                              ratio(bandwidth(ours, q8), read_gbps), 0.8))
    kv = cache_mib(config, plan.prompt + plan.new)
    for dtype in runs:
        out += [Target(f"{dtype} decode @{plan.context} / our decode @{plan.prompt}",
                       r(dtype, "decode_tps", "ours_context", "ours"), 0.7),
                Target(f"{dtype} peak RSS / llama", r(dtype, "VmHWM"), -1.1),
                Target(f"{dtype} anonymous MiB (150 + {kv:.0f} cache)", _metric(runs, dtype, "ours", "RssAnon"),
                       -(150 + kv))]
    q8 = conversions.get("q8_0", {})
    if "llama" in q8:
        out += [Target("q8_0 conversion wall / llama converter",
                       ratio(q8["ours"]["wall_s"], q8["llama"]["wall_s"]), -0.5),
                Target("q8_0 conversion peak RSS / llama converter",
                       ratio(q8["ours"]["peak_rss_mib"], q8["llama"]["peak_rss_mib"]), -0.3)]
    k4 = conversions.get("q4_k_m", {})
    if "llama" in k4 and "ours" in k4:
        out += [Target("q4_k_m from HF bf16, wall / llama convert + quantize",
                       ratio(k4["ours"]["wall_s"], k4["llama"]["wall_s"]), -1.0),
                Target("q4_k_m from HF bf16, peak RSS / llama convert + quantize",
                       ratio(k4["ours"]["peak_rss_mib"], k4["llama"]["peak_rss_mib"]), -0.25)]
    return out


# ------------------------------------------------------------------------------------------- machine

def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import numpy as np

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    info: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu,
                            "cores": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PHYS_PAGES") *
                                                                          os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
                            "python": platform.python_version(), "numpy": np.__version__,
                            "llama_cpp_python": llama_interop.installed_version(), "loadavg": os.getloadavg(),
                            "openblas_env": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS")}}
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = [{k: d.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
                        for d in threadpool_info()]
    except ImportError:
        info["blas"] = "threadpoolctl not installed"
    return info


# ------------------------------------------------------------------------------------------- main

def configure_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="qwen-numpy vs llama.cpp: conversion and runtime, one run.")
    p.add_argument("--quick", action="store_true", help="fewer tokens, 1 repeat; Qwen2.5-0.5B shape and q8_0 "
                   "unless --models / --dtypes are given")
    p.add_argument("--models", help=f"comma list of {', '.join(MODELS)} (default: all; --quick: the first), or of the "
                   f"larger {', '.join(LARGE_MODELS)} (free disk permitting)")
    p.add_argument("--dtypes", help=f"comma list of {', '.join(DTYPES)} (default: all; --quick: q8_0), or of the "
                   f"low-bit {', '.join(LLAMA_IMATRIX)} (llama.cpp's quantizer with llama-imatrix's matrix)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions of every measurement (medians reported)")
    p.add_argument("--new", type=int, help=f"greedy tokens after the prompt (default {Plan.new})")
    p.add_argument("--context", type=int, help=f"tokens of the long prompt (default {Plan.context}; e.g. 16384)")
    p.add_argument("--prefills", help="comma list of prompt lengths measured for prefill alone, paired with "
                   "llama.cpp, e.g. 64,512,2000 (default: none)")
    p.add_argument("--context-new", type=int, help=f"tokens decoded after the long prompt (default {Plan.context_new})")
    p.add_argument("--other-dtypes", help="dtypes of the second and later models (default: --dtypes), e.g. every "
                   "type for the first shape and q8_0 for the others, in one run")
    p.add_argument("--peer-dtypes", default="fp32",
                   help="dtypes the plain numpy peer runs on (default fp32: on any other file it widens every "
                   "weight to float32 at load and runs at its fp32 speed with 2-4x the memory)")
    p.add_argument("--others-single", action="store_true",
                   help="second and later models: the single-stream prompt + decode only (no batch, no long prompt)")
    p.add_argument("--batch-dtypes", help="dtypes with the batched measurement (default: all)")
    p.add_argument("--context-dtypes", help="dtypes with the long-prompt measurement (default: all)")
    p.add_argument("--context-caches", help="comma list of KV cache types (qwen_runtime.backend.cache.CACHE_TYPES) "
                   "both engines also run the long prompt on, beside their defaults, e.g. q8_0")
    p.add_argument("--conversion-repeat", type=int, default=None,
                   help="repetitions of every conversion (default: --repeat; the GGUF is always written once)")
    p.add_argument("--threads", type=int, default=2, help="threads of both runtimes")
    p.add_argument("--kernels", default="numba,numpy", help="our kernels, comma list of numba (the command lines' "
                   "default activations), numba-float, numba-q8-prompts, numba-q8 (load's activations), numpy: the "
                   "first runs every measurement, the others prompt + decode (default: numba,numpy)")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "qwen-numpy-bench")
    p.add_argument("--tokenizers", type=Path, default=None,
                   help="directory of <name>/tokenizer.json (default: the repository's, tests/data/tokenizers)")
    p.add_argument("--configs", type=Path, default=DATA / "model-configs")
    p.add_argument("--json", type=Path, default=None, help="results file (default: CACHE_DIR/bench-<date>.json)")
    p.add_argument("--no-llama", action="store_true", help="measure our runtime and converter only")
    p.add_argument("--no-peer", action="store_true", help="skip the plain numpy peer")
    p.add_argument("--no-runtime", action="store_true", help="the conversions only (no runtime measurements)")
    p.add_argument("--no-startup", action="store_true", help="skip the compiled kernels' start-up measurement (it "
                   "compiles every kernel module into an empty numba cache: minutes of CPU)")
    p.add_argument("--report", type=Path, metavar="JSON", help="only print the tables of an earlier results file")
    return p


def log(text: str) -> None:
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {text}\n")
    sys.stderr.flush()


def bench_model(src: Path, dtypes: list[str], args: argparse.Namespace, plan: Plan, script: Path | None,
                env: dict[str, str], conversions: dict[str, dict[str, list]],
                runtime: dict[str, dict[str, list]], save: Callable[[], None], single: bool = False) -> None:
    """Fill conversion[dtype][tool] and runtime[dtype][measurement] samples of one checkpoint; ``save`` after each."""
    config = json.loads((src / "config.json").read_text())
    peer = not args.no_peer and not any("Qwen3_5" in a for a in config.get("architectures", []))
    f32 = args.cache_dir / "gguf" / f"{src.name}-fp32.gguf"
    warm_page_cache(src)
    for dtype in dtypes:
        gguf = args.cache_dir / "gguf" / f"{src.name}-{dtype}.gguf"
        gguf.parent.mkdir(parents=True, exist_ok=True)
        if (dtype in LLAMA_QUANTIZED or dtype in LLAMA_IMATRIX) and not f32.is_file():
            log(f"{src.name}: fp32 GGUF for llama.cpp's quantizer")
            convert_ours(src, f32, "fp32", env)
        conv = conversions.setdefault(dtype, {})
        conversion_repeat = max(1, args.conversion_repeat or args.repeat)
        for rep in range(conversion_repeat):
            log(f"{src.name} {dtype}: conversion {rep + 1}/{conversion_repeat}")
            scratch = args.cache_dir / f"llama-out-{os.getpid()}.gguf"  # deleted after measuring
            if dtype in OURS:
                conv.setdefault("ours", []).append(convert_ours(src, gguf, dtype, env))
            if dtype in LLAMA_QUANTIZED and not args.no_llama:
                target = scratch if dtype in OURS else gguf
                conv.setdefault("llama", []).append(quantize_llama(f32, target, dtype, env))
                scratch.unlink(missing_ok=True)
            elif dtype in LLAMA_IMATRIX and not args.no_llama and not gguf.is_file():  # built once, then cached
                conv.setdefault("llama", []).append(quantize_imatrix_llama(f32, gguf, dtype, env))
            elif dtype in LLAMA_TWO_STEP and script is not None:
                conv.setdefault("llama", []).append(two_step_llama(script, src, scratch, dtype, env))
                scratch.unlink(missing_ok=True)
            elif script is not None and dtype in llama_interop.OUTTYPES:
                conv.setdefault("llama", []).append(convert_llama(script, src, scratch, dtype, env))
        save()
        for rep in range(0 if args.no_runtime else args.repeat):
            log(f"{src.name} {dtype}: runtime {rep + 1}/{args.repeat}")
            with_peer = peer and dtype in args.peer_dtypes.split(",")
            with_batch = not single and (args.batch_dtypes is None or dtype in args.batch_dtypes.split(","))
            with_context = not single and (args.context_dtypes is None or dtype in args.context_dtypes.split(","))
            for name, sample in runtime_round(gguf, plan, script is not None, with_peer, env, args.threads,
                                              with_batch, with_context, args.kernels.split(",")).items():
                runtime.setdefault(dtype, {}).setdefault(name, []).append(sample)
            save()


def report(results: dict[str, Any], plan: Plan) -> list[str]:
    conv, runs = summarize(results["conversion"]), summarize(results["runtime"])
    results["medians"] = {"conversion": conv, "runtime": runs}
    results["paired"] = {model: paired_ratios(dtypes) for model, dtypes in results["runtime"].items()}
    results["paired_prefill"] = {model: prefill_ratios(dtypes, plan.prefills)
                                 for model, dtypes in results["runtime"].items()}
    lines = [f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores, "
             f"numpy {results['machine']['numpy']}, llama-cpp-python {results['machine']['llama_cpp_python']}, "
             f"{results['machine']['date']}; medians of {results['repeat']} runs "
             f"({results.get('conversion_repeat', results['repeat'])} of each conversion)", "",
             *(runtime_table(runs, plan, results.get("kernels", ["numba"]),
                             results.get("read", {}).get("read_gbps", NAN)) + [""] if any(runs.values()) else []),
             *context_table(runs, plan), *paired_lines(results["paired"]),
             *prefill_lines(runs, results["paired_prefill"], plan.prefills, results["configs"], results.get("peak")),
             *jit_lines(results.get("jit", {})), *conversion_table(conv), ""]
    read_gbps = results.get("read", {}).get("read_gbps", NAN)
    for model in dict.fromkeys([*runs, *conv]):  # a NaN target was not measured (--quick, --dtypes, --no-llama)
        found = [t for t in targets(runs.get(model, {}), conv.get(model, {}), results["configs"][model], plan,
                                    read_gbps) + prefill_targets(results["paired_prefill"].get(model, {}))
                 + (context_targets(runs.get(model, {}), plan) if plan.context >= LONG_CONTEXT else [])
                 if t.value == t.value]
        results.setdefault("targets", {})[model] = [{"name": t.name, "value": t.value, "goal": t.goal, "met": t.met}
                                                     for t in found]
        lines += [f"Targets, {model}:", *(f"  {t.line()}" for t in found), ""]
    return lines


def plan_of(results: dict[str, Any]) -> Plan:
    """The plan of a results file (JSON keeps ``prefills`` as a list; older files have none)."""
    saved = results["plan"]
    return Plan(**{**saved, "prefills": tuple(saved.get("prefills", ())),
                   "context_caches": tuple(saved.get("context_caches", ()))})


def run(args: argparse.Namespace) -> None:
    plan = QUICK if args.quick else Plan()
    given = (("new", args.new), ("context_new", args.context_new), ("context", args.context),
             ("prefills", tuple(int(n) for n in args.prefills.split(",")) if args.prefills else None),
             ("context_caches", tuple(args.context_caches.split(",")) if args.context_caches else None))
    plan = Plan(**{**plan.__dict__, **{k: v for k, v in given if v is not None}})
    names = args.models.split(",") if args.models else list(MODELS)[:1] if args.quick else list(MODELS)
    dtypes = args.dtypes.split(",") if args.dtypes else ["q8_0"] if args.quick else list(DTYPES)
    args.repeat = 1 if args.quick and args.repeat == 3 else args.repeat
    env = bench_env(args.threads)
    version = None if args.no_llama else llama_interop.installed_version()
    script = llama_interop.converter_script(args.cache_dir) if version else None
    results: dict[str, Any] = {"machine": machine(), "plan": plan.__dict__, "repeat": args.repeat,
                               "conversion_repeat": max(1, args.conversion_repeat or args.repeat),
                               "conversion": {}, "runtime": {}, "configs": {}, "kernels": args.kernels.split(",")}
    if "numba" in results["kernels"] and not args.no_runtime and not args.no_startup:
        log("compiled kernels: first compile and warm start-up")
        results["jit"] = jit_startup(env, args.cache_dir)
    out = args.json or args.cache_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    others = args.other_dtypes.split(",") if args.other_dtypes else dtypes
    reads: list[dict[str, Any]] = []

    def sample_read() -> None:
        files = sorted((args.cache_dir / "gguf").glob("*.gguf"))
        if files and not args.no_runtime:
            log("plain read bandwidth")
            reads.append(read_bandwidth(files, env, args.threads))

    sample_read()
    if plan.prefills and not args.no_runtime:
        log("int8 and float peaks")
        results["peak"] = machine_peak(env, args.threads)
    for i, name in enumerate(names):
        log(f"{name}: checkpoint")
        tokenizers = args.tokenizers or real_tokenizers.tokenizers_dir()
        src = build_checkpoint({**MODELS, **LARGE_MODELS}[name], args.cache_dir / "hf", tokenizers, args.configs)
        results["configs"][name] = json.loads((src / "config.json").read_text())
        bench_model(src, dtypes if i == 0 else others, args, plan, script, env,
                    results["conversion"].setdefault(name, {}), results["runtime"].setdefault(name, {}),
                    lambda: out.write_text(json.dumps(results, indent=1)), single=i > 0 and args.others_single)
        sample_read()
    if reads:
        results["read"] = best_read(reads)
    results["machine"]["loadavg_end"] = os.getloadavg()
    sys.stdout.write("\n".join(report(results, plan)) + "\n")
    out.write_text(json.dumps(results, indent=1))
    log(f"results written to {out}")


def main() -> None:
    args = configure_parser().parse_args()
    if args.report:
        results = json.loads(args.report.read_text())
        sys.stdout.write("\n".join(report(results, plan_of(results))) + "\n")
        return
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
