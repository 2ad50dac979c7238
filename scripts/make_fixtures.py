"""Build deterministic tiny random-weight Qwen-family checkpoints plus transformers reference outputs.

Usage::

    python scripts/make_fixtures.py [--out tests/fixtures] [--configs tests/data/model-configs]

Needs torch (2.13.0, CPU), transformers (5.x, with ``qwen3_5``), tokenizers, safetensors, numpy. Everything is
seeded; running the script twice gives byte-identical files (same Python / library versions; the tokenizer is
trained on a slice of this Python's standard-library source, whose SHA-256 is checked and warned about).

Shared tokenizer
    Byte-level BPE trained with ``tokenizers`` (480 regular tokens = 256 byte symbols + 224 merges) on a fixed
    slice of stdlib source plus fixed English / Chinese / emoji sentences. Structure as a real Qwen
    ``tokenizer.json``: NFC normalizer, Split(Qwen regex, isolated) + ByteLevel(use_regex=False) pre-tokenizer,
    ByteLevel post-processor and decoder. Added tokens follow the regular vocab:

    * Qwen fixtures: 480 ``<|endoftext|>``, 481 ``<|im_start|>``, 482 ``<|im_end|>`` (special),
      483 ``<think>``, 484 ``</think>`` (not special).
    * deepseek-tiny (real DeepSeek order): 480 ``<｜end▁of▁sentence｜>`` (special), 481 ``<｜User｜>``,
      482 ``<｜Assistant｜>`` (not special), 483 ``<｜begin▁of▁sentence｜>`` (special), 484 ``<think>``,
      485 ``</think>``; its post-processor also prepends BOS (``add_bos_token: true``).

    ``vocab_size`` in every config is 512 (> tokenizer size): ids 485/486..511 are embedding rows only; their
    embedding / lm_head rows are scaled down so greedy decoding stays inside the tokenizer.

Fixtures (``<out>/<name>/``: config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
safetensors), all hidden 64, intermediate 128, 4 heads / 2 kv heads, vocab_size 512, rms_norm_eps 1e-6:

    qwen2-tiny       Qwen2ForCausalLM, 2 layers, head_dim 16, tied, rope_theta 1e6, BF16, sharded in 2 files
                     (+ model.safetensors.index.json); Qwen2.5-Instruct tokenizer_config / generation_config.
    deepseek-tiny    Qwen2ForCausalLM, 2 layers, untied (lm_head.weight), rope_theta 1e4, BF16 with all norms and
                     biases F32; DeepSeek-R1-Distill tokenizer_config (verbatim) and generation_config.
    qwen3-tiny       Qwen3ForCausalLM, 2 layers, head_dim 32, tied, rope_theta 1e6; self_attn.* F16, rest BF16.
    qwen35-tiny      Qwen3_5ForCausalLM (model_type qwen3_5_text, weights ``model.*``), 4 layers
                     [linear, linear, linear, full], head_dim 32, partial_rotary_factor 0.25 (rotary dim 8),
                     mrope_section [2, 1, 1] interleaved, rope_theta 1e7, linear heads 2 key / 2 value of dim 32,
                     conv kernel 4, tied; A_log / dt_bias F32, rest BF16. Qwen3-style ChatML template.
    qwen35-tiny-gqa  as qwen35-tiny but linear_num_value_heads 4 (value heads outnumber key heads).
    qwen35-vl-tiny   Qwen3_5ForConditionalGeneration: text_config as qwen35-tiny (+ mtp_num_hidden_layers 1),
                     vision tower depth 1 / hidden 32 / patch 4, weights ``model.language_model.*`` and
                     ``model.visual.*``, plus an MTP block ``mtp.*`` (ignored by transformers) added by hand.

Weights are re-initialised from a seeded ``torch.Generator`` (nothing left at HF's neutral init): linear
N(0, 1/fan_in) (std ×3 for o_proj / down_proj / out_proj, which write the residual stream, so a token's own
tied embedding does not dominate the logits), embeddings / lm_head N(0, 0.3²), biases N(0, 0.2²), Qwen2/3
RMSNorm and Qwen3.5's gated ``linear_attn.norm`` 1 + N(0, 0.1²), Qwen3.5 zero-centred (1 + w) norms N(0, 0.1²),
A_log = log U(1, 16), dt_bias = softplus⁻¹(dt) with log dt ~ U(log 1e-3, log 1e-1). Logit std is ≈ 2.3.

Reference outputs ``<out>/reference/<name>.npz`` (transformers, float32 weights, eager attention, CPU):

    prompt_0, prompt_1, prompt_2   int64 [T]      token ids (T = 5, 11, 17) from fixed texts (Chinese, emoji,
                                                  code; prompt_2 is chat-formatted with the family's specials)
    logits_0, logits_1, logits_2   float32 [T, V] logits of one no-cache forward over prompt_i (V = 512)
    greedy_ids                     int64 [16]     greedy continuation of prompt_0 using the cache
    greedy_logits                  float32 [16, V] logits greedy_ids[k] was chosen from (greedy_logits[0] is the
                                                  last prompt position after prefill; EOS does not stop)
    logits64_0 .. 2, greedy_logits64  float64  the same positions with transformers run in float64: the exact
                                                  reference every float32 result is compared with
    bound_0 .. 2, greedy_bound     float32 [T]    per row, the float32 error bound of scripts/float_error.py (derived
                                                  from the float32 error model, not measured on this machine)

``--float64-only`` adds (or recomputes) just the float64 keys of existing fixtures, keeping everything else.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import shutil
import sysconfig
import warnings
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import float_error  # the float32 error model the tests compare with (scripts/float_error.py)
import hf_oracle  # the transformers oracle the tests use too (scripts/hf_oracle.py)
import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "model-configs"

BASE_SEED = 20250601
REGULAR_VOCAB = 480
CONFIG_VOCAB = 512
HIDDEN = 64
INTERMEDIATE = 128
EMB_STD = 0.3
TAIL_SCALE = 0.05
BIAS_STD = 0.2
NORM_STD = 0.1
RESIDUAL_GAIN = 3.0  # projections writing into the residual stream, so a token's own embedding does not dominate
RESIDUAL_WRITERS = ("o_proj", "down_proj", "out_proj", "attn.proj")
VISION_TOKEN_KEYS = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
PROMPT_LENGTHS = (5, 11, 17)
GREEDY_STEPS = 16

QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
STDLIB_FILES = ("colorsys.py", "bisect.py", "textwrap.py", "keyword.py")
STDLIB_CHARS_PER_FILE = 6000
STDLIB_SLICE_SHA256 = "c090c5acfb6fb704ad90105468119c8cd60cd69b87a989a04d4f43657caa4185"
EXTRA_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。",
    "我喜欢用 Python 写代码，也喜欢读书。",
    "Emoji test: 😀 🚀 🎉 👍 ❤️",
    "Hello 世界 😀! 你好吗？我很好，谢谢。",
    "人工智能和机器学习正在改变世界。",
    "Numbers like 3.14159 and 2026 are split digit by digit.",
    "Tabs\tand\r\nnewlines, it's we're they'll I'm.",
)
SENTENCE_REPEATS = 5

EOT, IM_START, IM_END, THINK, END_THINK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"
DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
DS_USER, DS_ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
QWEN_ADDED = ((EOT, True), (IM_START, True), (IM_END, True), (THINK, False), (END_THINK, False))
DEEPSEEK_ADDED = (
    (DS_EOS, True),
    (DS_USER, False),
    (DS_ASSISTANT, False),
    (DS_BOS, True),
    (THINK, False),
    (END_THINK, False),
)

PROMPT_TEXTS_COMMON = (
    "Hi 你好 😀! How are you today?",
    'def greet(name):\n    return f"你好, {name}! 🚀"\n',
)
QWEN_CHAT_PROMPT = f"{IM_START}user\n今天天气很好。What's 2+2? 🎉{IM_END}\n{IM_START}assistant\n{THINK}\n"
DEEPSEEK_CHAT_PROMPT = f"{DS_BOS}{DS_USER}今天天气很好。What's 2+2? 🎉{DS_ASSISTANT}{THINK}\n"

# A Qwen3-style ChatML template for the Qwen3.5 fixtures (the real Qwen3.5 file was not available): Qwen3's
# template, with message content allowed to be a list of {"type": "text", "text": ...} parts, and thinking on by
# default (the generation prompt opens "<think>\n"; enable_thinking=false closes an empty think block).
QWEN35_CHAT_TEMPLATE = r"""{%- macro render_content(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is none %}
        {{- '' }}
    {%- else %}
        {%- for item in content %}
            {%- if item.type == 'text' %}
                {{- item.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- set text = render_content(message.content) %}
    {%- if ns.multi_step_tool and message.role == "user" and not(text.startswith('<tool_response>') and text.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set text = render_content(message.content) %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + text + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = text %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in text %}
                {%- set content = text.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- text }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501

TokenIds = dict[str, int]


# ----------------------------------------------------------------------------------------------- small io


def load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def dump_json(obj: Any, path: Path, sort_keys: bool = False) -> None:
    text = json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=sort_keys) + "\n"
    path.write_text(text, encoding="utf-8")


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez equivalent with fixed zip timestamps/permissions (np.savez stamps the current time)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for key, value in arrays.items():
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.ascontiguousarray(value), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, buffer.getvalue())


# ----------------------------------------------------------------------------------------------- tokenizer


def stdlib_slice() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text(encoding="utf-8")[:STDLIB_CHARS_PER_FILE] for name in STDLIB_FILES)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != STDLIB_SLICE_SHA256:
        warnings.warn(
            f"stdlib training slice differs from the committed one ({digest}); the tokenizer will differ",
            stacklevel=2,
        )
    return text


