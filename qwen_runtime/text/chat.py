"""Prompts as token ids: the model's own chat template, BOS handling and stop tokens.

The template is the model's jinja source (``tokenizer_config.json`` ``chat_template``, ``chat_template.jinja``,
``chat_template.json`` or GGUF ``tokenizer.chat_template``), rendered the way transformers does: an
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks`` and the ``loopcontrols`` extension,
``raise_exception``, ``strftime_now`` and a ``tojson`` filter that keeps non-ASCII text.  Templates come with
downloaded models, so the environment is :class:`~qwen_runtime.text.sandbox.BoundedEnvironment`, which also caps
steps, value sizes and output length.

BOS: the rendered text is tokenized without adding anything; BOS is prepended only when the model asks for
it (``add_bos_token``) and the ids do not already start with it, so DeepSeek-R1-Distill's template, which
writes ``{{bos_token}}`` itself, never yields two.  Stop ids are the union of every eos the model's files
name, plus ``<|im_end|>`` and ``<|endoftext|>`` when the vocabulary has them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

import jinja2
from gguf import Keys

from ..errors import ContextOverflowError, FormatError, TemplateError
from ..formats import ModelFiles
from ..formats.base import read_text_file
from ..formats.gguf_config import is_metadata_array
from .sandbox import BoundedEnvironment, json_size
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from ..models import Model

# Turn-end / document-end tokens that always stop generation when the vocabulary has them.
STOP_TEXTS = ("<|im_end|>", "<|endoftext|>")
Message = Mapping[str, Any]


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _tojson_size(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                 separators: tuple[str, str] | None = None, sort_keys: bool = False) -> int:
    """An upper bound of ``len(_tojson(...))``, before it is built."""
    custom = isinstance(separators, (list, tuple)) and all(isinstance(s, str) for s in separators)
    return json_size(value, indent, sum(map(len, separators)) + 1 if custom else 3)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template."""

    def __init__(self, source: str) -> None:
        env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = env.bounded_callable(_tojson, _tojson_size, "|tojson")
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template does not compile: {exc}") from None
        except RecursionError:
            raise TemplateError("chat template does not compile: nested too deeply") from None
        self.env, self.source = env, source

    def render(self, messages: Sequence[Message], **context: Any) -> str:
        try:
            return self.env.render_bounded(lambda: self.template.generate(messages=list(messages), **context))
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError,
                RecursionError) as exc:
            raise TemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None


def token_text(value: Any) -> str | None:
    """``bos_token``-style entries are a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> set[int]:
    if isinstance(value, bool) or value is None:
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def template_source(files: ModelFiles) -> str | None:
    """The model's chat template text, wherever its files keep it."""
    if files.directory is None:
        value = files.metadata.get(Keys.Tokenizer.CHAT_TEMPLATE)
        return value if isinstance(value, str) else None
    tok_config = files.read_json("tokenizer_config.json") or {}
    value = tok_config.get("chat_template")
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if isinstance(value, str):
        return value
    jinja_path = files.file("chat_template.jinja")
    if jinja_path.is_file():
        return read_text_file(jinja_path)
    value = (files.read_json("chat_template.json") or {}).get("chat_template")
    return value if isinstance(value, str) else None


@dataclass
class ChatFormat:
    """Tokenizer + template + special-token policy of one model."""

    tokenizer: Tokenizer
    template: ChatTemplate | None
    bos_token: str | None
    eos_token: str | None
    add_bos: bool
    stop_ids: frozenset[int]

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer.token_id(self.bos_token) if self.bos_token else None

    def _with_bos(self, ids: list[int]) -> list[int]:
        bos = self.bos_id
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            return [bos, *ids]
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt (no template): BOS only when the model asks for it."""
        return self._with_bos(self.tokenizer.encode(text))

    def encode_prompt_within(self, text: str, limit: int) -> list[int] | None:
        """:meth:`encode_prompt`, or None once the prompt is known to exceed ``limit`` tokens
        (:meth:`~qwen_runtime.text.tokenizer.Tokenizer.encode_within`: in pieces, other threads running)."""
        ids = self.tokenizer.encode_within(text, limit)
        if ids is None:
            return None
        ids = self._with_bos(ids)
        return ids if len(ids) <= limit else None

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, **extra: Any) -> str:
        """The template's text for ``messages`` (``enable_thinking`` is passed only when given)."""
        if self.template is None:
            raise TemplateError(f"{self.tokenizer.source}: the model has no chat template")
        context = dict(add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                       eos_token=self.eos_token or "", **extra)
        if enable_thinking is not None:
            context["enable_thinking"] = enable_thinking
        return self.template.render(messages, **context)

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    enable_thinking: bool | None = None, **extra: Any) -> list[int]:
        text = self.render(messages, add_generation_prompt, enable_thinking, **extra)
        return self._with_bos(self.tokenizer.encode(text))


