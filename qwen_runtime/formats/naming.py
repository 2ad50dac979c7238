"""The one place that maps Hugging Face tensors to canonical GGUF tensors, with llama.cpp's transforms.

Names come from the ``gguf`` package's :class:`TensorNameMap`.  Transforms follow llama.cpp's
``convert_hf_to_gguf.py``; which tensors get them is each architecture's ``transforms`` in
:mod:`qwen_runtime.formats.archs`.  For Qwen3.5 (see docs/qwen-architectures.md §4.4):

* ``A_log`` -> ``ssm_a = -exp(A_log)``;
* ``dt_bias`` -> ``ssm_dt.bias`` (values unchanged);
* ``conv1d.weight`` ``[C, 1, K]`` -> ``[C, K]``;
* ``+1`` on every ``*norm.weight`` except the gated ``linear_attn.norm`` (zero-centred (1 + w) norms);
* optionally, value heads reordered from HF's grouped order to llama.cpp's tiled order (Hv > Hk only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, TensorNameMap, get_tensor_name_map

from ..errors import FormatError
from .archs import NEG_EXP, NO_TRANSFORM, PLUS_ONE, SQUEEZE
from .config import ModelConfig

ARCH_BY_NAME: dict[str, MODEL_ARCH] = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}

# Source tensors that are deliberately not converted, with the reason reported by verify/inspect.
SKIP_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.visual.", "vision tower (text weights only)"),
    ("visual.", "vision tower (text weights only)"),
    ("mtp.", "multi-token-prediction block (not used for decoding)"),
)
SKIP_SUFFIXES: tuple[tuple[str, str], ...] = (("rotary_emb.inv_freq", "recomputed from rope_theta"),)


@dataclass(frozen=True)
class TensorPlan:
    """How one source tensor becomes one canonical tensor."""

    source: str  # HF name in the checkpoint
    name: str  # canonical GGUF name
    transform: str  # one of qwen_runtime.formats.archs' transforms (NO_TRANSFORM, NEG_EXP, SQUEEZE, PLUS_ONE)
    v_axis: int | None = None  # axis holding value heads to reorder, if any
    v_offset: int = 0  # first row/column of the value part along v_axis
    v_unit: int = 1  # rows per value head along v_axis (dv, or 1 for per-head scalars)


@lru_cache(maxsize=16)
def name_map(arch: str, n_layers: int) -> TensorNameMap:
    return get_tensor_name_map(ARCH_BY_NAME[arch], n_layers)


def skip_reason(hf_name: str, config: ModelConfig) -> str | None:
    """Why a source tensor is not converted, or None when it is."""
    for prefix, reason in SKIP_PREFIXES:
        if hf_name.startswith(prefix):
            return reason
    for suffix, reason in SKIP_SUFFIXES:
        if hf_name.endswith(suffix):
            return reason
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return "tied to the token embedding"
    return None


def _hf_key(hf_name: str) -> str:
    """The HF name as TensorNameMap knows it (text model prefix, dt_bias renamed as llama.cpp does)."""
    name = hf_name.replace("model.language_model.", "model.", 1)
    if name.endswith(".linear_attn.dt_bias"):
        name = name[: -len("dt_bias")] + "dt_proj.bias"
    return name


def plan_tensor(hf_name: str, shape: tuple[int, ...], config: ModelConfig, tiled_v_heads: bool = False) -> TensorPlan:
    """The canonical name and transform for a source tensor (raises FormatError when unknown); ``tiled_v_heads``:
    reorder Qwen3.5's value heads as llama.cpp's converter does (:func:`tile_v_heads`)."""
    key = _hf_key(hf_name)
    name = name_map(config.arch, config.num_hidden_layers).get_name(key, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise FormatError(f"tensor {hf_name!r} has no GGUF mapping for architecture {config.arch}")
    transform = config.spec.transform(key)
    if transform == SQUEEZE and len(shape) != 3:
        transform = NO_TRANSFORM
    plan = TensorPlan(hf_name, name, transform)
    if tiled_v_heads and config.has_linear_attention:
        plan = _with_v_reorder(plan, key, config)
    return plan


def _with_v_reorder(plan: TensorPlan, key: str, config: ModelConfig) -> TensorPlan:
    """Attach the value-head reordering of llama.cpp's converter to the tensors it touches."""
    if config.linear_num_value_heads == config.linear_num_key_heads:
        return plan
    dv, key_dim = config.linear_value_head_dim, config.linear_key_dim
    spec = {
        ".linear_attn.in_proj_qkv.weight": (0, 2 * key_dim, dv),
        ".linear_attn.conv1d.weight": (0, 2 * key_dim, dv),
        ".linear_attn.in_proj_z.weight": (0, 0, dv),
        ".linear_attn.in_proj_a.weight": (0, 0, 1),
        ".linear_attn.in_proj_b.weight": (0, 0, 1),
        ".linear_attn.A_log": (0, 0, 1),
        ".linear_attn.dt_proj.bias": (0, 0, 1),
        ".linear_attn.out_proj.weight": (1, 0, dv),
    }
    for suffix, (axis, offset, unit) in spec.items():
        if key.endswith(suffix):
            return TensorPlan(plan.source, plan.name, plan.transform, axis, offset, unit)
    return plan


