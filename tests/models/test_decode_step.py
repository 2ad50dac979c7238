"""The compiled decode step (``models/step_jit.py``) against the per-operation path it replaces: the same logits,
bit for bit, for every family (Qwen3.5's hybrid layers included), several stored types, batches, ragged rows, one
thread or two, and a pool thread that leaves the step early."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import write_qwen2
from runtime_helpers import DENSE_FAMILIES, Converted

from qwen_convert.convert import convert
from qwen_runtime import load
from qwen_runtime.generation.generate import left_pad
from qwen_runtime.models import decode_step
from qwen_runtime.models.attention import Attention
from qwen_runtime.models.decode_step import DecodeStep

pytest.importorskip("numba")

STEPS = 4


def decode(model, prompts: list[np.ndarray], compiled: bool, rowwise: bool = False) -> list[np.ndarray]:
    """A left-padded prefill of ``prompts`` and STEPS greedy decode steps, with the compiled step on or off:
    the logits of every step [B, V]."""
    step, model.step = model.step, (model.step if compiled else None)
    ids, valid = left_pad(prompts)
    cache = model.make_cache(len(prompts), ids.shape[1] + STEPS)
    out = [model.forward(ids, cache, valid, last_only=True)]
    try:
        for _ in range(STEPS):
            if rowwise:
                with model.workspace.rowwise():
                    out.append(model.forward(out[-1].argmax(-1)[:, None], cache, last_only=True))
            else:
                out.append(model.forward(out[-1].argmax(-1)[:, None], cache, last_only=True))
    finally:
        model.step = step
    return out


def prompts(model, lengths: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(sum(lengths))
    return [rng.integers(0, model.config.vocab_size, n) for n in lengths]


FAMILIES = (*DENSE_FAMILIES, "qwen35-tiny", "qwen35-tiny-gqa")


def assert_step_equals_per_operation(model) -> list[np.ndarray]:
    """The compiled step's logits equal the per-operation path's, bit for bit, for a ragged batch of three, as it
    is and row-wise; returns the batch."""
    assert model.step is not None
    batch = prompts(model, (5, 11, 3))
    for rowwise in (False, True):
        got, want = decode(model, batch, True, rowwise), decode(model, batch, False, rowwise)
        for a, b in zip(got, want, strict=True):
            assert np.array_equal(a, b)
    return batch


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "fp16", "q5_1", "fp32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_step_equals_the_per_operation_path_bit_for_bit(converted: Converted, name: str, dtype: str,
                                                                 threads: int) -> None:
    model = load(converted(name, "gguf", dtype), kernels="numba", threads=threads)
    batch = assert_step_equals_per_operation(model)
    lone = decode(model, batch[:1], True)
    assert np.array_equal(lone[-1][0], decode(model, batch[:1], False)[-1][0])


def test_a_pool_thread_that_leaves_early_changes_nothing(converted: Converted, monkeypatch: pytest.MonkeyPatch,
                                                         ) -> None:
    """A helper that gives up waiting at once (as on a busy machine) leaves its share to the caller."""
    model = load(converted("qwen2-tiny", "gguf", "q8_0"), kernels="numba", threads=2)
    batch = prompts(model, (7, 2))
    want = decode(model, batch, False)
    monkeypatch.setattr(decode_step, "WAIT_US", 0)
    for a, b in zip(decode(model, batch, True), want, strict=True):
        assert np.array_equal(a, b)


def test_the_step_counts_its_chunks(converted: Converted, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk of every product runs exactly once a step, whoever claims it."""
    model = load(converted("qwen3-tiny", "gguf", "q8_0"), kernels="numba", threads=2)
    done: list[int] = []

    def counted(worker: int, args: tuple, scratch: object) -> None:
        done.append(decode_step.jit().decode_layers(worker, *args))

    monkeypatch.setattr(decode_step, "_worker", counted)
    decode(model, prompts(model, (4,)), True)
    step = model.step
    per_step = len(step.chunks) * model.config.num_hidden_layers
    assert sum(done) == STEPS * per_step


