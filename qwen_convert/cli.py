"""``qwen-convert`` and ``qwen-inspect``: thin argparse front ends over the library.

Errors are printed as one line (``qwen-convert: error: <file>: <what>``) and mapped to the exit codes of
:mod:`qwen_runtime.errors`; Ctrl-C exits with 130 and leaves no partial output.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from qwen_runtime.cli_support import ArgumentParser, positive_int, run_guarded
from qwen_runtime.errors import UsageError
from qwen_runtime.executor import EXECUTORS, LOCAL, RAY, connect
from qwen_runtime.formats import MANIFEST_NAME, open_model_files, verify_model_files
from qwen_runtime.formats.hub import resolve_model

from .batch import FAILED, ConversionJob, JobResult, plan_jobs, run_batch, summary_table
from .bpw import DEFAULT_MIX, model_sensitivities, sensitivity_table
from .convert import FORMATS, convert, infer_format, open_source
from .imatrix import WEIGHTED_TYPES, load_importance
from .inspect import (
    compare,
    compare_json,
    compare_table,
    metadata_table,
    model_stats,
    model_summary,
    open_pair,
    selected,
    stats_json,
    stats_table,
)
from .policy import (
    CONVERTER_DTYPES,
    DTYPES,
    MIXES,
    OVERRIDE_TYPES,
    QuantOptions,
    TensorSpec,
    check_dtype,
    parse_tensor_type,
    parse_type,
)
from .verify import BatchVerifier, ConversionVerifier, report_json, report_summary, report_table, verify_against


class TqdmProgress:
    """Two bars on stderr: the whole output (bytes) and the tensor being written."""

    def __init__(self, first_position: int = 0) -> None:
        self._position = first_position
        self._bars: list[tqdm] = []
        self._current = ""

    def start(self, label: str, specs: Sequence[TensorSpec]) -> None:
        common = dict(unit="B", unit_scale=True, leave=False, dynamic_ncols=True, disable=None)
        self._bars = [tqdm(total=sum(s.nbytes for s in specs), desc=label, position=self._position, **common),
                      tqdm(total=0, position=self._position + 1, **common)]

    def advance(self, spec: TensorSpec, nbytes: int) -> None:
        whole, tensor = self._bars
        if spec.name != self._current:
            self._current = spec.name
            tensor.reset(total=spec.nbytes)
            tensor.set_description(spec.name)
        tensor.update(nbytes)
        whole.update(nbytes)

    def stop(self) -> None:
        for bar in self._bars:
            bar.close()
        self._bars, self._current = [], ""


def _csv(value: str, choices: Sequence[str], what: str) -> list[str]:
    items = [v.strip().lower() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in choices]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"invalid {what} {value!r}; choose from {', '.join(choices)}")
    return items


def _dtypes(value: str) -> list[str]:
    """``--dtype``: a comma list of dtypes in any spelling :func:`~qwen_convert.policy.check_dtype` knows, as our
    names."""
    items = [v for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"invalid dtype {value!r}; choose from {', '.join(DTYPES)}")
    try:
        return [check_dtype(v) for v in items]
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def convert_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="qwen-convert", description="Convert HF Qwen models to npy directories or GGUF files "
                       "(one model with -o, or every combination with --output-dir).")
    p.add_argument("sources", nargs="+", metavar="MODEL", help="Hugging Face model directory or Hub id "
                   "ORG/NAME[@REVISION]")
    p.add_argument("-o", "--output", metavar="OUT", help="output path (a .gguf suffix selects GGUF; no default: "
                   "give -o or --output-dir)")
    p.add_argument("--output-dir", "--out-dir", dest="out_dir", metavar="DIR",
                   help="batch mode: write <model>-<dtype>.gguf / <model>-<dtype>/ here (no default)")
    p.add_argument("--format", type=lambda v: _csv(v, FORMATS, "format"), help="npy or gguf (batch: comma list; "
                   "default: from the -o suffix, .gguf or else npy; batch: npy)")
    p.add_argument("--dtype", type=_dtypes, default=None,
                   help=f"{', '.join(CONVERTER_DTYPES)} (every matrix that type), or one of llama.cpp's mixes "
                   f"{', '.join(MIXES)} (llama-quantize's type per tensor); any case, and llama.cpp's spellings "
                   "(F16, F32, Q4_K_M) too (batch: comma list; default fp16)")
    types = ", ".join(q.name.lower() for q in OVERRIDE_TYPES) + "; any case, fp16/fp32 too"
    p.add_argument("--pure", action="store_true", help="with a mix: every quantizable matrix the mix's base type "
                   "(llama-quantize --pure; rows its block does not divide still fall back)")
    p.add_argument("--tensor-type", action="append", default=[], metavar="REGEX=TYPE",
                   help=f"store tensors whose name matches REGEX (searched, lower-cased) as TYPE ({types}); "
                   "repeatable, the first match wins; needs a quantized --dtype (llama-quantize --tensor-type; "
                   "default: none)")
    p.add_argument("--output-tensor-type", metavar="TYPE", help="type of output.weight (and, with a mix, of a "
                   "tied token embedding); default: the mix's choice")
    p.add_argument("--imatrix", metavar="FILE", help="importance matrix (llama-imatrix's GGUF or legacy .dat, or "
                   "qwen-imatrix's): weights the rounding of every tensor llama.cpp weights by it (all quantized "
                   "types but Q8_0), and the iq4 mixes drop their ffn_down bump as llama.cpp does with one "
                   "(default: none)")
    p.add_argument("--target-bpw", type=float, metavar="X", help="choose each quantizable matrix's type among "
                   "Q2_K..Q6_K and Q8_0 by its measured sensitivity (importance-weighted with --imatrix) to reach at "
                   f"most X bits per weight over them; output, tied embedding and file type from --dtype's mix "
                   f"(default {DEFAULT_MIX} with this option); see qwen-inspect --sensitivity (default: off)")
    p.add_argument("--token-embedding-type", metavar="TYPE", help="type of token_embd.weight; default: the "
                   "dtype's choice")
    p.add_argument("--jobs", type=positive_int, default=1, help="batch mode: conversions run in parallel (local "
                   "executor)")
    p.add_argument("--executor", choices=EXECUTORS, default=LOCAL, help="batch mode: run the conversions in this "
                   "process (local) or as Ray tasks, one per output, each declaring the memory it needs (ray; "
                   "needs the ray extra)")
    p.add_argument("--address", metavar="ADDR", help="with --executor ray: the Ray cluster to use (auto, "
                   "HOST:6379 or ray://HOST:10001; default: the RAY_ADDRESS variable, else a local instance)")
    p.add_argument("--force", action="store_true", help="overwrite existing outputs")
    p.add_argument("--verify", action="store_true", help="before renaming the output into place, re-read its "
                   "checksums and verify it against the source (every tensor within its rounding bound, metadata, "
                   "probe KL); a failed output is removed and the exit code is non-zero")
    p.add_argument("--keep-failed", action="store_true", help="with --verify: keep a failed output as "
                   "<name>.FAILED-VERIFY")
    p.add_argument("--name", help="general.name of a GGUF (default: the source directory name)")
    p.add_argument("-v", "--verbose", action="store_true", help="log details (dtype fallbacks, tokenizer)")
    return p


def quant_options(args: argparse.Namespace) -> QuantOptions:
    """The per-tensor options of the command line (:class:`QwenError` for a bad type or pattern)."""
    output = args.output_tensor_type and parse_type(args.output_tensor_type, "--output-tensor-type")
    embedding = args.token_embedding_type and parse_type(args.token_embedding_type, "--token-embedding-type")
    return QuantOptions(pure=args.pure, tensor_types=tuple(map(parse_tensor_type, args.tensor_type)),
                        output_type=output or None, token_embedding_type=embedding or None)


def check_source(path: Path) -> Path:
    """``path`` when it may be an HF model directory (the converter checks the rest); a folder of model folders
    is refused once, with the hint that a shell glob converts them all, before any job starts."""
    if path.is_dir() and not (path / "config.json").is_file() and not (path / MANIFEST_NAME).is_file():
        models = sorted(p.name for p in path.iterdir() if (p / "config.json").is_file())
        if models:
            raise UsageError(f"{path}: a folder of {len(models)} model folders ({', '.join(models[:3])}"
                             f"{', ...' if len(models) > 3 else ''}), not a model; convert them all with "
                             f"qwen-convert {path}/* --output-dir DIR")
    return path


def check_single_output(output: Path, fmt: str) -> None:
    """An output name that contradicts its format is refused: a ``.gguf`` name for an npy folder, a GGUF file
    where a folder is, an npy folder where a file is."""
    if fmt == "npy" and output.suffix.lower() == ".gguf":
        raise UsageError(f"-o {output}: a .gguf name for an npy output (a folder); drop --format npy or name the "
                         "folder without .gguf")
    if fmt == "gguf" and output.is_dir():
        raise UsageError(f"-o {output}: a folder; a GGUF output is a file (e.g. -o {output / 'model.gguf'})")
    if fmt == "npy" and output.exists() and not output.is_dir():
        raise UsageError(f"-o {output}: a file; an npy output is a folder (or use --format gguf)")


def check_importance_use(dtype: str, options: QuantOptions) -> None:
    """``--imatrix`` is refused when no tensor would be stored in a type it weights (fp32, fp16 and q8_0 without
    per-tensor types that use it), so that no output claims an importance matrix it was not made with."""
    types = [DTYPES[dtype][0], *(t for _, t in options.tensor_types), options.output_type,
             options.token_embedding_type]
    if not any(t in WEIGHTED_TYPES for t in types):
        raise UsageError(f"--imatrix: --dtype {dtype} stores no tensor in a type an importance matrix weights "
                         f"({', '.join(sorted(q.name for q in WEIGHTED_TYPES))}); drop --imatrix or choose such a "
                         "type")


def _run_single(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if len(args.sources) != 1 or len(args.dtype) > 1 or (args.format and len(args.format) > 1):
        parser.error("-o converts one MODEL to one format and dtype; use --output-dir for several")
    fmt = infer_format(args.output, args.format[0] if args.format else None)
    check_single_output(Path(args.output), fmt)
    options = quant_options(args)
    if args.imatrix and args.target_bpw is None:
        check_importance_use(args.dtype[0], options)
    args.sources = [check_source(resolve_model(args.sources[0]))]
    importance = load_importance(args.imatrix) if args.imatrix else None
    if importance is not None:
        print(importance.match_report(open_source(args.sources[0]).tensors))
    verifier = ConversionVerifier(args.sources[0], args.output, args.keep_failed) if args.verify else None
    try:
        result = convert(args.sources[0], args.output, fmt, args.dtype[0], force=args.force, name=args.name,
                         verify=verifier, progress=TqdmProgress(), options=options,
                         importance=importance, target_bpw=args.target_bpw)
    finally:
        if verifier is not None and verifier.report is not None:
            print(report_summary(verifier.report))
    print(f"wrote {result.output} ({result.nbytes:,} bytes, {result.format} {result.dtype}, "
          f"{result.seconds:.1f} s)")
    if result.bpw is not None:
        print(f"bits per weight: {result.bpw[0]:.4f} over the quantizable matrices (target {args.target_bpw:g}), "
              f"{result.bpw[1]:.4f} over the whole file")
    return 0


class RemoteBars:
    """The driver's bars for jobs running elsewhere: one byte bar per running job, below the jobs bar, fed by
    :class:`qwen_convert.ray_batch.RelayProgress` events."""

    def __init__(self, first_position: int = 1) -> None:
        self._first = first_position
        self._bars: dict[int, tqdm] = {}

    def event(self, index: int, event: tuple) -> None:
        kind = event[0]
        if kind == "start":
            self.close(index)
            taken = {bar.pos for bar in self._bars.values()}
            position = next(p for p in range(self._first, self._first + len(taken) + 1) if p not in taken)
            self._bars[index] = tqdm(total=event[2], desc=event[1], position=position, unit="B", unit_scale=True,
                                     leave=False, dynamic_ncols=True, disable=None)
        elif kind == "advance" and index in self._bars:
            self._bars[index].update(event[1])
        elif kind in ("stop", "done"):
            self.close(index)

    def close(self, index: int) -> None:
        bar = self._bars.pop(index, None)
        if bar is not None:
            bar.close()

    def close_all(self) -> None:
        for index in list(self._bars):
            self.close(index)


def _run_batch(args: argparse.Namespace) -> int:
    jobs = plan_jobs([check_source(resolve_model(s)) for s in args.sources], args.out_dir, args.format or ["npy"],
                     args.dtype)
    verify = BatchVerifier(args.keep_failed) if args.verify else None
    overall = tqdm(total=len(jobs), desc="jobs", unit="job", position=0, leave=False, dynamic_ncols=True,
                   disable=None)

    def done(result: JobResult) -> None:
        overall.update(1)
        if result.status == FAILED:
            tqdm.write(f"qwen-convert: failed: {result.message}", file=sys.stderr)

    try:
        if args.executor == RAY:
            results = _run_batch_on_ray(args, jobs, verify, done)
        else:
            progress = TqdmProgress(first_position=1) if args.jobs <= 1 else None
            results = run_batch(jobs, args.force, verify, args.jobs, progress, done)
    finally:
        overall.close()
    print(summary_table(results))
    return 1 if any(r.status == FAILED for r in results) else 0


def _run_batch_on_ray(args: argparse.Namespace, jobs: list[ConversionJob], verify: BatchVerifier | None,
                      done: Callable[[JobResult], None]) -> list[JobResult]:
    from .ray_batch import run_batch_on_ray

    connect(args.address)
    bars = RemoteBars(first_position=1)
    try:
        return run_batch_on_ray(jobs, args.force, verify, done, bars.event)
    finally:
        bars.close_all()


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")


def convert_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``qwen-convert``."""
    parser = convert_parser()
    args = parser.parse_args(argv)
    if (args.output is None) == (args.out_dir is None):
        parser.error("give exactly one of -o OUT (one output) and --output-dir DIR (batch)")
    if args.executor == RAY and args.output is not None:
        parser.error("--executor ray runs batches: use --output-dir DIR")
    if args.address is not None and args.executor != RAY:
        parser.error("--address needs --executor ray")
    per_tensor = args.pure or args.tensor_type or args.output_tensor_type or args.token_embedding_type
    if (per_tensor or args.imatrix or args.target_bpw is not None or args.name) and args.out_dir is not None:
        parser.error("--pure, --tensor-type, --output-tensor-type, --token-embedding-type, --imatrix, "
                     "--target-bpw and --name convert one model: use -o OUT")
    if args.jobs != 1 and args.output is not None:
        parser.error("--jobs runs a batch's conversions in parallel: use --output-dir DIR (-o converts one)")
    if args.keep_failed and not args.verify:
        parser.error("--keep-failed keeps an output that failed --verify: it needs --verify")
    if args.target_bpw is not None and args.pure:
        parser.error("--target-bpw chooses a type per tensor: it cannot be combined with --pure")
    args.dtype = args.dtype or ([DEFAULT_MIX] if args.target_bpw is not None else ["fp16"])
    if args.target_bpw is not None and args.dtype[0] not in MIXES:
        parser.error(f"--target-bpw needs one of llama.cpp's mixes as --dtype ({', '.join(MIXES)}), not "
                     f"{args.dtype[0]}")
    _logging(args.verbose)
    if args.output is not None:
        return run_guarded("qwen-convert", lambda: _run_single(args, parser))
    return run_guarded("qwen-convert", lambda: _run_batch(args))


