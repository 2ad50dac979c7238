"""Harness for the llama.cpp interop tests: llama.cpp's converter, its runtime, and structural GGUF diffs.

* :func:`converter_script` finds llama.cpp's ``convert_hf_to_gguf.py`` in the sdist of the installed
  ``llama-cpp-python`` (the sdist vendors llama.cpp with its converter and ``gguf-py``): it is downloaded once
  with ``pip download`` into a cache directory and unpacked there.  Nothing of it is committed.
* :func:`llama_convert` runs that converter in a subprocess (it puts its own ``gguf-py`` first on sys.path).
* :func:`llama_quantize` quantizes a GGUF with llama.cpp's own quantizer (``llama_model_quantize``), as
  ``llama-quantize`` does: a file type such as ``Q4_K_M`` (its per-tensor mixture) or, with ``pure``, one type;
  :func:`llama_quantize_types` only the types it would give (its dry run).
* :class:`LlamaModel` opens a GGUF with ``llama_cpp.Llama`` (logits for every position), collecting llama.cpp's
  log lines so tests can assert the absence of warnings.
* :func:`gguf_structure` / :func:`structural_diff` compare two GGUF files: tensor names, shapes and types, and
  metadata keys with their values.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import math
import re
import struct
import subprocess
import sys
import tarfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DIST_NAME = "llama-cpp-python"
# What the converter needs from the sdist (paths below vendor/llama.cpp/).
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
OUTTYPES = {"fp32": "f32", "fp16": "f16", "q8_0": "q8_0"}  # our --dtype -> llama.cpp's --outtype
GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_CONT = 3, 5  # ggml_log_level: CONT continues the previous line
GGML_TYPE_F32 = 0  # KV cache in float32 (llama.cpp defaults to F16, which alone moves logits by ~1e-3)


class ConverterUnavailable(RuntimeError):
    """llama.cpp's converter could not be obtained (reason in the message)."""


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        return None


def _vendor_root(cache_dir: Path, version: str) -> Path:
    return cache_dir / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def _download_sdist(cache_dir: Path, version: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
           f"{DIST_NAME}=={version}", "-d", str(cache_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    sdists = sorted(cache_dir.glob(f"llama_cpp_python-{version}.tar.gz"))
    if done.returncode != 0 or not sdists:
        raise ConverterUnavailable(f"pip download of the {DIST_NAME} {version} sdist failed: "
                                   f"{done.stderr.strip()[-400:]}")
    return sdists[0]


def _unpack_converter(sdist: Path, cache_dir: Path, version: str) -> None:
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    wanted = tuple(prefix + part for part in CONVERTER_PARTS)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(wanted)]
        tar.extractall(cache_dir, members=members, filter="data")


def converter_script(cache_dir: Path) -> Path:
    """``convert_hf_to_gguf.py`` of the installed llama-cpp-python's vendored llama.cpp (downloaded once)."""
    version = installed_version()
    if version is None:
        raise ConverterUnavailable(f"{DIST_NAME} is not installed")
    script = _vendor_root(cache_dir, version) / CONVERTER_PARTS[0]
    if not script.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        _unpack_converter(_download_sdist(cache_dir, version), cache_dir, version)
    if not script.is_file():
        raise ConverterUnavailable(f"the {DIST_NAME} {version} sdist has no vendor/llama.cpp/{CONVERTER_PARTS[0]}")
    return script


def supports_flag(script: Path, flag: str) -> bool:
    return flag in script.read_text(encoding="utf-8")


def llama_convert(script: Path, src: Path, out: Path, dtype: str, extra: Sequence[str] = ()) -> Path:
    """Convert ``src`` with llama.cpp's converter to ``out`` (``dtype`` in our naming: fp32/fp16/q8_0)."""
    cmd = [sys.executable, str(script), str(src), "--outtype", OUTTYPES[dtype], "--outfile", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama.cpp conversion of {src} ({dtype}) failed:\n{done.stderr[-3000:]}")
    return out


def llama_quantize(src: Path, dst: Path, ftype: str, pure: bool = False, threads: int = 2,
                   tensor_types: Sequence[tuple[str, str]] = (), output_tensor_type: str | None = None,
                   token_embedding_type: str | None = None,
                   imatrix: dict[str, np.ndarray] | None = None) -> Path:
    """Quantize GGUF ``src`` (F32/F16/BF16) to ``dst`` with llama.cpp's quantizer; ``ftype`` is a
    ``LLAMA_FTYPE_MOSTLY_*`` suffix (``Q4_K_M``, ``IQ4_XS``, ``BF16``, ...).  Without ``pure`` llama.cpp picks
    its mixture per tensor; with it every quantizable tensor gets the file type's base type (both fall back to
    a 32-block type where a row length is not a multiple of 256, as ``llama-quantize`` does).

    ``tensor_types`` ((regex, GGML type name) pairs), ``output_tensor_type`` and ``token_embedding_type`` are
    llama-quantize's ``--tensor-type``, ``--output-tensor-type`` and ``--token-embedding-type``; ``imatrix`` maps
    tensor names to their importance vectors (what llama-quantize passes after reading an imatrix file).
    """
    logs = _quantize(src, dst, ftype, pure, threads, tensor_types, output_tensor_type, token_embedding_type, imatrix,
                     dry_run=False)
    if not dst.is_file():
        raise RuntimeError(f"llama.cpp wrote no {dst} quantizing {src} to {ftype}:\n{logs.text()[-2000:]}")
    return dst


# One tensor of llama_model_quantize's log: its name, stored type and, when it converts it, the new type.
_QUANTIZE_LINE = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\w+), "
                            r"size =\s*[\d.]+ MiB(?:\s*->\s*[\d.]+ MiB \((\w+)\))?")


