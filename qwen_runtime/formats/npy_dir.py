"""Directories of memory-mappable ``.npy`` files written by ``qwen-convert --format npy``.

Layout: one ``<canonical name>.npy`` per tensor, ``manifest.json`` (schema below), the normalised
``config.json`` and the source's tokenizer files.  Quantized tensors (Q8_0, Q4_0 to Q5_1, the K-quants, IQ4_NL,
IQ4_XS) are stored as arrays of their type's structured block dtype (``Codec.npy_dtype``, e.g. 34-byte Q8_0
blocks of an fp16 ``d`` and 32 int8 ``qs``), one row of blocks per tensor row, so the bytes equal a GGUF's.

``manifest.json``::

    {"format": "qwen-numpy-npy", "version": 1, "architecture": "qwen2", "source": "...",
     "dtype": "q8_0", "v_head_order": "grouped" | "tiled", "tied_embeddings": true,
     "tensors": {"token_embd.weight": {"file": "token_embd.weight.npy", "shape": [V, H], "type": "Q8_0",
                                       "nbytes": 123, "sha256": "..."}, ...}}
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from tokenize import TokenError
from typing import Any

import numpy as np

from ..errors import FormatError
from ..quants import CODECS
from .base import V_HEAD_GROUPED, V_HEAD_ORDERS, ModelFiles, contained_path, read_json_file
from .config import ModelConfig
from .hf_dir import load_hf_config
from .naming import check_tensor_set
from .tensors import QType, StoredTensor, stored_nbytes, stored_shape

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "qwen-numpy-npy"
FORMAT_VERSION = 1
MAX_DIMS = 4
# The types an npy directory may hold: those with a block dtype.
NPY_TYPES = tuple(q for q, c in CODECS.items() if c.npy_dtype is not None)


def npy_dtype(qtype: QType) -> np.dtype:
    """The dtype of the ``.npy`` array holding a tensor of ``qtype``."""
    return CODECS[qtype].npy_dtype


def npy_shape(qtype: QType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The ``.npy`` array shape for a tensor of logical ``shape`` (blocks, for quantized types)."""
    if CODECS[qtype].quantized:
        return (*shape[:-1], stored_shape(qtype, shape)[-1] // npy_dtype(qtype).itemsize)
    return shape


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _entry_type(path: Path, name: str, info: dict[str, Any]) -> tuple[QType, tuple[int, ...]]:
    """The (type, logical shape) a manifest entry claims, checked for form."""
    qtype, shape = info.get("type"), info.get("shape")
    if not isinstance(qtype, str) or qtype not in QType.__members__:
        raise FormatError(f"{path}: manifest entry for {name!r}: unknown type {qtype!r}")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise FormatError(f"{path}: manifest entry for {name!r}: 'shape' should list 1..{MAX_DIMS} positive "
                          f"integers, got {shape!r}")
    if QType[qtype] not in NPY_TYPES:
        raise FormatError(f"{path}: tensor {name!r} has unsupported type {qtype}")
    return QType[qtype], tuple(shape)


def read_npy_header(path: Path, name: str) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, data offset) of a C-order ``.npy`` file; never unpickles, never trusts the sizes."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise FormatError(f"{path}: tensor {name!r}: unsupported .npy version {version}")
            offset = f.tell()
    except (OSError, ValueError, SyntaxError, TokenError, TypeError, RecursionError) as exc:
        # numpy parses the header dict with tokenize + ast.literal_eval: a corrupt one raises any of these
        raise FormatError(f"{path}: tensor {name!r}: not a valid .npy file ({exc})") from None
    if dtype.hasobject:
        raise FormatError(f"{path}: tensor {name!r}: object dtype refused (it would need pickle)")
    if fortran and len(shape) > 1:
        raise FormatError(f"{path}: tensor {name!r}: Fortran-ordered arrays are not supported")
    return dtype, tuple(shape), offset


