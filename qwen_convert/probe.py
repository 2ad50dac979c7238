"""Behavioural check of a conversion: source and output run side by side on a short probe.

The probe is a fixed prompt (:data:`PROBE_TEXT`) plus the model's own chat template rendered on one user
message (:data:`PROBE_MESSAGE`), tokenized by the source's tokenizer; the output's tokenizer must produce
the same ids.  At every probe position we compare the next-token distributions p (source) and q (output):
``KL(p || q)`` in float64 from log-softmax, and top-1 agreement.

Thresholds, per output dtype (:func:`thresholds`).  Hoeffding's lemma gives ``KL(p || q) <= range(δ)²/8`` for
a logit perturbation δ = z_out - z_src, and ``KL ≈ Var_p(δ)/2`` when δ is small, so a KL limit is a statement
about how far rounded weights may move the logits.  Measured on the fixtures (logit std ≈ 2.3, as peaked as a
small trained model's) and set about 10x above what correct conversions give and 10x below what the
broken ones in tests/test_verify.py give (mean KL >= 1):

* fp32: mean and max KL <= 1e-6.  A bf16/f16/f32 source widens to float32 exactly, so both runs multiply the
  same numbers; only summation order and the exp/log of ``ssm_a`` differ (measured KL <= 1e-9).  Top-1 must
  agree wherever the source's lead exceeds 1e-4 logits.
* fp16: mean KL <= 1e-4, max <= 1e-3, top-1 agreement where the source leads by > 0.05.  fp16 holds every
  bf16 value in [2^-14, 65504] exactly (11 vs 8 significant bits), so from a bf16 checkpoint only |w| < 2^-14
  changes, by <= 2^-25 (measured KL <= 1e-12); from an f32 checkpoint each weight moves <= 2^-11 relative,
  each matmul output ~3e-4, the logits ~1e-3·σ_z: KL ~1e-6.
* q8_0: mean KL <= 1e-2, max <= 1e-1, top-1 agreement where the source leads by > 0.5.  A Q8_0 weight moves
  <= amax/254 of its 32-block (rms ≈ 0.5% of the block rms), so logits move ~0.05-0.3: measured mean KL
  <= 1.6e-3, max <= 1.1e-2, max |δ| 0.33, flips only where the lead was < 0.13.
* q5_0 / q5_1: mean KL <= 0.25, max <= 1, margin 4; q4_0 / q4_1: mean KL <= 1, max <= 5, margin 8.  A
  5-bit (4-bit) weight moves up to amax/32 (amax/16) of its block, 8x (16x) a Q8_0 step, so the margin is
  q8_0's times that, and KL grows with the square: on the tiny random fixtures the measured mean KL is <= 0.10
  (q5) and <= 0.41 (q4), max <= 0.39 and 2.41, a flip where the source led by 1.6 (q5_1).  These limits can
  no longer tell a broken conversion from 4-bit noise on these models; the tensor check, exact up to the grid
  step, is what catches one.  Files of other types (llama.cpp's K-quant mixtures) get the q4 limits.
* Qwen3.5, fp16 and the quantized types: KL limits x20, margins x5.  A Gated DeltaNet output is a small
  difference of large terms that the gated RMSNorm scales back up, so a linear-attention layer amplifies a weight
  perturbation ~10x (tests/test_qwen35_formats.py): measured q8_0 mean KL <= 0.038, max <= 0.98, max |δ| 4.6,
  flips where the lead was <= 1.2.

When the check fails, :func:`first_divergence` runs both models block by block and names the first layer
whose residual stream differs by more than the dtype's relative tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qwen_runtime.archs import ARCHS
from qwen_runtime.chat import ChatFormat, chat_format
from qwen_runtime.errors import QwenError
from qwen_runtime.evaluate import kl_divergence, log_softmax
from qwen_runtime.formats import ModelFiles
from qwen_runtime.models import Model, build_model

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


THRESHOLDS: dict[str, Thresholds] = {
    "fp32": Thresholds(mean_kl=1e-6, max_kl=1e-6, margin=1e-4, hidden=1e-5),
    "fp16": Thresholds(mean_kl=1e-4, max_kl=1e-3, margin=0.05, hidden=1e-3),
    "q8_0": Thresholds(mean_kl=1e-2, max_kl=1e-1, margin=0.5, hidden=5e-2),
    "q5_0": Thresholds(mean_kl=0.25, max_kl=1.0, margin=4.0, hidden=0.2),
    "q5_1": Thresholds(mean_kl=0.25, max_kl=1.0, margin=4.0, hidden=0.2),
    "q4_0": Thresholds(mean_kl=1.0, max_kl=5.0, margin=8.0, hidden=0.4),
    "q4_1": Thresholds(mean_kl=1.0, max_kl=5.0, margin=8.0, hidden=0.4),
}
LOOSEST = "q4_0"  # for file types we did not write (llama.cpp's K-quant mixtures, ...)


def thresholds(dtype: str, arch: str) -> Thresholds:
    """The limits for an output ``dtype`` of architecture ``arch``."""
    limits, spec = THRESHOLDS[dtype], ARCHS[arch]
    if dtype == "fp32":
        return limits
    kl, margin = spec.probe_kl_factor, spec.probe_margin_factor
    return Thresholds(limits.mean_kl * kl, limits.max_kl * kl, limits.margin * margin, limits.hidden * margin)


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
        return (f"{self.positions} probe positions, mean KL {self.mean_kl:.3g} (limit {t.mean_kl:g}), "
                f"max KL {self.max_kl:.3g} (limit {t.max_kl:g}), top-1 agreement {self.top1_agreement:.1%} "
                f"({self.decisive_flips} flips where the source leads by > {t.margin:g})")


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


def first_divergence(source: Model, output: Model, ids: list[int], tolerance: float) -> str:
    """Where the two models part: the first residual stream (embedding, block i) off by > ``tolerance``."""
    errors = []
    for i, (a, b) in enumerate(zip(source.hidden_states([ids]), output.hidden_states([ids]), strict=True)):
        error = float(np.linalg.norm(b - a) / max(float(np.linalg.norm(a)), 1e-30))
        errors.append(error)
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
    name = dtype if dtype in THRESHOLDS else LOOSEST
    limits = thresholds(name, source.config.arch)
    try:
        output = build_model(output_path)
    except QwenError as exc:
        return BehaviourCheck(name, limits, failures=(f"the output does not load with qwen_runtime ({exc})",))
    reference = build_model(source)
    ids = probe_ids(chat_format(reference))
    failures = [f for f in [_tokenizer_failure(ids, output)] if f]
    kl, agree, flips = [], [], 0
    for probe in ids:
        a = reference.logits(np.asarray([probe]))[0]  # [T, V]
        b = output.logits(np.asarray([probe]))[0]
        kl.append(np.maximum(kl_divergence(log_softmax(a), log_softmax(b)), 0.0))
        same = a.argmax(-1) == b.argmax(-1)
        agree.append(same)
        flips += int((~same & (top1_margin(a) > limits.margin)).sum())
    kl_all, agree_all = np.concatenate(kl), np.concatenate(agree)
    check = BehaviourCheck(name, limits, len(kl_all), float(kl_all.mean()), float(kl_all.max()),
                           float(agree_all.mean()), flips)
    numeric = _limit_failures(check)
    if numeric:
        numeric.append(first_divergence(reference, output, ids[0], limits.hidden))
    failures += numeric
    return BehaviourCheck(name, limits, check.positions, check.mean_kl, check.max_kl, check.top1_agreement,
                          flips, tuple(failures))


def _limit_failures(check: BehaviourCheck) -> list[str]:
    t, failures = check.thresholds, []
    if check.mean_kl > t.mean_kl:
        failures.append(f"mean KL {check.mean_kl:.3g} exceeds {t.mean_kl:g} for {check.dtype}")
    if check.max_kl > t.max_kl:
        failures.append(f"max KL {check.max_kl:.3g} exceeds {t.max_kl:g} for {check.dtype}")
    if check.decisive_flips:
        failures.append(f"top-1 differs at {check.decisive_flips} positions where the source leads by more than "
                        f"{t.margin:g} logits")
    return failures