def llama_quantize_types(src: Path, ftype: str, pure: bool = False, threads: int = 2,
                         tensor_types: Sequence[tuple[str, str]] = (), output_tensor_type: str | None = None,
                         token_embedding_type: str | None = None,
                         imatrix: dict[str, np.ndarray] | None = None) -> dict[str, str]:
    """The type llama.cpp's quantizer gives each tensor of ``src`` (name -> GGML type name, upper case, as
    ``GGMLQuantizationType`` names it), from its ``--dry-run`` (no file written, nothing encoded); the arguments
    are :func:`llama_quantize`'s."""
    logs = _quantize(src, None, ftype, pure, threads, tensor_types, output_tensor_type, token_embedding_type, imatrix,
                     dry_run=True)
    types = {name: (new or old).upper() for name, old, new in _QUANTIZE_LINE.findall(logs.text())}
    if not types:
        raise RuntimeError(f"no tensor in llama.cpp's dry run of {src} to {ftype}:\n{logs.text()[-2000:]}")
    return types


def _quantize(src: Path, dst: Path | None, ftype: str, pure: bool, threads: int,
              tensor_types: Sequence[tuple[str, str]], output_tensor_type: str | None,
              token_embedding_type: str | None, imatrix: dict[str, np.ndarray] | None,
              dry_run: bool) -> LogCapture:
    """One ``llama_model_quantize`` call with llama-quantize's options; its log."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.pure = pure
    params.nthread = threads
    params.dry_run = dry_run
    if output_tensor_type is not None:
        params.output_tensor_type = getattr(llama_cpp, f"GGML_TYPE_{output_tensor_type.upper()}")
    if token_embedding_type is not None:
        params.token_embedding_type = getattr(llama_cpp, f"GGML_TYPE_{token_embedding_type.upper()}")
    keep: list[Any] = []  # what the C structures point into, alive for the call
    if tensor_types:
        overrides = (llama_cpp.llama_model_tensor_override * (len(tensor_types) + 1))()
        for slot, (pattern, type_name) in zip(overrides, tensor_types, strict=False):
            slot.pattern = pattern.lower().encode()
            slot.type = getattr(llama_cpp, f"GGML_TYPE_{type_name.upper()}")
        overrides[len(tensor_types)].type = llama_cpp.GGML_TYPE_COUNT
        params.tt_overrides = overrides
        keep.append(overrides)
    if imatrix:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for slot, (name, values) in zip(entries, imatrix.items(), strict=False):
            values = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(values)
            slot.name = name.encode()
            slot.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            slot.size = values.size
        params.imatrix = entries
        keep.append(entries)
    target = b"" if dst is None else str(dst).encode()
    with captured_llama_logs() as logs:
        status = llama_cpp.llama_model_quantize(str(src).encode(), target, params)
    if status != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype} (status {status}):\n{logs.text()[-2000:]}")
    return logs


# ------------------------------------------------------------------------------------------------ runtime

@dataclass
class LogCapture:
    """llama.cpp log lines (level, text) received through ``llama_log_set``."""

    lines: list[tuple[int, str]] = field(default_factory=list)

    def add(self, level: int, text: str) -> None:
        if level == GGML_LOG_LEVEL_CONT and self.lines:
            self.lines[-1] = (self.lines[-1][0], self.lines[-1][1] + text)
        else:
            self.lines.append((level, text))

    def warnings(self) -> list[str]:
        return [text for level, text in self.lines if level >= GGML_LOG_LEVEL_WARN]

    def text(self) -> str:
        return "".join(text for _, text in self.lines)


@contextmanager
def captured_llama_logs() -> Iterator[LogCapture]:
    """Route llama.cpp's log callback into a :class:`LogCapture` for the duration of the block."""
    import llama_cpp

    capture = LogCapture()

    @llama_cpp.llama_log_callback
    def _callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        capture.add(int(level), text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
    try:
        yield capture
    finally:
        from llama_cpp._logger import llama_log_callback as default_callback

        llama_cpp.llama_log_set(default_callback, ctypes.c_void_p(0))


class LlamaModel:
    """A GGUF opened by llama.cpp with logits kept for every position."""

    def __init__(self, path: Path, n_ctx: int = 256) -> None:
        import llama_cpp

        with captured_llama_logs() as logs:
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=2,
                                       logits_all=True, verbose=True, seed=0,
                                       type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
        self.load_log = logs

    @property
    def metadata(self) -> dict[str, str]:
        return self.llm.metadata

    def tokenize(self, text: str) -> list[int]:
        """Token ids as llama.cpp encodes a prompt: BOS when the file asks for it, special tokens parsed."""
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=True))

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Float32 [T, V] logits of one evaluation of ``ids`` from an empty cache."""
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        self.llm.eval(list(ids))
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def greedy(self, ids: Sequence[int], steps: int) -> list[int]:
        """Greedy continuation through llama.cpp's cache (decode one token at a time)."""
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        self.llm.eval(list(ids))
        out: list[int] = []
        for _ in range(steps):
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            out.append(token)
            self.llm.eval([token])
        return out

    def close(self) -> None:
        self.llm.close()