def _open_npy(path: Path, name: str, info: dict[str, Any]) -> StoredTensor:
    qtype, shape = _entry_type(path, name, info)
    try:
        nbytes = stored_nbytes(qtype, shape)
    except FormatError as exc:
        raise FormatError(f"{path}: tensor {name!r}: {exc}") from None
    if info.get("nbytes") != nbytes:
        raise FormatError(f"{path}: tensor {name!r}: manifest nbytes {info.get('nbytes')!r} disagrees with "
                          f"{qtype.name}{list(shape)} ({nbytes} bytes)")
    want_dtype, want_shape = npy_dtype(qtype), npy_shape(qtype, shape)
    dtype, file_shape, offset = read_npy_header(path, name)
    if dtype != want_dtype or file_shape != want_shape:
        raise FormatError(f"{path}: tensor {name!r} is {dtype}{list(file_shape)}, manifest says "
                          f"{qtype.name}{list(shape)} ({want_dtype}{list(want_shape)})")
    size = path.stat().st_size
    if size != offset + nbytes:
        raise FormatError(f"{path}: tensor {name!r}: file has {size} bytes, its header needs exactly "
                          f"{offset + nbytes} (truncated or trailing data)")
    array = np.memmap(path, dtype=want_dtype, mode="r", offset=offset, shape=want_shape)
    if CODECS[qtype].quantized:
        array = array.view(np.uint8).reshape(stored_shape(qtype, shape))
    return StoredTensor(name, qtype, shape, path, data=np.asarray(array))


def read_manifest(directory: Path) -> dict[str, Any]:
    manifest = read_json_file(contained_path(directory, MANIFEST_NAME, "manifest"))
    assert manifest is not None
    if manifest.get("format") != FORMAT_NAME:
        raise FormatError(f"{directory / MANIFEST_NAME}: format is {manifest.get('format')!r}, "
                          f"expected {FORMAT_NAME!r}")
    if manifest.get("version") != FORMAT_VERSION:
        raise FormatError(f"{directory / MANIFEST_NAME}: unsupported version {manifest.get('version')!r}")
    if not isinstance(manifest.get("tensors"), dict):
        raise FormatError(f"{directory / MANIFEST_NAME}: 'tensors' must be an object")
    return manifest


def verify_manifest_checksums(files: ModelFiles) -> None:
    """Recompute every tensor file's SHA-256 and compare it with the manifest."""
    for name, info in files.metadata["tensors"].items():
        path = files.tensors[name].path
        expected = info.get("sha256")
        if not isinstance(expected, str):
            raise FormatError(f"{path}: tensor {name!r}: {MANIFEST_NAME} has no 'sha256' to verify against")
        if sha256_file(Path(path)) != expected:
            raise FormatError(f"{path}: tensor {name!r}: checksum does not match {MANIFEST_NAME} "
                              f"(the file changed after it was written)")


def open_npy_dir(path: str | Path, verify: bool = False, expected: ModelConfig | None = None) -> ModelFiles:
    """Open an npy model directory; every tensor is a read-only memory map of its ``.npy`` file, whose header
    and size are checked against the manifest.  ``verify``: recompute every checksum too.  ``expected``: open
    leniently as a model of that config (see :func:`.open_model_files`): neither ``config.json`` nor the
    tensor set is checked, and a ``v_head_order`` the manifest gets wrong reads as grouped."""
    directory = Path(path)
    manifest = read_manifest(directory)
    raw, config = (None, expected) if expected is not None else load_hf_config(directory)
    if expected is None and manifest.get("architecture") != config.arch:
        raise FormatError(f"{directory / MANIFEST_NAME}: architecture {manifest.get('architecture')!r} "
                          f"disagrees with config.json ({config.arch})")
    order = manifest.get("v_head_order", V_HEAD_GROUPED) if config.spec.hybrid else V_HEAD_GROUPED
    if order not in V_HEAD_ORDERS:
        if expected is None:
            raise FormatError(f"{directory / MANIFEST_NAME}: v_head_order {order!r} is not one of "
                              f"{list(V_HEAD_ORDERS)}")
        order = V_HEAD_GROUPED
    tensors = {}
    for name, info in manifest["tensors"].items():
        if not isinstance(info, dict):
            raise FormatError(f"{directory / MANIFEST_NAME}: entry for {name!r} is not an object")
        file = contained_path(directory, info.get("file"), f"tensor {name!r}")
        if not file.is_file():
            raise FormatError(f"{file}: file of tensor {name!r} is missing or not a regular file")
        tensors[name] = _open_npy(file, name, info)
    if expected is None and check_tensor_set(config, tensors, str(directory)) != config.tie_word_embeddings:
        raise FormatError(f"{directory}: config.json says tie_word_embeddings is {config.tie_word_embeddings}, "
                          f"but output.weight is {'present' if config.tie_word_embeddings else 'missing'}")
    files = ModelFiles(directory, "npy", config, tensors, directory=directory, metadata=manifest, hf_config=raw,
                       v_head_order=order)
    if verify:
        verify_manifest_checksums(files)
    return files
