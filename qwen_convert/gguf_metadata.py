"""Every GGUF key/value we write: the model table (§4.2) and the tokenizer (§4.5) of docs/qwen-architectures.md.

Keys come from ``gguf.Keys``; the model keys live in one table, :data:`qwen_runtime.formats.gguf_keys.MODEL_KEYS`, which
the reader and verify use too.  The tokenizer follows
llama.cpp's converter: the token list comes from ``tokenizer.json`` (padded to ``vocab_size`` with
``[PAD{id}]`` UNUSED tokens), merges, special ids, add_bos/add_eos and the chat template come from
``gguf.SpecialVocab`` (tokenizer_config.json wins over config.json).  tokenizer.json is parsed once: SpecialVocab
reads a stand-in directory whose tokenizer.json leaves out the vocabulary and merges (:func:`special_vocab`).

``tokenizer.ggml.pre`` rule (llama.cpp decides by hashing the tokenizer; we decide from the files): first
:func:`tokenizer_pre` checks that the keys can reproduce tokenizer.json at all (BPE without byte fallback, NFC or
no normalizer, ByteLevel decoder, added tokens matched by exact text, ``ignore_merges`` as the pre-type implies)
and refuses with :class:`~qwen_runtime.errors.UnsupportedTokenizerError` naming the difference, before anything
is written. The name is then the pre-type whose split regex (``qwen_runtime.text.tokenizer.PRE_PATTERNS``) the
pre-tokenizer uses: ``qwen2`` / ``deepseek-r1-qwen`` (one regex; ``deepseek-r1-qwen`` when the architecture's
spec picks it by tokenizer_config.json's DeepSeek ``bos_token``), ``qwen35``, or ``gpt-2`` for a plain
ByteLevel pre-tokenizer with its own regex.
"""

from __future__ import annotations

import json
import logging
import tempfile
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_VERSION, GGUFValueType, GGUFWriter, SpecialVocab, TokenType

from qwen_runtime.errors import FormatError, UnsupportedTokenizerError
from qwen_runtime.formats.base import read_json_file
from qwen_runtime.formats.config import ModelConfig
from qwen_runtime.formats.gguf_keys import MODEL_KEYS, gguf_key, rope_scaling_metadata
from qwen_runtime.text.chat import token_text
from qwen_runtime.text.tokenizer import GPT2_PATTERN, IGNORE_MERGES, PRE_PATTERNS

from .policy import file_type

TOKENIZER_JSON = "tokenizer.json"
log = logging.getLogger(__name__)
# gguf-py's warnings about tokenizer.json's TemplateProcessing that change nothing written when tokenizer_config.json
# sets add_bos_token: its leading-token check compares the template's token with a bos_token still in AddedToken
# form (DeepSeek-R1-Distill: "Unknown leading special token"; add_bos_token then overrides the guess), and a
# "BOS A BOS B" pair template only decides add_sep_token (False, as llama.cpp's converter writes it too).
SETTLED_TEMPLATE_WARNINGS = ("Unknown leading special token", "Unknown separator token",
                             "leading/trailing special tokens do not match", "Unknown sequence",
                             "Unknown middle sequence", "Unknown second separator token",
                             "Unknown second middle sequence")
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
    for key, value_type, value in rope_scaling_metadata(config):
        writer.add_key_value(key, value, value_type)


def tokenizer_pre(config: ModelConfig, tokenizer: dict[str, Any], tokenizer_config: dict[str, Any],
                  source: Path) -> str:
    """``tokenizer.ggml.pre`` for the model (rule in the module docstring), after checking that GGUF's keys
    reproduce ``tokenizer`` (a parsed tokenizer.json) at all; :class:`UnsupportedTokenizerError` otherwise."""
    check_byte_level_bpe(tokenizer, source)
    pattern = split_pattern(tokenizer.get("pre_tokenizer"), source)
    names = [name for name, regex in PRE_PATTERNS.items() if regex == pattern]
    if not names:
        raise UnsupportedTokenizerError(
            f"{source}: the pre-tokenizer splits with the regex {pattern!r}, which is none of the splits GGUF "
            f"readers know for tokenizer.ggml.pre ({', '.join(PRE_PATTERNS)})")
    preferred = config.spec.pre_tokenizer(token_text(tokenizer_config.get("bos_token")))
    name = preferred if preferred in names else names[0]
    ignore = bool(tokenizer["model"].get("ignore_merges", False))
    if ignore != (name in IGNORE_MERGES):
        raise UnsupportedTokenizerError(
            f"{source}: model.ignore_merges is {str(ignore).lower()}, but GGUF readers use "
            f"{str(not ignore).lower()} for the {name!r} split")
    return name


def _describe(node: Any) -> str:
    return json.dumps(node, ensure_ascii=False)[:200]


