"""Behavioural check of a conversion: source and output run side by side on a short probe.

The probe is a fixed prompt (:data:`PROBE_TEXT`) plus the model's own chat template rendered on one user
message (:data:`PROBE_MESSAGE`), tokenized by the source's tokenizer; the output's tokenizer must produce
the same ids.  At every probe position we compare the next-token distributions p (source) and q (output):
``KL(p || q)`` in float64 from log-softmax, and top-1 agreement.

Limits: what a correct conversion of *this* model does, predicted by the rounding error model.
Hoeffding's lemma gives ``KL(p || q) <= range(δ)²/8`` for a logit perturbation δ = z_out - z_src, and
``KL ≈ Var_p(δ)/2`` when δ is small, so the KL of a rounded output depends on how far rounding moves the logits,
which depends on the weights: a correct q8_0 conversion of the bundled trained model (qwen3-stdlib) gives mean KL
3.7e-5, of the random-weight Qwen3.5 fixtures 1.4e-2..3.8e-2 (a Gated DeltaNet layer amplifies weight
perturbations ~10x), nearly three orders of magnitude apart. No fixed number serves both, so the check predicts
it:

* The *rounding twin* (:func:`rounding_twin`) is the source with every tensor the output stores rounded
  replaced by source + independent uniform noise of that type's rounding step, computed from the source values
  alone, so a fault in the output cannot widen it (Q8_0: amax/127 per block of 32; F16/BF16: one unit in the
  last place, zero where the value is representable exactly). A correct conversion is one draw of such
  rounding, the twin another, so their probe KLs agree up to the draw: measured real/twin 0.85-1.38 for the
  mean KL and 0.63-2.84 for the max, on the bundled model and all six fixtures at q8_0 (one draw each; single
  draws of the random Qwen3.5 fixtures' largest logit change spread 2x, and their correct q8_0 reaches 2.5x
  the median draw). The limits are ``TWIN_FACTOR_MEAN`` (3) and ``TWIN_FACTOR_MAX`` (6) times the largest of
  ``TWIN_DRAWS`` (3) draws; top-1 must agree where the source
  leads by more than ``TWIN_MARGIN`` (4) times the twin's largest logit change (a flip needs two logits to move
  towards each other by the lead), and a failure is located at the first residual stream off by more than 4x
  the twin's largest relative residual error.
* Floors, calibrated on trained weights (``FLOORS``): fp32 and fp16 1e-6 (float32 summation order alone
  gives <= 1e-9; fp16 holds every bf16 weight exactly); for the block types about 3x the mean KL and 6x the
  max KL a correct conversion of the bundled model gives (q8_0 3.7e-5 / 2.8e-4 -> 1e-4 / 1e-3; q5_0 2.0e-3 /
  8.5e-3 and q5_1 1.4e-3 / 6.8e-3 -> 6e-3 / 5e-2; q4_0 9.9e-3 / 0.17 and q4_1 5.8e-3 / 2.4e-2 -> 3e-2 / 1),
  the factors of the twin limits. The limit is the larger of floor and twin limit; the twins (float32 copies
  of the rounded matrices) are built only when an output exceeds its floor, so a good conversion of a trained
  model never pays for them. For q4/q5 the twin predicts as well as for q8_0 (real/twin 0.79-1.22 mean,
  0.42-2.17 max on the bundled model and the Qwen2 and Qwen3.5 fixtures). Types we do not write (llama.cpp's
  K-quant and IQ4 files) get the q4_0 floors and a twin whose grid has 2^floor(bits per weight) - 1 steps
  over each 32 values' span (:func:`_generic_levels`), an approximation of their sub-block grids.
* What fails on behaviour alone (tests/convert/test_verify.py): one matrix scaled by 1.25, the rotary halves of one
  query head's rows swapped and one layer's norm off by +1, on the bundled trained model (q8_0, fp16), the Qwen2
  and Qwen3 fixtures (fp32, q8_0) and the Qwen3.5 fixtures (fp32; at q8_0 their own rounding moves the probe as
  much as a swapped head or a 1.25 scale, mean KL 1.7e-2..3.8e-2 vs 3.1e-2..1.1e-1, so there only the norm
  fault is asserted), and value heads in the wrong order. Smaller faults (one matrix scaled by 1.01 or 1.05
  gives mean KL 4.0e-5 and 1.3e-4 on the bundled model's q8_0, whose correct conversion gives 3.7e-5) are
  within what rounding does: they are the per-tensor checks' job (qwen_convert/verify/tensors.py), which catch a 1 %
  scale exactly.

When the check fails, :func:`first_divergence` runs both models block by block and names the first layer
whose residual stream differs by more than the dtype's relative tolerance.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES

from qwen_runtime.errors import QwenError
from qwen_runtime.formats import ModelFiles, open_model_files
from qwen_runtime.formats.tensors import QType, StoredTensor
from qwen_runtime.generation.evaluate import kl_divergence, log_softmax
from qwen_runtime.models import Model, WeightStore, build_model
from qwen_runtime.text.chat import ChatFormat, chat_format

PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
              "def add(a, b):\n    return a + b\n")
PROBE_MESSAGE = "What is the capital of France? Answer in one word."


@dataclass(frozen=True)
class Thresholds:
    """Pass limits of the behavioural check for one output dtype (justified in the module docstring)."""

    mean_kl: float
    max_kl: float
    margin: float  # top-1 must agree wherever the source's top-1 leads its runner-up by more than this
    hidden: float  # relative residual-stream error that counts as divergence, when locating a failure


FLOORS: dict[str, Thresholds] = {
    "fp32": Thresholds(mean_kl=1e-6, max_kl=1e-6, margin=1e-4, hidden=1e-5),
    "fp16": Thresholds(mean_kl=1e-6, max_kl=1e-6, margin=1e-3, hidden=1e-4),
    "q8_0": Thresholds(mean_kl=1e-4, max_kl=1e-3, margin=0.5, hidden=5e-2),
    "q5_0": Thresholds(mean_kl=6e-3, max_kl=5e-2, margin=4.0, hidden=0.2),
    "q5_1": Thresholds(mean_kl=6e-3, max_kl=5e-2, margin=4.0, hidden=0.2),
    "q4_0": Thresholds(mean_kl=3e-2, max_kl=1.0, margin=8.0, hidden=0.4),
    "q4_1": Thresholds(mean_kl=3e-2, max_kl=1.0, margin=8.0, hidden=0.4),
}
LOOSEST = "q4_0"  # floors for file types we did not write (llama.cpp's K-quant mixtures, ...)
TWIN_FACTOR_MEAN, TWIN_FACTOR_MAX, TWIN_MARGIN = 3.0, 6.0, 4.0
TWIN_DRAWS = 3


@dataclass(frozen=True)
class ProbeStats:
    """How far one model's next-token distributions are from the source's on the probe."""

    kl: np.ndarray  # [positions] KL(source || model)
    same_top1: np.ndarray  # [positions] bool
    source_margin: np.ndarray  # [positions] lead of the source's top-1 over its runner-up
    max_delta: float  # largest |logit change|

    @property
    def mean_kl(self) -> float:
        return float(self.kl.mean())

    @property
    def max_kl(self) -> float:
        return float(self.kl.max())

    def flips(self, margin: float) -> int:
        """Top-1 disagreements where the source leads by more than ``margin``."""
        return int((~self.same_top1 & (self.source_margin > margin)).sum())


def probe_stats(reference: Model, model: Model, ids: list[list[int]]) -> ProbeStats:
    """KL, top-1 agreement and largest logit change of ``model`` against ``reference`` on every probe."""
    kl, same, margin, delta = [], [], [], 0.0
    for probe in ids:
        a = reference.logits(np.asarray([probe]))[0]  # [T, V]
        b = model.logits(np.asarray([probe]))[0]
        kl.append(np.maximum(kl_divergence(log_softmax(a), log_softmax(b)), 0.0))
        same.append(a.argmax(-1) == b.argmax(-1))
        margin.append(top1_margin(a))
        delta = max(delta, float(np.abs(b - a).max()))
    return ProbeStats(np.concatenate(kl), np.concatenate(same), np.concatenate(margin), delta)


def twin_thresholds(floor: Thresholds, twin: ProbeStats, twin_hidden: float) -> Thresholds:
    """The larger of ``floor`` and the limits one draw of the rounding twin predicts (module docstring)."""
    return Thresholds(max(floor.mean_kl, TWIN_FACTOR_MEAN * twin.mean_kl),
                      max(floor.max_kl, TWIN_FACTOR_MAX * twin.max_kl),
                      max(floor.margin, TWIN_MARGIN * twin.max_delta),
                      max(floor.hidden, TWIN_MARGIN * twin_hidden))


@dataclass(frozen=True)
class BehaviourCheck:
    """Result of running the probe through source and output."""

    dtype: str
    thresholds: Thresholds
    positions: int = 0
    mean_kl: float = 0.0
    max_kl: float = 0.0
    top1_agreement: float = 1.0
    decisive_flips: int = 0  # top-1 disagreements where the source leads by more than thresholds.margin
    failures: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failure(self) -> str:
        return "; ".join(self.failures)

    def summary(self) -> str:
        t = self.thresholds
        return (f"{self.positions} probe positions, mean KL {self.mean_kl:.3g} (limit {t.mean_kl:.3g}), "
                f"max KL {self.max_kl:.3g} (limit {t.max_kl:.3g}), top-1 agreement {self.top1_agreement:.1%} "
                f"({self.decisive_flips} flips where the source leads by > {t.margin:.3g})")


# Block types of 32 values: (levels of the grid over the block's span, grid symmetric about zero).
BLOCK_LEVELS = {QType.Q8_0: (127, True), QType.Q5_0: (16, True), QType.Q4_0: (8, True), QType.Q5_1: (31, False),
                QType.Q4_1: (15, False)}


def rounding_twin(source: ModelFiles, output: ModelFiles, seed: int = 0) -> Model | None:
    """The source model with each tensor the output stores rounded replaced by source + noise of that rounding.

    The noise is what a correct conversion adds, drawn independently: uniform on +-step/2 with the step of the
    stored type, from the *source's* values only (so a fault in the output cannot widen it): Q8_0 rounds each
    block of 32 to a step of amax/127; F16 and BF16 round each value to half a unit in the last place of
    that type. None when the output holds no such type (fp32) or a type without a model here.
    """
    rng = np.random.default_rng(seed)
    tensors, changed = dict(source.tensors), False
    for name, stored in output.tensors.items():
        if stored.qtype == QType.F32 or name not in source.tensors:
            continue
        w = np.ascontiguousarray(source.tensors[name].to_float32())
        step = _rounding_step(w, stored.qtype)
        if step is None:
            return None
        noisy = w + (rng.random(w.shape, dtype=np.float32) - np.float32(0.5)) * step
        tensors[name] = StoredTensor(name, QType.F32, w.shape, "<rounding twin>", data=noisy)
        changed = True
    if not changed:
        return None
    files = dataclasses.replace(source, tensors=tensors)
    return Model(files, WeightStore(files))


def _rounding_step(w: np.ndarray, qtype: QType) -> np.ndarray | None:
    """Rounding step of each value of ``w`` when stored as ``qtype`` (broadcastable to ``w``), or None."""
    if qtype not in (QType.F16, QType.BF16) and w.shape[-1] % 32 == 0:
        blocks = w.reshape(*w.shape[:-1], -1, 32)
        levels, symmetric = BLOCK_LEVELS.get(qtype) or _generic_levels(qtype)
        if symmetric:  # values are d * q with q in [-levels, levels) or [-levels, levels], d = amax / levels
            span = np.abs(blocks).max(axis=-1, keepdims=True)
        else:  # values are d * q + min with q in [0, levels], d = (max - min) / levels
            span = blocks.max(axis=-1, keepdims=True) - blocks.min(axis=-1, keepdims=True)
        step = span / np.float32(levels)
        return np.broadcast_to(step, blocks.shape).reshape(w.shape)
    if qtype == QType.F16:
        step = np.spacing(np.abs(w).astype(np.float16)).astype(np.float32)
        return np.where(w.astype(np.float16).astype(np.float32) == w, np.float32(0), step)
    if qtype == QType.BF16:
        exact = (w.view(np.uint32) & np.uint32(0xFFFF)) == 0
        exponent = np.frexp(np.maximum(np.abs(w), np.float32(2.0**-126)))[1]
        return np.where(exact, np.float32(0), np.ldexp(np.float32(1.0), exponent - 8).astype(np.float32))
    return None


def _generic_levels(qtype: QType) -> tuple[int, bool]:
    """Other block types (K-quants, IQ4): a grid of 2^floor(bits per weight) - 1 steps over each 32 values'
    span, an approximation of their sub-block grids (Q4_K 15, Q5_K 31, Q6_K 63, Q3_K 7, Q2_K 3 levels)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return 2 ** int(8 * size / block) - 1, False


