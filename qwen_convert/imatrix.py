"""Importance matrices: the files ``llama-imatrix`` writes, read and written, and the vectors quantizers use.

An importance matrix holds, per weight matrix ``W [out, in]`` of the model's layers, the sum over the tokens of
a calibration text of the squared activations entering ``W``, per input column, and the number of tokens
summed.  ``llama-quantize --imatrix`` weights each column's rounding error by ``sum / count``.

Two file formats (llama.cpp's ``common/imatrix-loader.cpp``, ``tools/imatrix/imatrix.cpp``):

* **GGUF** (current): keys ``general.type = "imatrix"``, ``imatrix.datasets`` (strings), ``imatrix.chunk_count``
  and ``imatrix.chunk_size`` (u32); per matrix ``<name>.in_sum2`` (F32 ``[n_mat, in]``: the raw sums) and
  ``<name>.counts`` (F32 ``[n_mat, 1]``: tokens summed), tensors sorted by name.  ``n_mat`` is 1 for dense models.
* **legacy .dat**: i32 entry count; per entry i32 name length, name, i32 ``ncall`` (chunks), i32 value count,
  f32 values ``sum / count * ncall``; then optionally i32 chunk count, i32 length and the dataset name.

:func:`load_importance` turns either into llama-quantize's vectors: GGUF sums divided by their count, legacy
values divided by ``ncall``.  Checks, with llama.cpp's rules where it has one:

* a non-finite value (NaN, ±Inf) is refused, naming the file and tensor (llama-quantize refuses the whole
  file: ``imatrix contains non-finite value``; llama.cpp#7816);
* a matrix with a zero count (no token reached it, e.g. an unused expert) is **repaired as llama.cpp does**:
  its vector becomes all ones (plain, unweighted rounding error), with a warning naming the file and tensor
  (llama.cpp#16095: zero counts silently gave NaN weights before);
* a vector whose length is not the tensor's row length is refused when quantizing (as llama-quantize does).

Checks llama.cpp does not make, for values that would silently ruin a tensor (llama-quantize takes them and
writes a model whose rows come out as zeros):

* a negative value is refused (sums of squares cannot be negative; llama.cpp's searches would then maximise
  the rounding error of that column);
* a matrix whose values are all zero is refused, and so is, per stored type, a run of columns sharing one
  scale whose values are all zero (:data:`ZERO_RUIN_GROUP`): with no weight anywhere in a block, llama.cpp's
  scale search returns 0 and the block is stored as zeros (the i-quants: as their grid's first point at the
  smallest scale, whatever the values);
* names are matched against the model's tensors (:meth:`Importance.match_report`): a file of which no entry
  names a tensor of the model is refused, and ``quantize.imatrix.entries_count`` counts the entries that match
  (:meth:`Importance.metadata`; no ``quantize.imatrix.*`` keys when no tensor used a vector).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGUFWriter

from qwen_runtime.errors import FormatError
from qwen_runtime.formats.gguf_parse import parse_gguf, tensor_view
from qwen_runtime.formats.tensors import QType

if TYPE_CHECKING:
    from .policy import TensorSpec

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
TYPE_KEY, TYPE_VALUE = "general.type", "imatrix"
DATASETS_KEY, CHUNK_COUNT_KEY, CHUNK_SIZE_KEY = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"
SUMS_SUFFIX, COUNTS_SUFFIX = ".in_sum2", ".counts"
# Keys llama-quantize adds to a model quantized with an imatrix (tools/quantize/quantize.cpp).
QUANTIZE_FILE_KEY, QUANTIZE_DATASET_KEY = "quantize.imatrix.file", "quantize.imatrix.dataset"
QUANTIZE_ENTRIES_KEY, QUANTIZE_CHUNKS_KEY = "quantize.imatrix.entries_count", "quantize.imatrix.chunks_count"
KV_STRING_MAX = 127  # llama-quantize copies these strings into a 128-byte buffer
# Types whose llama.cpp quantizer takes the importance vector (quantize_q8_0 ignores it; F16/F32 are no quant).
WEIGHTED_TYPES = frozenset({QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q2_K, QType.Q3_K, QType.Q4_K,
                            QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS, QType.IQ3_XXS, QType.IQ3_S,
                            QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ1_S, QType.IQ1_M})
# Per weighted type, the run of columns whose all-zero weights make our (and llama.cpp's) search give up on them
# (stored as zeros, or for the i-quants as the grid's first point at the smallest scale): the 16-column
# sub-blocks of Q3_K / Q6_K / IQ1_M, the 32-column blocks of Q4_0 / Q5_0 / IQ4 / IQ2_XXS / IQ1_S, the 256-column
# super-blocks of Q2_K / Q4_K / Q5_K.  Q4_1 / Q5_1 fall back to the block's min and max, so they have none.
ZERO_RUIN_GROUP = {QType.Q3_K: 16, QType.Q6_K: 16, QType.Q4_0: 32, QType.Q5_0: 32, QType.IQ4_NL: 32,
                   QType.IQ4_XS: 32, QType.IQ2_XXS: 32, QType.IQ1_S: 32, QType.IQ1_M: 16, QType.Q2_K: 256,
                   QType.Q4_K: 256, QType.Q5_K: 256}


@dataclass
class ImatrixEntry:
    """One matrix's statistics: raw sums of squares ``[n_mat, in]`` and token counts ``[n_mat]``."""

    sums: np.ndarray  # float32 [n_mat, in]
    counts: np.ndarray  # int64 [n_mat]


