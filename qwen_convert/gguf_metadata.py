"""Every GGUF key/value we write: the model table (§4.2) and the tokenizer (§4.5) of docs/qwen-architectures.md.

Keys come from ``gguf.Keys``; the model keys live in one table, :data:`MODEL_KEYS`.  The tokenizer follows
llama.cpp's converter: the token list comes from ``tokenizer.json`` (padded to ``vocab_size`` with
``[PAD{id}]`` UNUSED tokens), merges, special ids, add_bos/add_eos and the chat template come from
``gguf.SpecialVocab`` (tokenizer_config.json wins over config.json).

``tokenizer.ggml.pre`` rule (llama.cpp decides by hashing the tokenizer; we decide from the files):
``qwen35`` for the qwen35 architecture, ``deepseek-r1-qwen`` when tokenizer_config.json's ``bos_token`` is
DeepSeek's ``<｜begin▁of▁sentence｜>``, otherwise ``qwen2``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_VERSION, GGUFValueType, GGUFWriter, Keys, SpecialVocab, TokenType

from qwen_runtime.config import FULL_ATTENTION, LINEAR_ATTENTION, QWEN2, QWEN35, ModelConfig, gguf_key
from qwen_runtime.errors import ConfigError, FormatError
from qwen_runtime.formats.base import read_json_file

from .policy import file_type

U32, F32, I32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.INT32
ALL = ("qwen2", "qwen3", "qwen35")
WITH_HEAD_DIM = ("qwen3", "qwen35")


def _rope_sections(c: ModelConfig) -> list[int]:
    """IMROPE sections padded to 4; without mrope_section every rotary slot uses the text position."""
    sections = list(c.mrope_sections) or [c.rotary_dim // 2]
    return (sections + [0, 0, 0, 0])[:4]


# (key template, GGUF type, value from the config, architectures that get the key)
MODEL_KEYS: tuple[tuple[str, GGUFValueType, Callable[[ModelConfig], Any], tuple[str, ...]], ...] = (
    (Keys.LLM.BLOCK_COUNT, U32, lambda c: c.num_hidden_layers, ALL),
    (Keys.LLM.CONTEXT_LENGTH, U32, lambda c: c.max_position_embeddings, ALL),
    (Keys.LLM.EMBEDDING_LENGTH, U32, lambda c: c.hidden_size, ALL),
    (Keys.LLM.FEED_FORWARD_LENGTH, U32, lambda c: c.intermediate_size, ALL),
    (Keys.Attention.HEAD_COUNT, U32, lambda c: c.num_attention_heads, ALL),
    (Keys.Attention.HEAD_COUNT_KV, U32, lambda c: c.num_key_value_heads, ALL),
    (Keys.Attention.KEY_LENGTH, U32, lambda c: c.head_dim, WITH_HEAD_DIM),
    (Keys.Attention.VALUE_LENGTH, U32, lambda c: c.head_dim, WITH_HEAD_DIM),
    (Keys.Attention.LAYERNORM_RMS_EPS, F32, lambda c: c.rms_norm_eps, ALL),
    (Keys.Rope.FREQ_BASE, F32, lambda c: c.rope_theta, ALL),
    # llama.cpp defaults the rotary width to the head size, right for qwen2/qwen3; its converter writes it
    # only where it differs (qwen35's partial rotary), and so do we.
    (Keys.Rope.DIMENSION_COUNT, U32, lambda c: c.rotary_dim, ("qwen35",)),
    (Keys.Rope.DIMENSION_SECTIONS, I32, _rope_sections, ("qwen35",)),
    (Keys.SSM.CONV_KERNEL, U32, lambda c: c.linear_conv_kernel_dim, ("qwen35",)),
    (Keys.SSM.STATE_SIZE, U32, lambda c: c.linear_key_head_dim, ("qwen35",)),
    (Keys.SSM.GROUP_COUNT, U32, lambda c: c.linear_num_key_heads, ("qwen35",)),
    (Keys.SSM.TIME_STEP_RANK, U32, lambda c: c.linear_num_value_heads, ("qwen35",)),
    (Keys.SSM.INNER_SIZE, U32, lambda c: c.linear_value_dim, ("qwen35",)),
    (Keys.LLM.FULL_ATTENTION_INTERVAL, U32, lambda c: c.full_attention_interval, ("qwen35",)),
)
DEEPSEEK_BOS = "<｜begin▁of▁sentence｜>"
PRE_QWEN2, PRE_DEEPSEEK, PRE_QWEN35 = "qwen2", "deepseek-r1-qwen", "qwen35"


def add_model_metadata(writer: GGUFWriter, config: ModelConfig, dtype: str, name: str) -> None:
    """``general.*`` and the architecture's hyper-parameters (``general.architecture`` is the writer's)."""
    check_representable(config)
    writer.add_type("model")
    writer.add_name(name)
    writer.add_file_type(int(file_type(dtype)))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    for template, vtype, value, archs in MODEL_KEYS:
        if config.arch in archs:
            got = value(config)
            sub_type = vtype if isinstance(got, list) else None
            writer.add_key_value(gguf_key(template, config.arch), got, GGUFValueType.ARRAY if sub_type else vtype,
                                 sub_type=sub_type)


def check_representable(config: ModelConfig) -> None:
    """GGUF has no per-layer type list: llama.cpp derives it from full_attention_interval."""
    if config.arch != QWEN35:
        return
    interval = config.full_attention_interval
    derived = tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                    for i in range(config.num_hidden_layers))
    if derived != config.layer_types:
        raise ConfigError(f"config: layer_types {list(config.layer_types)} do not follow full_attention_interval "
                          f"{interval}, which is all a GGUF file can express")


def _token_text(entry: Any) -> str | None:
    """A tokenizer_config ``*_token`` entry (a string or an AddedToken dict) as its text."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def tokenizer_pre(config: ModelConfig, tokenizer_config: dict[str, Any]) -> str:
    """``tokenizer.ggml.pre`` for the model (rule in the module docstring)."""
    if config.arch == QWEN35:
        return PRE_QWEN35
    if config.arch == QWEN2 and _token_text(tokenizer_config.get("bos_token")) == DEEPSEEK_BOS:
        return PRE_DEEPSEEK
    return PRE_QWEN2


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


def special_vocab(directory: Path, vocab_size: int) -> SpecialVocab:
    """llama.cpp's reader of merges, special ids, add_bos/add_eos and the chat template."""
    try:
        return SpecialVocab(directory, load_merges=True, n_vocab=vocab_size)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FormatError(f"{directory}: cannot read the tokenizer files ({exc})") from None


def add_tokenizer_metadata(writer: GGUFWriter, directory: Path, config: ModelConfig) -> None:
    """Every ``tokenizer.*`` key of §4.5 from the model directory's tokenizer files."""
    tokenizer_path = directory / "tokenizer.json"
    tokenizer = read_json_file(tokenizer_path)
    tokenizer_config = read_json_file(directory / "tokenizer_config.json", required=False) or {}
    tokens, types = token_table(tokenizer, config.vocab_size, tokenizer_path)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre(config, tokenizer_config))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = special_vocab(directory, config.vocab_size)
    if not special.merges:
        raise FormatError(f"{tokenizer_path}: no BPE merges found")
    special.add_to_gguf(writer, quiet=True)

