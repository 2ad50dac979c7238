"""verify's entry points: :func:`verify_against` runs the checks, :class:`ConversionVerifier` is the converter's
``--verify`` (and :class:`BatchVerifier` the batch converter's)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import Keys

from qwen_runtime.formats import open_hf_dir, open_model_files
from qwen_runtime.formats.base import ModelFiles
from qwen_runtime.formats.config import ModelConfig

from ..convert import verify_written_checksums
from ..outputs import check_replaceable, remove_path
from ..policy import DTYPES
from .metadata import check_metadata
from .report import VerifyReport
from .tensors import compare_tensors, plan_sources

FILE_TYPE_DTYPES = {int(ftype): name for name, (_, ftype) in DTYPES.items()}
FAILED_SUFFIX = ".FAILED-VERIFY"


def open_output(path: str | Path, config: ModelConfig) -> ModelFiles:
    """Open an npy directory or GGUF file through the readers, leniently, as a model of ``config`` (the
    source's): its structure is checked as always, its metadata and tensor set are checked here, with better
    messages; MTP blocks llama.cpp appends after the decoder layers are left out."""
    return open_model_files(path, expected=config)


def output_dtype(output: ModelFiles) -> str | None:
    """The dtype a converted model declares: its manifest's, or the name of its GGUF file type."""
    if output.format == "npy":
        return output.metadata.get("dtype")
    return FILE_TYPE_DTYPES.get(output.metadata.get(Keys.General.FILE_TYPE, -1))


def verify_against(output_path: str | Path, source_dir: str | Path, behaviour: bool = True) -> VerifyReport:
    """Verify a converted model against its HF source: tensors, accounting, metadata and (``behaviour``)
    next-token distributions on a probe.  Never raises for a mismatch: read :attr:`VerifyReport.ok` /
    :meth:`VerifyReport.failures`, or call :meth:`VerifyReport.raise_for_failure`."""
    source = open_hf_dir(source_dir)
    config = source.config
    output = open_output(output_path, config)
    dtype = output_dtype(output)
    report = VerifyReport(Path(output_path), Path(source_dir), output.format, dtype)
    planned, report.skipped, report.problems = plan_sources(Path(source_dir), config, output.v_head_order)
    report.tensors, unaccounted = compare_tensors(output, planned, config)
    report.problems += unaccounted
    report.metadata = check_metadata(output, source)
    if behaviour:  # imported here: it loads the models, which the other checks do not need
        from .behaviour import behaviour_check

        report.behaviour = behaviour_check(source, output.path, dtype)
    return report


def failed_path(target: Path) -> Path:
    """Where ``--keep-failed`` keeps an output that failed verification: ``<name>.FAILED-VERIFY``."""
    return target.with_name(target.name + FAILED_SUFFIX)


class ConversionVerifier:
    """The converter's ``--verify`` for one output: re-read the checksums, then :func:`verify_against` the
    source, on the temporary output before it is renamed into place.  On failure the temporary output is
    removed by the converter, or kept as ``<target>.FAILED-VERIFY`` with ``keep_failed``, and
    :class:`VerificationError` names the first failure.  ``report`` holds the last report."""

    def __init__(self, source: str | Path, target: str | Path, keep_failed: bool = False,
                 behaviour: bool = True) -> None:
        self.source, self.target = Path(source), Path(target)
        self.keep_failed, self.behaviour = keep_failed, behaviour
        self.report: VerifyReport | None = None

    def __call__(self, tmp: Path, fmt: str, checksums: dict[str, str]) -> None:
        verify_written_checksums(tmp, fmt, checksums)
        report = verify_against(tmp, self.source, self.behaviour)
        report.output = self.target
        self.report = report
        if report.ok:
            return
        fate = "output removed"
        if self.keep_failed:
            kept = failed_path(self.target)
            if kept.exists() or kept.is_symlink():
                check_replaceable(kept)
            remove_path(kept)
            tmp.rename(kept)
            fate = f"kept as {kept}"
        report.raise_for_failure(fate)


@dataclass(frozen=True)
class BatchVerifier:
    """Makes the :class:`ConversionVerifier` of each batch job (picklable for worker processes)."""

    keep_failed: bool = False
    behaviour: bool = True

    def __call__(self, job: Any) -> ConversionVerifier:  # job: qwen_convert.batch.ConversionJob
        return ConversionVerifier(job.src, job.out, self.keep_failed, self.behaviour)
