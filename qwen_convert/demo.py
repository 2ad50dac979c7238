"""The demo: convert a model to every output, measure what quantization costs, and run each output.

Steps (each a library function; ``qwen-demo`` prints their results):

1. :func:`prepare_outputs` converts the source (by default the bundled ``qwen3-stdlib`` model, found with
   :mod:`importlib.resources`) to npy and GGUF in fp32, fp16 and q8_0 with :mod:`qwen_convert.batch`;
   outputs that are complete and were made from the same source (``demo-source.json`` records a
   fingerprint of it) are reused.  Each output is compared with the source by
   :func:`qwen_convert.inspect.compare`.
2. :func:`measure_quality` scores the held-out text with the six outputs and the source in lockstep
   (:func:`qwen_runtime.generation.evaluate.evaluate_ids`): perplexity, KL(source || output), top-1 agreement, Δppl.
   With ``kquants`` (``qwen-demo --kquants``), :func:`prepare_kquant_outputs` adds a GGUF per llama.cpp
   mix of each new type (:data:`KQUANT_MIXES`; ``--lowbit``: :data:`LOWBIT_MIXES`), without and with an
   importance matrix that
   :func:`qwen_convert.imatrix_collect.compute_imatrix` computes on a calibration text other than the
   evaluation text (:func:`calibration_text`: standard-library modules, the bundled model's kind of text,
   none of them in its held-out text), and scores them in the same lockstep pass.
3. :func:`complete_in_fresh_process` generates greedily from each output in a freshly spawned Python
   process, so its peak RSS (``VmHWM``) is that of loading and running this one output only.

The demo drives both halves of the project, so it lives in :mod:`qwen_convert`, which may import
:mod:`qwen_runtime` (never the reverse).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import multiprocessing
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from importlib.resources import files as package_files
from pathlib import Path

from qwen_runtime import EXACT_CACHE, chat_format, load, stream
from qwen_runtime.errors import QwenError, UsageError
from qwen_runtime.formats.hub import model_name
from qwen_runtime.generation.evaluate import EvalResult, encode_text, evaluate_ids

from .batch import ConversionJob, output_is_complete, plan_jobs
from .convert import Progress, convert, path_size, verify_written_checksums
from .imatrix import load_importance, write_imatrix
from .imatrix_collect import compute_imatrix
from .inspect import compare, open_pair
from .outputs import atomic_output

BUNDLED_MODEL = "qwen3-stdlib"
HELDOUT_FILE = "heldout.txt"
DEFAULT_OUT = Path("qwen-demo-out")
FORMATS = ("npy", "gguf")
DTYPES = ("fp32", "fp16", "q8_0")
STAMP_FILE = "demo-source.json"
# One llama.cpp mix per type the converter writes beyond the 32-value ones (Q2_K ... Q6_K, IQ4_NL, IQ4_XS).
KQUANT_MIXES = ("q2_k", "q3_k_m", "q4_k_m", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs")
# llama.cpp's 1.5-3.5-bit mixes (qwen-demo --lowbit), the ones people download to fit a large model in little
# memory; most need the importance matrix (llama-quantize refuses them without one, and so does the converter).
LOWBIT_MIXES = ("q2_k_s", "iq3_m", "iq3_xxs", "iq2_m", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s", "tq2_0")
# Calibration text for the importance matrix: standard-library modules (what the bundled model was trained
# on), each used only when none of its lines of code appears in the evaluation text.
CALIBRATION_MODULES = ("argparse", "textwrap", "string", "shlex", "fnmatch", "difflib", "heapq", "bisect",
                       "dataclasses", "functools", "pprint", "calendar", "ipaddress", "fractions")
CALIBRATION_BYTES = 60_000
IMATRIX_CTX = 256
REUSED, CONVERTED = "reused", "converted"


class MissingAssetError(QwenError, FileNotFoundError):
    """A file the demo needs (the bundled model, a held-out text) is not there."""


@dataclass(frozen=True)
class DemoOutput:
    """One converted output and its error against the source (from the inspect compare API)."""

    path: Path
    format: str
    dtype: str
    status: str  # REUSED or CONVERTED
    nbytes: int  # on disk
    bytes_per_parameter: float  # tensor bytes / parameters
    rmse: float
    snr_db: float
    min_cosine: float

    imatrix: bool = False  # quantized with the demo's importance matrix

    @property
    def label(self) -> str:
        return f"{self.format} {self.dtype}" + (" +imatrix" if self.imatrix else "")


@dataclass(frozen=True)
class Completion:
    """A greedy completion from one output, measured in its own process."""

    text: str
    new_tokens: int
    tokens_per_second: float  # decode forward passes per second
    load_seconds: float
    peak_rss_kb: int  # VmHWM of the process (weights are memory-mapped: touched pages count)


def bundled_model_path() -> Path:
    """The HF directory of the model shipped in ``qwen_runtime/assets/``."""
    path = Path(str(package_files("qwen_runtime").joinpath("assets", BUNDLED_MODEL)))
    if not (path / "config.json").is_file():
        raise MissingAssetError(f"{path}: the bundled model is not installed (expected config.json there); "
                                "pass --model PATH to use another Hugging Face model directory")
    return path


def heldout_text_path(model_dir: Path, text: str | Path | None = None) -> Path:
    """``text`` when given, else the model's own ``heldout.txt``, else the bundled model's."""
    if text is not None:
        return Path(text)
    if (model_dir / HELDOUT_FILE).is_file():
        return model_dir / HELDOUT_FILE
    try:
        return bundled_model_path() / HELDOUT_FILE
    except MissingAssetError:
        raise MissingAssetError(f"{model_dir}: no {HELDOUT_FILE} to evaluate on; pass -f/--file FILE") from None


def source_fingerprint(src: Path) -> str:
    """A digest of the source's config.json and its safetensors names, sizes and headers (cheap, not the data)."""
    digest = hashlib.sha256((src / "config.json").read_bytes())
    for path in sorted(src.glob("*.safetensors")):
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f"{path.name}:{path.stat().st_size}:".encode())
            digest.update(f.read(min(header_len, 100_000_000)))
    return digest.hexdigest()


