"""Synthetic HF checkpoints for converter tests, written with numpy alone (no torch, no safetensors package).

``write_qwen2(directory, ...)`` makes a random-weight bf16 Qwen2 checkpoint of any size (tensors are slices
of one random pool, generated once, so even a 1.5 GB model is quick to write), with the tokenizer files of
the ``qwen2-tiny`` fixture.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ALL_FIXTURES = ("qwen2-tiny", "deepseek-tiny", "qwen3-tiny", "qwen35-tiny", "qwen35-tiny-gqa", "qwen35-vl-tiny")
SAFETENSORS_DTYPES = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16"}


def fixture(name: str) -> Path:
    """Path of a fixture model directory (the test is skipped when it has not been generated)."""
    path = FIXTURES / name
    if not (path / "config.json").is_file():
        pytest.skip(f"fixture {name} not generated yet (scripts/make_fixtures.py)")
    return path


def bf16_pool(n: int, seed: int = 0) -> np.ndarray:
    """``n`` bfloat16 bit patterns (``uint16``) of N(0, 0.02) values."""
    x = (np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(0.02))
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], data: Callable[[str, int], np.ndarray],
                      dtype: str = "BF16") -> None:
    """A safetensors file of ``shapes``; ``data(name, n_elements)`` gives each tensor's 2-byte elements."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in shapes.items():
            f.write(np.ascontiguousarray(data(name, int(np.prod(shape)))).tobytes())


def qwen2_config(layers: int, hidden: int, inter: int, vocab: int, heads: int, kv_heads: int) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
            "bos_token_id": 480, "eos_token_id": 482, "torch_dtype": "bfloat16"}


def qwen2_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                   p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                   p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (i, h),
                   p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)}
    return shapes


def write_qwen2(directory: Path, layers: int = 2, hidden: int = 64, inter: int = 128, vocab: int = 512,
                heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Path:
    """A random bf16 Qwen2 checkpoint in ``directory`` (created) with the qwen2-tiny tokenizer files."""
    tokenizer_dir = fixture("qwen2-tiny")
    directory.mkdir(parents=True, exist_ok=True)
    config = qwen2_config(layers, hidden, inter, vocab, heads, kv_heads)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shapes = qwen2_shapes(config)
    pool = bf16_pool(max(int(np.prod(s)) for s in shapes.values()), seed)
    write_safetensors(directory / "model.safetensors", shapes, lambda name, n: pool[:n])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, directory / name)
    return directory


def read_header(path: Path) -> tuple[dict, int]:
    """(header JSON, header length) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), n


def rewrite_header(path: Path, header: dict) -> None:
    """Replace a safetensors header, keeping the data bytes."""
    old, n = read_header(path)
    data = path.read_bytes()[8 + n:]
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def drop_tensor(path: Path, name: str) -> None:
    """Rewrite a BF16/F16 safetensors file without tensor ``name`` (the other tensors keep their bytes)."""
    header, n = read_header(path)
    data = path.read_bytes()[8 + n:]
    del header[name]
    shapes = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    spans = {k: header[k]["data_offsets"] for k in shapes}
    write_safetensors(path, shapes, lambda k, _: np.frombuffer(data[spans[k][0]:spans[k][1]], np.uint16))
