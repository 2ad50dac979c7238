"""Batch conversion on Ray: every (model, format, dtype) job of :func:`qwen_convert.batch.plan_jobs` as one Ray
task that runs :func:`qwen_convert.batch.run_job` (the same code as a local batch, ``--verify`` included).

Each task declares the memory its conversion needs at its peak (:func:`job_memory`), so Ray places no more
conversions on a node than its memory holds.  Outputs go straight to the shared output directory through
the converter's atomic rename; the temporary output of a job is named by a tag the driver draws
(``.NAME.tmp-<tag>``), so a retry after a worker died replaces the dead attempt's temporary, and the driver
removes it when a job is lost for good or the batch is interrupted.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qwen_runtime.backend.weights import kept_bytes
from qwen_runtime.errors import QwenError
from qwen_runtime.executor import RemoteJob, Throttle, run_on_ray
from qwen_runtime.formats.tensors import Q8_0_BLOCK, Q8_0_BYTES, QType
from qwen_runtime.text.chat import load_chat_format

from .batch import FAILED, ConversionJob, JobResult, VerifierFactory, check_jobs, run_job
from .convert import open_source
from .outputs import remove_path, temp_path
from .policy import TensorSpec
from .verify.behaviour import probe_ids

MiB = 1 << 20

# Heap (anonymous memory) one job needs at its peak: what Ray's ``memory`` resource reserves.  Memory-mapped
# model files are page cache, which the kernel reclaims and Ray does not count as used (as in
# qwen_runtime.backend.limits), so they are not declared.  Measured on 2026-12-01 (VmHWM and the peak of RssAnon
# sampled every 2 ms, each job in a fresh process, bf16 Qwen2 sources, every format x type; MiB):
#
#   source (params, vocab, probe tokens)     no verify: anon (VmHWM)          --verify: anon (VmHWM)
#   0.1 M, vocab 512, probe 95               25 (46) npy and gguf             28-33 (53-60)
#   91 M, vocab 151,936, probe 41            29-39 (53-63) npy, 118 (138) gguf 453-470 npy, 492-506 gguf (848-1384)
#   172 M, vocab 512, probe 95               30-40 (53-64)                    96-104 (807-1785)
#   494 M, vocab 151,936 (Qwen2.5-0.5B)      30-40 (54-64) npy, 119 (139) gguf 493 gguf fp32 (5240), 535 q8_0 (2515)
#
# What the numbers say: without --verify the heap does not grow with the model (tensors stream in 4 MiB row
# chunks; q8_0 adds ~10 MiB of temporaries); a GGUF adds the tokenizer metadata (~590 B per vocabulary
# entry).  --verify adds ~62 MiB (both models' tokenizers and caches; vocab 512) plus ~60 B per probe
# position and vocabulary entry (float32 logits of both models, their float64 log-softmax, exp and
# difference), plus the float32 block scales a Q8_0 output keeps (4 of every 34 bytes).  VmHWM adds the
# file pages verification reads (up to source + output size).  A Ray worker idles at 41 MiB of heap.
BASE_BYTES = 128 * MiB  # Ray worker (41) + converter (<= 41, q8_0 temporaries included), with margin
GGUF_TOKEN_BYTES = 1024  # per vocabulary entry (measured ~590)
VERIFY_BASE_BYTES = 128 * MiB  # measured 62
VERIFY_LOGIT_BYTES = 64  # per probe position x vocabulary entry (measured 58-66)


@functools.lru_cache(maxsize=64)
def _source_facts(src: Path) -> tuple[int, int, int]:
    """(vocabulary size, probe tokens, Q8_0 bytes of its 2-D weights) of a source, or zeros if it cannot be
    opened (the job then fails at once, on the worker, with the same error)."""
    try:
        files = open_source(src)
        probe = max(len(ids) for ids in probe_ids(load_chat_format(files)))
    except (QwenError, OSError):
        return 0, 0, 0
    matrices = sum(t.n_elements for t in files.tensors.values() if len(t.shape) == 2)
    return files.config.vocab_size, probe, matrices // Q8_0_BLOCK * Q8_0_BYTES


def job_memory(job: ConversionJob, verify: bool) -> int:
    """Bytes of heap one conversion job needs at its peak, to declare to Ray (derivation above)."""
    vocab, probe, q8_0_bytes = _source_facts(job.src.resolve())
    if not vocab:
        return BASE_BYTES  # the job fails as it opens the source
    need = BASE_BYTES + (GGUF_TOKEN_BYTES * vocab if job.format == "gguf" else 0)
    if verify:
        need += VERIFY_BASE_BYTES + VERIFY_LOGIT_BYTES * probe * vocab
        if job.dtype == "q8_0":
            need += kept_bytes(QType.Q8_0, q8_0_bytes)  # the output's weights while probing
    return int(need)


class RelayProgress:
    """The converter's :class:`~qwen_convert.convert.Progress` inside a task: reports ``("start", label,
    total bytes, pid)``, ``("advance", bytes)`` (at most a few times a second) and ``("stop",)``."""

    def __init__(self, report: Callable[[Any], None]) -> None:
        self._report = report
        self._throttle = Throttle(lambda n: report(("advance", n)))

    def start(self, label: str, specs: Sequence[TensorSpec]) -> None:
        self._report(("start", label, sum(s.nbytes for s in specs), os.getpid()))

    def advance(self, spec: TensorSpec, nbytes: int) -> None:
        self._throttle.add(nbytes)

    def stop(self) -> None:
        self._throttle.flush()
        self._report(("stop",))


def convert_task(job: ConversionJob, force: bool, verify: VerifierFactory | None, tmp_tag: str,
                 report: Callable[[Any], None]) -> JobResult:
    """What a Ray task runs: :func:`run_job` with its progress relayed to the driver."""
    return run_job(job, force, verify, RelayProgress(report), tmp_tag)


def lost_message(job: ConversionJob, exc: BaseException) -> str:
    """One line for a job whose task failed for good (its worker died on every attempt, or it fits no node)."""
    text = str(exc).strip().splitlines()
    return f"{job.out}: the Ray task failed: {type(exc).__name__}: {text[0] if text else ''}"


def run_batch_on_ray(jobs: Sequence[ConversionJob], force: bool = False, verify: VerifierFactory | None = None,
                     on_done: Callable[[JobResult], None] | None = None,
                     on_event: Callable[[int, Any], None] | None = None) -> list[JobResult]:
    """Run every job as a Ray task on the connected cluster (:func:`qwen_runtime.executor.connect`).

    Returns the results in job order, like :func:`qwen_convert.batch.run_batch`; ``on_done`` sees each as it
    finishes, ``on_event(job index, event)`` each :class:`RelayProgress` event and ``("done",)`` when the job
    has finished (a worker that died sent no ``("stop",)``).  The plan is checked first
    (:func:`qwen_convert.batch.check_jobs`).
    """
    check_jobs(jobs, force)
    tags = [uuid.uuid4().hex[:16] for _ in jobs]
    existed = [job.out.exists() for job in jobs]  # never removed below: only what this run wrote
    remote = [RemoteJob((job, force, verify, tag), job_memory(job, verify is not None), name=job.out.name)
              for job, tag in zip(jobs, tags, strict=True)]
    finished: set[int] = set()

    def done(i: int, result: JobResult) -> None:
        finished.add(i)
        if on_event is not None:
            on_event(i, ("done",))
        if on_done is not None:
            on_done(result)

    def lost(i: int, exc: BaseException) -> JobResult:
        remove_path(temp_path(jobs[i].out, tags[i]))
        return JobResult(jobs[i], FAILED, message=lost_message(jobs[i], exc))

    try:
        return run_on_ray(convert_task, remote, on_done=done, on_event=on_event, on_lost=lost)
    except BaseException:  # the tasks are cancelled and stopped by now (run_on_ray)
        for i, job in enumerate(jobs):
            if i not in finished:  # a task may have finished before the driver heard of it: its output goes too
                remove_path(temp_path(job.out, tags[i]))
                if not existed[i]:
                    remove_path(job.out)
        raise