def tile_v_heads(x: np.ndarray, plan: TensorPlan, n_key_heads: int, n_value_heads: int,
                 inverse: bool = False) -> np.ndarray:
    """Reorder value heads along ``plan.v_axis``: grouped (k0v0,k0v1,..) <-> tiled (k0v0,k1v0,..)."""
    if plan.v_axis is None:
        return x
    ratio = n_value_heads // n_key_heads
    moved = np.moveaxis(x, plan.v_axis, 0)
    head, vpart = moved[: plan.v_offset], moved[plan.v_offset:]
    rest = vpart.shape[1:]
    grouped = (n_key_heads, ratio) if not inverse else (ratio, n_key_heads)
    heads = vpart.reshape(*grouped, plan.v_unit, *rest).swapaxes(0, 1).reshape(vpart.shape)
    return np.moveaxis(np.concatenate([head, heads], axis=0), 0, plan.v_axis)


TRANSFORMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    NO_TRANSFORM: lambda x: x,
    NEG_EXP: lambda x: -np.exp(x.astype(np.float32)),
    SQUEEZE: lambda x: x.reshape(x.shape[0], x.shape[-1]),
    PLUS_ONE: lambda x: x.astype(np.float32) + np.float32(1.0),
}
INVERSE_TRANSFORMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    NO_TRANSFORM: lambda x: x,
    NEG_EXP: lambda x: np.log(-x.astype(np.float64)).astype(np.float32),
    SQUEEZE: lambda x: x.reshape(x.shape[0], 1, x.shape[-1]),
    PLUS_ONE: lambda x: x.astype(np.float32) - np.float32(1.0),
}
TRANSFORM_NOTES = {
    NEG_EXP: "A_log -> -exp(A_log)",
    SQUEEZE: "conv1d [C,1,K] -> [C,K]",
    PLUS_ONE: "(1 + w) norm baked to w + 1",
}


def output_shape(plan: TensorPlan, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], shape[-1]) if plan.transform == SQUEEZE else shape


def tensor_name(kind: MODEL_TENSOR, layer: int | None = None, suffix: str = ".weight") -> str:
    """Canonical name of a tensor kind, e.g. ``tensor_name(MODEL_TENSOR.ATTN_Q, 3)`` -> ``blk.3.attn_q.weight``."""
    return TENSOR_NAMES[kind].format(bid=layer) + suffix


