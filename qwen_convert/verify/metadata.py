"""verify's metadata checks: what a converted model declares against what its Hugging Face source says.

GGUF: every key of the model table (:data:`qwen_runtime.formats.gguf_keys.MODEL_KEYS`) that llama.cpp reads for the
architecture against ``config.json`` (an absent key passes only where llama.cpp's default is the right value),
plus the tokenizer keys against the tokenizer files, in full: every token's text and type (added tokens
included), every merge in order, every special-token id and add-token flag the source's files give (and none
they do not), the chat template.  npy: the manifest and the copied config/tokenizer files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import Keys, TokenType

from qwen_runtime.errors import UnsupportedTokenizerError
from qwen_runtime.formats.base import TOKENIZER_FILES, V_HEAD_GROUPED, V_HEAD_TILED, ModelFiles
from qwen_runtime.formats.config import ModelConfig
from qwen_runtime.formats.gguf_config import is_metadata_array, metadata_array, without_mtp_blocks
from qwen_runtime.formats.gguf_keys import MODEL_KEYS, gguf_key, rope_scaling_metadata

from ..gguf_metadata import special_vocab, token_table, tokenizer_pre
from ..policy import DTYPES


@dataclass(frozen=True)
class MetadataCheck:
    """One metadata key (or manifest field) against what the source says it must be."""

    key: str
    expected: Any
    actual: Any
    ok: bool
    note: str = ""


def _same(expected: Any, actual: Any) -> bool:
    if isinstance(actual, np.ndarray):  # a numeric array: a view of the file map
        return isinstance(expected, (list, tuple, np.ndarray)) and np.array_equal(np.asarray(expected), actual)
    if isinstance(expected, float) or isinstance(actual, float):
        return (isinstance(actual, (int, float)) and not isinstance(actual, bool)
                and np.float32(expected) == np.float32(actual))
    return expected == actual


def _pre_check(files: ModelFiles, tokenizer_json: dict[str, Any], meta: dict[str, Any]) -> MetadataCheck:
    """tokenizer.ggml.pre against the split of the source's tokenizer.json (a failure if no name reproduces it)."""
    assert files.directory is not None
    try:
        pre = tokenizer_pre(files.config, tokenizer_json, files.read_json("tokenizer_config.json") or {},
                            files.directory / "tokenizer.json")
    except UnsupportedTokenizerError as exc:
        return MetadataCheck(Keys.Tokenizer.PRE, None, meta.get(Keys.Tokenizer.PRE), False,
                             f"no GGUF pre-tokenizer reproduces the source's tokenizer ({exc})")
    return _key_check(Keys.Tokenizer.PRE, pre, meta)


