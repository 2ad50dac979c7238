"""Importance matrices: llama-imatrix's two file formats, the checks on them, ``qwen-convert --imatrix`` plumbing
and ``qwen-imatrix`` (our runtime's sums) — against llama-imatrix itself in the peer test at the end."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import fixture

from qwen_convert.convert import convert
from qwen_convert.imatrix import (
    QUANTIZE_CHUNKS_KEY,
    QUANTIZE_DATASET_KEY,
    QUANTIZE_ENTRIES_KEY,
    QUANTIZE_FILE_KEY,
    WEIGHTED_TYPES,
    Imatrix,
    ImatrixEntry,
    importance_vectors,
    load_importance,
    read_imatrix,
    write_imatrix,
)
from qwen_convert.imatrix_cli import main as imatrix_main
from qwen_convert.imatrix_collect import chunk_tokens, compute_imatrix
from qwen_runtime.errors import FormatError, QwenError
from qwen_runtime.formats import open_hf_dir, open_model_files
from qwen_runtime.formats.gguf_parse import parse_gguf
from qwen_runtime.tensors import QType

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "def read(path):\n    return open(path).read()\n") * 12


def _imatrix(counts: tuple[int, ...] = (40,)) -> Imatrix:
    rng = np.random.default_rng(5)
    entries = {"blk.0.attn_q.weight": ImatrixEntry(rng.uniform(0, 9, (len(counts), 8)).astype(np.float32),
                                                   np.array(counts, np.int64)),
               "blk.0.ffn_down.weight": ImatrixEntry(rng.uniform(0, 9, (1, 4)).astype(np.float32),
                                                     np.array([40], np.int64))}
    return Imatrix(entries, ["calib.txt"], 2, 20)


def test_gguf_roundtrip_has_llama_imatrix_layout(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_imatrix(path, _imatrix())
    layout = parse_gguf(path)
    assert layout.metadata == {"general.type": "imatrix", "imatrix.datasets": ["calib.txt"],
                               "imatrix.chunk_count": 2, "imatrix.chunk_size": 20}
    assert [(t.name, t.shape, t.qtype) for t in layout.tensors] == [
        ("blk.0.attn_q.weight.in_sum2", (1, 8), QType.F32), ("blk.0.attn_q.weight.counts", (1, 1), QType.F32),
        ("blk.0.ffn_down.weight.in_sum2", (1, 4), QType.F32), ("blk.0.ffn_down.weight.counts", (1, 1), QType.F32)]
    back = read_imatrix(path)
    original = _imatrix()
    assert (back.datasets, back.chunk_count, back.chunk_size, back.legacy) == (["calib.txt"], 2, 20, False)
    for name, entry in original.entries.items():
        assert np.array_equal(back.entries[name].sums, entry.sums)
        assert np.array_equal(back.entries[name].counts, entry.counts)
    vectors = importance_vectors(back, path)
    assert np.array_equal(vectors["blk.0.attn_q.weight"], original.entries["blk.0.attn_q.weight"].sums[0]
                          / np.float32(40))


def _legacy_bytes(entries: dict[str, tuple[int, np.ndarray]], trailer: tuple[int, str] | None) -> bytes:
    out = struct.pack("<i", len(entries))
    for name, (ncall, values) in entries.items():
        out += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, values.size)
        out += values.astype("<f4").tobytes()
    if trailer is not None:
        out += struct.pack("<ii", trailer[0], len(trailer[1])) + trailer[1].encode()
    return out


def test_legacy_dat_is_divided_by_ncall(tmp_path: Path) -> None:
    values = np.array([2.0, 4.0, 6.0], np.float32)
    path = tmp_path / "old.dat"
    path.write_bytes(_legacy_bytes({"blk.1.attn_k.weight": (2, values), "blk.1.ffn_up.weight": (0, values)},
                                   (7, "wiki.txt")))
    importance = load_importance(path)
    assert importance.dataset == "wiki.txt" and importance.chunk_count == 7
    assert np.array_equal(importance.vectors["blk.1.attn_k.weight"], values / 2)
    assert np.array_equal(importance.vectors["blk.1.ffn_up.weight"], values)  # ncall 0: as stored
    path.write_bytes(_legacy_bytes({"blk.1.attn_k.weight": (2, values)}, None))
    assert load_importance(path).dataset is None
    path.write_bytes(_legacy_bytes({"blk.1.attn_k.weight": (2, values)}, None)[:-3])
    with pytest.raises(FormatError, match="old.dat: truncated legacy imatrix"):
        read_imatrix(path)


def test_non_finite_entries_are_refused_naming_file_and_tensor(tmp_path: Path) -> None:
    bad = _imatrix()
    bad.entries["blk.0.ffn_down.weight"].sums[0, 2] = np.nan
    path = tmp_path / "nan.gguf"
    write_imatrix(path, bad)
    with pytest.raises(FormatError, match=r"nan.gguf: tensor 'blk.0.ffn_down.weight': non-finite importance at "
                                          r"column 2"):
        load_importance(path)
    dat = tmp_path / "inf.dat"
    dat.write_bytes(_legacy_bytes({"blk.3.attn_v.weight": (1, np.array([1.0, np.inf], np.float32))}, None))
    with pytest.raises(FormatError, match="inf.dat: tensor 'blk.3.attn_v.weight': non-finite"):
        load_importance(dat)


def test_zero_count_is_repaired_with_ones_as_llama_cpp(tmp_path: Path, caplog) -> None:
    path = tmp_path / "zero.gguf"
    write_imatrix(path, _imatrix(counts=(0,)))
    with caplog.at_level("WARNING"):
        vectors = load_importance(path).vectors
    assert np.array_equal(vectors["blk.0.attn_q.weight"], np.ones(8, np.float32))
    assert "zero.gguf: tensor blk.0.attn_q.weight: no tokens were counted" in caplog.text


def test_not_an_imatrix_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.dat"
    path.write_bytes(b"\0\0\0\0")
    with pytest.raises(FormatError, match="x.dat: neither a GGUF nor a legacy imatrix"):
        read_imatrix(path)
    model = convert(fixture("qwen3-tiny"), tmp_path / "m.gguf", "gguf", "fp16").output
    with pytest.raises(FormatError, match="not an importance matrix"):
        read_imatrix(model)


def test_chunks_follow_llama_imatrix() -> None:
    ids = list(range(100))
    assert chunk_tokens(ids, 32, None, None, "t") == [ids[:32], ids[32:64], ids[64:96]]
    assert chunk_tokens(ids, 32, 2, 7, "t") == [[7, *ids[1:32]], [7, *ids[33:64]]]
    with pytest.raises(QwenError, match="t: 100 tokens; a context of 64 needs at least 128"):
        chunk_tokens(ids, 64, None, None, "t")
    with pytest.raises(QwenError, match="fewer than 16"):
        chunk_tokens(ids, 8, None, None, "t")


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def test_collector_sums_first_layer_inputs(tmp_path: Path) -> None:
    """blk.0's q/k/v/gate... inputs are the normed embeddings: their sums follow from the weights alone."""
    src = fixture("qwen3-tiny")
    imatrix = compute_imatrix(src, TEXT, "calib.txt", n_ctx=32, chunks=3)
    files = open_hf_dir(src)
    layer_matrices = {n for n, t in files.tensors.items() if n.startswith("blk.") and len(t.shape) == 2}
    assert set(imatrix.entries) == layer_matrices
    assert all(int(e.counts[0]) == 3 * 32 for e in imatrix.entries.values())
    assert (imatrix.chunk_count, imatrix.chunk_size, imatrix.datasets) == (3, 32, ["calib.txt"])
    import qwen_runtime

    ids = qwen_runtime.chat_format(qwen_runtime.load(src)).tokenizer.encode(TEXT)[:96]
    embed = files.tensors["token_embd.weight"].to_float32()
    normed = _rms(embed[ids], files.tensors["blk.0.attn_norm.weight"].to_float32(), files.config.rms_norm_eps)
    expected = (normed * normed).sum(0)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"):
        got = imatrix.entries[name].sums[0].astype(np.float64)
        assert np.abs(got - expected).max() <= 1e-5 * expected.max(), name


