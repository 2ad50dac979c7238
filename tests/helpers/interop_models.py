"""Tiny-weight, full-vocabulary Hugging Face checkpoints around the real Qwen tokenizers (llama.cpp interop).

llama.cpp's ``convert_hf_to_gguf.py`` only accepts tokenizers whose pre-tokenizer hash it knows, so the tiny
fixtures of ``tests/fixtures`` (own 480-token BPE) cannot go through it.  These models use the real
``tokenizer.json`` files (rebuilt from ``tests/data/tokenizers``, see ``shared_data``) with real
``vocab_size`` (151936 / 248320) and hidden size 64, so the embedding stays small (≈ 10-16 M parameters).

Models (name: architecture, files):

    qwen2       Qwen2ForCausalLM, tied, rope 1e6; Qwen2.5-0.5B-Instruct tokenizer_config / generation_config.
    deepseek    Qwen2ForCausalLM, untied, rope 1e4; DeepSeek-R1-Distill-Qwen-1.5B config files; tokenizer.json is
                the Qwen2 one with DeepSeek's renamed added tokens and a BOS-prepending post-processor.
    qwen3       Qwen3ForCausalLM, tied, head_dim 32 != hidden / heads; Qwen3-0.6B config files.
    qwen35      Qwen3_5ForCausalLM (text), [linear x3, full], 2 key / 2 value linear heads; ChatML files written
                here (the real Qwen3.5 ones are not available).
    qwen35-gqa  as qwen35 with 2 key / 4 value linear heads (exercises llama.cpp's value-head reorder).

Weights are drawn from numpy generators seeded by (BASE_SEED, CRC-32 of the tensor name), with the scales of
``scripts/make_fixtures.py`` (linear N(0, 1/fan_in), residual writers x3, embeddings N(0, 0.3^2), ...), and
stored as BF16 like real checkpoints (Qwen3.5's ``A_log`` / ``dt_bias`` as F32).  The builder needs torch and
transformers (tensor names come from the transformers model built on the meta device).
"""

from __future__ import annotations

import copy
import json
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from shared_data import MODEL_CONFIGS, tokenizer_json

REPO_ROOT = Path(__file__).resolve().parents[2]
QWEN35_TEMPLATE_SOURCE = REPO_ROOT / "tests" / "fixtures" / "qwen35-tiny" / "tokenizer_config.json"

BASE_SEED = 20250611
HIDDEN = 64
INTERMEDIATE = 128
EMB_STD = 0.3
BIAS_STD = 0.2
NORM_STD = 0.1
RESIDUAL_GAIN = 3.0
RESIDUAL_WRITERS = ("o_proj", "down_proj", "out_proj")
QWEN_VOCAB, QWEN35_VOCAB = 151936, 248320