def training_corpus() -> list[str]:
    return [stdlib_slice(), *(list(EXTRA_SENTENCES) * SENTENCE_REPEATS)]


def empty_qwen_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(byte_fallback=False, fuse_unk=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_base_tokenizer() -> Tokenizer:
    tokenizer = empty_qwen_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=REGULAR_VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != REGULAR_VOCAB:
        raise RuntimeError(f"BPE training gave {tokenizer.get_vocab_size()} tokens, expected {REGULAR_VOCAB}")
    return tokenizer


def add_tokens(base: Tokenizer, added: tuple[tuple[str, bool], ...]) -> Tokenizer:
    tokenizer = Tokenizer.from_str(base.to_str())
    for content, special in added:
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    return tokenizer


def prepend_bos(tokenizer: Tokenizer, bos: str) -> None:
    """Like DeepSeek's LlamaTokenizerFast tokenizer.json: the post-processor adds BOS to every encoding."""
    bos_id = tokenizer.token_to_id(bos)
    template = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    byte_level = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.post_processor = processors.Sequence([byte_level, template])


def token_ids(tokenizer: Tokenizer, added: tuple[tuple[str, bool], ...]) -> TokenIds:
    ids = {content: tokenizer.token_to_id(content) for content, _ in added}
    expected = list(range(REGULAR_VOCAB, REGULAR_VOCAB + len(added)))
    if list(ids.values()) != expected:
        raise RuntimeError(f"unexpected added-token ids {ids}")
    return ids


# ----------------------------------------------------------------------------------------------- configs


def added_tokens_decoder(ids: TokenIds, added: tuple[tuple[str, bool], ...]) -> dict[str, Any]:
    flags = dict(added)
    return {
        str(ids[content]): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": flags[content],
        }
        for content in ids
    }


