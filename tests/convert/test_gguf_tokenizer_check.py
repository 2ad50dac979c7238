"""GGUF conversion writes a tokenizer.ggml.pre that reproduces the source tokenizer.json, or refuses.

A GGUF reader (ours, llama.cpp) rebuilds the tokenizer from ``tokenizer.ggml.*``: byte-level BPE, NFC, the split
regex named by ``pre``. A source whose tokenizer.json does something else must not become a GGUF that silently
tokenizes differently (qwen_convert/gguf_metadata.py, :func:`tokenizer_pre`).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from convert_helpers import fixture

from qwen_convert.cli import convert_main
from qwen_runtime import chat_format, load
from qwen_runtime.formats.gguf_parse import parse_gguf
from qwen_runtime.text.tokenizer import QWEN35_PATTERN, Tokenizer

TEXTS = ("Hello, world! It's 2026 -- naïve café, ½ ℌ\n\tdef f(x):\n        return x  # 你好 🚀",
         "नमस्ते दुनिया, ผู้ใหญ่, e\u0301 a\u0308 combining marks\r\n\r\n  spaces   and 12345 6789")


def variant(tmp_path: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of fixture ``name`` whose tokenizer.json ``edit`` changed."""
    out = tmp_path / f"{name}-variant"
    shutil.copytree(fixture(name), out)
    tokenizer = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    edit(tokenizer)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    return out


def convert_gguf(src: Path, tmp_path: Path) -> tuple[int, Path]:
    out = tmp_path / "out.gguf"
    return convert_main([str(src), "-o", str(out), "--dtype", "fp32"]), out


def gpt2_byte_level(t: dict[str, Any]) -> None:
    t["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def qwen35_split(t: dict[str, Any]) -> None:
    t["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = QWEN35_PATTERN
    t["model"]["ignore_merges"] = True


@pytest.mark.parametrize(("edit", "pre"), [(gpt2_byte_level, "gpt-2"), (qwen35_split, "qwen35")])
def test_the_matching_pre_tokenizer_is_written_and_reproduces_the_source(tmp_path: Path, edit, pre: str) -> None:
    src = variant(tmp_path, "qwen2-tiny", edit)
    code, out = convert_gguf(src, tmp_path)
    assert code == 0 and parse_gguf(out).metadata["tokenizer.ggml.pre"] == pre
    source = Tokenizer.from_file(src / "tokenizer.json")
    ours = chat_format(load(out)).tokenizer
    for text in TEXTS:
        assert ours.encode(text) == source.encode(text)


REFUSALS = [
    ("byte fallback", lambda t: t["model"].update(byte_fallback=True), "model.byte_fallback is true"),
    ("lowercase", lambda t: t.update(normalizer={"type": "Lowercase"}), "is not NFC"),
    ("NFKC in a sequence", lambda t: t.update(normalizer={"type": "Sequence", "normalizers": [
        {"type": "NFC"}, {"type": "NFKC"}]}), "is not NFC"),
    ("other regex", lambda t: t["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\w+|\s+"),
     r"splits with the regex '\\\\w\+\|\\\\s\+', which is none of"),
    ("prefix space", lambda t: t["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
     "is not one GGUF's tokenizer.ggml.pre can name"),
    ("ignore_merges", lambda t: t["model"].update(ignore_merges=True),
     "model.ignore_merges is true, but GGUF readers use false for the 'qwen2' split"),
    ("decoder", lambda t: t.update(decoder={"type": "Metaspace", "replacement": "▁"}), "is not ByteLevel"),
    ("lstrip", lambda t: t["added_tokens"][1].update(lstrip=True), "added token '<|im_start|>' has lstrip set"),
    ("wordpiece", lambda t: t["model"].update(type="WordPiece"), "the tokenizer model is 'WordPiece'"),
]


@pytest.mark.parametrize(("case", "edit", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_tokenizer_gguf_cannot_express_is_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, edit, message: str) -> None:
    src = variant(tmp_path, "qwen2-tiny", edit)
    code, out = convert_gguf(src, tmp_path)
    err = capsys.readouterr().err
    assert code == 3, err
    assert str(src / "tokenizer.json") in err
    assert re.search(message, err), err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.gguf")]


def test_npy_output_keeps_any_tokenizer(tmp_path: Path) -> None:
    """npy directories carry the source tokenizer files themselves, so no check applies."""
    src = variant(tmp_path, "qwen2-tiny", REFUSALS[0][1])
    assert convert_main([str(src), "-o", str(tmp_path / "out"), "--format", "npy", "--dtype", "fp32"]) == 0
