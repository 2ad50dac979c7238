"""``qwen-imatrix``: an importance matrix computed with our runtime, in llama-imatrix's GGUF format.

    qwen-imatrix model.gguf -f calibration.txt -o imatrix.gguf [--ctx 512] [--chunks N]

The output is checked before the matrix is computed (its folder exists; an existing file is replaced only
with ``--force`` and only when it is a GGUF file that is not the model: :mod:`qwen_convert.outputs`), written
to a temporary name beside ``-o`` and renamed when complete.  Errors print one line on stderr and exit with the code of
:func:`qwen_runtime.errors.exit_code`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from qwen_runtime.cli_support import ArgumentParser, add_machine_options, run_guarded
from qwen_runtime.formats.hub import resolve_model
from qwen_runtime.generation.evaluate import read_text

from .imatrix import write_imatrix
from .imatrix_collect import compute_imatrix
from .outputs import atomic_output, check_output

DEFAULT_CTX = 512  # llama-imatrix's default context


def imatrix_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="qwen-imatrix", description="Compute an importance matrix (per weight matrix "
                                "of the layers: sums of squared input activations per column and token counts) "
                                "over a text, as llama-imatrix does, and write it in llama-imatrix's GGUF format "
                                "for qwen-convert --imatrix or llama-quantize --imatrix.")
    p.add_argument("model", metavar="MODEL", help="model to run: HF directory, npy directory, GGUF file or Hub id "
                   "ORG/NAME[:QUANT][@REVISION]")
    p.add_argument("-f", "--file", required=True, metavar="TEXT", help="calibration text (UTF-8; required, no default)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="imatrix file to write (GGUF; required, no "
                   "default)")
    p.add_argument("-c", "--ctx", type=int, default=DEFAULT_CTX, metavar="N",
                   help=f"tokens per chunk, each run from an empty cache (default {DEFAULT_CTX}; at least 16)")
    p.add_argument("--chunks", type=int, default=None, metavar="N",
                   help="use at most N chunks (default: every whole chunk of the text)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    add_machine_options(p)
    return p


def _run(args: argparse.Namespace) -> int:
    output, model = Path(args.output), resolve_model(args.model)
    inputs = (model, args.file)
    check_output(output, args.force, inputs)
    text = read_text(args.file)

    def progress(done: int, total: int) -> None:
        sys.stderr.write(f"\rchunk {done}/{total}")
        if done == total:
            sys.stderr.write("\n")

    imatrix = compute_imatrix(model, text, args.file, args.ctx, args.chunks, progress,
                              args.threads, args.kernels)
    with atomic_output(output, args.force, inputs=inputs) as tmp:
        write_imatrix(tmp, imatrix)
    print(f"wrote {args.output} ({len(imatrix.entries)} matrices, {imatrix.chunk_count} chunks of {args.ctx} tokens)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``qwen-imatrix``."""
    args = imatrix_parser().parse_args(argv)
    return run_guarded("qwen-imatrix", lambda: _run(args))