# DeepSeek-R1-Distill-Qwen renames Qwen's first added tokens; (id, content, special) as in its tokenizer.json.
DEEPSEEK_ADDED = (
    (151643, "<｜end▁of▁sentence｜>", True), (151644, "<｜User｜>", False), (151645, "<｜Assistant｜>", False),
    (151646, "<｜begin▁of▁sentence｜>", True), (151647, "<|EOT|>", False), (151648, "<think>", False),
    (151649, "</think>", False), (151650, "<|quad_start|>", True), (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True), (151653, "<|vision_end|>", True), (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True), (151656, "<|video_pad|>", True), (151657, "<tool_call>", False),
    (151658, "</tool_call>", False), (151659, "<|fim_prefix|>", False), (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False), (151662, "<|fim_pad|>", False), (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
)
DEEPSEEK_BOS = "<｜begin▁of▁sentence｜>"


@dataclass(frozen=True)
class InteropModel:
    """How to build one checkpoint: its config and the sources of its tokenizer files."""

    name: str
    tokenizer: str  # name of a real tokenizer (shared_data.tokenizer_json)
    config: dict[str, Any]
    tokenizer_config: Callable[[], dict[str, Any]]
    generation_config: Callable[[], dict[str, Any]]
    edit_tokenizer: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    @property
    def is_qwen35(self) -> bool:
        return self.config["model_type"] == "qwen3_5_text"


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _model_file(model: str, name: str) -> Callable[[], dict[str, Any]]:
    return lambda: _read_json(MODEL_CONFIGS / model / name)


def _added_decoder(entries: list[tuple[int, str, bool]]) -> dict[str, dict[str, Any]]:
    return {str(i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": special} for i, text, special in entries}


def qwen35_tokenizer_config() -> dict[str, Any]:
    """A plausible Qwen3.5 tokenizer_config: ChatML template (thinking on), eos <|im_end|>, no BOS."""
    tokenizer = _read_json(tokenizer_json("qwen3_5"))
    added = [(int(a["id"]), a["content"], bool(a["special"])) for a in tokenizer["added_tokens"]]
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": _added_decoder(added),
        "bos_token": None,
        "chat_template": _read_json(QWEN35_TEMPLATE_SOURCE)["chat_template"],
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "TokenizersBackend",
        "unk_token": None,
    }


def qwen35_generation_config() -> dict[str, Any]:
    return {"bos_token_id": 248044, "do_sample": True, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
            "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def deepseek_tokenizer(tokenizer: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's tokenizer.json as DeepSeek-R1-Distill-Qwen ships it: renamed added tokens, BOS post-processor."""
    out = copy.deepcopy(tokenizer)
    template = {"id": 0, "content": "", "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": False}
    out["added_tokens"] = [{**template, "id": i, "content": text, "special": special}
                           for i, text, special in DEEPSEEK_ADDED]
    bos = {"SpecialToken": {"id": DEEPSEEK_BOS, "type_id": 0}}
    out["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {DEEPSEEK_BOS: {"id": DEEPSEEK_BOS, "ids": [151646], "tokens": [DEEPSEEK_BOS]}},
    }
    return out


def only_listed_added_tokens(tokenizer: dict[str, Any], tokenizer_config: dict[str, Any]) -> dict[str, Any]:
    """Keep the added tokens tokenizer_config.json lists, as in the released model (Qwen2.5 has 22, not 26)."""
    listed = tokenizer_config.get("added_tokens_decoder")
    if not listed:
        return tokenizer
    return {**tokenizer, "added_tokens": [a for a in tokenizer["added_tokens"] if str(a["id"]) in listed]}


def _flat_config(arch: str, model_type: str, base: str, **fields: Any) -> dict[str, Any]:
    cfg = _read_json(MODEL_CONFIGS / base / "config.json")
    cfg.update(architectures=[arch], model_type=model_type, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **fields)
    return cfg


def _qwen35_config(value_heads: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "attention_bias": False,
        "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": None, "eos_token_id": 248044,
        "full_attention_interval": 4, "head_dim": 32, "hidden_act": "silu", "hidden_size": HIDDEN,
        "initializer_range": 0.02, "intermediate_size": INTERMEDIATE,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": value_heads,
        "linear_value_head_dim": 32, "max_position_embeddings": 262144, "num_attention_heads": 4,
        "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000.0, "rope_type": "default"},
        "tie_word_embeddings": True, "dtype": "bfloat16", "use_cache": True, "vocab_size": QWEN35_VOCAB,
    }


def interop_models() -> dict[str, InteropModel]:
    """Every interop checkpoint by name (configs are read lazily from tests/data/model-configs)."""
    q25, ds, q3 = "qwen2.5-0.5b-instruct", "deepseek-r1-distill-qwen-1.5b", "qwen3-0.6b"
    models = [
        InteropModel("qwen2", "qwen2_qwen3", _flat_config("Qwen2ForCausalLM", "qwen2", q25),
                     _model_file(q25, "tokenizer_config.json"), _model_file(q25, "generation_config.json")),
        InteropModel("deepseek", "qwen2_qwen3", _flat_config("Qwen2ForCausalLM", "qwen2", ds),
                     _model_file(ds, "tokenizer_config.json"), _model_file(ds, "generation_config.json"),
                     deepseek_tokenizer),
        InteropModel("qwen3", "qwen2_qwen3", _flat_config("Qwen3ForCausalLM", "qwen3", q3, head_dim=32),
                     _model_file(q3, "tokenizer_config.json"), _model_file(q3, "generation_config.json")),
        InteropModel("qwen35", "qwen3_5", _qwen35_config(2), qwen35_tokenizer_config, qwen35_generation_config),
        InteropModel("qwen35-gqa", "qwen3_5", _qwen35_config(4), qwen35_tokenizer_config,
                     qwen35_generation_config),
    ]
    return {m.name: m for m in models}


# ------------------------------------------------------------------------------------------------- weights

def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng([BASE_SEED, zlib.crc32(name.encode())])


def init_tensor(name: str, shape: tuple[int, ...], qwen35: bool) -> np.ndarray:
    """Seeded float32 values for one HF tensor (scales as in scripts/make_fixtures.py)."""
    rng = _rng(name)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
        return np.log(np.expm1(dt)).astype(np.float32)  # softplus^-1
    if "norm" in name:
        zero_centred = qwen35 and not name.endswith("linear_attn.norm.weight")
        return ((0.0 if zero_centred else 1.0) + NORM_STD * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".bias"):
        return (BIAS_STD * rng.standard_normal(shape)).astype(np.float32)
    if "embed_tokens" in name or name == "lm_head.weight":
        return (EMB_STD * rng.standard_normal(shape)).astype(np.float32)
    fan_in = int(np.prod(shape[1:]))
    gain = RESIDUAL_GAIN if any(w in name for w in RESIDUAL_WRITERS) else 1.0
    return (gain / math.sqrt(fan_in) * rng.standard_normal(shape)).astype(np.float32)


def hf_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the checkpoint tensors, from the transformers model built on the meta device."""
    import torch
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config)
    model_cls = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        model = model_cls(hf_config)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)
    return shapes


def _keeps_f32(name: str, qwen35: bool) -> bool:
    return qwen35 and name.endswith(("A_log", "dt_bias"))


def write_weights(config: dict[str, Any], path: Path, qwen35: bool) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for name, shape in sorted(hf_tensor_shapes(config).items()):
        values = torch.from_numpy(init_tensor(name, shape, qwen35))
        tensors[name] = values if _keeps_f32(name, qwen35) else values.to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------- files

def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_model(model: InteropModel, out: Path) -> Path:
    """Write ``out/<name>/`` (config, tokenizer files, model.safetensors); returns the directory."""
    target = out / model.name
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = _read_json(tokenizer_json(model.tokenizer))
    if model.edit_tokenizer is not None:
        tokenizer = model.edit_tokenizer(tokenizer)
    tokenizer_config = model.tokenizer_config()
    tokenizer = only_listed_added_tokens(tokenizer, tokenizer_config)
    (target / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    _write_json(target / "tokenizer_config.json", tokenizer_config)
    _write_json(target / "generation_config.json", model.generation_config())
    _write_json(target / "config.json", model.config)
    write_weights(model.config, target / "model.safetensors", model.is_qwen35)
    return target


def build_all(out: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Build the named models (all by default) under ``out``."""
    models = interop_models()
    return {name: build_model(models[name], out) for name in (names or list(models))}


# ------------------------------------------------------------------------------------- quantization models

FIXTURE_TOKENIZER = REPO_ROOT / "tests" / "fixtures" / "qwen3-tiny"
# Models for llama.cpp's quantizer (tests/interop/test_quant_interop.py): head_dim 128 (transformers' GGUF loader
# assumes it for qwen3), the fixtures' small tokenizer (llama.cpp's quantizer and runtime do not need a
# pre-tokenizer hash, only its converter does).  "qwen3": every row length a multiple of 256, so K-quants are
# used everywhere; "qwen2": hidden 384 (not a multiple of 256), untied, biases, so mixtures fall back to
# 32-blocks for the attention and up/gate rows and use K-quants only in ffn_down.
QUANT_MODELS: dict[str, dict[str, Any]] = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
              "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 512,
              "tie_word_embeddings": True},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 384,
              "num_attention_heads": 3, "num_key_value_heads": 1, "intermediate_size": 768,
              "tie_word_embeddings": False},
}