def _key_check(key: str, expected: Any, meta: dict[str, Any], default: Any = ...) -> MetadataCheck:
    if key not in meta:
        if default is not ... and _same(expected, default):
            return MetadataCheck(key, expected, None, True, f"absent; llama.cpp's default {default!r} is right")
        return MetadataCheck(key, expected, None, False, f"missing (source says {_short(expected)})")
    actual = meta[key]
    if _same(expected, actual):
        return MetadataCheck(key, expected, actual, True)
    return MetadataCheck(key, expected, actual, False, f"is {_short(actual)}, the source says {_short(expected)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def gguf_model_checks(meta: dict[str, Any], config: ModelConfig) -> list[MetadataCheck]:
    """Every key of the model table that llama.cpp reads for the architecture, against the source config.

    An absent key passes where llama.cpp's default is the source's value; block_count is net of appended MTP
    blocks.
    """
    arch = config.arch
    checks = [_key_check(Keys.General.ARCHITECTURE, arch, meta)]
    meta = without_mtp_blocks(meta, arch)
    fields = asdict(config)
    for row in MODEL_KEYS:
        if arch in row.archs:
            default = row.default(fields, meta) if row.default is not None else ...
            checks.append(_key_check(gguf_key(row.key, arch), row.value(config), meta, default))
    checks += [_key_check(key, value, meta) for key, _, value in rope_scaling_metadata(config)]
    if config.rope_scaling is None:
        checks.append(_key_check(gguf_key(Keys.Rope.SCALING_TYPE, arch), "none", meta, "none"))
    return checks


def gguf_tokenizer_checks(meta: dict[str, Any], files: ModelFiles) -> list[MetadataCheck]:
    """Tokenizer keys against tokenizer.json / tokenizer_config.json (the same rules the converters use)."""
    directory, config = files.directory, files.config
    assert directory is not None
    tokenizer_json = files.read_json("tokenizer.json")
    if tokenizer_json is None:
        return [MetadataCheck("tokenizer.json", "present", None, False, "the source has no tokenizer.json")]
    tokens, types = token_table(tokenizer_json, config.vocab_size, directory / "tokenizer.json")
    added = {int(t["id"]) for t in tokenizer_json.get("added_tokens") or [] if isinstance(t, dict)}
    special = special_vocab(directory, tokenizer_json, config.vocab_size)
    checks = [_key_check(Keys.Tokenizer.MODEL, "gpt2", meta), _pre_check(files, tokenizer_json, meta),
              _token_list_check(tokens, meta.get(Keys.Tokenizer.LIST), added),
              _token_type_check(types, tokens, meta.get(Keys.Tokenizer.TOKEN_TYPE), added),
              _merges_check(special.merges, meta.get(Keys.Tokenizer.MERGES))]
    for kind in sorted(set(special.special_token_types) | set(special.special_token_ids)):
        key = getattr(Keys.Tokenizer, f"{kind.upper()}_ID", None)
        if key is not None:
            checks.append(_optional_key_check(key, special.special_token_ids.get(kind), meta))
    for kind in sorted({"bos", "eos", "sep"} | set(special.add_special_token)):
        key = getattr(Keys.Tokenizer, f"ADD_{kind.upper()}", None)
        if key is not None:
            checks.append(_optional_key_check(key, special.add_special_token.get(kind), meta, absent_means=False))
    checks.append(_optional_key_check(Keys.Tokenizer.CHAT_TEMPLATE, special.chat_template, meta))
    return checks


def _optional_key_check(key: str, expected: Any, meta: dict[str, Any], absent_means: Any = None) -> MetadataCheck:
    """A key the source's files may or may not give: when they give none, the output must not claim one
    (``absent_means``: the value an absent key stands for, which a stored key may repeat)."""
    if expected is not None:
        return _key_check(key, expected, meta)
    actual = meta.get(key)
    ok = actual is None or (absent_means is not None and _same(absent_means, actual))
    return MetadataCheck(key, None, actual, ok, "" if ok else f"is {_short(actual)}, the source's tokenizer files "
                                                               f"give none")


def _token_name(i: int, tokens: list[str], added: set[int]) -> str:
    return f"{'added token' if i in added else 'token'} {i} ({tokens[i]!r})"


def _token_type_check(expected: list[int], tokens: list[str], actual: Any, added: set[int]) -> MetadataCheck:
    """Every token's GGUF type (NORMAL, CONTROL, USER_DEFINED, UNUSED) against tokenizer.json's rule."""
    key = Keys.Tokenizer.TOKEN_TYPE
    summary = f"{len(expected)} token types"
    stored = metadata_array(actual)
    if stored is None:
        return MetadataCheck(key, summary, None, False, "missing or not an array of integers")
    if len(stored) != len(expected):
        return MetadataCheck(key, summary, f"{len(stored)} token types", False,
                             f"has {len(stored)} entries for {len(expected)} tokens")
    differ = np.flatnonzero(stored != np.asarray(expected, dtype=np.int64))
    if len(differ):
        i = int(differ[0])
        return MetadataCheck(key, summary, summary, False,
                             f"{len(differ)} token types differ from tokenizer.json's; first: "
                             f"{_token_name(i, tokens, added)} is {_type_name(int(stored[i]))}, expected "
                             f"{_type_name(expected[i])}")
    return MetadataCheck(key, summary, summary, True)


def _type_name(value: int) -> str:
    try:
        return TokenType(value).name
    except ValueError:
        return str(value)


def _first_difference(expected: list[str], actual: Any) -> int | None:
    """The first index where two sequences of the same length differ, or None."""
    return next((i for i, (a, b) in enumerate(zip(expected, actual, strict=True)) if a != b), None)


def _string_list_check(key: str, noun: str, expected: list[str], actual: Any, source_length: str,
                       difference: Callable[[int], str]) -> MetadataCheck:
    """A list the output must store in full and in order: present, as long as the source's (``source_length``
    names that length in the note) and equal item by item (``difference(i)``: the note of the first that is
    not)."""
    summary = f"{len(expected)} {noun}"
    if not is_metadata_array(actual):
        return MetadataCheck(key, summary, None, False, "missing")
    if len(actual) != len(expected):
        return MetadataCheck(key, summary, f"{len(actual)} {noun}", False,
                             f"has {len(actual)} {noun}, {source_length}")
    first = _first_difference(expected, actual)
    if first is not None:
        return MetadataCheck(key, summary, summary, False, difference(first))
    return MetadataCheck(key, summary, summary, True)


def _merges_check(expected: list[str], actual: Any) -> MetadataCheck:
    """Every BPE merge, in order (their order is their priority)."""
    return _string_list_check(Keys.Tokenizer.MERGES, "merges", expected, actual, f"the source has {len(expected)}",
                              lambda i: f"merge {i} is {actual[i]!r}, the source has {expected[i]!r}")


def _token_list_check(expected: list[str], actual: Any, added: set[int]) -> MetadataCheck:
    """Every token's text, in id order."""
    return _string_list_check(Keys.Tokenizer.LIST, "tokens", expected, actual,
                              f"config.json vocab_size is {len(expected)}",
                              lambda i: f"{'added token' if i in added else 'token'} {i} is {actual[i]!r}, "
                                        f"tokenizer.json has {expected[i]!r}")


def npy_checks(output: ModelFiles, files: ModelFiles) -> list[MetadataCheck]:
    """Manifest fields, the copied config.json and tokenizer files against the source directory."""
    manifest, config = output.metadata, files.config
    checks = [_key_check("architecture", config.arch, manifest),
              _key_check("tied_embeddings", config.tie_word_embeddings, manifest)]
    for name, allowed in (("dtype", tuple(DTYPES)), ("v_head_order", (V_HEAD_GROUPED, V_HEAD_TILED))):
        value = manifest.get(name)
        checks.append(MetadataCheck(name, allowed, value, value in allowed,
                                    "" if value in allowed else f"is {value!r}, expected one of {list(allowed)}"))
    for name in ("config.json", *TOKENIZER_FILES):
        checks += _copied_file_check(files, output.path, name)
    return checks


def _copied_file_check(files: ModelFiles, out_dir: Path, name: str) -> list[MetadataCheck]:
    assert files.directory is not None
    source = files.directory / name
    if not source.is_file():
        return []
    copy = out_dir / name
    if not copy.is_file():
        return [MetadataCheck(name, "copied", None, False, "missing from the output directory")]
    if name == "config.json":
        same = json.loads(copy.read_text(encoding="utf-8")) == files.hf_config
    else:
        same = copy.read_bytes() == source.read_bytes()
    return [MetadataCheck(name, "copied", "copied", same, "" if same else "differs from the source's")]


def check_metadata(output: ModelFiles, files: ModelFiles) -> list[MetadataCheck]:
    """Every metadata key or manifest field the architecture needs, consistent with the source."""
    if output.format == "npy":
        return npy_checks(output, files)
    return gguf_model_checks(output.metadata, files.config) + gguf_tokenizer_checks(output.metadata, files)