def qwen_tokenizer_config(template: Path, ids: TokenIds, chat_template: str | None = None) -> dict[str, Any]:
    config = load_json(template)
    config["added_tokens_decoder"] = added_tokens_decoder(ids, QWEN_ADDED)
    config["additional_special_tokens"] = [t for t in config["additional_special_tokens"] if t in ids]
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def flat_config(template: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    config = load_json(template)
    unknown = set(overrides) - set(config)
    if unknown:
        raise KeyError(f"{template}: overrides not in the real config: {sorted(unknown)}")
    config.update(overrides)
    return config


def common_dims(layers: int) -> dict[str, Any]:
    return {
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": CONFIG_VOCAB,
    }


def write_qwen2_configs(out: Path, ids: TokenIds, configs: Path) -> None:
    src = configs / "qwen2.5-0.5b-instruct"
    overrides = {**common_dims(2), "bos_token_id": ids[EOT], "eos_token_id": ids[IM_END]}
    dump_json(flat_config(src / "config.json", overrides), out / "config.json")
    generation = load_json(src / "generation_config.json")
    generation.update(bos_token_id=ids[EOT], pad_token_id=ids[EOT], eos_token_id=[ids[IM_END], ids[EOT]])
    dump_json(generation, out / "generation_config.json")
    dump_json(qwen_tokenizer_config(src / "tokenizer_config.json", ids), out / "tokenizer_config.json")


def write_deepseek_configs(out: Path, ids: TokenIds, configs: Path) -> None:
    src = configs / "deepseek-r1-distill-qwen-1.5b"
    overrides = {**common_dims(2), "bos_token_id": ids[DS_EOS], "eos_token_id": ids[DS_EOS]}
    dump_json(flat_config(src / "config.json", overrides), out / "config.json")
    generation = load_json(src / "generation_config.json")
    generation.update(bos_token_id=ids[DS_BOS], eos_token_id=ids[DS_EOS])
    dump_json(generation, out / "generation_config.json")
    # names tokens by content only (no ids), so the real file is copied byte for byte
    shutil.copyfile(src / "tokenizer_config.json", out / "tokenizer_config.json")


def write_qwen3_configs(out: Path, ids: TokenIds, configs: Path) -> None:
    src = configs / "qwen3-0.6b"
    overrides = {**common_dims(2), "head_dim": 32, "bos_token_id": ids[EOT], "eos_token_id": ids[IM_END]}
    dump_json(flat_config(src / "config.json", overrides), out / "config.json")
    generation = load_json(src / "generation_config.json")
    generation.update(bos_token_id=ids[EOT], pad_token_id=ids[EOT], eos_token_id=[ids[IM_END], ids[EOT]])
    dump_json(generation, out / "generation_config.json")
    dump_json(qwen_tokenizer_config(src / "tokenizer_config.json", ids), out / "tokenizer_config.json")


def qwen35_text_kwargs(ids: TokenIds, value_heads: int) -> dict[str, Any]:
    return {
        **common_dims(4),
        "head_dim": 32,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": value_heads,
        "attn_output_gate": True,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "eos_token_id": ids[EOT],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    }


def vision_kwargs() -> dict[str, Any]:
    return {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 4,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": HIDDEN,
        "num_position_embeddings": 16,
    }


def qwen35_model_config(ids: TokenIds, value_heads: int, vision: bool) -> transformers.PreTrainedConfig:
    text = qwen35_text_kwargs(ids, value_heads)
    if not vision:
        return transformers.Qwen3_5TextConfig(**text, architectures=["Qwen3_5ForCausalLM"], dtype="bfloat16")
    text["mtp_num_hidden_layers"] = 1
    unused = range(CONFIG_VOCAB - len(VISION_TOKEN_KEYS), CONFIG_VOCAB)  # rows the tokenizer never produces
    return transformers.Qwen3_5Config(
        text_config=text,
        vision_config=vision_kwargs(),
        tie_word_embeddings=True,
        architectures=["Qwen3_5ForConditionalGeneration"],
        dtype="bfloat16",
        **dict(zip(VISION_TOKEN_KEYS, unused, strict=True)),
    )


def write_qwen35_configs(out: Path, ids: TokenIds, configs: Path, value_heads: int, vision: bool) -> None:
    qwen35_model_config(ids, value_heads, vision).save_pretrained(out)
    generation = {
        "bos_token_id": ids[EOT],
        "do_sample": True,
        "eos_token_id": [ids[IM_END], ids[EOT]],
        "pad_token_id": ids[EOT],
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }
    dump_json(generation, out / "generation_config.json")
    template = configs / "qwen3-0.6b" / "tokenizer_config.json"
    dump_json(qwen_tokenizer_config(template, ids, QWEN35_CHAT_TEMPLATE), out / "tokenizer_config.json")


# ----------------------------------------------------------------------------------------------- dtype rules


def all_bf16(name: str) -> torch.dtype:
    return torch.bfloat16


def norms_and_biases_f32(name: str) -> torch.dtype:
    return torch.float32 if name.endswith(("norm.weight", ".bias")) else torch.bfloat16


def attention_f16(name: str) -> torch.dtype:
    return torch.float16 if ".self_attn." in name else torch.bfloat16


def ssm_params_f32(name: str) -> torch.dtype:
    return torch.float32 if name.endswith(("A_log", "dt_bias")) else torch.bfloat16


# ----------------------------------------------------------------------------------------------- fixtures


@dataclass(frozen=True)
class Fixture:
    name: str
    added: tuple[tuple[str, bool], ...]
    write_configs: Callable[[Path, TokenIds, Path], None]
    dtype_rule: Callable[[str], torch.dtype]
    chat_prompt: str
    shards: int = 1
    mtp: bool = False


def qwen35_writer(value_heads: int, vision: bool) -> Callable[[Path, TokenIds, Path], None]:
    def write(out: Path, ids: TokenIds, configs: Path) -> None:
        write_qwen35_configs(out, ids, configs, value_heads, vision)

    return write


FIXTURES = (
    Fixture("qwen2-tiny", QWEN_ADDED, write_qwen2_configs, all_bf16, QWEN_CHAT_PROMPT, shards=2),
    Fixture("deepseek-tiny", DEEPSEEK_ADDED, write_deepseek_configs, norms_and_biases_f32, DEEPSEEK_CHAT_PROMPT),
    Fixture("qwen3-tiny", QWEN_ADDED, write_qwen3_configs, attention_f16, QWEN_CHAT_PROMPT),
    Fixture("qwen35-tiny", QWEN_ADDED, qwen35_writer(2, False), ssm_params_f32, QWEN_CHAT_PROMPT),
    Fixture("qwen35-tiny-gqa", QWEN_ADDED, qwen35_writer(4, False), ssm_params_f32, QWEN_CHAT_PROMPT),
    Fixture("qwen35-vl-tiny", QWEN_ADDED, qwen35_writer(2, True), ssm_params_f32, QWEN_CHAT_PROMPT, mtp=True),
)


# ----------------------------------------------------------------------------------------------- weights


def normal(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def uniform(shape: tuple[int, ...], low: float, high: float, gen: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=gen, dtype=torch.float32)


def vocab_matrix(shape: tuple[int, ...], gen: torch.Generator, n_tokens: int) -> torch.Tensor:
    weight = normal(shape, EMB_STD, gen)
    weight[n_tokens:] *= TAIL_SCALE
    return weight


def delta_net_param(param: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if param == "A_log":
        return torch.log(uniform(shape, 1.0, 16.0, gen))
    if param == "dt_bias":
        dt = torch.exp(uniform(shape, math.log(1e-3), math.log(1e-1), gen))
        return torch.log(torch.expm1(dt))  # inverse softplus
    raise KeyError(param)


def fresh_value(
    kind: str, module: str, param: str, shape: tuple[int, ...], gen: torch.Generator, n_tokens: int
) -> torch.Tensor:
    """New float32 value for parameter `param` of module `module` (class name `kind`)."""
    if kind == "Qwen3_5GatedDeltaNet":
        return delta_net_param(param, shape, gen)
    if kind == "Qwen3_5RMSNorm":  # zero-centred: the forward multiplies by (1 + w)
        return normal(shape, NORM_STD, gen)
    if kind.endswith(("RMSNorm", "RMSNormGated", "LayerNorm")):
        return 1.0 + normal(shape, NORM_STD, gen) if param == "weight" else normal(shape, NORM_STD, gen)
    if param == "bias":
        return normal(shape, BIAS_STD, gen)
    if module.endswith(("embed_tokens", "lm_head")):
        return vocab_matrix(shape, gen, n_tokens)
    if kind == "Embedding":
        return normal(shape, EMB_STD, gen)
    if kind in ("Linear", "Conv1d", "Conv3d"):
        gain = RESIDUAL_GAIN if module.endswith(RESIDUAL_WRITERS) else 1.0
        return normal(shape, gain / math.sqrt(math.prod(shape[1:])), gen)
    raise TypeError(f"no init rule for {module}.{param} ({kind})")


def reinit_parameters(model: torch.nn.Module, gen: torch.Generator, n_tokens: int) -> None:
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            value = fresh_value(type(module).__name__, module_name, param_name, tuple(param.shape), gen, n_tokens)
            with torch.no_grad():
                param.copy_(value)
    missing = [name for name, p in model.named_parameters() if id(p) not in seen]
    if missing:
        raise RuntimeError(f"parameters not re-initialised: {missing}")


def build_model(model_dir: Path, seed: int, n_tokens: int) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model_cls = getattr(transformers, config.architectures[0])
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    reinit_parameters(model, torch.Generator().manual_seed(seed), n_tokens)
    return model


def text_config(model: torch.nn.Module) -> Any:
    config = model.config
    return config.text_config if hasattr(config, "text_config") else config


def mtp_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """MTP block as in real Qwen3.5 checkpoints: fc over [embedding; hidden] plus one full-attention layer."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = "mtp.layers.0."
    return {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        layer + "input_layernorm.weight": (h,),
        layer + "post_attention_layernorm.weight": (h,),
        layer + "self_attn.q_proj.weight": (2 * q, h),
        layer + "self_attn.k_proj.weight": (kv, h),
        layer + "self_attn.v_proj.weight": (kv, h),
        layer + "self_attn.o_proj.weight": (h, q),
        layer + "self_attn.q_norm.weight": (hd,),
        layer + "self_attn.k_norm.weight": (hd,),
        layer + "mlp.gate_proj.weight": (i, h),
        layer + "mlp.up_proj.weight": (i, h),
        layer + "mlp.down_proj.weight": (h, i),
    }


def mtp_tensors(cfg: Any, gen: torch.Generator) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, shape in mtp_shapes(cfg).items():
        gain = RESIDUAL_GAIN if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        std = NORM_STD if len(shape) == 1 else gain / math.sqrt(shape[1])  # (1 + w) norms are zero-centred
        tensors[name] = normal(shape, std, gen)
    return tensors


def checkpoint_tensors(model: torch.nn.Module, fixture: Fixture, seed: int) -> dict[str, torch.Tensor]:
    tensors = {name: t.detach().clone() for name, t in model.state_dict().items()}
    if text_config(model).tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if fixture.mtp:
        tensors.update(mtp_tensors(text_config(model), torch.Generator().manual_seed(seed + 1)))
    return {name: t.to(fixture.dtype_rule(name)).contiguous() for name, t in sorted(tensors.items())}


def shard_index(name: str, shards: int) -> int:
    """Sharded layout: embeddings + layer 0 in the first file, everything later in the second."""
    if shards == 1:
        return 0
    early = name.startswith(("model.embed_tokens.", "model.layers.0."))
    return 0 if early else 1


def save_checkpoint(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(tensors, out / "model.safetensors", metadata=metadata)
        return
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[shard_index(name, shards)] for name in tensors}
    for file in files:
        part = {name: t for name, t in tensors.items() if weight_map[name] == file}
        save_file(part, out / file, metadata=metadata)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    dump_json(index_json, out / "model.safetensors.index.json", sort_keys=True)


# ----------------------------------------------------------------------------------------------- reference


def prompt_ids(tokenizer: Tokenizer, fixture: Fixture) -> list[np.ndarray]:
    prompts = []
    for text, length in zip((*PROMPT_TEXTS_COMMON, fixture.chat_prompt), PROMPT_LENGTHS, strict=True):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) < length:
            raise RuntimeError(f"prompt {text!r} has only {len(ids)} tokens, need {length}")
        prompts.append(np.asarray(ids[:length], dtype=np.int64))
    return prompts


def check_logits(name: str, logits: np.ndarray) -> float:
    if not np.all(np.isfinite(logits)):
        raise RuntimeError(f"{name}: non-finite logits")
    std = float(logits.std())
    if not 0.5 < std < 10.0:
        raise RuntimeError(f"{name}: degenerate logits (std {std:.3f})")
    return std


def check_greedy_matches_full(
    oracle: Any, model_dir: Path, prompt: np.ndarray, ids: np.ndarray, logits: np.ndarray
) -> float:
    """The cached greedy logits must equal a no-cache forward over prompt + generated tokens."""
    full = oracle.hf_logits(model_dir, np.concatenate([prompt, ids[:-1]]), None)[0]
    diff = float(np.abs(full[len(prompt) - 1 :] - logits).max())
    if diff > 2e-4:
        raise RuntimeError(f"{model_dir.name}: cached decode differs from full forward by {diff}")
    return diff


def reference_arrays(oracle: Any, model_dir: Path, prompts: list[np.ndarray]) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for index, prompt in enumerate(prompts):
        arrays[f"prompt_{index}"] = prompt
        arrays[f"logits_{index}"] = oracle.hf_logits(model_dir, prompt, None)[0]
    ids, logits = oracle.hf_greedy(model_dir, prompts[0], GREEDY_STEPS)
    arrays["greedy_ids"] = ids
    arrays["greedy_logits"] = logits
    return arrays | float64_arrays(model_dir, arrays)


def float64_arrays(model_dir: Path, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float64 logits and float32 error bounds per row of every stored float32 reference (scripts/float_error.py)."""
    extra: dict[str, np.ndarray] = {}
    for index in range(len(PROMPT_LENGTHS)):
        logits, bound = float_error.reference64(model_dir, arrays[f"prompt_{index}"])
        extra[f"logits64_{index}"], extra[f"bound_{index}"] = logits[0], bound[0]
    extra["greedy_logits64"], extra["greedy_bound"] = float_error.greedy_reference64(
        model_dir, arrays["prompt_0"], arrays["greedy_ids"])
    return extra


def update_float64(out: Path, name: str) -> None:
    """Add the float64 keys to an existing reference .npz, keeping its float32 arrays as they are."""
    path = out / "reference" / f"{name}.npz"
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files if "64" not in key and "bound" not in key}
    arrays |= float64_arrays(out / name, arrays)
    write_npz(path, arrays)
    bounds = np.concatenate([arrays[key].ravel() for key in arrays if "bound" in key])
    print(f"{name}: float32 error bound per row {bounds.min():.2e}..{bounds.max():.2e}")


def check_hf_tokenizer(model_dir: Path, tokenizer: Tokenizer, prompts: list[np.ndarray]) -> str:
    """AutoTokenizer must load the dir, agree with tokenizer.json and render the chat template."""
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    for prompt in prompts:
        text = tokenizer.decode(prompt.tolist(), skip_special_tokens=False)
        ours = tokenizer.encode(text, add_special_tokens=False).ids
        theirs = hf_tok.encode(text, add_special_tokens=False)
        if ours != theirs:
            raise RuntimeError(f"{model_dir.name}: AutoTokenizer disagrees on {text!r}: {theirs} vs {ours}")
    messages = [{"role": "user", "content": "你好 😀"}]
    return hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ----------------------------------------------------------------------------------------------- driver


def fixture_seed(name: str) -> int:
    return BASE_SEED + zlib.crc32(name.encode("utf-8")) % 100_000


def make_fixture(fixture: Fixture, base: Tokenizer, out: Path, configs: Path, oracle: Any) -> None:
    model_dir = out / fixture.name
    shutil.rmtree(model_dir, ignore_errors=True)
    model_dir.mkdir(parents=True)
    tokenizer = add_tokens(base, fixture.added)
    ids = token_ids(tokenizer, fixture.added)
    if DS_BOS in ids:
        prepend_bos(tokenizer, DS_BOS)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    fixture.write_configs(model_dir, ids, configs)

    seed = fixture_seed(fixture.name)
    model = build_model(model_dir, seed, tokenizer.get_vocab_size())
    save_checkpoint(checkpoint_tensors(model, fixture, seed), model_dir, fixture.shards)
    del model

    prompts = prompt_ids(tokenizer, fixture)
    arrays = reference_arrays(oracle, model_dir, prompts)
    stds = [check_logits(f"{fixture.name}/{key}", v) for key, v in arrays.items() if "logits" in key]
    diff = check_greedy_matches_full(oracle, model_dir, prompts[0], arrays["greedy_ids"], arrays["greedy_logits"])
    chat = check_hf_tokenizer(model_dir, tokenizer, prompts)
    (out / "reference").mkdir(exist_ok=True)
    write_npz(out / "reference" / f"{fixture.name}.npz", arrays)
    print(
        f"{fixture.name}: specials {ids}, logit std {min(stds):.2f}..{max(stds):.2f}, "
        f"greedy {arrays['greedy_ids'].tolist()}, cache-vs-full {diff:.1e}, chat {chat!r}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures")
    parser.add_argument("--configs", type=Path, default=DEFAULT_CONFIGS, help="real HF json files per model")
    parser.add_argument("--only", nargs="*", default=None, help="fixture names to (re)build")
    parser.add_argument("--float64-only", action="store_true",
                        help="only (re)compute the float64 references and bounds of the existing fixtures")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.float64_only:
        for fixture in FIXTURES:
            if args.only is None or fixture.name in args.only:
                update_float64(args.out, fixture.name)
        return
    base = train_base_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)
    for fixture in FIXTURES:
        if args.only is None or fixture.name in args.only:
            make_fixture(fixture, base, args.out, args.configs, hf_oracle)


if __name__ == "__main__":
    main()
