"""Convert one Hugging Face model directory to an npy directory or a GGUF file, atomically.

The output path is checked before any tensor is read and written through :mod:`qwen_convert.outputs`:
under a temporary name, renamed into place once complete (and verified, when asked); an existing output is
replaced only with ``force``, and only when it is an output of ours that is not an input of the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from qwen_runtime.errors import FormatError, OutputError, QwenError
from qwen_runtime.formats import detect_format, open_gguf, open_hf_dir, open_npy_dir
from qwen_runtime.formats.base import V_HEAD_TILED, ModelFiles
from qwen_runtime.formats.hub import model_name

from .gguf_writer import GGUFFileWriter
from .imatrix import Importance
from .npy_writer import NpyDirWriter
from .outputs import atomic_output, check_output
from .policy import MIXES, ModelFacts, QuantOptions, TensorSpec, block_size, check_dtype, ordered_specs, plan_outputs
from .quantize import encode_rows, stream_rows

FORMATS = ("npy", "gguf")


class Progress(Protocol):
    """Receives progress reports; the CLI implements it with tqdm bars."""

    def start(self, label: str, specs: Sequence[TensorSpec]) -> None: ...

    def advance(self, spec: TensorSpec, nbytes: int) -> None: ...

    def stop(self) -> None: ...


class OutputSink(Protocol):
    """What :func:`convert` drives: one writer per output format."""

    checksums: dict[str, str]

    def write_tensor(self, spec: TensorSpec, chunks: Iterable[np.ndarray]) -> None: ...

    def finish(self) -> None: ...

    def __enter__(self) -> OutputSink: ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass(frozen=True)
class ConvertResult:
    """What one conversion produced."""

    output: Path
    format: str
    dtype: str
    nbytes: int  # bytes on disk
    seconds: float
    bpw: tuple[float, float] | None = None  # --target-bpw: bits per weight of the quantizable matrices, of the file


def infer_format(out: str | Path, fmt: str | None) -> str:
    """The output format: given, else ``gguf`` for a ``.gguf`` suffix, else ``npy``."""
    fmt = fmt or ("gguf" if Path(out).suffix.lower() == ".gguf" else "npy")
    if fmt not in FORMATS:
        raise QwenError(f"unknown output format {fmt!r}; choose from {', '.join(FORMATS)}")
    return fmt


def open_source(src: str | Path) -> ModelFiles:
    """Open an HF model directory for conversion (Qwen3.5 value heads in llama.cpp's tiled order)."""
    if detect_format(src) != "hf":
        raise FormatError(f"{src}: conversion needs a Hugging Face model directory (config.json + safetensors)")
    return open_hf_dir(src, v_head_order=V_HEAD_TILED)


def path_size(path: Path) -> int:
    """Bytes of a file, or of all files in a directory."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def open_sink(fmt: str, tmp: Path, files: ModelFiles, dtype: str, specs: Sequence[TensorSpec],
              name: str, extra: dict[str, str | int] | None = None) -> OutputSink:
    """The writer for ``fmt`` writing to ``tmp`` (``extra``: more metadata keys)."""
    if fmt == "gguf":
        return GGUFFileWriter(tmp, files, dtype, specs, name, extra)
    return NpyDirWriter(tmp, files, dtype, extra)


def _write_all(sink: OutputSink, files: ModelFiles, specs: Sequence[TensorSpec], target: Path,
               progress: Progress | None, importance: Importance | None = None) -> None:
    """Stream every tensor into ``sink``; I/O errors name the output and the tensor."""
    for spec in specs:
        weights = importance.for_tensor(spec.name, spec.shape[-1], spec.qtype) if importance is not None else None
        chunks = stream_rows(files.tensors[spec.name], spec.qtype, weights)
        if progress is not None:
            chunks = _reporting(chunks, spec, progress)
        try:
            sink.write_tensor(spec, chunks)
        except OSError as exc:
            raise OutputError(f"{target}: cannot write tensor {spec.name!r} ({exc.strerror or exc})") from None
    try:
        sink.finish()
    except OSError as exc:
        raise OutputError(f"{target}: cannot finish writing ({exc.strerror or exc})") from None


def _reporting(chunks: Iterable[np.ndarray], spec: TensorSpec, progress: Progress) -> Iterator[np.ndarray]:
    for chunk in chunks:
        yield chunk
        progress.advance(spec, chunk.nbytes)


def verify_written_checksums(path: Path, fmt: str, checksums: dict[str, str]) -> None:
    """Re-read a written output and compare every tensor's SHA-256 with what was written."""
    if fmt == "npy":
        open_npy_dir(path, verify=True)
        return
    import hashlib

    files = open_gguf(path)
    for name, expected in checksums.items():
        data = np.ascontiguousarray(files.tensor(name).data)
        if hashlib.sha256(data.data).hexdigest() != expected:
            raise FormatError(f"{path}: tensor {name!r}: bytes read back differ from those written")


Verifier = Callable[[Path, str, dict[str, str]], None]


def check_writable(specs: Sequence[TensorSpec], importance: Importance | None = None) -> None:
    """:class:`FormatError` naming the first tensor whose planned type the converter cannot encode (with its
    importance vector, if any), before any output is created."""
    kinds = {}  # (type, weighted) -> first tensor
    for spec in specs:
        weights = importance.for_tensor(spec.name, spec.shape[-1], spec.qtype) if importance is not None else None
        kinds.setdefault((spec.qtype, weights is not None), spec.name)
    for (qtype, weighted), first in kinds.items():
        width = block_size(qtype)
        try:
            encode_rows(np.zeros((1, width), np.float32), qtype, np.ones(width, np.float32) if weighted else None)
        except FormatError:
            how = "importance-weighted " if weighted else ""
            raise FormatError(f"tensor {first!r}: this converter cannot write {how}type {qtype.name} yet") from None


def plan_model(files: ModelFiles, dtype: str, options: QuantOptions | None = None) -> list[TensorSpec]:
    """The output tensors of ``files`` converted to ``dtype`` with ``options`` (llama-quantize's choices)."""
    shapes = {n: t.shape for n, t in files.tensors.items()}
    return plan_outputs(shapes, dtype, ModelFacts.from_config(files.config), options)


def convert(src: str | Path, out: str | Path, fmt: str | None = None, dtype: str = "fp16", force: bool = False,
            name: str | None = None, verify: Verifier | None = None, progress: Progress | None = None,
            tmp_tag: str | None = None, options: QuantOptions | None = None,
            importance: Importance | None = None, target_bpw: float | None = None) -> ConvertResult:
    """Convert the HF model ``src`` to ``out`` (``fmt`` npy or gguf; ``dtype`` a key of ``policy.DTYPES``,
    ``options`` llama-quantize's per-tensor options, ``target_bpw`` types chosen by :mod:`qwen_convert.bpw` to
    reach that many bits per weight (``dtype`` a mix: its output rule and file type), ``importance`` an imatrix
    file's vectors: each quantized tensor llama.cpp would weight is weighted by its vector, and the mixes make
    their imatrix choices).

    ``verify`` (e.g. :func:`verify_written_checksums`) runs on the complete temporary output, before the
    rename; ``tmp_tag`` names the temporary output (:func:`temp_path`), so a retried attempt replaces a killed
    one's.
    Raises :class:`OutputExistsError` when ``out`` exists and ``force`` is false, or when ``out`` is not an
    output ``force`` may replace (:func:`qwen_convert.outputs.check_output`), :class:`FormatError`
    (and subclasses) for bad input and :class:`OutputError` when the output cannot be written.
    """
    started = time.perf_counter()
    target, fmt, dtype = Path(out), infer_format(out, fmt), check_dtype(dtype)
    inputs = (src,) if importance is None else (src, importance.path)
    check_output(target, force, inputs)
    files = open_source(src)
    if importance is not None:
        options = replace(options or QuantOptions(), imatrix=True)
    allocation = None
    if target_bpw is None:
        specs = plan_model(files, dtype, options)
    else:
        from .bpw import plan_target

        if dtype not in MIXES:
            raise QwenError(f"--target-bpw needs one of llama.cpp's mixes as --dtype, not {dtype}")
        types, allocation = plan_target(files, target_bpw, dtype, importance, options)
        specs = ordered_specs({n: t.shape for n, t in files.tensors.items()}, types)
    check_writable(specs, importance)
    if progress is not None:
        progress.start(target.name, specs)
    try:
        with atomic_output(target, force, tmp_tag, inputs) as tmp:
            try:
                sink = open_sink(fmt, tmp, files, dtype, specs, name or model_name(files.path),
                                 importance.metadata(specs) if importance is not None else None)
            except OSError as exc:
                raise OutputError(f"{target}: cannot create output ({exc.strerror or exc})") from None
            with sink:
                _write_all(sink, files, specs, target, progress, importance)
            if verify is not None:
                verify(tmp, fmt, sink.checksums)
    finally:
        if progress is not None:
            progress.stop()
    nbytes = path_size(target)
    bpw = None
    if allocation is not None:
        bpw = (allocation.bpw, nbytes * 8 / sum(int(np.prod(t.shape)) for t in files.tensors.values()))
    return ConvertResult(target, fmt, dtype, nbytes, time.perf_counter() - started, bpw)