def probe_ids(fmt: ChatFormat) -> list[list[int]]:
    """The raw probe prompt and, when the model has a chat template, one rendered user message."""
    probes = [fmt.encode_prompt(PROBE_TEXT)]
    if fmt.template is not None:
        probes.append(fmt.encode_chat([{"role": "user", "content": PROBE_MESSAGE}]))
    return probes


def top1_margin(logits: np.ndarray) -> np.ndarray:
    """Lead of the top logit over the runner-up per position.  # [T, V] -> [T]"""
    top2 = np.partition(logits, -2, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def residual_errors(source: Model, other: Model, ids: list[int]) -> list[float]:
    """Relative error of ``other``'s residual stream after the embedding and after each block."""
    return [float(np.linalg.norm(b - a) / max(float(np.linalg.norm(a)), 1e-30))
            for a, b in zip(source.hidden_states([ids]), other.hidden_states([ids]), strict=True)]


def first_divergence(source: Model, output: Model, ids: list[int], tolerance: float) -> str:
    """Where the two models part: the first residual stream (embedding, block i) off by > ``tolerance``."""
    errors = residual_errors(source, output, ids)
    for i, error in enumerate(errors):
        if error > tolerance:
            where = "the token embedding (token_embd.weight)" if i == 0 else f"layer {i - 1} (blk.{i - 1}.*)"
            return f"first divergence at {where}: relative residual-stream error {error:.3g} > {tolerance:g}"
    return (f"residual streams agree within {max(errors):.3g} through the last layer: the divergence is in "
            f"output_norm.weight or the LM head (output.weight / token_embd.weight)")


def _tokenizer_failure(source_ids: list[list[int]], output: Model) -> str | None:
    try:
        output_ids = probe_ids(chat_format(output))
    except QwenError as exc:
        return f"the output's tokenizer or chat template fails ({exc})"
    for k, (a, b) in enumerate(zip(source_ids, output_ids, strict=False)):
        if a != b:
            i = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            return f"the output's tokenizer encodes probe {k} differently from token {i} on"
    if len(output_ids) != len(source_ids):
        return "the output has no chat template but the source has one"
    return None


def behaviour_check(source: ModelFiles, output_path: Path, dtype: str | None) -> BehaviourCheck:
    """Run the probe through ``source`` and the output at ``output_path`` and compare (module docstring)."""
    name = dtype if dtype in FLOORS else LOOSEST
    limits = FLOORS[name]
    try:
        output_files = open_model_files(output_path)
        output = build_model(output_files)
    except QwenError as exc:
        return BehaviourCheck(name, limits, failures=(f"the output does not load with qwen_runtime ({exc})",))
    reference = build_model(source)
    ids = probe_ids(chat_format(reference))
    failures = [f for f in [_tokenizer_failure(ids, output)] if f]
    stats = probe_stats(reference, output, ids)
    check = _check(name, limits, stats)
    if _limit_failures(check):
        for seed in range(TWIN_DRAWS):
            twin = rounding_twin(source, output_files, seed)
            if twin is None:
                break
            limits = twin_thresholds(limits, probe_stats(reference, twin, ids),
                                     max(residual_errors(reference, twin, ids[0])))
        check = _check(name, limits, stats)
    numeric = _limit_failures(check)
    if numeric:
        numeric.append(first_divergence(reference, output, ids[0], limits.hidden))
    return dataclasses.replace(check, failures=tuple(failures + numeric))


def _check(name: str, limits: Thresholds, stats: ProbeStats) -> BehaviourCheck:
    return BehaviourCheck(name, limits, len(stats.kl), stats.mean_kl, stats.max_kl, float(stats.same_top1.mean()),
                          stats.flips(limits.margin))


def _limit_failures(check: BehaviourCheck) -> list[str]:
    t, failures = check.thresholds, []
    if check.mean_kl > t.mean_kl:
        failures.append(f"mean KL {check.mean_kl:.3g} exceeds {t.mean_kl:.3g} for {check.dtype}")
    if check.max_kl > t.max_kl:
        failures.append(f"max KL {check.max_kl:.3g} exceeds {t.max_kl:.3g} for {check.dtype}")
    if check.decisive_flips:
        failures.append(f"top-1 differs at {check.decisive_flips} positions where the source leads by more than "
                        f"{t.margin:.3g} logits")
    return failures