# ------------------------------------------------------------------------------------------ structure

@dataclass(frozen=True)
class GGUFStructure:
    """What a structural comparison looks at: tensors (numpy shape, GGML type name), metadata values and the
    GGUF value type of every key (``UINT32``, ``ARRAY[INT32]``, ...)."""

    tensors: dict[str, tuple[tuple[int, ...], str]]
    metadata: dict[str, Any]
    key_types: dict[str, str]
    data: dict[str, bytes]  # SHA-256 of each tensor's bytes


def _key_types(buf: np.ndarray) -> dict[str, str]:
    """GGUF value type of each key, walking the KV section (the values themselves come from parse_gguf)."""
    from gguf import GGUFValueType

    from qwen_runtime.formats.gguf_parse import SCALAR_FORMATS

    view, u32, u64 = memoryview(buf), struct.Struct("<I").unpack_from, struct.Struct("<Q").unpack_from
    (kv_count,) = u64(view, 16)
    pos, types = 24, {}

    def skip_string(at: int) -> int:
        return at + 8 + u64(view, at)[0]

    for _ in range(kv_count):
        (n,) = u64(view, pos)
        key = str(view[pos + 8:pos + 8 + n], "utf-8")
        pos += 8 + n
        vtype = GGUFValueType(u32(view, pos)[0])
        pos += 4
        if vtype == GGUFValueType.ARRAY:
            etype, count = GGUFValueType(u32(view, pos)[0]), u64(view, pos + 4)[0]
            pos += 12
            types[key] = f"ARRAY[{etype.name}]"
            if etype == GGUFValueType.STRING:
                for _ in range(count):
                    pos = skip_string(pos)
            else:
                pos += count * struct.calcsize(SCALAR_FORMATS[etype])
        else:
            types[key] = vtype.name
            pos = skip_string(pos) if vtype == GGUFValueType.STRING else pos + struct.calcsize(SCALAR_FORMATS[vtype])
    return types


def gguf_structure(path: Path) -> GGUFStructure:
    """Read a GGUF with qwen_runtime's validating parser (gguf.GGUFReader is far slower on 250k-token lists)."""
    from qwen_runtime.formats.gguf_parse import parse_gguf, tensor_view

    layout = parse_gguf(path)
    tensors = {t.name: (t.shape, t.qtype.name) for t in layout.tensors}
    data = {t.name: hashlib.sha256(tensor_view(layout, t)).digest() for t in layout.tensors}
    return GGUFStructure(tensors, dict(layout.metadata), _key_types(layout.data), data)


def values_equal(a: Any, b: Any) -> bool:
    """Metadata equality; floats compare as float32 (both files store FLOAT32)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and (
            np.float32(a) == np.float32(b) or (math.isnan(a) and math.isnan(b)))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):  # numeric arrays: views of the file map
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                and np.array_equal(a, b, equal_nan=a.dtype.kind == "f" and b.dtype.kind == "f"))
    if isinstance(a, list) and isinstance(b, list):
        return a == b or (len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b, strict=True)))
    return type(a) is type(b) and a == b


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def structural_diff(ours: GGUFStructure, theirs: GGUFStructure, ignore_keys: frozenset[str] = frozenset()
                    ) -> dict[str, str]:
    """Every difference as {"tensor:<name>" or "key:<name>": description}; keys in ``ignore_keys`` skipped."""
    diffs: dict[str, str] = {}
    for name in sorted(set(ours.tensors) | set(theirs.tensors)):
        a, b = ours.tensors.get(name), theirs.tensors.get(name)
        if a != b:
            diffs[f"tensor:{name}"] = f"ours {a}, llama.cpp {b}"
    for key in sorted((set(ours.metadata) | set(theirs.metadata)) - ignore_keys):
        a, b = ours.metadata.get(key, "<absent>"), theirs.metadata.get(key, "<absent>")
        if not values_equal(a, b):
            diffs[f"key:{key}"] = f"ours {_short(a)}, llama.cpp {_short(b)}"
        elif ours.key_types[key] != theirs.key_types[key]:
            diffs[f"key:{key}"] = f"GGUF type: ours {ours.key_types[key]}, llama.cpp {theirs.key_types[key]}"
    return diffs


def data_diff(ours: GGUFStructure, theirs: GGUFStructure) -> list[str]:
    """Tensors present in both files whose stored bytes differ."""
    return sorted(n for n in set(ours.data) & set(theirs.data) if ours.data[n] != theirs.data[n])