def inspect_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="qwen-inspect", description="What a model is (architecture, context length, rope, "
                       "tokenizer, special tokens, chat template, bytes per type) and per-tensor statistics, for an "
                       "HF directory, npy directory or GGUF file; with --compare, the error of B against A.")
    p.add_argument("path", metavar="MODEL", help="HF model directory, npy model directory, GGUF file or Hub id "
                   "ORG/NAME[:QUANT][@REVISION] (so are B and SRC)")
    p.add_argument("--meta", action="store_true", help="print the metadata view alone, without tensor statistics")
    p.add_argument("--compare", metavar="B", help="report the error of B against MODEL (tensors matched by name; "
                   "default: no comparison)")
    p.add_argument("--filter", metavar="REGEX", help="only tensors whose canonical name matches (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--sensitivity", action="store_true", help="per quantizable matrix, the relative "
                   "importance-weighted squared error of each type qwen-convert --target-bpw chooses among "
                   "(encoded and decoded with our codecs; slow on big models)")
    p.add_argument("--imatrix", metavar="FILE", help="with --sensitivity: weight the errors and encodings by this "
                   "importance matrix (default: unweighted)")
    p.add_argument("--verify", action="store_true", help="check MODEL's integrity on its own: npy checksums, GGUF "
                   "structure (alignment, bounds, type sizes), the architecture's tensor set; exit code 2 on failure")
    p.add_argument("--verify-against", metavar="SRC", help="verify MODEL (npy directory or GGUF) against its HF "
                   "source SRC: tensors, metadata and probe KL; exit code 9 when it fails (default: no check)")
    return p