def expected_tensors(config: ModelConfig, tied: bool) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor a model of ``config`` must have, with its numpy shape."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {
        tensor_name(MODEL_TENSOR.TOKEN_EMBD): (c.vocab_size, c.hidden_size),
        tensor_name(MODEL_TENSOR.OUTPUT_NORM): (c.hidden_size,),
    }
    if not tied:
        shapes[tensor_name(MODEL_TENSOR.OUTPUT)] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        shapes |= {
            tensor_name(MODEL_TENSOR.ATTN_NORM, i): (c.hidden_size,),
            tensor_name(c.spec.mlp_norm, i): (c.hidden_size,),
            tensor_name(MODEL_TENSOR.FFN_GATE, i): (c.intermediate_size, c.hidden_size),
            tensor_name(MODEL_TENSOR.FFN_UP, i): (c.intermediate_size, c.hidden_size),
            tensor_name(MODEL_TENSOR.FFN_DOWN, i): (c.hidden_size, c.intermediate_size),
        }
        shapes |= _linear_shapes(c, i) if c.is_linear(i) else _attention_shapes(c, i)
    return shapes


def _attention_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    q_rows = c.num_attention_heads * c.head_dim * (2 if c.spec.gated_attention else 1)
    kv_rows = c.num_key_value_heads * c.head_dim
    shapes = {
        tensor_name(MODEL_TENSOR.ATTN_Q, i): (q_rows, c.hidden_size),
        tensor_name(MODEL_TENSOR.ATTN_K, i): (kv_rows, c.hidden_size),
        tensor_name(MODEL_TENSOR.ATTN_V, i): (kv_rows, c.hidden_size),
        tensor_name(MODEL_TENSOR.ATTN_OUT, i): (c.hidden_size, c.num_attention_heads * c.head_dim),
    }
    if c.spec.attention_bias:
        shapes |= {tensor_name(MODEL_TENSOR.ATTN_Q, i, ".bias"): (q_rows,),
                   tensor_name(MODEL_TENSOR.ATTN_K, i, ".bias"): (kv_rows,),
                   tensor_name(MODEL_TENSOR.ATTN_V, i, ".bias"): (kv_rows,)}
    if c.spec.qk_norm:
        shapes |= {tensor_name(MODEL_TENSOR.ATTN_Q_NORM, i): (c.head_dim,),
                   tensor_name(MODEL_TENSOR.ATTN_K_NORM, i): (c.head_dim,)}
    return shapes


def _linear_shapes(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    hv = c.linear_num_value_heads
    return {
        tensor_name(MODEL_TENSOR.ATTN_QKV, i): (c.linear_conv_dim, c.hidden_size),
        tensor_name(MODEL_TENSOR.ATTN_GATE, i): (c.linear_value_dim, c.hidden_size),
        tensor_name(MODEL_TENSOR.SSM_BETA, i): (hv, c.hidden_size),
        tensor_name(MODEL_TENSOR.SSM_ALPHA, i): (hv, c.hidden_size),
        tensor_name(MODEL_TENSOR.SSM_CONV1D, i): (c.linear_conv_dim, c.linear_conv_kernel_dim),
        tensor_name(MODEL_TENSOR.SSM_DT, i, ".bias"): (hv,),
        tensor_name(MODEL_TENSOR.SSM_A, i, ""): (hv,),
        tensor_name(MODEL_TENSOR.SSM_NORM, i): (c.linear_value_head_dim,),
        tensor_name(MODEL_TENSOR.SSM_OUT, i): (c.hidden_size, c.linear_value_dim),
    }


def check_tensor_set(config: ModelConfig, tensors: dict, source: str) -> bool:
    """Check names and shapes against the architecture; return whether embeddings are tied."""
    tied = tensor_name(MODEL_TENSOR.OUTPUT) not in tensors
    expected = expected_tensors(config, tied)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise FormatError(f"{source}: tensor {missing[0]!r} is missing "
                          f"({len(missing)} missing in all) for a {config.arch} model of this config")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise FormatError(f"{source}: unexpected tensor {extra[0]!r} for a {config.arch} model of this config")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise FormatError(f"{source}: tensor {name!r} has shape {list(tensors[name].shape)}, "
                              f"expected {list(shape)}")
    return tied
