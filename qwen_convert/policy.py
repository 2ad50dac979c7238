"""Which GGML type each canonical tensor is stored as, per output dtype (docs/qwen-architectures.md §4.6).

Two kinds of ``--dtype``:

* **Converter dtypes** (fp32, fp16, q8_0) follow llama.cpp's converter (``prepare_tensors``): F32 for tensors
  of at most one dimension, for names ending in ``_norm.weight``, for names not ending in ``.weight``
  (``ssm_a``, biases) and for ``ssm_conv1d``; every other tensor (embedding and output included) gets the output
  type.  A quantized tensor whose row length is not a multiple of its block falls back to F16, with a logged
  note.  This is also what ``llama-quantize`` writes for these types (its Q8_0 bumps nothing).
* **llama.cpp's mixes** (q4_0 ... iq4_xs, :data:`MIXES`) follow ``llama-quantize``'s ``llama_tensor_get_type``
  (src/llama-quant.cpp of llama.cpp as vendored in llama-cpp-python 0.3.36) for dense Qwen2, Qwen3 and Qwen3.5
  models: the same tensors stay unquantized; the output (and a tied token embedding) is Q6_K (the legacy
  Q4_0..Q5_1 mixes included), or Q8_0 when its row length is not a multiple of the mix's block; ``attn_v``
  (and Qwen3.5's ``attn_qkv``, which llama.cpp counts with them), ``ffn_down`` and (iq3_xs) ``ffn_up`` and
  ``ffn_gate`` get the per-layer bumps of each mix's table; ``attn_output``, ``attn_k`` and ``attn_q`` their fixed
  types; a type whose block does not divide the row length falls
  back to llama.cpp's 32-value twin (F16 when that does not fit either).  :class:`QuantOptions` adds
  ``--pure``, ``--tensor-type``, ``--output-tensor-type`` and ``--token-embedding-type`` with llama-quantize's
  precedence.

llama.cpp counts attn_v, ffn_down, ffn_up and ffn_gate tensors in its own order (token embedding and output
first, then layer by layer) and only for tensors its mix logic sees: a tensor given its type by ``--tensor-type``
is not counted, which shifts the later layers' bumps; :func:`plan_types` does the same.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from gguf import GGML_QUANT_SIZES, MODEL_TENSOR, TENSOR_NAMES, LlamaFileType

from qwen_runtime.errors import QwenError, UsageError
from qwen_runtime.formats.config import ModelConfig
from qwen_runtime.formats.tensors import QType, stored_nbytes

logger = logging.getLogger(__name__)

# Converter dtypes: --dtype -> (GGML type of the big matrices, general.file_type).
CONVERTER_DTYPES: dict[str, tuple[QType, LlamaFileType]] = {
    "fp32": (QType.F32, LlamaFileType.ALL_F32),
    "fp16": (QType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (QType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
# Types --tensor-type, --output-tensor-type and --token-embedding-type may name: the ones the converter writes.
OVERRIDE_TYPES = (QType.F32, QType.F16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q2_K,
                  QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS, QType.TQ1_0, QType.TQ2_0,
                  QType.IQ3_XXS, QType.IQ3_S, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ1_S, QType.IQ1_M)
# llama.cpp's tensor_type_fallback: a 256-value type whose block does not divide the row length -> its twin.
FALLBACKS = {QType.Q2_K: QType.Q4_0, QType.Q3_K: QType.Q4_0, QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1,
             QType.Q6_K: QType.Q8_0, QType.TQ1_0: QType.Q4_0, QType.TQ2_0: QType.Q4_0,
             **dict.fromkeys((QType.IQ1_S, QType.IQ1_M, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS,
                              QType.IQ3_S, QType.IQ4_XS), QType.IQ4_NL)}
# llama.cpp's tensor_requires_imatrix: tensors (other than token_embd and output) stored in these types need an
# importance matrix, and Q2_K ones of a q2_k_s file; llama-quantize refuses to write them without one.
IMATRIX_TYPES = frozenset({QType.IQ1_S, QType.IQ1_M, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS})
# Types llama.cpp's quantizer cannot encode without importance weights at all (it asserts them), whatever the
# tensor: token_embd and output stored so need a vector too.
WEIGHTS_REQUIRED = frozenset({QType.IQ1_S, QType.IQ2_XXS, QType.IQ2_XS})
# Tensor kinds llama.cpp always keeps in F32 whatever their shape (the ones Qwen models have).
F32_KINDS = frozenset(TENSOR_NAMES[kind] for kind in (MODEL_TENSOR.SSM_CONV1D,))
_LAYER = re.compile(r"^blk\.\d+\.")


def _weight(kind: MODEL_TENSOR) -> str:
    """``attn_v.weight`` for ``blk.{bid}.attn_v``: the suffix llama.cpp's categories look for."""
    return TENSOR_NAMES[kind].removeprefix("blk.{bid}.") + ".weight"


