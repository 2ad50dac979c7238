"""Compute an importance matrix with our runtime, as ``llama-imatrix`` does (tools/imatrix/imatrix.cpp).

The text is tokenized whole (BOS only when the model asks for one, as llama-imatrix's ``common_tokenize(text,
add_special=true)``; special tokens written in the text are recognised, which llama-imatrix does with
``--parse-special``: text without them tokenizes the same), cut into ``n_ctx``-token chunks (at least two
chunks' worth of tokens are required, the remainder is dropped, ``chunks`` caps their number), and each chunk
runs from an empty cache; with a BOS the chunk's first token is *replaced* by it.  Every product of a layer's
weight matrix (``blk.*``; not the output head, llama-imatrix's default) adds, per input column, the squares of
its input rows to the matrix's sums and the row count to its count.  llama-imatrix skips products of fewer than
16 rows, so chunks shorter than 16 tokens are refused here.

Inputs are observed where every matrix product of the runtime starts, :meth:`Weight.prepared` (shared by
:func:`~qwen_runtime.backend.weights.matmul_many` and :func:`~qwen_runtime.backend.weights.gated_matmul`), on the
weights of a
model built for this run: the loaded model's objects are wrapped, nothing global changes.  A Hugging Face
directory is read with Qwen3.5's value heads in llama.cpp's tiled order, the order the converter writes, so
``ssm_out``'s columns (and their sums) are those of every converted file whatever the source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qwen_runtime.backend.weights import Weight
from qwen_runtime.errors import QwenError
from qwen_runtime.formats import ModelFiles, open_model_files
from qwen_runtime.formats.base import V_HEAD_TILED
from qwen_runtime.models import Model, WeightStore
from qwen_runtime.text.chat import load_chat_format

from .imatrix import Imatrix, ImatrixEntry

MIN_ROWS = 16  # llama-imatrix ignores matrix products of fewer rows
LAYER_PREFIX = "blk."


class RecordingStore(WeightStore):
    """A :class:`WeightStore` that remembers every matrix it hands out."""

    def __init__(self, files: ModelFiles, threads: int | None = None, kernels: str | None = None) -> None:
        super().__init__(files, threads=threads, kernels=kernels)
        self.handed: dict[str, Weight] = {}

    def matrix(self, kind, layer=None) -> Weight:  # noqa: ANN001 (WeightStore's signature)
        weight = super().matrix(kind, layer)
        self.handed[weight.name] = weight
        return weight


@dataclass
class Collector:
    """Running sums of squared inputs per layer matrix (float64 while collecting)."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float64 [in]
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, x: np.ndarray) -> None:
        """Add the rows of one product's input ``x`` [N, in]."""
        if x.shape[0] < MIN_ROWS:
            return
        x64 = np.asarray(x, np.float64)
        squares = np.einsum("ni,ni->i", x64, x64)  # [in]
        if name in self.sums:
            self.sums[name] += squares
            self.counts[name] += x.shape[0]
        else:
            self.sums[name], self.counts[name] = squares, x.shape[0]

    def observe(self, weight: Weight) -> None:
        """Wrap ``weight.prepared`` so every product of it reports its input first."""
        prepared = weight.prepared

        def reporting(x: np.ndarray, cache: dict) -> object:
            self.add(weight.name, x)
            return prepared(x, cache)

        weight.prepared = reporting  # type: ignore[method-assign]

    def imatrix(self, datasets: list[str], chunk_size: int) -> Imatrix:
        entries = {name: ImatrixEntry(self.sums[name].astype(np.float32).reshape(1, -1),
                                      np.array([self.counts[name]], np.int64)) for name in sorted(self.sums)}
        largest = max(self.counts.values(), default=0)
        return Imatrix(entries, datasets, largest // chunk_size, chunk_size)


def chunk_tokens(ids: list[int], n_ctx: int, chunks: int | None, bos: int | None, source: str) -> list[list[int]]:
    """llama-imatrix's chunks: ``n_ctx`` tokens each, the first replaced by ``bos`` when given."""
    if n_ctx < MIN_ROWS:
        raise QwenError(f"--ctx {n_ctx}: llama-imatrix ignores products of fewer than {MIN_ROWS} tokens")
    if len(ids) < 2 * n_ctx:
        raise QwenError(f"{source}: {len(ids)} tokens; a context of {n_ctx} needs at least {2 * n_ctx}")
    count = len(ids) // n_ctx if chunks is None or chunks < 0 else min(chunks, len(ids) // n_ctx)
    out = []
    for i in range(count):
        chunk = ids[i * n_ctx:(i + 1) * n_ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        out.append(chunk)
    return out


def compute_imatrix(model_path: str | Path, text: str, dataset: str, n_ctx: int = 512, chunks: int | None = None,
                    progress: Callable[[int, int], None] | None = None, threads: int | None = None,
                    kernels: str | None = None) -> Imatrix:
    """The importance matrix of the model at ``model_path`` over ``text`` (named ``dataset`` in the file);
    ``threads`` and ``kernels`` as :func:`qwen_runtime.load`'s."""
    files = open_model_files(model_path, v_head_order=V_HEAD_TILED)  # columns in the order files are written
    store = RecordingStore(files, threads, kernels)
    model = Model(files, store)
    collector = Collector()
    for name, weight in store.handed.items():
        if name.startswith(LAYER_PREFIX):
            collector.observe(weight)
    fmt = load_chat_format(files)
    ids = fmt.tokenizer.encode(text)
    bos = fmt.bos_id if fmt.add_bos else None
    pieces = chunk_tokens(ids, n_ctx, chunks, bos, dataset)
    for index, chunk in enumerate(pieces):
        model.logits(np.array([chunk], np.int64))
        if progress is not None:
            progress(index + 1, len(pieces))
    return collector.imatrix([dataset], n_ctx)
