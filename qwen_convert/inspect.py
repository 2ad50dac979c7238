"""Per-tensor statistics of a model, and the error of one model against another.

Every statistic streams over row chunks widened to float32 and accumulates in float64 (means and
variances merged with Chan's parallel formula; the error against another model in the accumulator verify uses
too, :class:`~qwen_convert.error_sums.ErrorSums`), so a 500M-element tensor needs a few MB, not 2 GB.
Works on anything :func:`~qwen_runtime.formats.open_model_files` opens: HF directories, our npy
directories and GGUF files (ours or llama.cpp's).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import Keys

from qwen_runtime.errors import FormatError, TemplateError
from qwen_runtime.formats import ModelFiles, detect_format, open_model_files
from qwen_runtime.formats.gguf_config import is_metadata_array
from qwen_runtime.formats.gguf_keys import gguf_key
from qwen_runtime.formats.tensors import StoredTensor, to_float32
from qwen_runtime.text.chat import load_chat_format

from .error_sums import ErrorSums
from .quantize import rows_per_chunk


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor's values (over finite values; None when there are none)."""

    name: str
    shape: tuple[int, ...]
    type: str
    nbytes: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    absmax: float | None
    nan: int
    inf: int


@dataclass(frozen=True)
class TensorError:
    """Error of tensor B against reference A (same canonical name and shape)."""

    name: str
    shape: tuple[int, ...]
    type_a: str
    type_b: str
    rmse: float
    max_abs: float
    snr_db: float  # 10 log10(sum a^2 / sum (b - a)^2); inf when identical
    cosine: float


@dataclass(frozen=True)
class Comparison:
    """All per-tensor errors plus the whole-model summary."""

    tensors: list[TensorError]
    only_a: list[str]
    only_b: list[str]
    rmse: float
    max_abs: float
    snr_db: float
    min_cosine: float


def float32_chunks(tensor: StoredTensor) -> Iterator[np.ndarray]:
    """The tensor as float32 ``[rows, n]`` chunks (one reused buffer: consume each before the next)."""
    source = tensor.rows2d()
    width = tensor.shape[-1] if tensor.shape else 1
    step = rows_per_chunk(width)
    buffer = np.empty((min(step, len(source)), width), np.float32)
    for start in range(0, len(source), step):
        rows = source[start:start + step]
        yield to_float32(tensor.qtype, rows, buffer[: len(rows)])


class Moments:
    """Streaming count / min / max / mean / M2 / abs-max of finite values, plus NaN and Inf counts."""

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0
        self.min, self.max, self.absmax = math.inf, -math.inf, 0.0
        self.nan = self.inf = 0

    def add(self, chunk: np.ndarray) -> None:
        values = chunk.ravel()
        finite = np.isfinite(values)
        if not finite.all():
            self.nan += int(np.isnan(values).sum())
            self.inf += int(np.isinf(values).sum())
            values = values[finite]
        if values.size == 0:
            return
        wide = values.astype(np.float64)
        n_b, mean_b = wide.size, float(wide.mean())
        wide -= mean_b
        m2_b = float(wide @ wide)
        n = self.n + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += m2_b + delta * delta * self.n * n_b / n
        self.n = n
        lo, hi = float(values.min()), float(values.max())
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        self.absmax = max(self.absmax, abs(lo), abs(hi))

    def stats(self, tensor: StoredTensor) -> TensorStats:
        some = self.n > 0
        return TensorStats(tensor.name, tensor.shape, tensor.qtype.name, tensor.nbytes,
                           self.min if some else None, self.max if some else None,
                           self.mean if some else None, math.sqrt(self.m2 / self.n) if some else None,
                           self.absmax if some else None, self.nan, self.inf)


def tensor_stats(tensor: StoredTensor) -> TensorStats:
    """Statistics of one tensor, streamed."""
    moments = Moments()
    for chunk in float32_chunks(tensor):
        moments.add(chunk)
    return moments.stats(tensor)


def selected(files: ModelFiles, pattern: str | None) -> list[str]:
    """Tensor names matching ``pattern`` (``re.search``), in file order."""
    try:
        regex = re.compile(pattern or "")
    except re.error as exc:
        raise FormatError(f"invalid --filter regular expression {pattern!r} ({exc})") from None
    return [name for name in files.tensors if regex.search(name)]


