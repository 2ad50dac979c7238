"""Full-size random-weight Hugging Face checkpoints with the published shapes of three Qwen models.

Each checkpoint is a directory with ``config.json``, the real ``tokenizer.json`` (from ``--tokenizers``),
``tokenizer_config.json``, ``generation_config.json`` and one bf16 ``model.safetensors`` written straight
from numpy (header + streamed tensors, so memory stays at one row chunk).  Matrices are normal(0, 0.02),
norms ones (zeros for Qwen3.5's zero-centred norms), biases zeros; Qwen3.5's ``A_log`` / ``dt_bias`` are F32
as in the real checkpoint.  Qwen2.5 / Qwen3 configs are the real ones from ``model-configs``; the Qwen3.5-0.8B
text config is written here (:func:`qwen35_config`) from the shape its model card publishes; docs/performance.md
("Running the benchmarks") lists the three shapes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

STD = 0.02
CHUNK_ELEMENTS = 1 << 24  # values generated at once (32 MiB of bf16)
COMPLETE = ".complete"  # marker written last: a directory without it is rebuilt


@dataclass(frozen=True)
class BenchModel:
    """One benchmark shape: its name, config source and tokenizer folder."""

    name: str
    tokenizer: str  # folder under --tokenizers
    config_dir: str | None  # folder under model-configs (None: Qwen3.5, written here)


MODELS = {
    "qwen2.5-0.5b": BenchModel("qwen2.5-0.5b", "qwen2_qwen3", "qwen2.5-0.5b-instruct"),
    "qwen3-0.6b": BenchModel("qwen3-0.6b", "qwen2_qwen3", "qwen3-0.6b"),
    "qwen3.5-0.8b": BenchModel("qwen3.5-0.8b", "qwen3_5", None),
}
# Shapes too large for every run of bench.py: scripts/bench_large.py builds and measures them on request.
LARGE_MODELS = {
    "qwen2.5-3b": BenchModel("qwen2.5-3b", "qwen2_qwen3", None),
    "qwen2.5-7b": BenchModel("qwen2.5-7b", "qwen2_qwen3", None),
}


def qwen35_config() -> dict[str, Any]:
    """Qwen3.5-0.8B text: h1024, 24 layers = (3 linear + 1 full) x 6, 8/2 heads of 256, GDN 16/16 x 128."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "attention_bias": False,
        "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": None, "eos_token_id": 248044,
        "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 1024,
        "initializer_range": 0.02, "intermediate_size": 3584,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_value_head_dim": 128, "max_position_embeddings": 262144, "num_attention_heads": 8,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000.0, "rope_type": "default"},
        "tie_word_embeddings": True, "dtype": "bfloat16", "use_cache": True, "vocab_size": 248320,
    }


def qwen25_7b_config() -> dict[str, Any]:
    """Qwen2.5-7B-Instruct as published: h3584, 28 layers, 28/4 heads of 128, ffn 18944, untied lm_head."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
        "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
        "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
    }


def qwen25_3b_config() -> dict[str, Any]:
    """Qwen2.5-3B-Instruct as published: h2048, 36 layers, 16/2 heads of 128, ffn 11008, tied embeddings."""
    return {**qwen25_7b_config(), "hidden_size": 2048, "intermediate_size": 11008, "max_window_layers": 70,
            "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2, "sliding_window": 32768,
            "tie_word_embeddings": True, "vocab_size": 151936}


# Checkpoints whose config.json is written here (no published file in model-configs), by model name.
WRITTEN_CONFIGS = {"qwen3.5-0.8b": qwen35_config, "qwen2.5-3b": qwen25_3b_config, "qwen2.5-7b": qwen25_7b_config}


def qwen35_tokenizer_config(tokenizer: dict[str, Any]) -> dict[str, Any]:
    """A ChatML tokenizer_config for the Qwen3.5 tokenizer (the real file is not available)."""
    added = {str(a["id"]): {"content": a["content"], "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": bool(a["special"])} for a in tokenizer["added_tokens"]}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
            "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
            "model_max_length": 262144, "pad_token": "<|endoftext|>", "split_special_tokens": False,
            "tokenizer_class": "TokenizersBackend", "unk_token": None}


def _attention_shapes(c: dict[str, Any], prefix: str, qwen35: bool) -> dict[str, tuple[int, ...]]:
    h, hd = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    p = f"{prefix}.self_attn"
    shapes = {f"{p}.q_proj.weight": (nh * hd * (2 if qwen35 else 1), h), f"{p}.k_proj.weight": (nkv * hd, h),
              f"{p}.v_proj.weight": (nkv * hd, h), f"{p}.o_proj.weight": (h, nh * hd)}
    if c["model_type"] == "qwen2":
        shapes.update({f"{p}.q_proj.bias": (nh * hd,), f"{p}.k_proj.bias": (nkv * hd,),
                       f"{p}.v_proj.bias": (nkv * hd,)})
    else:
        shapes.update({f"{p}.q_norm.weight": (hd,), f"{p}.k_norm.weight": (hd,)})
    return shapes


def _linear_attention_shapes(c: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    h, hk, hv = c["hidden_size"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv = 2 * hk * dk + hv * dv
    p = f"{prefix}.linear_attn"
    return {f"{p}.in_proj_qkv.weight": (conv, h), f"{p}.in_proj_z.weight": (hv * dv, h),
            f"{p}.in_proj_a.weight": (hv, h), f"{p}.in_proj_b.weight": (hv, h),
            f"{p}.conv1d.weight": (conv, 1, c["linear_conv_kernel_dim"]), f"{p}.A_log": (hv,),
            f"{p}.dt_bias": (hv,), f"{p}.norm.weight": (dv,), f"{p}.out_proj.weight": (h, hv * dv)}


def tensor_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Qwen2 / Qwen3 / Qwen3.5-text checkpoint (``lm_head`` unless tied)."""
    h, ffn = c["hidden_size"], c["intermediate_size"]
    qwen35 = c["model_type"] == "qwen3_5_text"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    if not c.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        linear = qwen35 and c["layer_types"][i] == "linear_attention"
        shapes.update(_linear_attention_shapes(c, prefix) if linear else _attention_shapes(c, prefix, qwen35))
        shapes.update({f"{prefix}.input_layernorm.weight": (h,), f"{prefix}.post_attention_layernorm.weight": (h,),
                       f"{prefix}.mlp.gate_proj.weight": (ffn, h), f"{prefix}.mlp.up_proj.weight": (ffn, h),
                       f"{prefix}.mlp.down_proj.weight": (h, ffn)})
    return shapes


