"""What differs between the supported architectures, one :class:`ArchSpec` each (docs/qwen-architectures.md §1).

Everything else (the converter, the readers, the models, verification) asks the spec instead of testing the
architecture's name.  Names are the GGUF architecture names of the ``gguf`` package (``MODEL_ARCH_NAMES``);
the GGUF metadata keys of each architecture are in :mod:`qwen_runtime.formats.gguf_keys`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR

QWEN2 = MODEL_ARCH_NAMES[MODEL_ARCH.QWEN2]
QWEN3 = MODEL_ARCH_NAMES[MODEL_ARCH.QWEN3]
QWEN35 = MODEL_ARCH_NAMES[MODEL_ARCH.QWEN35]

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# tokenizer.ggml.pre values: llama.cpp's names of the pre-tokenizer splits (llama-vocab.cpp).
PRE_QWEN2, PRE_DEEPSEEK_R1_QWEN, PRE_QWEN35, PRE_GPT2 = "qwen2", "deepseek-r1-qwen", "qwen35", "gpt-2"
DEEPSEEK_BOS = "<｜begin▁of▁sentence｜>"

# Tensor transforms of the converter (applied in qwen_runtime.formats.naming, undone by verify).
NO_TRANSFORM, NEG_EXP, SQUEEZE, PLUS_ONE = "", "neg_exp", "squeeze", "plus_one"
VALUE_TRANSFORMS = (NEG_EXP, PLUS_ONE)  # those that change values (SQUEEZE only changes the shape)


@dataclass(frozen=True)
class ArchSpec:
    """The facts of one architecture that code elsewhere would otherwise test the name for."""

    name: str  # GGUF architecture name
    hf_architectures: tuple[str, ...]  # config.json ``architectures`` entries
    hf_model_types: tuple[str, ...]  # config.json ``model_type`` values (used when ``architectures`` is absent)
    attention_bias: bool  # q/k/v projections carry biases
    qk_norm: bool  # per-head RMSNorm on queries and keys
    gated_attention: bool  # attn_q holds a sigmoid output gate beside each query head (twice the rows)
    hybrid: bool  # Gated DeltaNet layers between the full-attention ones (``layer_types``)
    mlp_norm: MODEL_TENSOR  # the block's second norm, in llama.cpp's naming
    partial_rotary_factor: float  # rotary share of the head dim when config.json does not say
    # Converter transforms: (HF name suffix, transform), the first suffix that matches wins.
    transforms: tuple[tuple[str, str], ...] = ()
    # tokenizer.ggml.pre: the architecture's preference among the names of the split its tokenizer.json uses
    # (qwen_convert.gguf_metadata.gguf_pre_tokenizer decides by the split itself): the default, and
    # (BOS token text, pre-type) for tokenizers recognised by their BOS.
    tokenizer_pre: str = PRE_QWEN2
    tokenizer_pre_by_bos: tuple[tuple[str, str], ...] = ()

    def transform(self, hf_key: str) -> str:
        """The converter's transform of the tensor named ``hf_key`` (:data:`NO_TRANSFORM` when none)."""
        return next((t for suffix, t in self.transforms if hf_key.endswith(suffix)), NO_TRANSFORM)

    def pre_tokenizer(self, bos_token: str | None) -> str:
        """``tokenizer.ggml.pre`` of a model of this architecture whose BOS token is ``bos_token``."""
        return dict(self.tokenizer_pre_by_bos).get(bos_token or "", self.tokenizer_pre)


ARCHS: dict[str, ArchSpec] = {
    QWEN2: ArchSpec(
        QWEN2, hf_architectures=("Qwen2ForCausalLM",), hf_model_types=("qwen2",), attention_bias=True,
        qk_norm=False, gated_attention=False, hybrid=False, mlp_norm=MODEL_TENSOR.FFN_NORM,
        partial_rotary_factor=1.0, tokenizer_pre_by_bos=((DEEPSEEK_BOS, PRE_DEEPSEEK_R1_QWEN),)),
    QWEN3: ArchSpec(
        QWEN3, hf_architectures=("Qwen3ForCausalLM",), hf_model_types=("qwen3",), attention_bias=False,
        qk_norm=True, gated_attention=False, hybrid=False, mlp_norm=MODEL_TENSOR.FFN_NORM,
        partial_rotary_factor=1.0),
    QWEN35: ArchSpec(
        QWEN35, hf_architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
        hf_model_types=("qwen3_5", "qwen3_5_text"), attention_bias=False, qk_norm=True, gated_attention=True,
        hybrid=True, mlp_norm=MODEL_TENSOR.ATTN_POST_NORM, partial_rotary_factor=0.25,
        # (1 + w) RMSNorms get their +1 baked in, except the gated norm of linear attention, a plain w norm.
        transforms=((".linear_attn.norm.weight", NO_TRANSFORM), (".A_log", NEG_EXP), (".conv1d.weight", SQUEEZE),
                    ("norm.weight", PLUS_ONE)),
        tokenizer_pre=PRE_QWEN35),
}
SUPPORTED_ARCHS = tuple(ARCHS)


def layer_types_from_interval(layers: int, interval: int) -> tuple[str, ...]:
    """Qwen3.5's layer pattern: every ``interval``-th layer full attention, the others linear attention."""
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers))