def model_stats(files: ModelFiles, pattern: str | None = None) -> list[TensorStats]:
    """Statistics of every tensor whose name matches ``pattern``."""
    return [tensor_stats(files.tensors[name]) for name in selected(files, pattern)]


def totals(stats: Sequence[TensorStats]) -> dict[str, float]:
    """Parameters, bytes and bytes per parameter over ``stats``."""
    params = sum(int(np.prod(s.shape, dtype=np.int64)) for s in stats)
    nbytes = sum(s.nbytes for s in stats)
    return {"tensors": len(stats), "parameters": params, "bytes": nbytes,
            "bytes_per_parameter": nbytes / params if params else 0.0}


def open_pair(path_a: str | Path, path_b: str | Path) -> tuple[ModelFiles, ModelFiles]:
    """Open A and B with the same Qwen3.5 value-head order (an HF side follows the other side's order)."""
    if detect_format(path_a) == "hf" and detect_format(path_b) != "hf":
        b = open_model_files(path_b)
        a = open_model_files(path_a, v_head_order=b.v_head_order)
    else:
        a = open_model_files(path_a)
        b = open_model_files(path_b, v_head_order=a.v_head_order)
    c = a.config
    if (c.has_linear_attention and c.linear_num_value_heads != c.linear_num_key_heads
            and a.v_head_order != b.v_head_order):
        raise FormatError(f"{path_b}: value heads are {b.v_head_order}, {path_a} has them "
                          f"{a.v_head_order}; cannot compare")
    return a, b


def tensor_error(a: StoredTensor, b: StoredTensor) -> tuple[TensorError, ErrorSums]:
    """Error of ``b`` against ``a``, streamed over matching row chunks."""
    if a.shape != b.shape:
        raise FormatError(f"{b.path}: tensor {b.name!r} has shape {list(b.shape)}, {a.path} has {list(a.shape)}")
    sums = ErrorSums()
    for chunk_a, chunk_b in zip(float32_chunks(a), float32_chunks(b), strict=True):
        sums.add(chunk_a, chunk_b)
    row = TensorError(a.name, a.shape, a.qtype.name, b.qtype.name, sums.rmse, sums.max_abs, sums.snr_db,
                      sums.cosine)
    return row, sums


def compare(a: ModelFiles, b: ModelFiles, pattern: str | None = None) -> Comparison:
    """Per-tensor and whole-model error of B against reference A, tensors matched by canonical name."""
    names = selected(a, pattern)
    total, rows, worst_cosine = ErrorSums(), [], 1.0
    for name in names:
        if name in b.tensors:
            row, sums = tensor_error(a.tensors[name], b.tensors[name])
            rows.append(row)
            total.merge(sums)
            worst_cosine = min(worst_cosine, row.cosine)
    only_b = sorted(set(selected(b, pattern)) - set(a.tensors))
    return Comparison(rows, [n for n in names if n not in b.tensors], only_b, total.rmse, total.max_abs,
                      total.snr_db, worst_cosine)


def _rope(files: ModelFiles) -> dict[str, Any]:
    """Rope base, rotated dimensions, sections and scaling (GGUF keys, else the HF config)."""
    c, meta = files.config, files.metadata
    scaling: Any = None
    if files.format == "gguf":
        kind = meta.get(gguf_key(Keys.Rope.SCALING_TYPE, c.arch))
        if kind not in (None, "none"):
            scaling = {"type": kind, "factor": meta.get(gguf_key(Keys.Rope.SCALING_FACTOR, c.arch))}
    else:
        scaling = (files.hf_config or {}).get("rope_scaling")
    return {"theta": c.rope_theta, "dimensions": c.rotary_dim, "head_dim": c.head_dim,
            "sections": list(c.mrope_sections), "scaling": scaling}


def _tokenizer_model(files: ModelFiles, backend: Any) -> str:
    """GGUF ``tokenizer.ggml.model`` (and ``.pre``); for directories, the tokenizers model's class (BPE)."""
    if files.format == "gguf":
        model, pre = files.metadata.get(Keys.Tokenizer.MODEL), files.metadata.get(Keys.Tokenizer.PRE)
        return f"{model}" + (f" (pre {pre})" if pre else "")
    return type(backend.model).__name__


