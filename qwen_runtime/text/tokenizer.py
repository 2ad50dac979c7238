"""Byte-level BPE tokenizers from a model directory's ``tokenizer.json`` or a GGUF's ``tokenizer.ggml.*``.

For GGUF files the tokenizer is rebuilt with the same structure as Qwen's ``tokenizer.json``: NFC
normaliser, a ``Split`` pre-tokenizer with the regex named by ``tokenizer.ggml.pre`` followed by
``ByteLevel`` (no regex), a BPE model over the NORMAL tokens, CONTROL tokens as added *special* tokens and
USER_DEFINED ones as added plain tokens.  UNUSED ``[PADn]`` fillers are left out (they exist as embedding
rows only and decode to nothing).  Encoding never adds BOS/EOS by itself; :mod:`.chat` decides that.

:class:`StreamDecoder` turns generated ids into text incrementally without ever emitting half of a UTF-8
character: tokens are mapped to their bytes and fed to an incremental UTF-8 decoder.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import Keys, TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ..errors import FormatError
from ..formats.archs import PRE_DEEPSEEK_R1_QWEN, PRE_GPT2, PRE_QWEN2, PRE_QWEN35
from ..formats.gguf_config import is_metadata_array, metadata_array

# Qwen2's pre-tokenizer split (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2; also used by deepseek-r1-qwen).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5 keeps combining marks on letters (docs §4.5).
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                  r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-2's split: what tokenizers' ByteLevel pre-tokenizer applies with use_regex=true (llama.cpp's "gpt-2").
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre -> the split regex it stands for (llama.cpp's llama-vocab.cpp); the first name of a regex is
# the one a converter writes when nothing else decides (qwen_convert.gguf_metadata.gguf_pre_tokenizer).
PRE_PATTERNS: dict[str, str] = {PRE_QWEN2: QWEN2_PATTERN, PRE_DEEPSEEK_R1_QWEN: QWEN2_PATTERN,
                                PRE_QWEN35: QWEN35_PATTERN, PRE_GPT2: GPT2_PATTERN}
# Where a text can be cut so that its tokens are the two pieces' tokens: after a newline between two
# non-space characters, or before a space between two letters.  No alternative of the split regexes above
# matches across such a point, and none looks ahead past it (checked against the whole text at load,
# Tokenizer.can_cut).  Python's \s is wider than Unicode's White_Space, so these cuts are conservative.
CUT_POINTS = re.compile(r"(?<=\S\n)(?=\S)|(?<=[^\W\d_])(?= [^\W\d_])")
CUT_PROBE = ("Hello world, it's fine.\nSecond  line\n\n  indented x\n\tTab\nÉtude naïve über café\n"
             "日本語の文 and 123 numbers\nend.\r\nwindows line\n<|im_start|>user\nok<|im_end|>\nlast")
PIECE_CHARS = 1 << 14  # characters per piece of Tokenizer.encode_within (at most ~ms of work per piece)
# Pre-types whose BPE uses a word that is in the vocabulary as one token without merging (tokenizer.json's
# ``ignore_merges``, set by Qwen3.5's tokenizer).
IGNORE_MERGES = frozenset({PRE_QWEN35})


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what generation needs: token bytes and which ids are special."""

    def __init__(self, backend: HFTokenizer, source: str) -> None:
        self.backend = backend
        self.source = source
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        self.added: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.can_cut = not any(t.lstrip or t.rstrip or any(c.isspace() for c in t.content) for t in added.values()) \
            and self._encode_pieces(cut_text(CUT_PROBE, 8)) == self.encode(CUT_PROBE)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        try:
            return cls(HFTokenizer.from_file(str(path)), str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses for bad files
            raise FormatError(f"{path}: cannot load tokenizer ({exc})") from None

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str) -> Tokenizer:
        return cls(build_gguf_tokenizer(meta, source), source)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognised, nothing is added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    @cached_property
    def longest_token_bytes(self) -> int:
        """UTF-8 bytes of the vocabulary's longest token: no token covers more of a (normalized) text."""
        return max(len(self.token_bytes(i)) for i in range(self.backend.get_vocab_size(with_added_tokens=True)))

    def encode_within(self, text: str, limit: int) -> list[int] | None:
        """Token ids of ``text``, or None as soon as it is known to have more than ``limit`` tokens.

        The text is encoded in pieces of about :data:`PIECE_CHARS` characters cut where tokens never span
        (:data:`CUT_POINTS`), each with the GIL released (``tokenizers``' batch call), stopping at the first
        piece past ``limit``: a huge text costs about ``limit`` tokens' worth of work and never holds up the
        other threads of the process.  A text without such cuts (or a tokenizer whose added tokens could span
        one) is encoded whole, still with the GIL released.
        """
        pieces = cut_text(text, PIECE_CHARS) if self.can_cut else [text]
        ids: list[int] = []
        for piece in pieces:
            ids.extend(self._encode_pieces([piece]))
            if len(ids) > limit:
                return None
        return ids

    def _encode_pieces(self, pieces: list[str]) -> list[int]:
        """The concatenated ids of ``pieces`` encoded separately (the batch calls release the GIL; the fast one,
        without offsets, exists from tokenizers 0.21)."""
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [i for enc in encode(pieces, add_special_tokens=False) for i in enc.ids]

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (added tokens: their UTF-8 text; unknown ids: nothing)."""
        token_id = int(token_id)
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        text = self.backend.id_to_token(token_id)
        if text is None:
            return b""
        table = byte_decoder()
        return bytes(table[c] for c in text if c in table)


def cut_text(text: str, size: int) -> list[str]:
    """``text`` in pieces of at least ``size`` characters (the last may be shorter), each ending at the first
    :data:`CUT_POINTS` point past ``size``; a piece with no such point runs to the end."""
    pieces, start = [], 0
    while len(text) - start > size:
        cut = CUT_POINTS.search(text, start + size)
        if cut is None:
            break
        pieces.append(text[start:cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


def _meta_list(meta: dict[str, Any], key: str, source: str) -> Sequence[Any]:
    """An array value: a list of numbers, or GGUF strings still in the file map (read once, here)."""
    value = meta.get(key)
    if not is_metadata_array(value):
        raise FormatError(f"{source}: metadata key {key!r} is missing or not an array")
    return value


def build_gguf_tokenizer(meta: dict[str, Any], source: str) -> HFTokenizer:
    """A ``tokenizers`` BPE tokenizer equivalent to Qwen's tokenizer.json, from GGUF metadata."""
    kind = meta.get(Keys.Tokenizer.MODEL)
    if kind != "gpt2":
        raise FormatError(f"{source}: tokenizer model {kind!r} is not supported (expected byte-level BPE 'gpt2')")
    pre = meta.get(Keys.Tokenizer.PRE, "qwen2")
    if not isinstance(pre, str) or pre not in PRE_PATTERNS:
        raise FormatError(f"{source}: tokenizer pre-tokenizer {pre!r} is not supported; "
                          f"supported: {sorted(PRE_PATTERNS)}")
    tokens = [str(t) for t in _meta_list(meta, Keys.Tokenizer.LIST, source)]
    stored = meta.get(Keys.Tokenizer.TOKEN_TYPE)
    array = metadata_array(stored) if stored is not None else np.full(len(tokens), TokenType.NORMAL)
    if array is None:
        raise FormatError(f"{source}: metadata key {Keys.Tokenizer.TOKEN_TYPE!r} should be an array of integers")
    if len(array) != len(tokens):
        raise FormatError(f"{source}: {len(tokens)} tokens but {len(array)} token types")
    types = array.tolist()
    merges = [tuple(str(m).split(" ", 1)) for m in _meta_list(meta, Keys.Tokenizer.MERGES, source)]
    if any(len(m) != 2 for m in merges):
        raise FormatError(f"{source}: metadata key {Keys.Tokenizer.MERGES!r} has an entry without a space")
    vocab = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k != TokenType.UNUSED}
    try:
        bpe = models.BPE(vocab, merges, ignore_merges=pre in IGNORE_MERGES)
    except Exception as exc:  # tokenizers raises plain Exception for inconsistent vocab/merges
        raise FormatError(f"{source}: invalid tokenizer vocabulary or merges ({exc})") from None
    tok = HFTokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_PATTERNS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k == TokenType.CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types, strict=True) if k == TokenType.USER_DEFINED])
    return tok


class StreamDecoder:
    """Incremental detokenizer: ``push(id)`` returns the text completed by that token (maybe '')."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self.skip_special and int(token_id) in self.tokenizer.special_ids:
            return ""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still buffered (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)
