"""qwen-inspect: streamed statistics, totals, --filter, --json and --compare across formats."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import fixture
from runtime_helpers import Converted

from qwen_convert import inspect as inspect_module
from qwen_convert.cli import inspect_main
from qwen_convert.inspect import compare, open_pair, tensor_stats
from qwen_runtime.formats import open_model_files
from qwen_runtime.formats.tensors import QType, StoredTensor


def test_streamed_statistics_equal_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inspect_module, "rows_per_chunk", lambda width: 3)  # many chunks
    values = (np.random.default_rng(0).standard_normal((31, 16)) * 3 + 100).astype(np.float32)
    values[4, 2], values[7, 1], values[9, 0] = np.nan, np.inf, -np.inf
    stats = tensor_stats(StoredTensor("t.weight", QType.F32, values.shape, "mem", data=values))
    finite = values[np.isfinite(values)].astype(np.float64)
    assert (stats.nan, stats.inf) == (1, 2)
    assert stats.min == finite.min() and stats.max == finite.max() and stats.absmax == np.abs(finite).max()
    assert stats.mean == pytest.approx(finite.mean(), rel=1e-12)
    assert stats.std == pytest.approx(finite.std(), rel=1e-9)


def test_table_filter_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_main([str(fixture("qwen3-tiny")), "--filter", r"^blk\.0\.attn_[qk]_norm"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model:") and "context length: " in "\n".join(lines)  # the metadata view first
    out = lines[lines.index("") + 1:]
    assert out[0].split()[:4] == ["name", "shape", "type", "bytes"]
    assert [line.split()[0] for line in out[1:-1]] == ["blk.0.attn_k_norm.weight", "blk.0.attn_q_norm.weight"]
    assert out[-1].startswith("total: 2 tensors")


def test_json_totals_match_the_files(capsys: pytest.CaptureFixture[str]) -> None:
    path = fixture("qwen2-tiny")
    assert inspect_main([str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    files = open_model_files(path)
    assert report["totals"]["parameters"] == sum(t.n_elements for t in files.tensors.values())
    assert report["totals"]["bytes"] == sum(t.nbytes for t in files.tensors.values())
    assert report["totals"]["bytes_per_parameter"] == pytest.approx(2.0, abs=0.01)  # bf16 checkpoint
    assert {t["name"] for t in report["tensors"]} == set(files.tensors)


@pytest.fixture(scope="module")
def gqa_q8(converted: Converted) -> Path:
    return converted("qwen35-tiny-gqa", "gguf", "q8_0")


def test_compare_hf_against_tiled_gguf(gqa_q8: Path) -> None:
    a, b = open_pair(fixture("qwen35-tiny-gqa"), gqa_q8)
    assert a.v_head_order == b.v_head_order == "tiled"
    result = compare(a, b)
    assert not result.only_a and not result.only_b
    by_name = {row.name: row for row in result.tensors}
    assert by_name["blk.0.ssm_a"].rmse == 0 and math.isinf(by_name["blk.0.ssm_a"].snr_db)
    quantized = [row for row in result.tensors if row.type_b == "Q8_0"]
    assert quantized and all(row.cosine > 0.9999 and 35 < row.snr_db < 60 for row in quantized)
    assert result.min_cosine == min(row.cosine for row in result.tensors)


def test_compare_in_the_wrong_order_would_be_caught(gqa_q8: Path) -> None:
    grouped = open_model_files(fixture("qwen35-tiny-gqa"))  # HF order, not the GGUF's
    result = compare(grouped, open_model_files(gqa_q8), r"attn_qkv")
    assert min(row.cosine for row in result.tensors) < 0.9


def test_compare_cli_json(capsys: pytest.CaptureFixture[str], gqa_q8: Path) -> None:
    assert inspect_main([str(gqa_q8), "--compare", str(fixture("qwen35-tiny-gqa")), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tensors"] and report["snr_db"] > 30
    assert inspect_main([str(fixture("qwen35-tiny-gqa")), "--compare", str(gqa_q8), "--filter", "ssm_out"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("model: 3 tensors compared")


def test_bad_path_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert inspect_main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing" in err


@pytest.fixture(scope="module")
def three_formats(converted: Converted) -> dict[str, Path]:
    return {fmt: converted("qwen3-tiny", fmt, "q8_0") for fmt in ("hf", "gguf", "npy")}


def test_metadata_view_of_all_three_formats(three_formats: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    views = {}
    for fmt, path in three_formats.items():
        assert inspect_main([str(path), "--meta", "--json"]) == 0
        views[fmt] = json.loads(capsys.readouterr().out)
    hf_config = json.loads((three_formats["hf"] / "config.json").read_text())
    tok_config = json.loads((three_formats["hf"] / "tokenizer_config.json").read_text())
    for fmt, view in views.items():
        files = open_model_files(three_formats[fmt])
        assert view["format"] == fmt and view["architecture"] == "qwen3"
        assert view["context_length"] == hf_config["max_position_embeddings"]
        assert view["rope"]["theta"] == hf_config["rope_theta"] and view["rope"]["dimensions"] == files.config.head_dim
        assert view["tokenizer"]["embedding_rows"] == hf_config["vocab_size"]
        assert view["special_tokens"]["eos"]["text"] == tok_config["eos_token"]
        assert view["chat_template"]["present"] and view["chat_template"]["chars"] > 100
        assert sum(row["bytes"] for row in view["types"].values()) == sum(t.nbytes for t in files.tensors.values())
        assert view["parameters"] == sum(t.n_elements for t in files.tensors.values())
    # the tokenizer is the same in every format; GGUF names its model and pre-tokenizer and counts its merges
    assert len({v["tokenizer"]["tokens"] for v in views.values()}) == 1
    assert views["hf"]["tokenizer"]["model"] == "BPE" and views["gguf"]["tokenizer"]["model"] == "gpt2 (pre qwen2)"
    gguf = open_model_files(three_formats["gguf"])
    assert views["gguf"]["tokenizer"]["merges"] == len(gguf.metadata["tokenizer.ggml.merges"])
    assert set(views["gguf"]["types"]) == {"Q8_0", "F32"} and "BF16" in views["hf"]["types"]
    assert views["gguf"]["types"]["Q8_0"]["bytes"] * 32 == views["gguf"]["types"]["Q8_0"]["parameters"] * 34


def test_metadata_table_alone_and_as_header(three_formats: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_main([str(three_formats["gguf"]), "--meta"]) == 0
    alone = capsys.readouterr().out
    for label in ("architecture:", "context length:", "rope:", "tokenizer:", "special tokens:", "chat template:"):
        assert label in alone
    assert "Q8_0" in alone and "name  " not in alone and "total:" not in alone
    assert inspect_main([str(three_formats["gguf"])]) == 0
    both = capsys.readouterr().out
    assert both.startswith(alone.rstrip("\n") + "\n\nname") and "total:" in both


def test_metadata_view_without_a_tokenizer_still_shows_the_tensors(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    model = Path(shutil.copytree(fixture("qwen3-tiny"), tmp_path / "m"))
    (model / "tokenizer.json").unlink()
    assert inspect_main([str(model)]) == 0
    out = capsys.readouterr().out
    assert "tokenizer:      unavailable (" in out and "tokenizer.json" in out and "total:" in out