def test_a_checkpointed_state_steps_op_by_op(converted: Converted) -> None:
    """A pass that may be rolled back (speculative decoding's checkpoint) records its Gated DeltaNet inputs op by
    op, so the compiled step steps aside for it."""
    model = load(converted("qwen35-tiny", "gguf", "q8_0"), kernels="numba")
    cache = model.make_cache(1, 8)
    model.forward(np.array([[1, 2]]), cache)
    assert model.step.runs(1, 1, cache)
    cache.checkpoint()
    assert not model.step.runs(1, 1, cache)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q5_1", "iq4_nl"])
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_step_with_8_bit_activations_equals_the_per_operation_path(converted: Converted, name: str,
                                                                           dtype: str, threads: int) -> None:
    """With ``activations="q8"`` the step quantizes each product's input once (``prepare_forms``) and calls the
    types' integer-dot row products: the per-operation path's logits, bit for bit."""
    assert_step_equals_per_operation(load(converted(name, "gguf", dtype), kernels="numba", threads=threads,
                                          activations="q8"))


@pytest.fixture(scope="module")
def kquant_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 checkpoint whose rows hold whole K-quant blocks (hidden 256, intermediate 512)."""
    return write_qwen2(tmp_path_factory.mktemp("kquant") / "src", hidden=256, inter=512)


@pytest.mark.parametrize("dtype", ["q4_k_m", "q5_k_m", "q2_k", "q3_k_m", "q6_k", "iq4_xs"])
def test_compiled_step_with_8_bit_activations_on_k_quants(kquant_source: Path, tmp_path: Path, dtype: str) -> None:
    """The K-quant and IQ4_XS row products with 8-bit activations (a model whose matrices are those types): the
    per-operation path's logits, bit for bit, for one row and a batch."""
    path = convert(kquant_source, tmp_path / f"m-{dtype}.gguf", "gguf", dtype).output
    model = load(path, kernels="numba", threads=2, activations="q8")
    assert model.step is not None
    for lengths in ((6,), (5, 9, 3)):
        batch = prompts(model, lengths)
        for a, b in zip(decode(model, batch, True), decode(model, batch, False), strict=True):
            assert np.array_equal(a, b)


def test_models_without_a_compiled_step(converted: Converted) -> None:
    """The numpy kernels keep the per-operation path (float32 matrices through whole-matrix BLAS calls); a model
    built for 8-bit activations steps aside when its workspace is switched back to float ones."""
    for dtype in ("q8_0", "fp32"):
        model = load(converted("qwen2-tiny", "gguf", dtype), kernels="numpy")
        assert model.step is None
    assert load(converted("qwen2-tiny", "gguf", "fp32"), kernels="numba").step is not None
    model = load(converted("qwen2-tiny", "gguf", "q8_0"), kernels="numba", activations="q8")
    cache = model.make_cache(1, 4)
    assert model.step.runs(1, 1, cache)
    model.workspace.activations = "float"
    assert not model.step.runs(1, 1, cache)


def test_a_model_without_the_compiled_step_says_why(converted: Converted, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Each reason the step is refused is named once, in ``model.step_refusal`` and the log (``qwen-run --stats``
    prints it): the numpy kernels; a layer whose mixer does not describe itself (a new mixer); a matrix whose
    stored type has no compiled row kernel (here: a Q8_0 matrix swapped for a numpy-kernel one)."""
    path = converted("qwen2-tiny", "gguf", "q8_0")
    assert "numpy kernels" in load(path, kernels="numpy").step_refusal
    model = load(path, kernels="numba")
    assert model.step is not None and model.step_refusal is None
    monkeypatch.delattr(Attention, "step_parts")
    with caplog.at_level(logging.INFO, logger="qwen_runtime.models.transformer"):
        refused = load(path, kernels="numba")
    assert refused.step is None
    assert refused.step_refusal == "layer 0: its Attention mixer does not describe itself to the compiled step " \
                                   "(step_parts)"
    assert [r.getMessage() for r in caplog.records] == [f"{path}: decode steps run op by op: {refused.step_refusal}"]
    monkeypatch.undo()
    wq = model.blocks[1].mixer.wq
    wq.compiled, saved = False, wq.compiled
    assert DecodeStep.offer(model.config, model.blocks, model.workspace) == \
        "layer 1: 'blk.1.attn_q.weight' has no compiled row kernel"
    wq.compiled = saved