def _inspect(args: argparse.Namespace) -> int:
    args.path, args.compare, args.verify_against = (p and resolve_model(p) for p in (args.path, args.compare,
                                                                                      args.verify_against))
    if args.verify:
        print(verify_model_files(args.path)[1])
        return 0
    if args.verify_against:
        report = verify_against(args.path, args.verify_against)
        print(json.dumps(report_json(report), indent=1) if args.json else report_table(report))
        report.raise_for_failure()
        return 0
    if args.compare:
        a, b = open_pair(args.path, args.compare)
        result = compare(a, b, args.filter)
        print(json.dumps(compare_json(result), indent=1) if args.json else compare_table(result))
        return 0
    files = open_model_files(args.path)
    if args.sensitivity:
        importance = load_importance(args.imatrix) if args.imatrix else None
        print(sensitivity_table(model_sensitivities(files, importance, names=selected(files, args.filter))))
        return 0
    summary = model_summary(files)
    if args.meta:
        print(json.dumps(summary, indent=1) if args.json else metadata_table(summary))
        return 0
    stats = model_stats(files, args.filter)
    if args.json:
        print(json.dumps({"metadata": summary, **stats_json(stats)}, indent=1))
    else:
        print(f"{metadata_table(summary)}\n\n{stats_table(stats)}")
    return 0


def inspect_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``qwen-inspect``."""
    parser = inspect_parser()
    args = parser.parse_args(argv)
    modes = [flag for flag, on in (("--meta", args.meta), ("--compare", args.compare), ("--sensitivity",
             args.sensitivity), ("--verify", args.verify), ("--verify-against", args.verify_against)) if on]
    if len(modes) > 1:
        parser.error(f"{' and '.join(modes)} are different reports: give one")
    if args.imatrix and not args.sensitivity:
        parser.error("--imatrix weights --sensitivity's errors: it needs --sensitivity")
    if args.filter and modes and modes[0] in ("--meta", "--verify", "--verify-against"):
        parser.error(f"--filter selects tensors for statistics, --compare or --sensitivity, not {modes[0]}")
    if args.json and modes and modes[0] in ("--sensitivity", "--verify"):
        parser.error(f"--json: {modes[0]} prints a table only")
    _logging(False)
    return run_guarded("qwen-inspect", lambda: _inspect(args))
