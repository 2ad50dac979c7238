"""Every GGUF key/value we write: the model table (§4.2) and the tokenizer (§4.5) of docs/qwen-architectures.md.

Keys come from ``gguf.Keys``; the model keys live in one table, :data:`qwen_runtime.gguf_keys.MODEL_KEYS`, which
the reader and verify use too.  The tokenizer follows
llama.cpp's converter: the token list comes from ``tokenizer.json`` (padded to ``vocab_size`` with
``[PAD{id}]`` UNUSED tokens), merges, special ids, add_bos/add_eos and the chat template come from
``gguf.SpecialVocab`` (tokenizer_config.json wins over config.json).  tokenizer.json is parsed once: SpecialVocab
reads a stand-in directory whose tokenizer.json leaves out the vocabulary and merges (:func:`special_vocab`).

``tokenizer.ggml.pre`` rule (llama.cpp decides by hashing the tokenizer; we decide from the files, by the
architecture's ``tokenizer_pre`` in :mod:`qwen_runtime.archs`): ``qwen35`` for the qwen35 architecture,
``deepseek-r1-qwen`` for qwen2 when tokenizer_config.json's ``bos_token`` is DeepSeek's
``<｜begin▁of▁sentence｜>``, otherwise ``qwen2``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_VERSION, GGUFValueType, GGUFWriter, SpecialVocab, TokenType

from qwen_runtime.config import ModelConfig
from qwen_runtime.errors import FormatError
from qwen_runtime.formats.base import read_json_file
from qwen_runtime.gguf_keys import MODEL_KEYS, gguf_key

from .policy import file_type

TOKENIZER_JSON = "tokenizer.json"
MERGE_SPACE = chr(ord(" ") + 256)  # "Ġ": byte-level BPE's stand-in for a space, as SpecialVocab writes it


def add_model_metadata(writer: GGUFWriter, config: ModelConfig, dtype: str, name: str) -> None:
    """``general.*`` and the architecture's hyper-parameters (``general.architecture`` is the writer's)."""
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(int(file_type(dtype)))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    for row in MODEL_KEYS:
        if row.written_for(config.arch):
            value_type, sub_type = (GGUFValueType.ARRAY, row.type) if row.array else (row.type, None)
            writer.add_key_value(gguf_key(row.key, config.arch), row.value(config), value_type, sub_type=sub_type)


def _token_text(entry: Any) -> str | None:
    """A tokenizer_config ``*_token`` entry (a string or an AddedToken dict) as its text."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def tokenizer_pre(config: ModelConfig, tokenizer_config: dict[str, Any]) -> str:
    """``tokenizer.ggml.pre`` for the model (rule in the module docstring)."""
    return config.spec.pre_tokenizer(_token_text(tokenizer_config.get("bos_token")))


def looks_special(text: str) -> bool:
    """Added tokens llama.cpp makes CONTROL even when HF does not mark them special (``<|…|>``, ``<｜…｜>``)."""
    return (text.startswith("<|") and text.endswith("|>")) or (text.startswith("<｜") and text.endswith("｜>"))


def token_table(tokenizer: dict[str, Any], vocab_size: int, source: Path) -> tuple[list[str], list[int]]:
    """``vocab_size`` token strings and GGUF token types from a parsed ``tokenizer.json``."""
    model = tokenizer.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(vocab, dict) or model.get("type", "BPE") != "BPE":
        raise FormatError(f"{source}: expected a byte-level BPE tokenizer with a 'model.vocab' object")
    tokens: dict[int, str] = {int(i): text for text, i in vocab.items()}
    types = dict.fromkeys(tokens, int(TokenType.NORMAL))
    for added in tokenizer.get("added_tokens") or []:
        i, text = int(added["id"]), str(added["content"])
        tokens[i] = text
        control = added.get("special") or looks_special(text)
        types[i] = int(TokenType.CONTROL if control else TokenType.USER_DEFINED)
    if tokens and max(tokens) >= vocab_size:
        raise FormatError(f"{source}: token id {max(tokens)} is not below vocab_size {vocab_size} of config.json")
    texts = [tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    kinds = [types.get(i, int(TokenType.UNUSED)) for i in range(vocab_size)]
    return texts, kinds


def bpe_merges(tokenizer: dict[str, Any], source: Path) -> list[str]:
    """``model.merges`` of a parsed tokenizer.json (one :func:`token_table` accepted) as GGUF's ``"a b"``
    strings (SpecialVocab's rule: the ``[a, b]`` pairs of transformers >= 4.45 are joined with their own spaces
    encoded as U+0120)."""
    merges = tokenizer["model"].get("merges")
    if not isinstance(merges, list) or not merges:
        return []
    if isinstance(merges[0], str):
        return merges
    if isinstance(merges[0], list) and len(merges[0]) == 2 and isinstance(merges[0][0], str):
        return [" ".join(part.replace(" ", MERGE_SPACE) for part in pair) for pair in merges]
    raise FormatError(f"{source}: 'model.merges' is neither a list of strings nor a list of string pairs")


def _stand_in_directory(directory: Path, tokenizer: dict[str, Any], stand_in: Path) -> Path:
    """``stand_in`` filled with links to every file of ``directory`` but tokenizer.json, which is written
    without its ``model`` (vocabulary and merges, nearly all of its size)."""
    for path in directory.iterdir():
        if path.name != TOKENIZER_JSON:
            (stand_in / path.name).symlink_to(path.absolute())
    slim = {**tokenizer, "model": {}}
    (stand_in / TOKENIZER_JSON).write_text(json.dumps(slim), encoding="utf-8")
    return stand_in


def special_vocab(directory: Path, tokenizer: dict[str, Any], vocab_size: int) -> SpecialVocab:
    """llama.cpp's reader of merges, special ids, add_bos/add_eos and the chat template, for a directory whose
    tokenizer.json is already parsed (``tokenizer``).

    SpecialVocab parses tokenizer.json itself, vocabulary included (80-90 MB of peak RSS for Qwen's 150k-250k
    tokens), so it reads a stand-in directory instead (:func:`_stand_in_directory`) and the merges come from
    ``tokenizer``; without merges there, SpecialVocab looks for merges.txt, as it would in ``directory``.
    """
    merges = bpe_merges(tokenizer, directory / TOKENIZER_JSON)
    try:
        with tempfile.TemporaryDirectory(prefix="qwen-special-vocab-") as tmp:
            stand_in = _stand_in_directory(directory, tokenizer, Path(tmp))
            special = SpecialVocab(stand_in, load_merges=not merges, n_vocab=vocab_size)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FormatError(f"{directory}: cannot read the tokenizer files ({exc})") from None
    if merges:
        special.merges = merges
    return special


def add_tokenizer_metadata(writer: GGUFWriter, directory: Path, config: ModelConfig) -> None:
    """Every ``tokenizer.*`` key of §4.5 from the model directory's tokenizer files."""
    tokenizer_path = directory / TOKENIZER_JSON
    tokenizer = read_json_file(tokenizer_path)
    tokenizer_config = read_json_file(directory / "tokenizer_config.json", required=False) or {}
    tokens, types = token_table(tokenizer, config.vocab_size, tokenizer_path)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre(config, tokenizer_config))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = special_vocab(directory, tokenizer, config.vocab_size)
    if not special.merges:
        raise FormatError(f"{tokenizer_path}: no BPE merges found")
    special.add_to_gguf(writer, quiet=True)