def check_byte_level_bpe(tokenizer: dict[str, Any], source: Path) -> None:
    """The parts of a tokenizer.json besides its split that GGUF's byte-level BPE ('gpt2') keys must match:
    a BPE model without byte fallback or affixes, no normalizer but NFC (what GGUF readers apply), a ByteLevel
    decoder, and added tokens that match their exact text (no strip, whole-word or normalized matching)."""
    model = tokenizer.get("model")
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else model
        raise UnsupportedTokenizerError(f"{source}: the tokenizer model is {kind!r}; GGUF's 'gpt2' tokenizer is BPE")
    if model.get("byte_fallback"):
        raise UnsupportedTokenizerError(f"{source}: model.byte_fallback is true (SentencePiece-style BPE); GGUF's "
                                        f"'gpt2' tokenizer is byte-level BPE")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise UnsupportedTokenizerError(f"{source}: model.{key} is {model[key]!r}; GGUF's byte-level BPE has none")
    normalizer = tokenizer.get("normalizer")
    steps = normalizer.get("normalizers") if isinstance(normalizer, dict) and normalizer.get("type") == "Sequence" \
        else [normalizer]
    if any(step is not None and not (isinstance(step, dict) and step.get("type") == "NFC") for step in steps or []):
        raise UnsupportedTokenizerError(f"{source}: the normalizer {_describe(normalizer)} is not NFC, the only "
                                        f"normalization GGUF readers apply")
    decoder = tokenizer.get("decoder")
    if not (isinstance(decoder, dict) and decoder.get("type") == "ByteLevel"):
        raise UnsupportedTokenizerError(f"{source}: the decoder {_describe(decoder)} is not ByteLevel, the only "
                                        f"decoding of GGUF's byte-level BPE")
    for added in tokenizer.get("added_tokens") or []:
        flags = [flag for flag in ("lstrip", "rstrip", "single_word") if added.get(flag)]
        content = str(added.get("content"))
        if added.get("normalized") and unicodedata.normalize("NFC", content) != content:
            flags.append("normalized")
        if flags:
            raise UnsupportedTokenizerError(f"{source}: added token {content!r} has {', '.join(flags)} set; GGUF "
                                            f"readers match added tokens by their exact text")


def split_pattern(pre_tokenizer: Any, source: Path) -> str:
    """The regex a tokenizer.json pre-tokenizer splits with, when it is one GGUF's byte-level BPE can express:
    Split(regex, isolated) then ByteLevel without its own regex (Qwen), or ByteLevel with GPT-2's regex."""
    node = pre_tokenizer if isinstance(pre_tokenizer, dict) else {}
    steps = node.get("pretokenizers") if node.get("type") == "Sequence" else [node]
    steps = steps if isinstance(steps, list) else []
    last = steps[-1] if steps and isinstance(steps[-1], dict) else {}
    if last.get("type") == "ByteLevel" and not last.get("add_prefix_space"):
        if len(steps) == 1 and last.get("use_regex", True):
            return GPT2_PATTERN
        split = steps[0] if len(steps) == 2 and isinstance(steps[0], dict) else {}
        pattern = split.get("pattern")
        if (not last.get("use_regex", True) and split.get("type") == "Split" and isinstance(pattern, dict)
                and isinstance(pattern.get("Regex"), str) and str(split.get("behavior")).lower() == "isolated"
                and not split.get("invert")):
            return pattern["Regex"]
    raise UnsupportedTokenizerError(f"{source}: the pre-tokenizer {_describe(pre_tokenizer)} is not one GGUF's "
                                    f"tokenizer.ggml.pre can name (a regex Split, isolated, then ByteLevel without "
                                    f"add_prefix_space)")


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


class _SettledWarnings(logging.Filter):
    """Holds back the ``gguf.vocab`` records of :data:`SETTLED_TEMPLATE_WARNINGS`."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(SETTLED_TEMPLATE_WARNINGS):
            self.held.append(message)
            return False
        return True


@contextmanager
def settled_template_warnings(directory: Path) -> Iterator[None]:
    """While SpecialVocab reads ``directory``: when tokenizer_config.json gives ``add_bos_token``, its
    TemplateProcessing warnings that change nothing are logged at INFO (``qwen-convert -v``) instead."""
    config = read_json_file(directory / "tokenizer_config.json", required=False) or {}
    if not isinstance(config.get("add_bos_token"), bool):
        yield
        return
    gguf_log, held = logging.getLogger("gguf.vocab"), _SettledWarnings()
    gguf_log.addFilter(held)
    try:
        yield
    finally:
        gguf_log.removeFilter(held)
    for message in held.held:
        log.info("%s: gguf.vocab: %s (nothing written depends on it: add_bos_token=%s comes from "
                 "tokenizer_config.json)", directory, message, config["add_bos_token"])


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
            with settled_template_warnings(directory):
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
    pre = tokenizer_pre(config, tokenizer, tokenizer_config, tokenizer_path)
    tokens, types = token_table(tokenizer, config.vocab_size, tokenizer_path)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = special_vocab(directory, tokenizer, config.vocab_size)
    if not special.merges:
        raise FormatError(f"{tokenizer_path}: no BPE merges found")
    special.add_to_gguf(writer, quiet=True)

