"""Memory limits: what a generation will allocate, checked against what the user allows before allocating.

The budget is ``--max-memory`` (``max_memory=`` in the API) or, by default, 80 % of the kernel's
``MemAvailable``.  Weights are memory-mapped (the page cache holds them), so only the cache (what the
mixers report: ``Model.cache_bytes``, ``Model.cache_size``) and the activations (:func:`activation_bytes`)
count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ResourceLimitError
from ..formats.config import ModelConfig

FLOAT32_BYTES = 4
DEFAULT_FRACTION = 0.8  # of MemAvailable
FALLBACK_LIMIT = 4 << 30  # when /proc/meminfo cannot be read
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def activation_bytes(config: ModelConfig, batch: int, max_len: int, chunk: int) -> int:
    """An upper estimate of the float32 activations of one prefill chunk: hidden states and projections,
    the MLP, attention scores over every slot, and the last-position logits."""
    c, t = config, min(chunk, max_len)
    widest = max(c.hidden_size, c.num_attention_heads * c.head_dim * 2, c.linear_conv_dim)
    hidden = 4 * batch * t * widest
    mlp = 3 * batch * t * c.intermediate_size
    scores = 2 * batch * c.num_attention_heads * t * max_len
    return (hidden + mlp + scores + batch * c.vocab_size) * FLOAT32_BYTES


def available_memory() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_memory_limit() -> int:
    """80 % of the available memory, or 4 GiB when it cannot be read."""
    available = available_memory()
    return int(available * DEFAULT_FRACTION) if available else FALLBACK_LIMIT


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units (``1.5 GiB``, ``12.0 MiB``, ``512 B``): the one byte format of every message,
    banner and table, matching :func:`parse_memory_size`'s units."""
    units = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
    unit, size = next(((u, s) for u, s in units if abs(n) >= s), ("B", 1))
    return f"{n} B" if size == 1 else f"{n / size:.1f} {unit}"


def parse_memory_size(text: str) -> int:
    """``"512M"``, ``"4G"``, ``"1.5G"`` or a plain byte count -> bytes (binary units); ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"invalid memory size {text!r} (expected e.g. 512M, 4G or a byte count)")
    value = int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class MemoryPlan:
    """What a run will hold, known before any of it is allocated: the one account that ``qwen-run --stats``,
    the server's banner and the ``--max-memory`` checks read, so the figures printed are the figures checked.

    ``weights`` are the stored bytes of the model's tensors: memory-mapped, held by the page cache and not
    counted against the limit; ``cache`` is the KV cache (and recurrent state) of ``rows`` rows at ``tokens``
    tokens in ``cache_types`` (keys, values); ``activations`` the scratch of a pass (:func:`activation_bytes`).
    """

    weights: int
    cache: int
    activations: int
    rows: int
    tokens: int
    cache_types: tuple[str, str]

    @property
    def required(self) -> int:
        """The bytes the limit is checked against: cache and activations."""
        return self.cache + self.activations

    def summary(self) -> str:
        keys, values = self.cache_types
        return (f"memory plan: weights {format_bytes(self.weights)} (mapped), kv cache {format_bytes(self.cache)} "
                f"at {self.tokens} tokens x {self.rows} rows ({keys} keys, {values} values), "
                f"activations {format_bytes(self.activations)}")

    def check(self, allowed: int | None, what: str) -> None:
        """Raise :class:`ResourceLimitError` (one line: the cache, the activations, the limit and what to lower)
        when the plan needs more than ``allowed`` bytes (default: :func:`default_memory_limit`)."""
        limit = default_memory_limit() if allowed is None else allowed
        if self.required <= limit:
            return
        smaller = ", or use -ctk/-ctv f16" if "f32" in self.cache_types else ""
        raise ResourceLimitError(
            f"{what} needs about {format_bytes(self.required)} (kv cache {format_bytes(self.cache)} at "
            f"{self.tokens} tokens x {self.rows} rows + activations {format_bytes(self.activations)}), more than "
            f"the {format_bytes(limit)} allowed (--max-memory); lower --ctx, --max-new-tokens or --max-batch"
            f"{smaller}")


def check_memory(required: int, allowed: int | None, what: str) -> None:
    """Raise :class:`ResourceLimitError` when ``required`` bytes exceed ``allowed`` (default: the limit of
    :func:`default_memory_limit`)."""
    limit = default_memory_limit() if allowed is None else allowed
    if required > limit:
        raise ResourceLimitError(f"{what} needs about {format_bytes(required)}, more than the "
                                 f"{format_bytes(limit)} allowed (--max-memory); use a smaller batch, "
                                 f"prompt or --max-new-tokens")