def _token(tokenizer: Any, token_id: int | None) -> dict[str, Any] | None:
    return None if token_id is None else {"id": token_id, "text": tokenizer.id_to_token(token_id)}


def _text_summary(files: ModelFiles) -> dict[str, Any]:
    """Tokenizer, special tokens and chat template; ``text_error`` says why when they cannot be read (the
    tensors can still be inspected)."""
    try:
        fmt = load_chat_format(files)
    except (FormatError, TemplateError) as exc:
        return {"text_error": str(exc)}
    tok, meta = fmt.tokenizer, files.metadata
    merges = meta.get(Keys.Tokenizer.MERGES) if files.format == "gguf" else None
    pad = meta.get(Keys.Tokenizer.PAD_ID) if files.format == "gguf" else None
    if pad is None and files.directory is not None:
        pad_text = (files.read_json("tokenizer_config.json") or {}).get("pad_token")
        pad = tok.token_id(pad_text) if isinstance(pad_text, str) else None
    return {
        "tokenizer": {"model": _tokenizer_model(files, tok.backend),
                      "tokens": tok.backend.get_vocab_size(with_added_tokens=True),
                      "embedding_rows": files.config.vocab_size,
                      "merges": len(merges) if is_metadata_array(merges) else None,
                      "added_special": len(tok.special_ids)},
        "special_tokens": {"bos": _token(tok, fmt.bos_id), "add_bos": fmt.add_bos,
                           "eos": _token(tok, tok.token_id(fmt.eos_token) if fmt.eos_token else None),
                           "pad": _token(tok, pad if isinstance(pad, int) else None),
                           "stop": [_token(tok, i) for i in sorted(fmt.stop_ids)]},
        "chat_template": {"present": fmt.template is not None,
                          "chars": len(fmt.template.source) if fmt.template is not None else 0},
    }


def model_summary(files: ModelFiles) -> dict[str, Any]:
    """What a model is, as gguf-dump's header shows it but for every format: architecture, sizes, context
    length, rope, tokenizer model and size, special tokens, chat template, and bytes per stored type."""
    c, meta = files.config, files.metadata
    types: dict[str, dict[str, int]] = {}
    for t in files.tensors.values():
        row = types.setdefault(t.qtype.name, {"tensors": 0, "parameters": 0, "bytes": 0})
        row["tensors"] += 1
        row["parameters"] += t.n_elements
        row["bytes"] += t.nbytes
    name = meta.get(Keys.General.NAME) if files.format == "gguf" else None
    return {
        "path": str(files.path), "format": files.format, "name": name or files.path.name, "architecture": c.arch,
        "parameters": sum(r["parameters"] for r in types.values()),
        "layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "layer_types": sorted(set(c.layer_types)),
        "context_length": c.max_position_embeddings, "rope": _rope(files), **_text_summary(files), "types": types,
    }


def _special(token: dict[str, Any] | None) -> str:
    return "-" if token is None else f"{token['id']} {token['text']!r}"


def _text_lines(summary: dict[str, Any]) -> list[str]:
    if "text_error" in summary:
        return [f"tokenizer:      unavailable ({summary['text_error']})"]
    tok, sp, template = summary["tokenizer"], summary["special_tokens"], summary["chat_template"]
    merges = f", {tok['merges']:,} merges" if tok["merges"] is not None else ""
    present = f"present ({template['chars']:,} characters)" if template["present"] else "absent"
    return [
        f"tokenizer:      {tok['model']}, {tok['tokens']:,} tokens ({tok['added_special']} special; embedding rows "
        f"{tok['embedding_rows']:,}){merges}",
        f"special tokens: bos {_special(sp['bos'])}{' (added)' if sp['add_bos'] else ''}, eos {_special(sp['eos'])}, "
        f"pad {_special(sp['pad'])}",
        f"stop tokens:    {', '.join(_special(t) for t in sp['stop']) or '-'}",
        f"chat template:  {present}",
    ]


