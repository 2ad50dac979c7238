"""An npy model directory (schema in :mod:`qwen_runtime.formats.npy_dir`), written one tensor at a time.

Each ``<name>.npy`` gets its header first, then its rows as they are converted; the SHA-256 in the
manifest (of the whole file, as ``verify_manifest_checksums`` recomputes it) is computed while streaming.  The
manifest, ``config.json`` and the tokenizer files are written last.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from qwen_runtime.formats.base import TOKENIZER_FILES, ModelFiles
from qwen_runtime.formats.npy_dir import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, npy_dtype, npy_shape

from .policy import TensorSpec
from .quantize import write_chunks


def npy_header(spec: TensorSpec) -> bytes:
    """The ``.npy`` (format 1.0) header of the array holding ``spec``."""
    header = {"descr": np.lib.format.dtype_to_descr(npy_dtype(spec.qtype)), "fortran_order": False,
              "shape": npy_shape(spec.qtype, spec.shape)}
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


class NpyDirWriter:
    """Writes the tensors of one model into ``directory`` (created here), then its manifest and side files."""

    def __init__(self, directory: Path, files: ModelFiles, dtype: str,
                 extra: dict[str, str | int] | None = None) -> None:
        """``extra``: more manifest fields (e.g. the ``quantize.imatrix.*`` keys a GGUF would carry)."""
        if files.directory is None or files.hf_config is None:
            raise ValueError("npy output needs a source model directory with config.json")
        directory.mkdir()
        self.path = directory
        self._files = files
        self._dtype = dtype
        self._extra = dict(extra or {})
        self.checksums: dict[str, str] = {}
        self._entries: dict[str, dict[str, Any]] = {}

    def write_tensor(self, spec: TensorSpec, chunks: Iterable[np.ndarray]) -> None:
        """Write ``<name>.npy`` from C-contiguous chunks of the stored bytes."""
        file = f"{spec.name}.npy"
        digest = hashlib.sha256()
        with open(self.path / file, "wb") as f:
            header = npy_header(spec)
            f.write(header)
            digest.update(header)
            written = write_chunks(f, chunks, digest)
        if written != spec.nbytes:
            raise ValueError(f"tensor {spec.name!r}: wrote {written} bytes, expected {spec.nbytes}")
        self.checksums[spec.name] = digest.hexdigest()
        self._entries[spec.name] = {"file": file, "shape": list(spec.shape), "type": spec.qtype.name,
                                    "nbytes": spec.nbytes, "sha256": self.checksums[spec.name]}

    def finish(self) -> None:
        """Write ``manifest.json``, ``config.json`` and copy the tokenizer files."""
        files = self._files
        assert files.directory is not None
        manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "architecture": files.config.arch,
                    "source": str(files.path), "dtype": self._dtype, "v_head_order": files.v_head_order,
                    "tied_embeddings": files.config.tie_word_embeddings, **self._extra, "tensors": self._entries}
        (self.path / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        (self.path / "config.json").write_text(json.dumps(files.hf_config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
        for name in TOKENIZER_FILES:
            if (files.directory / name).is_file():
                shutil.copyfile(files.directory / name, self.path / name)

    def __enter__(self) -> NpyDirWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """Nothing stays open between tensors."""