def test_qwen_imatrix_cli_writes_and_convert_reads(tmp_path: Path, capsys) -> None:
    text = tmp_path / "calib.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "im.gguf"
    assert imatrix_main([str(fixture("qwen3-tiny")), "-f", str(text), "-o", str(out), "--ctx", "32"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert imatrix_main([str(fixture("qwen3-tiny")), "-f", str(text), "-o", str(out), "--ctx", "32"]) == 5
    assert imatrix_main([str(fixture("qwen3-tiny")), "-f", str(text), "-o", str(tmp_path / "b.gguf"),
                         "--ctx", "4096"]) == 1
    importance = load_importance(out)
    assert len(importance.vectors) == 14 and importance.chunk_count >= 2 and importance.dataset == str(text)


def test_convert_passes_each_tensor_its_vector(tmp_path: Path, monkeypatch) -> None:
    """Every tensor stored in a type llama.cpp weights gets its imatrix vector; Q8_0 and F32 get none; the GGUF
    records llama-quantize's ``quantize.imatrix.*`` keys; the iq4 mixes' imatrix rule applies."""
    import qwen_convert.quantize as quantize_module

    src = fixture("qwen3-tiny")
    im_path = tmp_path / "im.gguf"
    write_imatrix(im_path, compute_imatrix(src, TEXT, "calib.txt", n_ctx=32))
    importance = load_importance(im_path)
    seen: dict[tuple[QType, int], list[np.ndarray | None]] = {}
    real = quantize_module.encode_rows

    def recording(x: np.ndarray, qtype: QType, weights: np.ndarray | None = None) -> np.ndarray:
        seen.setdefault((qtype, x.shape[1]), []).append(weights)
        return real(x, qtype)

    monkeypatch.setattr(quantize_module, "encode_rows", recording)
    monkeypatch.setattr(sys.modules[convert.__module__], "encode_rows", recording)
    out = convert(src, tmp_path / "m.gguf", "gguf", "q4_k_m", importance=importance).output
    files = open_model_files(out)
    for key, value in {QUANTIZE_FILE_KEY: str(im_path), QUANTIZE_DATASET_KEY: "calib.txt",
                       QUANTIZE_ENTRIES_KEY: 14, QUANTIZE_CHUNKS_KEY: importance.chunk_count}.items():
        assert files.metadata[key] == value, key
    weighted = [t for t in files.tensors.values() if t.qtype in WEIGHTED_TYPES]
    assert weighted and any(t.qtype == QType.Q8_0 for t in files.tensors.values())
    passed = [w for calls in seen.values() for w in calls if w is not None]
    vectors = [importance.vectors[t.name] for t in weighted if t.name in importance.vectors]
    assert len(passed) >= len(vectors) > 0
    for vector in vectors:
        assert any(p is vector for p in passed)
    for (qtype, _), calls in seen.items():
        if qtype not in WEIGHTED_TYPES:
            assert all(w is None for w in calls), qtype