def metadata_table(summary: dict[str, Any]) -> str:
    """The metadata view: one ``key: value`` line per fact, then bytes per stored type."""
    s, rope = summary, summary["rope"]
    sections = f", sections {rope['sections']}" if rope["sections"] else ""
    lines = [
        f"model:          {s['name']} ({s['format']}, {s['path']})",
        f"architecture:   {s['architecture']}, {s['parameters']:,} parameters, {s['layers']} layers "
        f"({', '.join(s['layer_types'])}), hidden {s['hidden_size']}, {s['heads']} heads / {s['kv_heads']} kv "
        f"of {s['head_dim']}",
        f"context length: {s['context_length']:,}",
        f"rope:           theta {rope['theta']:.10g}, {rope['dimensions']} of {rope['head_dim']} dims{sections}, "
        f"scaling {rope['scaling'] or 'none'}",
        *_text_lines(s),
        f"{'type':<15} {'tensors':>8} {'parameters':>15} {'bytes':>15} {'bits/weight':>12}",
    ]
    for name, row in sorted(s["types"].items(), key=lambda kv: -kv[1]["bytes"]):
        bits = 8 * row["bytes"] / row["parameters"] if row["parameters"] else 0.0
        lines.append(f"{name:<15} {row['tensors']:>8} {row['parameters']:>15,} {row['bytes']:>15,} {bits:>12.3f}")
    return "\n".join(lines)


def _num(value: float | None, width: int = 11) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.4g}"


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def stats_table(stats: Sequence[TensorStats]) -> str:
    """Fixed-width table of :class:`TensorStats` rows followed by the totals."""
    width = max([4] + [len(s.name) for s in stats])
    tw = max([5] + [len(s.type) for s in stats])  # IQ4_NL, IQ4_XS: 6
    head = (f"{'name':<{width}}  {'shape':<14} {'type':<{tw}} {'bytes':>11} {'min':>11} {'max':>11} "
            f"{'mean':>11} {'std':>11} {'absmax':>11} {'nan':>6} {'inf':>6}")
    lines = [head]
    for s in stats:
        lines.append(f"{s.name:<{width}}  {_shape(s.shape):<14} {s.type:<{tw}} {s.nbytes:>11} {_num(s.min)} "
                     f"{_num(s.max)} {_num(s.mean)} {_num(s.std)} {_num(s.absmax)} {s.nan:>6} {s.inf:>6}")
    t = totals(stats)
    lines.append(f"total: {t['tensors']} tensors, {t['parameters']:,} parameters, {t['bytes']:,} bytes, "
                 f"{t['bytes_per_parameter']:.3f} bytes/parameter")
    return "\n".join(lines)


def compare_table(result: Comparison) -> str:
    """Fixed-width table of per-tensor errors followed by the whole-model summary."""
    width = max([4] + [len(r.name) for r in result.tensors])
    tw = max([5] + [len(t) for r in result.tensors for t in (r.type_a, r.type_b)])  # IQ4_NL, IQ4_XS: 6
    lines = [f"{'name':<{width}}  {'shape':<14} {'A':<{tw}} {'B':<{tw}} {'rmse':>11} {'max_abs':>11} "
             f"{'snr_db':>11} {'cosine':>11}"]
    for r in result.tensors:
        lines.append(f"{r.name:<{width}}  {_shape(r.shape):<14} {r.type_a:<{tw}} {r.type_b:<{tw}} {_num(r.rmse)} "
                     f"{_num(r.max_abs)} {_num(r.snr_db)} {r.cosine:>11.8f}")
    lines.append(f"model: {len(result.tensors)} tensors compared, rmse {result.rmse:.4g}, max abs error "
                 f"{result.max_abs:.4g}, snr {result.snr_db:.2f} dB, min cosine {result.min_cosine:.8f}")
    if result.only_a:
        lines.append(f"only in A ({len(result.only_a)}): {', '.join(result.only_a)}")
    if result.only_b:
        lines.append(f"only in B ({len(result.only_b)}): {', '.join(result.only_b)}")
    return "\n".join(lines)


def json_safe(value: Any) -> Any:
    """``value`` with what JSON cannot hold made printable: inf/NaN as strings, dict keys as strings, tuples as
    lists, any other object as its repr."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def stats_json(stats: Sequence[TensorStats]) -> dict[str, Any]:
    """JSON-ready form of :func:`model_stats` output with totals."""
    return json_safe({"tensors": [asdict(s) for s in stats], "totals": totals(stats)})


def compare_json(result: Comparison) -> dict[str, Any]:
    """JSON-ready form of a :class:`Comparison`."""
    return json_safe(asdict(result))