def _stamp(src: Path) -> dict[str, str]:
    return {"source": str(src.resolve()), "fingerprint": source_fingerprint(src)}


def _stamp_matches(out_dir: Path, src: Path) -> bool:
    try:
        return json.loads((out_dir / STAMP_FILE).read_text(encoding="utf-8")) == _stamp(src)
    except (OSError, ValueError):
        return False


def _convert_job(job: ConversionJob, reuse: bool, progress: Progress | None) -> str:
    """Make ``job.out`` unless a complete output of the same source can be reused; return the status."""
    if reuse and output_is_complete(job):
        return REUSED
    convert(job.src, job.out, job.format, job.dtype, force=True, verify=verify_written_checksums, progress=progress)
    return CONVERTED


def _describe(job: ConversionJob, status: str, imatrix: bool = False) -> DemoOutput:
    source, output = open_pair(job.src, job.out)
    diff = compare(source, output)
    params = sum(t.n_elements for t in output.tensors.values())
    tensor_bytes = sum(t.nbytes for t in output.tensors.values())
    return DemoOutput(job.out, job.format, job.dtype, status, path_size(job.out), tensor_bytes / params,
                      diff.rmse, diff.snr_db, diff.min_cosine, imatrix)


def prepare_outputs(src: Path, out_dir: Path, progress: Progress | None = None) -> list[DemoOutput]:
    """Convert ``src`` to npy and GGUF in fp32, fp16 and q8_0 under ``out_dir`` (reusing finished outputs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    reuse = _stamp_matches(out_dir, src)
    (out_dir / STAMP_FILE).unlink(missing_ok=True)  # rewritten once every output is done
    jobs = plan_jobs([src], out_dir, FORMATS, DTYPES)
    statuses = [_convert_job(job, reuse, progress) for job in jobs]
    (out_dir / STAMP_FILE).write_text(json.dumps(_stamp(src), indent=1), encoding="utf-8")
    return [_describe(job, status) for job, status in zip(jobs, statuses, strict=True)]


def calibration_text(evaluation: str, limit: int = CALIBRATION_BYTES) -> str:
    """Up to ``limit`` bytes of :data:`CALIBRATION_MODULES`' sources, skipping any module that shares a line of
    code (over 40 characters) with ``evaluation``, so the importance matrix never sees the scored text."""
    seen = {line.strip() for line in evaluation.splitlines() if len(line.strip()) > 40}
    parts: list[str] = []
    for name in CALIBRATION_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        source = Path(spec.origin).read_text(encoding="utf-8")
        if any(line.strip() in seen for line in source.splitlines()):
            continue
        parts.append(source)
        if sum(map(len, parts)) >= limit:
            break
    if not parts:
        raise MissingAssetError("no standard-library module to calibrate the importance matrix on")
    return "\n\n".join(parts)[:limit]


def prepare_kquant_outputs(src: Path, out_dir: Path, calibration: str, progress: Progress | None = None,
                           mixes: Sequence[str] = KQUANT_MIXES) -> list[DemoOutput]:
    """GGUFs of ``mixes`` (default :data:`KQUANT_MIXES`) under ``out_dir``, each without and with an importance
    matrix computed over ``calibration`` (``<model>.imatrix.gguf`` there); a mix the converter refuses to write
    without one (:class:`UsageError`, before any output) has only its weighted GGUF.  Call after
    :func:`prepare_outputs`, whose stamp decides reuse (the imatrix and its outputs are reused only with the same
    calibration text)."""
    digest = hashlib.sha256(calibration.encode("utf-8")).hexdigest()[:12]
    stamp = out_dir / f"{STAMP_FILE}.imatrix"
    reuse = _stamp_matches(out_dir, src)
    reuse_weighted = reuse and stamp.is_file() and stamp.read_text(encoding="utf-8") == digest
    stamp.unlink(missing_ok=True)
    imatrix_path = out_dir / f"{model_name(src)}.imatrix.gguf"
    if not (reuse_weighted and imatrix_path.is_file()):
        imatrix = compute_imatrix(src, calibration, "demo-calibration", n_ctx=IMATRIX_CTX)
        with atomic_output(imatrix_path, force=True, inputs=(src,)) as tmp:
            write_imatrix(tmp, imatrix)
    importance = load_importance(imatrix_path)
    outputs = []
    for weighted in (False, True):
        for job in plan_jobs([src], out_dir, ("gguf",), mixes):
            if weighted:
                job = replace(job, out=job.out.with_name(job.out.name.replace(".gguf", "-imatrix.gguf")))
            if (reuse_weighted if weighted else reuse) and output_is_complete(job):
                status = REUSED
            else:
                try:
                    convert(job.src, job.out, job.format, job.dtype, force=True, verify=verify_written_checksums,
                            progress=progress, importance=importance if weighted else None)
                except UsageError:
                    if weighted:
                        raise
                    continue  # the mix needs the importance matrix: only its weighted output
                status = CONVERTED
            outputs.append(_describe(job, status, weighted))
    stamp.write_text(digest, encoding="utf-8")
    return outputs


def measure_quality(src: Path, outputs: Sequence[DemoOutput], text: str, eval_tokens: int, ctx: int,
                    stride: int, progress: Callable[[int], None] | None = None, threads: int | None = None,
                    kernels: str | None = None) -> list[EvalResult]:
    """Perplexity of every output on ``text`` and its divergence from the source (one lockstep pass);
    ``threads`` and ``kernels`` are :func:`qwen_runtime.load`'s; every model keeps an exact f32 KV cache, so the
    numbers measure the files alone."""
    models = [load(o.path, threads=threads, kernels=kernels, **EXACT_CACHE) for o in outputs]
    reference = load(src, threads=threads, kernels=kernels, **EXACT_CACHE)
    ctx = min(ctx, reference.config.max_position_embeddings)
    ids = encode_text(reference, text, eval_tokens)
    return evaluate_ids(models, ids, ctx, min(stride, ctx), reference, progress=progress)


def peak_rss_kb() -> int:
    """VmHWM (peak resident set size) of this process from /proc/self/status, in kB (0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def complete(path: str | Path, prompt: str, max_new_tokens: int, threads: int | None = None,
             kernels: str | None = None) -> Completion:
    """Load ``path`` and complete ``prompt`` greedily; measured in (and for) the calling process."""
    t0 = time.perf_counter()
    model = load(path, threads=threads, kernels=kernels)
    chat_format(model)  # load the tokenizer before timing generation
    load_seconds = time.perf_counter() - t0
    generation = stream(model, prompt, max_new_tokens=max_new_tokens)
    [result] = generation.run()
    return Completion(result.text, len(result.token_ids), generation.stats.decode_tokens_per_second,
                      load_seconds, peak_rss_kb())


def complete_in_fresh_process(path: str | Path, prompt: str, max_new_tokens: int, threads: int | None = None,
                              kernels: str | None = None) -> Completion:
    """:func:`complete` in a newly spawned interpreter, so its peak RSS covers this output alone."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(complete, str(path), prompt, max_new_tokens, threads, kernels).result()