OUTPUT_NAME = _weight(MODEL_TENSOR.OUTPUT)
TOKEN_EMBD_NAME = _weight(MODEL_TENSOR.TOKEN_EMBD)


class Category(Enum):
    """llama.cpp's tensor_category (the ones dense Qwen models have)."""

    TOKEN_EMBD = "token_embd"
    OUTPUT = "output"
    ATTN_V = "attn_v"  # attn_v and attn_qkv: "more sensitive to quantization"
    ATTN_K = "attn_k"
    ATTN_Q = "attn_q"
    ATTN_OUTPUT = "attn_output"
    FFN_UP = "ffn_up"
    FFN_GATE = "ffn_gate"
    FFN_DOWN = "ffn_down"
    OTHER = "other"


# In llama.cpp's test order: the first contained substring decides.
_CATEGORY_SUBSTRINGS = (
    (_weight(MODEL_TENSOR.ATTN_QKV), Category.ATTN_V),
    (_weight(MODEL_TENSOR.ATTN_V), Category.ATTN_V),
    (_weight(MODEL_TENSOR.ATTN_K), Category.ATTN_K),
    (_weight(MODEL_TENSOR.ATTN_Q), Category.ATTN_Q),
    (_weight(MODEL_TENSOR.ATTN_OUT), Category.ATTN_OUTPUT),
    (TENSOR_NAMES[MODEL_TENSOR.FFN_UP].removeprefix("blk.{bid}."), Category.FFN_UP),
    (TENSOR_NAMES[MODEL_TENSOR.FFN_GATE].removeprefix("blk.{bid}."), Category.FFN_GATE),
    (TENSOR_NAMES[MODEL_TENSOR.FFN_DOWN].removeprefix("blk.{bid}."), Category.FFN_DOWN),
)


def tensor_category(name: str) -> Category:
    if name == OUTPUT_NAME:
        return Category.OUTPUT
    if name == TOKEN_EMBD_NAME:
        return Category.TOKEN_EMBD
    return next((category for part, category in _CATEGORY_SUBSTRINGS if part in name), Category.OTHER)


# ------------------------------------------------------------------------------------------------ mixes