def build_quant_model(name: str, out: Path) -> Path:
    """Write ``out/<name>/`` for a :data:`QUANT_MODELS` entry: float32 safetensors, the fixture tokenizer."""
    import torch
    from safetensors.torch import save_file

    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    config = _read_json(FIXTURE_TOKENIZER / "config.json")
    config.update(QUANT_MODELS[name], head_dim=128, num_hidden_layers=2, torch_dtype="float32")
    _write_json(target / "config.json", config)
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (target / file).write_bytes((FIXTURE_TOKENIZER / file).read_bytes())
    tensors = {n: torch.from_numpy(init_tensor(n, s, False)) for n, s in sorted(hf_tensor_shapes(config).items())}
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


# ------------------------------------------------------------------------------------------------ mix models

# Models for llama.cpp's per-tensor type choice (tests/convert/test_quant_mixes.py): enough layers for the layer bumps
# (use_more_bits, the first eighth / sixteenth, the first 2 / 4 attn_v), query groups on both sides of llama.cpp's
# threshold of 4, tied and untied heads.  "qwen2-odd" has rows of 384 (K-quants fall back to their 32-value twin)
# and an intermediate size of 200 (ffn_down rows fit no block: F16); "qwen35-mix" has ssm_out rows of 384 (6 value
# heads of 64: llama.cpp's loader needs equal key and value head sizes).  The fixtures' 512-token tokenizers.
_QWEN35_MIX_LAYERS = ["linear_attention"] * 3 + ["full_attention"]
MIX_MODELS: dict[str, tuple[Path, dict[str, Any]]] = {
    "qwen2-mix": (FIXTURE_TOKENIZER, {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 512, "num_hidden_layers": 10,
        "tie_word_embeddings": False}),
    "qwen3-mix": (FIXTURE_TOKENIZER, {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "num_hidden_layers": 9,
        "tie_word_embeddings": True}),
    "qwen35-mix": (REPO_ROOT / "tests" / "fixtures" / "qwen35-tiny", {
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
        "intermediate_size": 512, "num_hidden_layers": 8, "layer_types": _QWEN35_MIX_LAYERS * 2,
        "linear_key_head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
        "linear_value_head_dim": 64}),
    "qwen2-odd": (FIXTURE_TOKENIZER, {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 384, "num_attention_heads": 3,
        "num_key_value_heads": 1, "head_dim": 128, "intermediate_size": 200, "num_hidden_layers": 3,
        "tie_word_embeddings": False}),
}


def build_mix_model(name: str, out: Path) -> Path:
    """Write ``out/<name>/`` for a :data:`MIX_MODELS` entry: float32 safetensors, a fixture's tokenizer files."""
    import torch
    from safetensors.torch import save_file

    tokenizer_dir, fields = MIX_MODELS[name]
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    config = _read_json(tokenizer_dir / "config.json")
    config.update(fields, torch_dtype="float32", dtype="float32")
    _write_json(target / "config.json", config)
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (target / file).write_bytes((tokenizer_dir / file).read_bytes())
    qwen35 = config["model_type"] == "qwen3_5_text"
    tensors = {n: torch.from_numpy(init_tensor(n, s, qwen35)) for n, s in sorted(hf_tensor_shapes(config).items())}
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target
