"""Package docstrings and comments say why, not what a run measured.

A timing figure beside the code goes stale with the next kernel change, and nothing shows that it has; the
measurements live in ``docs/performance.md`` (dated, with the run that made them) and this test keeps new ones
out of the packages' prose.  It reads each module's docstrings (module, class, function) and comment blocks, never
its code or its other strings (a CLI may print ``12.3 tok/s``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("qwen_runtime", "qwen_convert", "qwen_serve")

_NUMBER = r"(?<![\w.])~?\d+(?:[.,]\d+)*"
_RANGE = rf"{_NUMBER}(?:\s*(?:-|–|to|/)\s*\d+(?:[.,]\d+)*)?"
_TIME = r"(?:ms|µs|us|ns|s|sec|seconds?|minutes?|hours?)"
_RATE = r"(?:tok/s|tokens/s|tokens per second|GFLOPS|GB/s|GiB/s|MB/s|MiB/s)"
TIMING = re.compile("|".join([
    rf"(?<!every ){_RANGE}\s+{_TIME}\b(?![-+/])",  # 0.12 s, 2-3 minutes, 46-50 ms (not an interval: every 2 ms)
    rf"{_NUMBER}(?:ms|µs|us|ns)\b",  # 4ms
    rf"{_NUMBER}\s*{_RATE}", rf"\b{_RATE}\s*[~:]?\s*\d",  # 3.18 tok/s, tok/s 6-10
    rf"{_NUMBER}\s*[x×]\s*(?:faster|slower|longer|sooner)\b",  # 5x slower
    r"\b(?:ms|us|µs) (?:of CPU )?per\b",  # ms of CPU per million weights: 0.103 -> 0.082
    rf"{_NUMBER}\s*% (?:more|less|faster|slower) (?:CPU|time|wall)",  # 15% more CPU
]), re.IGNORECASE)


def prose(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every docstring and every block of comment lines, whitespace collapsed so that a
    figure broken over two lines reads as one."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, " ".join(doc.split())))
    block: list[str] = []
    start = last = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        if block and line != last + 1:
            found.append((start, " ".join(" ".join(block).split())))
            block = []
        if not block:
            start = line
        block.append(token.string.lstrip("#"))
        last = line
    if block:
        found.append((start, " ".join(" ".join(block).split())))
    return found


def figures(source: str) -> list[tuple[int, str]]:
    """(line, figure) of every timing figure in the docstrings and comments of ``source``."""
    return [(line, match.group(0)) for line, text in prose(source) for match in TIMING.finditer(text)]


def package_modules() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            if "assets" not in path.parts]


def test_no_timing_figures_in_package_docstrings_or_comments() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {figure!r}" for path in package_modules()
             for line, figure in figures(path.read_text(encoding="utf-8"))]
    assert not found, ("timing figures go to docs/performance.md (dated, with the run), and the docstring or comment "
                       "says why the code is written so:\n" + "\n".join(found))


# As they stood in the packages until 2026-12-04 (their figures are in docs/performance.md now).
MOVED = [
    '"""which imports all of ``scipy.linalg`` (with SciPy installed, measured: 0.12 s of CPU time, over a quarter of\n'
    'numba\'s warm-cache start-up)."""',
    "# OpenBLAS's worker threads keep spinning (measured: 46-50 ms of CPU during a\n# 200 ms sleep after a GEMM)\n",
    '"""the Qwen2.5-7B-shaped Q4_K_M file\'s decode with 8-bit activations 2.60 -> 3.18\ntok/s (llama.cpp 3.74)."""',
    "# Products of up to this many rows read the blocks directly, more decode a tile for BLAS.  One thread, ms of CPU\n"
    "# per million weights, row kernels / tile + BLAS: Q8_0 4864 x 896 16 rows 0.46 / 0.67\n",
    "x = 1  # ``math.exp`` calls libm's scalar ``expf`` (5x slower here).\n",
    "# sums and products in contiguous buffers (numpy's loops over a column block of a wider array ran 1.5-2.5x\n"
    "# slower)\n",
    "# products of 8 heads cost what 16 heads' cost per head; groups of 4 and 2 took 15% and 35% more CPU.\n",
    '"""made a 128-token chunked prefill 10-20x slower on 2 shared vCPUs (0.6-10 s instead of 0.04 s)."""',
    "# took part in only 35-60 % of the runs; 2 x 100k floats took 115 us on one thread\n",
    '"""the first compile of every kernel module took 2-3 minutes of its time."""',
]


@pytest.mark.parametrize("source", MOVED)
def test_the_pattern_catches_the_figures_that_were_moved(source: str) -> None:
    assert figures(source), source


@pytest.mark.parametrize("source", [
    '"""value ``128h + 32s + l`` is bits ``2s, 2s+1`` of byte ``32h + l``."""',  # K-quant bit layouts
    "# VmHWM and the peak of RssAnon sampled every 2 ms, each job in a fresh process; MiB\n",  # an interval
    "# 8 rows, 4 MiB row chunks, 32 bytes serve 128 values, float32's 2^-24, (1 << 22) elements\n",
    'print(f"decode {tps:.1f} tok/s")\nHELP = "waits 30 s"\n',  # code and other strings are not prose
])
def test_the_pattern_leaves_other_numbers_alone(source: str) -> None:
    assert not figures(source), figures(source)