@dataclass(frozen=True)
class ModelFacts:
    """What llama.cpp's type choice reads of the model besides tensor names and shapes."""

    n_layer: int  # block count (llama.cpp's n_ffn_down)
    n_gqa: int  # attention heads // key-value heads (0 without kv heads)

    @classmethod
    def from_config(cls, config: ModelConfig) -> ModelFacts:
        kv = config.num_key_value_heads
        return cls(config.num_hidden_layers, config.num_attention_heads // kv if kv else 0)


@dataclass(frozen=True)
class RuleInput:
    """Where a bumped tensor sits: its index among the tensors of its category llama.cpp has counted so far,
    their number, and the model facts."""

    i: int
    n: int
    facts: ModelFacts
    imatrix: bool


Rule = Callable[[RuleInput], "QType | None"]  # the bumped type, or None to keep the mix's base type


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def more_bits(qtype: QType) -> Rule:
    return lambda r: qtype if use_more_bits(r.i, r.n) else None


def first(count: int, qtype: QType, rest: QType | None = None) -> Rule:
    """``qtype`` for the first ``count`` tensors counted, ``rest`` after."""
    return lambda r: qtype if r.i < count else rest


def first_part(divisor: int, qtype: QType, rest: QType | None = None) -> Rule:
    """``qtype`` for the first ``n // divisor`` tensors counted, ``rest`` after."""
    return lambda r: qtype if r.i < r.n // divisor else rest


def always(qtype: QType) -> Rule:
    return lambda r: qtype


def gqa_at_least(groups: int, qtype: QType, rest: QType | None = None) -> Rule:
    """``qtype`` when at least ``groups`` query heads share a key-value head, else ``rest``."""
    return lambda r: qtype if r.facts.n_gqa >= groups else rest


def without_imatrix(rule: Rule) -> Rule:
    """``rule`` only when no importance matrix is used."""
    return lambda r: None if r.imatrix else rule(r)


def with_imatrix(rule: Rule) -> Rule:
    """``rule`` only when an importance matrix is used."""
    return lambda r: rule(r) if r.imatrix else None


def middle(qtype: QType) -> Rule:
    """``qtype`` for the tensors counted between the first and the last eighth of the layers."""
    return lambda r: qtype if r.n // 8 <= r.i < 7 * r.n // 8 else None


def first_of(*rules: Rule) -> Rule:
    """The type of the first of ``rules`` that gives one (llama.cpp's chain of ``else if``)."""
    return lambda r: next((q for q in (rule(r) for rule in rules) if q is not None), None)


@dataclass(frozen=True)
class Mix:
    """One of llama-quantize's file types: its base type, ``general.file_type`` and per-category bumps."""

    base: QType
    file_type: LlamaFileType
    attn_v: Rule | None = None
    ffn_down: Rule | None = None
    ffn_up_gate: Rule | None = None  # ffn_up and ffn_gate, each counted on its own
    attn_output: QType | None = None
    attn_k: QType | None = None
    attn_q: QType | None = None
    token_embd: QType | None = None  # an untied token embedding's type (default: the base type)
    output: QType = QType.Q6_K  # output.weight's (and a tied embedding's) where the base type's block fits

    def rule(self, category: Category) -> Rule | None:
        """The per-layer rule of a counted category."""
        return {Category.ATTN_V: self.attn_v, Category.FFN_DOWN: self.ffn_down, Category.FFN_UP: self.ffn_up_gate,
                Category.FFN_GATE: self.ffn_up_gate}[category]


_IQ4_V, _IQ4_DOWN = gqa_at_least(4, QType.Q5_K), without_imatrix(first_part(8, QType.Q5_K))
_IQ1_BUMPS = {"attn_v": gqa_at_least(4, QType.Q4_K, QType.Q2_K), "ffn_down": first_part(8, QType.Q2_K),
              "attn_output": QType.IQ2_XXS, "token_embd": QType.Q2_K, "output": QType.Q5_K}
_IQ2_S_BUMPS = {"attn_v": gqa_at_least(4, QType.Q4_K, QType.IQ3_S), "ffn_down": first_part(8, QType.IQ3_S),
                "attn_output": QType.IQ3_S, "token_embd": QType.IQ3_S, "output": QType.Q5_K}
MIXES: dict[str, Mix] = {
    # "Guard against craziness in the first few ffn_down layers" (llama.cpp), with an importance matrix only.
    "q4_0": Mix(QType.Q4_0, LlamaFileType.MOSTLY_Q4_0, ffn_down=with_imatrix(first_part(8, QType.Q4_1))),
    "q4_1": Mix(QType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q5_0": Mix(QType.Q5_0, LlamaFileType.MOSTLY_Q5_0, ffn_down=with_imatrix(first_part(8, QType.Q5_1))),
    "q5_1": Mix(QType.Q5_1, LlamaFileType.MOSTLY_Q5_1),
    "q2_k_s": Mix(QType.Q2_K, LlamaFileType.MOSTLY_Q2_K_S, attn_v=gqa_at_least(4, QType.Q4_K),
                  ffn_down=first_part(8, QType.Q4_K)),
    "q2_k": Mix(QType.Q2_K, LlamaFileType.MOSTLY_Q2_K, attn_v=gqa_at_least(4, QType.Q4_K, QType.Q3_K),
                ffn_down=always(QType.Q3_K), attn_output=QType.Q3_K),
    "q3_k_s": Mix(QType.Q3_K, LlamaFileType.MOSTLY_Q3_K_S),
    "q3_k_m": Mix(QType.Q3_K, LlamaFileType.MOSTLY_Q3_K_M, attn_v=first(2, QType.Q5_K, QType.Q4_K),
                  ffn_down=first_part(16, QType.Q5_K, QType.Q4_K), attn_output=QType.Q4_K),
    "q3_k_l": Mix(QType.Q3_K, LlamaFileType.MOSTLY_Q3_K_L, attn_v=always(QType.Q5_K), ffn_down=always(QType.Q5_K),
                  attn_output=QType.Q5_K),
    "q4_k_s": Mix(QType.Q4_K, LlamaFileType.MOSTLY_Q4_K_S, attn_v=first(4, QType.Q5_K),
                  ffn_down=first_part(8, QType.Q5_K)),
    "q4_k_m": Mix(QType.Q4_K, LlamaFileType.MOSTLY_Q4_K_M, attn_v=more_bits(QType.Q6_K),
                  ffn_down=more_bits(QType.Q6_K)),
    "q5_k_s": Mix(QType.Q5_K, LlamaFileType.MOSTLY_Q5_K_S),
    "q5_k_m": Mix(QType.Q5_K, LlamaFileType.MOSTLY_Q5_K_M, attn_v=more_bits(QType.Q6_K),
                  ffn_down=more_bits(QType.Q6_K)),
    "q6_k": Mix(QType.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "iq4_nl": Mix(QType.IQ4_NL, LlamaFileType.MOSTLY_IQ4_NL, attn_v=_IQ4_V, ffn_down=_IQ4_DOWN),
    "iq4_xs": Mix(QType.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS, attn_v=_IQ4_V, ffn_down=_IQ4_DOWN),
    # the 2-bit i-quant mixes keep the sensitive tensors in K-quants ("first branch" of llama.cpp's rules)
    "iq2_xxs": Mix(QType.IQ2_XXS, LlamaFileType.MOSTLY_IQ2_XXS, attn_v=gqa_at_least(4, QType.Q4_K, QType.Q2_K),
                   ffn_down=first_part(8, QType.Q2_K), token_embd=QType.Q2_K, output=QType.Q5_K),
    "iq2_xs": Mix(QType.IQ2_XS, LlamaFileType.MOSTLY_IQ2_XS, attn_v=gqa_at_least(4, QType.Q4_K, QType.Q2_K),
                  ffn_down=first_part(8, QType.Q2_K), token_embd=QType.Q2_K, output=QType.Q5_K),
    # iq1_s, iq1_m: as iq2_xxs, with IQ2_XXS attn_output
    "iq1_s": Mix(QType.IQ1_S, LlamaFileType.MOSTLY_IQ1_S, **_IQ1_BUMPS),
    "iq1_m": Mix(QType.IQ1_M, LlamaFileType.MOSTLY_IQ1_M, **_IQ1_BUMPS),
    # iq2_s is IQ2_XS with IQ3_S where iq2_xs has Q2_K, and IQ3_S attn_output; iq2_m the same on IQ2_S
    "iq2_s": Mix(QType.IQ2_XS, LlamaFileType.MOSTLY_IQ2_S, **_IQ2_S_BUMPS),
    "iq2_m": Mix(QType.IQ2_S, LlamaFileType.MOSTLY_IQ2_M, **_IQ2_S_BUMPS),
    # the 3-bit i-quant mixes: attn_v Q4_K at 4+ query groups; iq3_xxs without an importance matrix (a file
    # llama.cpp writes only where IQ3_XXS falls back) keeps the K-quant bumps of ffn_down
    "iq3_xxs": Mix(QType.IQ3_XXS, LlamaFileType.MOSTLY_IQ3_XXS,
                   attn_v=first_of(gqa_at_least(4, QType.Q4_K), without_imatrix(always(QType.IQ3_S))),
                   ffn_down=without_imatrix(first_part(8, QType.Q4_K, QType.Q3_K)), attn_output=QType.IQ3_S,
                   attn_k=QType.IQ2_S, attn_q=QType.IQ2_S, token_embd=QType.IQ3_S, output=QType.Q5_K),
    "iq3_xs": Mix(QType.IQ3_S, LlamaFileType.MOSTLY_IQ3_XS, attn_v=gqa_at_least(4, QType.Q4_K),
                  ffn_up_gate=middle(QType.IQ3_XXS), attn_k=QType.IQ3_XXS, attn_q=QType.IQ3_XXS),
    "iq3_s": Mix(QType.IQ3_S, LlamaFileType.MOSTLY_IQ3_S, attn_v=gqa_at_least(4, QType.Q4_K)),
    "iq3_m": Mix(QType.IQ3_S, LlamaFileType.MOSTLY_IQ3_M, attn_v=always(QType.Q4_K),
                 ffn_down=first_part(8, QType.Q4_K), attn_output=QType.Q4_K),
    "tq1_0": Mix(QType.TQ1_0, LlamaFileType.MOSTLY_TQ1_0, token_embd=QType.Q4_K),
    "tq2_0": Mix(QType.TQ2_0, LlamaFileType.MOSTLY_TQ2_0, token_embd=QType.Q4_K),
}
# Every --dtype: -> (base GGML type, general.file_type).
DTYPES: dict[str, tuple[QType, LlamaFileType]] = {
    **CONVERTER_DTYPES, **{name: (mix.base, mix.file_type) for name, mix in MIXES.items()}}
# The one table of spellings: every name --dtype and the type options take besides ours and the GGML type names
# (all in any case), so that llama.cpp's and numpy's names work wherever a type is named.
ALIASES: dict[str, QType] = {"f32": QType.F32, "fp32": QType.F32, "float32": QType.F32,
                             "f16": QType.F16, "fp16": QType.F16, "float16": QType.F16, "half": QType.F16}
# Named types this converter does not write: refused with what to use instead.
UNWRITABLE = {"bf16": "this converter does not write BF16; f32 keeps bf16 weights exactly, f16 in half the size",
              "bfloat16": "this converter does not write BF16; f32 keeps bf16 weights exactly, f16 in half the size"}


@dataclass(frozen=True)
class QuantOptions:
    """llama-quantize's per-tensor options: ``--pure``, ``--tensor-type REGEX=TYPE`` (first match wins, in the
    order given), ``--output-tensor-type``, ``--token-embedding-type``, and whether an imatrix is used."""

    pure: bool = False
    tensor_types: tuple[tuple[str, QType], ...] = ()
    output_type: QType | None = None
    token_embedding_type: QType | None = None
    imatrix: bool = False
    _patterns: tuple[tuple[re.Pattern[str], QType], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        compiled = []
        for pattern, qtype in self.tensor_types:
            try:
                compiled.append((re.compile(pattern.lower()), qtype))
            except re.error as exc:
                raise UsageError(f"--tensor-type {pattern!r}: not a regular expression ({exc})") from None
        object.__setattr__(self, "_patterns", tuple(compiled))

    def manual_type(self, name: str) -> QType | None:
        """The type of the first ``--tensor-type`` pattern found in ``name``, if any."""
        return next((qtype for pattern, qtype in self._patterns if pattern.search(name)), None)

    @property
    def default(self) -> bool:
        return not (self.pure or self.tensor_types or self.output_type or self.token_embedding_type)


def parse_type(text: str, what: str) -> QType:
    """A GGML type named case-insensitively (``q4_K``, ``Q8_0``, ``f16``, ``fp16``: :data:`ALIASES`), one of
    :data:`OVERRIDE_TYPES`; else a :class:`UsageError` naming ``what`` (the flag)."""
    key = text.strip().lower()
    if key in UNWRITABLE:
        raise UsageError(f"{what}: {UNWRITABLE[key]}")
    found = ALIASES[key] if key in ALIASES else next((q for q in OVERRIDE_TYPES if q.name.lower() == key), None)
    if found is None:
        hint = f" ({key} is a --dtype mix; its base type is {MIXES[key].base.name})" if key in MIXES else ""
        raise UsageError(f"{what}: unknown or unwritable type {text!r}{hint}; choose from "
                         f"{', '.join(q.name for q in OVERRIDE_TYPES)} (any case; fp16/fp32 too)")
    return found


def parse_tensor_type(text: str) -> tuple[str, QType]:
    """``REGEX=TYPE`` of ``--tensor-type`` (split at the first ``=``, as llama-quantize does)."""
    pattern, sep, type_name = text.partition("=")
    if not sep or not pattern or not type_name:
        raise UsageError(f"--tensor-type {text!r}: expected REGEX=TYPE (e.g. attn_v=q8_0)")
    return pattern, parse_type(type_name, f"--tensor-type {text!r}")


# ------------------------------------------------------------------------------------------------ plans

@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an output file: canonical name, logical numpy shape and stored GGML type."""

    name: str
    shape: tuple[int, ...]
    qtype: QType

    @property
    def nbytes(self) -> int:
        return stored_nbytes(self.qtype, self.shape)


def check_dtype(dtype: str) -> str:
    """Our name of the output dtype ``dtype`` names: a key of :data:`DTYPES` or llama.cpp's spelling of one, in any
    case (``Q4_K_M``, ``F16``, ``fp16``, ``f32``: :data:`ALIASES`); else a :class:`UsageError` listing the
    choices."""
    key = dtype.strip().lower()
    if key in UNWRITABLE:
        raise UsageError(f"dtype {dtype!r}: {UNWRITABLE[key]}")
    if key in ALIASES:
        key = next(name for name, (qtype, _) in CONVERTER_DTYPES.items() if qtype == ALIASES[key])
    if key not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)} (any case; f16, f32 too)")
    return key


def block_size(qtype: QType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def is_quantized(qtype: QType) -> bool:
    return qtype not in (QType.F32, QType.F16, QType.BF16)


def tensor_kind(name: str) -> str:
    """The name without its layer number and suffix, as in ``gguf.TENSOR_NAMES`` (``blk.{bid}.ssm_conv1d``)."""
    base = _LAYER.sub("blk.{bid}.", name)
    return base.rsplit(".", 1)[0] if base.endswith((".weight", ".bias")) else base


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """llama.cpp's tensor_allows_quantization for Qwen tensors: 2-D ``*.weight`` other than norms and conv1d."""
    return (len(shape) >= 2 and name.endswith(".weight") and not name.endswith("_norm.weight")
            and tensor_kind(name) not in F32_KINDS)


def fallback(name: str, row_length: int, qtype: QType) -> QType:
    """llama.cpp's tensor_type_fallback: ``qtype`` when its block divides the row length, else its 32-value twin
    (F16 when no 32-value block fits); :class:`QwenError` for a type llama.cpp defines no fallback for."""
    block = block_size(qtype)
    if row_length % block == 0:
        return qtype
    if qtype in FALLBACKS:
        chosen = FALLBACKS[qtype]
    elif block <= 32:
        chosen = qtype
    else:
        raise QwenError(f"{name}: row length {row_length} is not a multiple of {block} and llama.cpp defines no "
                        f"fallback type for {qtype.name}")
    if row_length % block_size(chosen):
        chosen = QType.F16
    logger.info("%s: row length %d is not a multiple of %d, stored as %s instead of %s",
                name, row_length, block, chosen.name, qtype.name)
    return chosen


def tensor_qtype(name: str, shape: tuple[int, ...], dtype: str) -> QType:
    """The GGML type a canonical tensor is stored as for a converter dtype (a key of :data:`CONVERTER_DTYPES`);
    a mix's types depend on the whole model: :func:`plan_types`."""
    dtype = check_dtype(dtype)
    if dtype in MIXES:
        raise QwenError(f"dtype {dtype!r} chooses types per model: use plan_types")
    if not allows_quantization(name, shape):
        return QType.F32
    qtype = CONVERTER_DTYPES[dtype][0]
    return fallback(name, shape[-1], qtype) if is_quantized(qtype) else qtype


def _fixed_type(name: str, shape: tuple[int, ...], qtype: QType, flag: str) -> QType:
    """A type given by --output-tensor-type / --token-embedding-type: llama.cpp applies no fallback to it."""
    if shape[-1] % block_size(qtype):
        raise QwenError(f"{flag} {qtype.name}: tensor {name} has rows of {shape[-1]} values, not a multiple of "
                        f"{qtype.name}'s block of {block_size(qtype)}")
    return qtype


class _Chooser:
    """llama_tensor_get_type over one model, with llama.cpp's running counts of attn_v, ffn_down, ffn_up and
    ffn_gate tensors."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], mix: Mix | None, base: QType, facts: ModelFacts | None,
                 options: QuantOptions) -> None:
        self.mix, self.base, self.options = mix, base, options
        self.facts = facts or ModelFacts(0, 0)
        self.tied = OUTPUT_NAME not in shapes
        categories = [tensor_category(n) for n in shapes]
        self.totals = {Category.ATTN_V: categories.count(Category.ATTN_V),
                       **dict.fromkeys((Category.FFN_DOWN, Category.FFN_UP, Category.FFN_GATE), self.facts.n_layer)}
        self.counts = dict.fromkeys(self.totals, 0)

    def choose(self, name: str, shape: tuple[int, ...]) -> QType:
        if not allows_quantization(name, shape):
            return QType.F32
        category, options = tensor_category(name), self.options
        if options.token_embedding_type is not None and category == Category.TOKEN_EMBD:
            return _fixed_type(name, shape, options.token_embedding_type, "--token-embedding-type")
        if options.output_type is not None and category == Category.OUTPUT:
            return _fixed_type(name, shape, options.output_type, "--output-tensor-type")
        if not is_quantized(self.base):
            return self.base
        qtype = options.manual_type(name)
        if qtype is None:
            qtype = self.base if options.pure or self.mix is None else self.mixed(category, shape)
        return fallback(name, shape[-1], qtype)

    def mixed(self, category: Category, shape: tuple[int, ...]) -> QType:
        """llama_tensor_get_type_impl for a dense model that is neither Falcon nor a 70B Llama."""
        mix = self.mix
        assert mix is not None
        if category == Category.OUTPUT or (self.tied and category == Category.TOKEN_EMBD):
            if self.options.output_type is not None:
                return self.options.output_type
            if shape[-1] % block_size(mix.base):
                return QType.Q8_0
            return mix.output if mix.base != QType.Q8_0 else mix.base
        if category == Category.TOKEN_EMBD:
            return mix.token_embd or mix.base
        fixed = {Category.ATTN_OUTPUT: mix.attn_output, Category.ATTN_K: mix.attn_k, Category.ATTN_Q: mix.attn_q}
        if category in fixed:
            return fixed[category] or mix.base
        if category in self.counts:
            rule = mix.rule(category)
            place = RuleInput(self.counts[category], self.totals[category], self.facts, self.options.imatrix)
            self.counts[category] += 1
            return (rule(place) if rule else None) or mix.base
        return mix.base


def needs_importance(name: str, qtype: QType, dtype: str) -> bool:
    """llama.cpp's tensor_requires_imatrix: whether llama-quantize refuses to store ``name`` as ``qtype`` in a
    ``dtype`` file without an importance vector for it (the 1.5-3-bit i-quants, and q2_k_s's Q2_K; token_embd
    and output too for the types it cannot encode without one, :data:`WEIGHTS_REQUIRED`)."""
    if qtype in WEIGHTS_REQUIRED:
        return True
    if name in (TOKEN_EMBD_NAME, OUTPUT_NAME):
        return False
    return qtype in IMATRIX_TYPES or (qtype == QType.Q2_K and check_dtype(dtype) == "q2_k_s")


def llama_order(name: str) -> tuple[int, str]:
    """llama.cpp's order of a model's tensors (weight_name_comparer): non-layer tensors first, then by layer
    number, by name within each."""
    match = _LAYER.match(name)
    return (int(name.split(".")[1]) if match else -1, name)


def plan_types(shapes: dict[str, tuple[int, ...]], dtype: str, facts: ModelFacts | None = None,
               options: QuantOptions | None = None) -> dict[str, QType]:
    """The stored type of every tensor ``{name: shape}`` of one model for ``dtype`` and ``options``.

    A mix needs ``facts`` (block count and query groups).  :class:`QwenError` when an option does not apply
    (``--pure`` or ``--tensor-type`` with an unquantized dtype) or a type cannot hold a tensor's rows.
    """
    options = options or QuantOptions()
    dtype = check_dtype(dtype)
    base, mix = DTYPES[dtype][0], MIXES.get(dtype)
    if mix is not None and facts is None:
        raise ValueError(f"dtype {dtype!r} needs the model's facts (block count, query groups)")
    if (options.tensor_types or options.pure) and not is_quantized(base):
        raise UsageError(f"--tensor-type and --pure need a quantized --dtype, not {dtype}")
    chooser = _Chooser(shapes, mix, base, facts, options)
    return {name: chooser.choose(name, shapes[name]) for name in sorted(shapes, key=llama_order)}


def _order_key(name: str) -> tuple[int, int, str]:
    """token_embd first, then the blocks by layer number, then output_norm / output."""
    match = _LAYER.match(name)
    if match:
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith(TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]) else 2, 0, name)


def plan_outputs(shapes: dict[str, tuple[int, ...]], dtype: str, facts: ModelFacts | None = None,
                 options: QuantOptions | None = None) -> list[TensorSpec]:
    """Output specs for tensors ``{name: shape}``, in file order (embedding, layers 0..L-1, head)."""
    return ordered_specs(shapes, plan_types(shapes, dtype, facts, options))


def ordered_specs(shapes: dict[str, tuple[int, ...]], types: dict[str, QType]) -> list[TensorSpec]:
    """Specs for tensors ``{name: shape}`` stored as ``types``, in file order (embedding, layers, head)."""
    return [TensorSpec(name, shapes[name], types[name]) for name in sorted(shapes, key=_order_key)]


def file_type(dtype: str) -> LlamaFileType:
    """``general.file_type`` for an output dtype (llama-quantize writes the mix's, whatever the options)."""
    return DTYPES[check_dtype(dtype)][1]