@dataclass
class Imatrix:
    """An importance matrix as llama-imatrix keeps it (GGUF semantics: raw sums and counts)."""

    entries: dict[str, ImatrixEntry]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = False


# ------------------------------------------------------------------------------------------------ reading

def read_imatrix(path: str | Path) -> Imatrix:
    """Read a GGUF or legacy ``.dat`` imatrix (:class:`FormatError` naming the file for a malformed one)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read the importance matrix ({exc.strerror})") from None
    return _read_gguf(path) if magic == GGUF_MAGIC else _read_legacy(path)


def _read_gguf(path: Path) -> Imatrix:
    layout = parse_gguf(path)
    tensors = {t.name: t for t in layout.tensors}
    names = sorted({n.removesuffix(SUMS_SUFFIX).removesuffix(COUNTS_SUFFIX) for n in tensors
                    if n.endswith((SUMS_SUFFIX, COUNTS_SUFFIX))})
    if not names:
        raise FormatError(f"{path}: no {SUMS_SUFFIX} / {COUNTS_SUFFIX} tensors: not an importance matrix")
    meta = layout.metadata
    if DATASETS_KEY not in meta or CHUNK_COUNT_KEY not in meta or CHUNK_SIZE_KEY not in meta:
        raise FormatError(f"{path}: missing imatrix metadata ({DATASETS_KEY}, {CHUNK_COUNT_KEY}, {CHUNK_SIZE_KEY})")
    entries = {}
    for name in names:
        sums, counts = tensors.get(name + SUMS_SUFFIX), tensors.get(name + COUNTS_SUFFIX)
        if sums is None or counts is None:
            raise FormatError(f"{path}: tensor {name!r}: mismatched sums and counts (one of "
                              f"{SUMS_SUFFIX} / {COUNTS_SUFFIX} is missing)")
        if sums.qtype != QType.F32 or counts.qtype != QType.F32:
            raise FormatError(f"{path}: tensor {name!r}: sums and counts must be F32")
        values = tensor_view(layout, sums).view("<f4").astype(np.float32)
        n_counts = counts.nbytes // 4
        if n_counts == 0 or values.size % n_counts:
            raise FormatError(f"{path}: tensor {name!r}: {values.size} sums do not split into {n_counts} matrices")
        raw_counts = tensor_view(layout, counts).view("<f4")
        entries[name] = ImatrixEntry(values.reshape(n_counts, -1), np.rint(raw_counts).astype(np.int64))
    datasets = meta[DATASETS_KEY]
    datasets = [] if isinstance(datasets, str) else [str(d) for d in datasets]  # an array of strings
    return Imatrix(entries, datasets, int(meta[CHUNK_COUNT_KEY]), int(meta[CHUNK_SIZE_KEY]))


class _Reader:
    def __init__(self, path: Path) -> None:
        self.path, self.data, self.pos = path, path.read_bytes(), 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise FormatError(f"{self.path}: truncated legacy imatrix (reading {what} at byte {self.pos})")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def i32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]


def _read_legacy(path: Path) -> Imatrix:
    reader = _Reader(path)
    n_entries = reader.i32("the entry count") if len(reader.data) >= 4 else 0
    if n_entries < 1:
        raise FormatError(f"{path}: neither a GGUF nor a legacy imatrix with entries")
    entries = {}
    for index in range(n_entries):
        name = reader.take(reader.i32(f"entry {index}'s name length"), f"entry {index}'s name").decode(
            "utf-8", errors="replace")
        ncall, nval = reader.i32(f"{name}'s call count"), reader.i32(f"{name}'s value count")
        if nval < 1:
            raise FormatError(f"{path}: tensor {name!r}: {nval} values")
        values = np.frombuffer(reader.take(4 * nval, f"{name}'s values"), "<f4").astype(np.float32)
        entries[name] = ImatrixEntry(values.reshape(1, -1), np.array([ncall], np.int64))
    chunks, datasets = 0, []
    if reader.pos < len(reader.data):
        chunks = reader.i32("the chunk count")
        if reader.pos + 4 <= len(reader.data):
            length = reader.i32("the dataset name length")
            if length > 0:
                datasets.append(reader.take(length, "the dataset name").decode("utf-8", errors="replace"))
    return Imatrix(entries, datasets, chunks, 0, legacy=True)


def importance_vectors(imatrix: Imatrix, path: str | Path) -> dict[str, np.ndarray]:
    """llama-quantize's per-tensor vectors (float32 ``[n_mat * in]``): sums / count (GGUF) or values / ncall
    (legacy); a zero count gives ones (llama.cpp's rule, warned about); non-finite values are refused."""
    vectors = {}
    for name, entry in imatrix.entries.items():
        if imatrix.legacy:
            ncall = int(entry.counts[0])
            vector = entry.sums / np.float32(ncall) if ncall > 0 else entry.sums.copy()
        else:
            vector = np.empty_like(entry.sums)
            for j, count in enumerate(entry.counts):
                if count > 0:
                    vector[j] = entry.sums[j] / np.float32(count)
                else:
                    vector[j] = 1.0
                    logger.warning("%s: tensor %s: no tokens were counted for matrix %d; using weights of 1 "
                                   "(llama.cpp's rule)", path, name, j)
        vector = np.ascontiguousarray(vector.reshape(-1), dtype=np.float32)
        _check_values(vector, entry.sums.shape[-1], path, name)
        vectors[name] = vector
    return vectors


def _check_values(vector: np.ndarray, width: int, path: str | Path, name: str) -> None:
    """:class:`FormatError` for a non-finite or negative value, or a matrix (``width`` values) all zero."""
    bad = np.flatnonzero(~np.isfinite(vector))
    if bad.size:
        raise FormatError(f"{path}: tensor {name!r}: non-finite importance at column {int(bad[0])} "
                          f"({vector[bad[0]]}); {bad.size} of {vector.size} values are NaN or infinite")
    bad = np.flatnonzero(vector < 0)
    if bad.size:
        raise FormatError(f"{path}: tensor {name!r}: negative importance at column {int(bad[0])} "
                          f"({float(vector[bad[0]]):.6g}); {bad.size} of {vector.size} values are negative "
                          "(an importance is a mean of squares)")
    zero = np.flatnonzero(~vector.reshape(-1, width).any(axis=1))
    if zero.size:
        which = f"matrix {int(zero[0])}'s" if vector.size > width else "all"
        raise FormatError(f"{path}: tensor {name!r}: {which} {width} importance values are zero (quantizing with "
                          "them would store the tensor as zeros)")


@dataclass(frozen=True)
class Importance:
    """The vectors of one imatrix file, ready for the converter, and the keys llama-quantize records."""

    path: Path
    vectors: dict[str, np.ndarray]
    dataset: str | None
    chunk_count: int

    def for_tensor(self, name: str, row_length: int, qtype: QType) -> np.ndarray | None:
        """The vector to weight ``name`` by when stored as ``qtype`` (None: unweighted).

        :class:`FormatError` when the file's vector does not have ``row_length`` values (the token embedding
        excepted, as in llama-quantize).
        """
        if qtype not in WEIGHTED_TYPES:
            return None
        vector = self.vectors.get(name)
        if vector is None:
            logger.info("%s: no importance for %s: quantized without it", self.path, name)
            return None
        if vector.size != row_length:
            if name == "token_embd.weight":
                return None
            raise FormatError(f"{self.path}: tensor {name!r}: {vector.size} importance values for rows of "
                              f"{row_length}")
        group = ZERO_RUIN_GROUP.get(qtype)
        if group is not None and row_length % group == 0:
            zero = np.flatnonzero(~vector.reshape(-1, group).any(axis=1))
            if zero.size:
                first = int(zero[0]) * group
                raise FormatError(f"{self.path}: tensor {name!r}: importance is zero over columns {first}.."
                                  f"{first + group - 1}: {qtype.name} would not keep their values (each run of "
                                  f"{group} columns needs a non-zero value)")
        return vector

    def match_report(self, names: Collection[str]) -> str:
        """How many entries name one of the model's tensors ``names``, as a line to print; :class:`FormatError`
        when none does (the file belongs to another model, and would be silently ignored)."""
        missing = sorted(set(self.vectors) - set(names))
        matched = len(self.vectors) - len(missing)
        if not matched:
            example = next(iter(sorted(names)), "none")
            raise FormatError(f"{self.path}: none of its {len(self.vectors)} entries names a tensor of the model "
                              f"(it has {missing[0]!r}; the model e.g. {example!r})")
        line = f"imatrix: {matched} of {len(self.vectors)} entries match the model's tensors"
        if missing:
            line += f" (not: {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        return line

    def used_by(self, specs: Iterable[TensorSpec]) -> list[str]:
        """The tensors among ``specs`` (an output's plan) that are quantized with this file's vectors."""
        return [s.name for s in specs if self.for_tensor(s.name, s.shape[-1], s.qtype) is not None]

    def metadata(self, specs: Iterable[TensorSpec] | None = None) -> dict[str, str | int]:
        """``quantize.imatrix.*`` keys as llama-quantize writes them (strings cut to 127 bytes).

        With ``specs`` (the output's plan) the keys describe what the output used: ``entries_count`` counts the
        entries naming a tensor of the plan (llama-quantize's count when they all do, as a file made for the
        model does), and there are no keys at all when no tensor was quantized with a vector (an F16 output,
        say), so a file never claims an importance matrix it does not reflect.  :class:`FormatError` when no
        entry names a tensor of the plan.
        """
        entries = len(self.vectors)
        if specs is not None:
            specs = list(specs)
            names = {s.name for s in specs}
            self.match_report(names)
            if not self.used_by(specs):
                return {}
            entries = len(names & self.vectors.keys())
        keys: dict[str, str | int] = {QUANTIZE_FILE_KEY: _cut(str(self.path))}
        if self.dataset is not None:
            keys[QUANTIZE_DATASET_KEY] = _cut(self.dataset)
        keys[QUANTIZE_ENTRIES_KEY] = entries
        if self.chunk_count > 0:
            keys[QUANTIZE_CHUNKS_KEY] = self.chunk_count
        return keys


def _cut(text: str) -> str:
    return text.encode("utf-8")[:KV_STRING_MAX].decode("utf-8", errors="ignore")


def load_importance(path: str | Path) -> Importance:
    """Read an imatrix file and check it (see the module's rules)."""
    imatrix = read_imatrix(path)
    return Importance(Path(path), importance_vectors(imatrix, path), imatrix.datasets[0] if imatrix.datasets else
                      None, imatrix.chunk_count)


# ------------------------------------------------------------------------------------------------ writing

def write_imatrix(path: str | Path, imatrix: Imatrix) -> None:
    """Write ``imatrix`` in llama-imatrix's GGUF format (keys, then sums and counts per matrix, sorted by name),
    each tensor with the dimensions llama-imatrix gives it: sums ``[n, n_mat]`` and counts ``[1, n_mat]``, one
    dimension fewer where ``n_mat`` is 1."""
    writer = GGUFWriter(path, "")
    writer.kv_data[0].pop("general.architecture", None)  # llama-imatrix's files have no architecture
    writer.add_string(TYPE_KEY, TYPE_VALUE)
    writer.add_array(DATASETS_KEY, list(imatrix.datasets))
    writer.add_uint32(CHUNK_COUNT_KEY, imatrix.chunk_count)
    writer.add_uint32(CHUNK_SIZE_KEY, imatrix.chunk_size)
    for name in sorted(imatrix.entries):
        entry = imatrix.entries[name]
        sums, counts = entry.sums.astype(np.float32), entry.counts.astype(np.float32).reshape(-1, 1)
        if len(counts) == 1:  # ggml stores [n, 1] as one dimension (ggml_n_dims drops trailing ones)
            sums, counts = sums.reshape(-1), counts.reshape(-1)
        writer.add_tensor(name + SUMS_SUFFIX, np.ascontiguousarray(sums))
        writer.add_tensor(name + COUNTS_SUFFIX, counts)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()