def reply_budget(prompt_tokens: int, max_new_tokens: int, context: int) -> int:
    """``max_new_tokens`` cut to what a ``context`` of tokens leaves after the prompt.

    Raises :class:`ContextOverflowError` when the prompt leaves no room for even one new token.
    """
    room = context - prompt_tokens
    if room < 1:
        raise ContextOverflowError(f"prompt of {prompt_tokens} tokens leaves no room for a reply in the context "
                                   f"length of {context} tokens")
    return min(max_new_tokens, room)


@dataclass(frozen=True)
class FittedChat:
    """A conversation cut to fit a context: the prompt ids, the messages kept, how many turns went."""

    ids: list[int]
    messages: list[Message]
    dropped_turns: int
    max_new_tokens: int  # the reply's budget: the asked-for count, or less when the context is short of it


def _turn_starts(messages: Sequence[Message]) -> list[int]:
    """Index of every user message: where a turn begins."""
    return [i for i, m in enumerate(messages) if m.get("role") == "user"]


def fit_chat(fmt: ChatFormat, messages: Sequence[Message], context: int, max_new_tokens: int,
             enable_thinking: bool | None = None) -> FittedChat:
    """Drop the oldest turns (a user message and the replies after it; leading system messages are kept, and
    so is the last turn) until the prompt leaves room for ``min(max_new_tokens, context // 2)`` new tokens,
    then cut ``max_new_tokens`` to what is left (:func:`reply_budget`).

    The prompt is re-encoded after each drop: templates render earlier turns differently from the last one
    (Qwen3 drops the reasoning of earlier replies), so token counts of turns do not add up.
    """
    kept, dropped = list(messages), 0
    wanted = max(1, min(max_new_tokens, context // 2))
    while True:
        ids = fmt.encode_chat(kept, enable_thinking=enable_thinking)
        starts = _turn_starts(kept)
        if len(ids) + wanted <= context or len(starts) < 2:
            return FittedChat(ids, kept, dropped, reply_budget(len(ids), max_new_tokens, context))
        kept = kept[:starts[0]] + kept[starts[1]:]
        dropped += 1


def _stop_ids(files: ModelFiles, tokenizer: Tokenizer, eos_token: str | None) -> frozenset[int]:
    ids = set(files.config.eos_token_ids)
    ids |= _ids((files.read_json("generation_config.json") or {}).get("eos_token_id"))
    ids |= _ids((files.hf_config or {}).get("eos_token_id"))
    for key in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID):
        ids |= _ids(files.metadata.get(key))
    for text in (eos_token, *STOP_TEXTS):
        token_id = tokenizer.token_id(text) if text else None
        if token_id is not None:
            ids.add(token_id)
    return frozenset(i for i in ids if 0 <= i < files.config.vocab_size)


def _gguf_token(files: ModelFiles, key: str) -> str | None:
    tokens, token_id = files.metadata.get(Keys.Tokenizer.LIST), files.metadata.get(key)
    if isinstance(token_id, int) and is_metadata_array(tokens) and 0 <= token_id < len(tokens):
        return str(tokens[token_id])
    return None


def load_chat_format(files: ModelFiles) -> ChatFormat:
    """Tokenizer, template and special-token policy from a model's files."""
    source = template_source(files)
    template = ChatTemplate(source) if source else None
    if files.directory is None:
        tokenizer = Tokenizer.from_gguf_metadata(files.metadata, str(files.path))
        bos, eos = _gguf_token(files, Keys.Tokenizer.BOS_ID), _gguf_token(files, Keys.Tokenizer.EOS_ID)
        add_bos = bool(files.metadata.get(Keys.Tokenizer.ADD_BOS, False))
    else:
        path = files.file("tokenizer.json")
        if not path.is_file():
            raise FormatError(f"{path}: file not found (the model directory has no tokenizer)")
        tokenizer = Tokenizer.from_file(path)
        tok_config = files.read_json("tokenizer_config.json") or {}
        bos, eos = token_text(tok_config.get("bos_token")), token_text(tok_config.get("eos_token"))
        add_bos = bool(tok_config.get("add_bos_token", False))
        if bos is None and files.config.bos_token_id is not None and add_bos:
            bos = tokenizer.id_to_token(files.config.bos_token_id)
    return ChatFormat(tokenizer, template, bos, eos, add_bos, _stop_ids(files, tokenizer, eos))


_LOADED: WeakKeyDictionary[Model, ChatFormat] = WeakKeyDictionary()


def chat_format(model: Model) -> ChatFormat:
    """The chat format of ``model``'s files, loaded on first use and kept as long as the model.

    The model itself knows no tokenizer (numeric work never needs one); this is where text meets it.
    """
    fmt = _LOADED.get(model)
    if fmt is None:
        fmt = _LOADED[model] = load_chat_format(model.files)
    return fmt