def _keeps_f32(name: str) -> bool:
    return name.endswith(("A_log", "dt_bias"))


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """Float32 -> bf16 bits by truncation (the values are random anyway)."""
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _constant(name: str, qwen35: bool) -> float | None:
    """Norm weights (ones; zeros for Qwen3.5's zero-centred norms) and biases (zeros); None for matrices."""
    if name.endswith(".bias"):
        return 0.0
    if name.endswith("norm.weight"):
        return 0.0 if qwen35 and "linear_attn" not in name else 1.0
    return None


def _chunks(name: str, shape: tuple[int, ...], rng: np.random.Generator, qwen35: bool) -> Iterator[np.ndarray]:
    """The stored values of one tensor (bf16 bits, or float32 for ``_keeps_f32``), flattened, in chunks.

    Matrices draw bf16 values from a table of 65,536 normal(0, STD) samples by random 16-bit index: the same
    distribution as drawing each value, at a fraction of the cost (the checkpoints have up to 750 M values).
    """
    n = int(np.prod(shape))
    if name.endswith("A_log"):
        yield np.log(rng.uniform(1.0, 16.0, n)).astype(np.float32)
    elif name.endswith("dt_bias"):
        yield np.ones(n, np.float32)
    elif (value := _constant(name, qwen35)) is not None:
        yield np.full(n, _to_bf16(np.float32(value)), np.uint16)
    else:
        table = _to_bf16(rng.standard_normal(1 << 16, np.float32) * np.float32(STD))
        for start in range(0, n, CHUNK_ELEMENTS):
            yield table[rng.integers(0, 1 << 16, min(CHUNK_ELEMENTS, n - start), np.uint16)]


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], qwen35: bool, seed: int = 0) -> None:
    """Write a safetensors file tensor by tensor (header first: every size is known from the shapes)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * (4 if _keeps_f32(name) else 2)
        header[name] = {"dtype": "F32" if _keeps_f32(name) else "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, shape in shapes.items():
            for chunk in _chunks(name, shape, rng, qwen35):
                f.write(chunk.tobytes())


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_checkpoint(model: BenchModel, out: Path, tokenizers: Path, configs: Path) -> Path:
    """``out/<name>/``, built unless a complete copy is already there."""
    target = out / model.name
    if (target / COMPLETE).is_file():
        return target
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    tokenizer_file = tokenizers / model.tokenizer / "tokenizer.json"
    shutil.copyfile(tokenizer_file, target / "tokenizer.json")
    if model.config_dir is None and model.tokenizer == "qwen3_5":
        config = WRITTEN_CONFIGS[model.name]()
        _write_json(target / "tokenizer_config.json", qwen35_tokenizer_config(_read_json(tokenizer_file)))
        _write_json(target / "generation_config.json", {"bos_token_id": 248044, "eos_token_id": [248046, 248044]})
    elif model.config_dir is None:  # a Qwen2.5 shape without a published config here: the 0.5B's text files
        config = WRITTEN_CONFIGS[model.name]()
        for name in ("tokenizer_config.json", "generation_config.json"):
            shutil.copyfile(configs / "qwen2.5-0.5b-instruct" / name, target / name)
    else:
        config = _read_json(configs / model.config_dir / "config.json")
        for name in ("tokenizer_config.json", "generation_config.json"):
            shutil.copyfile(configs / model.config_dir / name, target / name)
    _write_json(target / "config.json", config)
    write_safetensors(target / "model.safetensors", tensor_shapes(config), config["model_type"] == "qwen3_5_text")
    (target / COMPLETE).write_text("")
    return target
