"""RoPE scaling: the rotary frequencies of a model run past the context it was trained on.

Two kinds, as transformers (``modeling_rope_utils``) computes them for Qwen2/Qwen3/Qwen3.5 and llama.cpp
reads them from a GGUF (``rope.scaling.*``):

* ``linear`` (position interpolation): every frequency divided by ``factor``.
* ``yarn`` (arXiv 2309.00071): frequencies that turn fewer than ``beta_slow`` times over the original context
  are divided by ``factor`` (interpolated), those that turn more than ``beta_fast`` times are kept
  (extrapolated), a linear ramp over the rotary pair index blends the two in between; and cos/sin are
  multiplied by ``attention_factor`` (default ``0.1 ln(factor) + 1``), which scales the attention logits by
  its square to keep their entropy at long range.

transformers' ``dynamic`` NTK changes the frequencies with the length of the sequence being run, which a KV
cache built at shorter lengths cannot follow, and Qwen configs do not use it; it is refused (as ``longrope``
and ``llama3``) rather than run differently.  The config readers (:mod:`.formats.hf_config`,
:mod:`.formats.gguf_config`) and the run-time override build a :class:`RopeScaling`; the math is here once,
in float64, for the fast path (:func:`qwen_runtime.backend.ops.rope_cos_sin`) and the reference alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

LINEAR, YARN = "linear", "yarn"
ROPE_SCALING_TYPES = (LINEAR, YARN)
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # transformers' and llama.cpp's defaults


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale ``0.1 mscale ln(factor) + 1`` (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are scaled; ``original_context`` is the context the model was trained on
    (transformers' ``original_max_position_embeddings``, llama.cpp's ``rope.scaling.original_context_length``;
    0, as llama.cpp's ``--yarn-orig-ctx 0``: the model's ``max_position_embeddings``, which the config fills in);
    ``attention_factor`` None means YaRN's default :func:`yarn_mscale`; ``truncate`` rounds YaRN's ramp
    bounds outward to whole pairs (transformers' default, and what llama.cpp always does)."""

    type: str
    factor: float
    original_context: int
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.type not in ROPE_SCALING_TYPES:
            raise ConfigError(f"rope scaling type {self.type!r} is not supported; supported: "
                              f"{', '.join(ROPE_SCALING_TYPES)}")
        if not (math.isfinite(self.factor) and self.factor >= 1):
            raise ConfigError(f"rope scaling factor must be a finite number >= 1, got {self.factor}")
        if self.original_context < 0:
            raise ConfigError(f"rope scaling original context must be positive, got {self.original_context}")
        for name in ("beta_fast", "beta_slow"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"yarn {name} must be a positive finite number, got {getattr(self, name)}")
        if self.attention_factor is not None and not (math.isfinite(self.attention_factor)
                                                      and self.attention_factor > 0):
            raise ConfigError(f"yarn attention_factor must be a positive finite number, got {self.attention_factor}")

    @property
    def attention_scale(self) -> float:
        """What cos and sin are multiplied by (transformers' ``attention_scaling``)."""
        if self.type != YARN:
            return 1.0
        return yarn_mscale(self.factor) if self.attention_factor is None else self.attention_factor

    @property
    def context(self) -> int:
        """The scaled window: ``factor`` times the original context."""
        return int(self.factor * self.original_context)

    def inv_freq(self, rotary_dim: int, theta: float) -> np.ndarray:
        """The scaled inverse frequencies, float64.  # [r/2]"""
        extrapolated = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)  # [r/2]
        interpolated = extrapolated / self.factor  # [r/2]
        if self.type == LINEAR:
            return interpolated
        low, high = (self._correction_dim(beta, rotary_dim, theta) for beta in (self.beta_fast, self.beta_slow))
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        ramp = np.clip((np.arange(rotary_dim // 2) - low) / max(high - low, 0.001), 0.0, 1.0)  # [r/2] 0: keep
        return interpolated * ramp + extrapolated * (1.0 - ramp)

    def _correction_dim(self, rotations: float, rotary_dim: int, theta: float) -> float:
        """The (fractional) pair index whose frequency turns ``rotations`` times over the original context."""
        return rotary_dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))
