"""The real Qwen tokenizers, carried inside the repository as compact packs (``tests/data/tokenizers/*.tokpack.xz``).

A Qwen ``tokenizer.json`` is 11 MB (Qwen2/2.5/3, DeepSeek-R1-Distill) or 20 MB (Qwen3.5), most of it the
vocabulary written twice: once as ``vocab`` and again inside ``merges``. In byte-level BPE every merge joins two
tokens into one that is itself in the vocabulary, so a merge is fully given by the id of the token it makes and
where that token's text splits. A pack stores, xz-compressed:

    line 1          JSON: the tokenizer.json with ``model.vocab`` and ``model.merges`` left out, and the SHA-256 of
                    the canonical form (``json.dumps(..., sort_keys=True, ensure_ascii=False)``) of the original
    vocab lines     one token per line, in id order (byte-level tokens hold no newline)
    one empty line
    merge lines     per merge, in order: "<id of the token it makes minus that of the previous merge> <split>"

``tokenizer_json(name)`` rebuilds the file once into a cache directory and checks the digest, so what the tests
read is byte for byte the original's content. ``python scripts/real_tokenizers.py SRC_DIR`` writes the packs from
directories ``SRC_DIR/<name>/tokenizer.json``. Where the tokenizers come from: ``tests/data/README.md``.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

PACKS = Path(__file__).resolve().parents[1] / "tests" / "data" / "tokenizers"
NAMES = ("qwen2_qwen3", "qwen3_5")


def canonical_digest(tokenizer: dict[str, Any]) -> str:
    text = json.dumps(tokenizer, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def pack(tokenizer: dict[str, Any]) -> bytes:
    """The xz-compressed pack of a byte-level BPE tokenizer.json (as a parsed dict)."""
    model = tokenizer["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))) or any("\n" in t for t in tokens):
        raise ValueError("vocabulary ids are not 0..n-1 or a token holds a newline")
    header = dict(tokenizer, model={k: v for k, v in model.items() if k not in ("vocab", "merges")})
    header["canonical_sha256"] = canonical_digest(tokenizer)
    lines = [json.dumps(header, ensure_ascii=False), *tokens, ""]
    previous = 0
    for merge in model["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        made = vocab[left + right]
        lines.append(f"{made - previous} {len(left)}")
        previous = made
    return lzma.compress("\n".join(lines).encode("utf-8"), preset=9 | lzma.PRESET_EXTREME)


def unpack(data: bytes) -> dict[str, Any]:
    """The tokenizer.json dict of a pack; raises ValueError if it does not reproduce the recorded digest."""
    lines = lzma.decompress(data).decode("utf-8").split("\n")
    header = json.loads(lines[0])
    digest = header.pop("canonical_sha256")
    end = lines.index("", 1)
    tokens = lines[1:end]
    merges = []
    made = 0
    for line in lines[end + 1:]:
        delta, split = line.split(" ")
        made += int(delta)
        text = tokens[made]
        merges.append([text[: int(split)], text[int(split):]])
    model = dict(header["model"])
    header["model"] = {"type": model.pop("type"), **model, "vocab": {t: i for i, t in enumerate(tokens)},
                       "merges": merges}
    if canonical_digest(header) != digest:
        raise ValueError("tokenizer pack does not reproduce its recorded digest")
    return header


def tokenizers_dir() -> Path:
    """A directory holding ``<name>/tokenizer.json`` for every real tokenizer, rebuilt once per pack version."""
    packs = {name: (PACKS / f"{name}.tokpack.xz").read_bytes() for name in NAMES}
    key = hashlib.sha256(b"".join(hashlib.sha256(data).digest() for data in packs.values())).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"qwen-numpy-tokenizers-{key}"
    for name, data in packs.items():
        target = root / name / "tokenizer.json"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".partial")
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(unpack(data), handle, ensure_ascii=False)
            os.replace(partial, target)
    return root


def tokenizer_json(name: str) -> Path:
    """Path of the real tokenizer ``name`` (``qwen2_qwen3`` / ``qwen3_5``) as a tokenizer.json."""
    return tokenizers_dir() / name / "tokenizer.json"


def main(argv: list[str]) -> None:
    source = Path(argv[0])
    PACKS.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        tokenizer = json.loads((source / name / "tokenizer.json").read_text(encoding="utf-8"))
        data = pack(tokenizer)
        if unpack(data) != tokenizer:
            raise SystemExit(f"{name}: the pack does not round-trip")
        (PACKS / f"{name}.tokpack.xz").write_bytes(data)
        print(f"{name}: {len(data):,} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
