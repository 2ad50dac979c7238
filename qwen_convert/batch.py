"""Convert many models to many (format, dtype) combinations, skipping outputs that are already done.

Outputs are named ``<model>-<dtype>.gguf`` and ``<model>-<dtype>/`` inside one directory.  Before any work the
plan is checked as a whole (:func:`check_jobs`): two jobs writing one output, an output that is a source, or
an existing output ``--force`` may not replace (:mod:`qwen_convert.outputs`) stop the batch before it starts.
A job that fails while running is recorded and the batch goes on; :func:`summary_table` renders the results.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from qwen_runtime.backend.limits import format_bytes
from qwen_runtime.errors import OutputError, QwenError
from qwen_runtime.formats import open_gguf, open_npy_dir
from qwen_runtime.formats.hub import model_name

from .convert import Progress, Verifier, convert, infer_format, path_size
from .outputs import check_not_input, check_replaceable
from .policy import check_dtype, file_type

CONVERTED, SKIPPED, FAILED, VERIFIED = "converted", "skipped", "failed", "verified"


@dataclass(frozen=True)
class ConversionJob:
    """One output to produce (``qwen_serve``'s ``Job`` is a request to generate)."""

    src: Path
    out: Path
    format: str
    dtype: str


@dataclass(frozen=True)
class JobResult:
    """What happened to one job."""

    job: ConversionJob
    status: str  # CONVERTED, VERIFIED (converted and verified against the source), SKIPPED or FAILED
    nbytes: int = 0
    seconds: float = 0.0
    message: str = ""


def output_name(src: Path, fmt: str, dtype: str) -> str:
    """``<model>-<dtype>.gguf`` or ``<model>-<dtype>`` (a directory) for source directory ``src`` (a Hub
    snapshot's model is its repo's name)."""
    stem = f"{model_name(src)}-{dtype}"
    return f"{stem}.gguf" if fmt == "gguf" else stem


def plan_jobs(sources: Sequence[str | Path], out_dir: str | Path, formats: Sequence[str],
              dtypes: Sequence[str]) -> list[ConversionJob]:
    """Every (source, format, dtype) combination, in that nesting order; :class:`OutputError` when two of
    them would write the same output (two sources of one name)."""
    jobs, planned = [], {}
    for src in map(Path, sources):
        for fmt in formats:
            infer_format("", fmt)
            for dtype in map(check_dtype, dtypes):
                job = ConversionJob(src, Path(out_dir) / output_name(src, fmt, dtype), fmt, dtype)
                other = planned.setdefault(job.out.resolve(), job)
                if other is not job:
                    raise OutputError(f"{job.out}: both {other.src} and {src} would be converted to this output "
                                      f"(outputs are named after the model's folder); convert them to separate "
                                      f"--output-dir folders")
                jobs.append(job)
    return jobs


def check_jobs(jobs: Sequence[ConversionJob], force: bool) -> None:
    """Before any work: no job writes over a source of the batch, and with ``force`` every existing output is
    one that may be replaced (:func:`qwen_convert.outputs.check_replaceable`); raises
    :class:`OutputExistsError` naming the first output in the way."""
    sources = sorted({job.src for job in jobs})
    for job in jobs:
        check_not_input(job.out, sources)
        if force and (job.out.exists() or job.out.is_symlink()):
            check_replaceable(job.out)


def output_is_complete(job: ConversionJob) -> bool:
    """Whether ``job.out`` opens with our reader and holds ``job.dtype`` (a finished earlier run)."""
    try:
        if job.format == "npy":
            files = open_npy_dir(job.out)
            return files.metadata.get("dtype") == job.dtype
        files = open_gguf(job.out)
        return files.metadata.get("general.file_type") == int(file_type(job.dtype))
    except QwenError:
        return False


VerifierFactory = Callable[[ConversionJob], Verifier]  # e.g. qwen_convert.verify.BatchVerifier


def run_job(job: ConversionJob, force: bool = False, verify: VerifierFactory | None = None,
            progress: Progress | None = None, tmp_tag: str | None = None) -> JobResult:
    """Convert one job, or skip it when a complete output exists; errors (a failed verification too) become
    a FAILED result.  ``verify(job)`` checks the output before it is renamed into place; ``tmp_tag`` names
    the temporary output (:func:`qwen_convert.convert.temp_path`).  Every executor runs jobs through here."""
    started = time.perf_counter()
    if job.out.exists() and not force:
        if output_is_complete(job):
            return JobResult(job, SKIPPED, path_size(job.out), time.perf_counter() - started)
        return JobResult(job, FAILED, message=f"{job.out}: exists but is not a complete {job.format} "
                                              f"{job.dtype} output (use --force to overwrite)")
    try:
        job.out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return JobResult(job, FAILED, message=f"{job.out.parent}: cannot create directory ({exc.strerror})")
    try:
        result = convert(job.src, job.out, job.format, job.dtype, force=force,
                         verify=verify(job) if verify is not None else None, progress=progress, tmp_tag=tmp_tag)
    except QwenError as exc:
        return JobResult(job, FAILED, seconds=time.perf_counter() - started, message=str(exc))
    return JobResult(job, VERIFIED if verify is not None else CONVERTED, result.nbytes, result.seconds)


def run_batch(jobs: Sequence[ConversionJob], force: bool = False, verify: VerifierFactory | None = None,
              workers: int = 1, progress: Progress | None = None,
              on_done: Callable[[JobResult], None] | None = None) -> list[JobResult]:
    """Run every job (``workers`` processes in parallel; per-tensor progress only with one worker) after
    :func:`check_jobs`."""
    check_jobs(jobs, force)
    if workers <= 1:
        results = []
        for job in jobs:
            results.append(run_job(job, force, verify, progress))
            if on_done is not None:
                on_done(results[-1])
        return results
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run_job, job, force, verify) for job in jobs]
        results = []
        for future in futures:
            results.append(future.result())
            if on_done is not None:
                on_done(results[-1])
        return results


def summary_table(results: Sequence[JobResult]) -> str:
    """A fixed-width table: output, size, seconds, status (failure reasons below the table)."""
    width = max([len("output")] + [len(str(r.job.out)) for r in results])
    lines = [f"{'output':<{width}}  {'size':>10}  {'seconds':>8}  status"]
    for r in results:
        size = format_bytes(r.nbytes) if r.status != FAILED else "-"
        lines.append(f"{str(r.job.out):<{width}}  {size:>10}  {r.seconds:>8.1f}  {r.status}")
    lines += [f"{r.job.out}: {r.message}" if not r.message.startswith(str(r.job.out)) else r.message
              for r in results if r.status == FAILED]
    return "\n".join(lines)

