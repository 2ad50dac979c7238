"""What verify found, and its renderings: a few summary lines, a per-tensor table, JSON."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qwen_runtime.errors import VerificationError

from ..inspect import json_safe
from .metadata import MetadataCheck
from .tensors import TensorCheck

if TYPE_CHECKING:
    from .behaviour import BehaviourCheck


@dataclass
class VerifyReport:
    """Everything :func:`verify_against` found; ``ok`` only when every check passed."""

    output: Path
    source: Path
    format: str
    dtype: str | None
    tensors: list[TensorCheck] = field(default_factory=list)
    metadata: list[MetadataCheck] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # source tensor -> why it is not in the output
    problems: list[str] = field(default_factory=list)  # accounting: missing / unexpected / unmapped tensors
    behaviour: BehaviourCheck | None = None  # when run

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        """Every failure, one line each: accounting, then tensors (file order), metadata, behaviour."""
        lines = list(self.problems)
        lines += [f"tensor {t.name!r} (from {t.source}): {t.cause}" for t in self.tensors if not t.ok]
        lines += [f"metadata {m.key!r}: {m.note}" for m in self.metadata if not m.ok]
        if self.behaviour is not None and not self.behaviour.ok:
            lines.append(f"behaviour: {self.behaviour.failure}")
        return lines

    def raise_for_failure(self, aftermath: str = "") -> None:
        """:class:`VerificationError` naming the first failure (and how many there are) unless ``ok``;
        ``aftermath`` (what became of the output) ends the message."""
        failures = self.failures()
        if failures:
            more = f" (and {len(failures) - 1} more failures)" if len(failures) > 1 else ""
            end = f"; {aftermath}" if aftermath else ""
            raise VerificationError(f"{self.output}: verification against {self.source} failed: "
                                    f"{failures[0]}{more}{end}")


def skipped_summary(skipped: dict[str, str]) -> str:
    """``12 vision tower (text weights only); 1 tied to the token embedding``."""
    return "; ".join(f"{n} {reason}" for reason, n in Counter(skipped.values()).most_common())


def report_summary(report: VerifyReport) -> str:
    """A few lines: what was checked and the verdict (the CLIs print this)."""
    failed_t = sum(not t.ok for t in report.tensors)
    failed_m = sum(not m.ok for m in report.metadata)
    lines = [f"verify {report.output} against {report.source} ({report.format}, {report.dtype or '?'})",
             f"  tensors:   {len(report.tensors)} compared, {failed_t} failed, {len(report.problems)} accounting "
             f"problems; skipped source tensors: {skipped_summary(report.skipped) or 'none'}",
             f"  metadata:  {len(report.metadata)} keys checked, {failed_m} failed"]
    if report.behaviour is not None:
        lines.append(f"  behaviour: {report.behaviour.summary()}")
    failures = report.failures()
    lines.append("  result:    verified" if not failures else f"  result:    FAILED ({len(failures)} failures)")
    lines += [f"  - {line}" for line in failures[:10]]
    if len(failures) > 10:
        lines.append(f"  - ... {len(failures) - 10} more")
    return "\n".join(lines)


def report_table(report: VerifyReport) -> str:
    """Per-tensor table (name, type, transform, max error, bound, status) followed by the summary."""
    width = max([4] + [len(t.name) for t in report.tensors])
    lines = [f"{'name':<{width}}  {'type':<5} {'max_error':>10} {'max_bound':>10}  status  transform"]
    for t in report.tensors:
        lines.append(f"{t.name:<{width}}  {t.type:<5} {t.max_error:>10.3g} {t.max_bound:>10.3g}  "
                     f"{'ok' if t.ok else 'FAILED':<6}  {t.transform}")
    return "\n".join(lines + [report_summary(report)])


def report_json(report: VerifyReport) -> dict[str, Any]:
    """JSON-ready form of a report (non-finite floats as strings)."""
    data = {"output": str(report.output), "source": str(report.source), "format": report.format,
            "dtype": report.dtype, "ok": report.ok, "failures": report.failures(),
            "tensors": [asdict(t) for t in report.tensors], "metadata": [asdict(m) for m in report.metadata],
            "skipped": report.skipped, "problems": report.problems,
            "behaviour": asdict(report.behaviour) if report.behaviour is not None else None}
    return json_safe(data)
