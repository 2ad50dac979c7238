"""qwen-eval: strided windows, perplexity/KL/top-1 against a direct numpy computation, quantized bounds, CLI."""

from __future__ import annotations

import dataclasses
import json
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import Converted, fixture_dir

import qwen_runtime
from qwen_runtime.eval_cli import main as eval_main
from qwen_runtime.generation.evaluate import (
    NAME_COLUMN,
    EvalResult,
    ReferenceStats,
    VocabularyMismatchError,
    count_targets,
    encode_text,
    evaluate,
    evaluate_ids,
    plan_windows,
    results_table,
    short_names,
)

TEXT = Path(textwrap.__file__).read_text(encoding="utf-8")  # stable real text (Python source)


@pytest.fixture(scope="module")
def qwen3() -> qwen_runtime.Model:
    return qwen_runtime.load(fixture_dir("qwen3-tiny"))


@pytest.fixture(scope="module")
def qwen2() -> qwen_runtime.Model:
    return qwen_runtime.load(fixture_dir("qwen2-tiny"))


@pytest.mark.parametrize(("n", "ctx", "stride"), [(10, 4, 2), (200, 48, 16), (97, 32, 31), (5, 8, 4), (2, 2, 1)])
def test_windows_score_every_token_after_the_first_once(n: int, ctx: int, stride: int) -> None:
    scored = [j for w in plan_windows(n, ctx, stride) for j in range(w.first_target, w.end)]
    assert scored == list(range(1, n))
    for w in plan_windows(n, ctx, stride):
        assert w.end - w.begin <= ctx and w.begin < w.first_target
        assert w.first_target - w.begin >= min(ctx - stride, w.first_target)  # context of the first target


def test_non_overlapping_windows_skip_each_windows_first_token() -> None:
    windows = plan_windows(10, 4, 4)
    assert [(w.begin, w.end, w.first_target) for w in windows] == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    assert count_targets(10, 4, 4) == 7


@pytest.mark.parametrize(("ctx", "stride"), [(1, 1), (8, 0), (8, 9)])
def test_invalid_windows_are_rejected(ctx: int, stride: int) -> None:
    with pytest.raises(ValueError, match="ctx|stride"):
        plan_windows(100, ctx, stride)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _direct(model, reference, ids: np.ndarray, ctx: int, stride: int) -> dict[str, float]:
    """Whole-window logits from ``model.logits``, scored by hand (independent of the streaming code)."""
    nll, ref_nll, kl, agree = [], [], [], []
    prev_end = 0
    for begin in range(0, len(ids), stride):  # HF's loop, with the first token of the text unscored
        end = min(begin + ctx, len(ids))
        lp = _log_softmax(model.logits(ids[None, begin:end])[0])
        rp = _log_softmax(reference.logits(ids[None, begin:end])[0])
        for j in range(max(prev_end, begin + 1), end):
            nll.append(-lp[j - 1 - begin, ids[j]])
            ref_nll.append(-rp[j - 1 - begin, ids[j]])
            p = np.exp(rp[j - 1 - begin])
            kl.append(float((p * (rp[j - 1 - begin] - lp[j - 1 - begin])).sum()))
            agree.append(rp[j - 1 - begin].argmax() == lp[j - 1 - begin].argmax())
        prev_end = end
        if end == len(ids):
            break
    kl = np.array(kl)
    return {"n": len(nll), "ppl": float(np.exp(np.mean(nll))), "ref_ppl": float(np.exp(np.mean(ref_nll))),
            "kl_mean": kl.mean(), "kl_p99": np.percentile(kl, 99), "kl_max": kl.max(), "kl_median": np.median(kl),
            "top1": float(np.mean(agree))}


@pytest.mark.parametrize(("ctx", "stride", "chunk"), [(48, 16, 20), (64, 64, 64), (40, 39, 7)])
def test_matches_direct_computation(qwen3, qwen2, ctx: int, stride: int, chunk: int) -> None:
    ids = encode_text(qwen3, TEXT, max_tokens=181)
    [r] = evaluate_ids([qwen3], ids, ctx, stride, reference=qwen2, chunk=chunk)
    want = _direct(qwen3, qwen2, ids, ctx, stride)
    v = r.vs_reference
    assert (r.tokens, r.scored) == (181, want["n"])
    assert r.perplexity == pytest.approx(want["ppl"], rel=1e-5)
    assert v.reference_perplexity == pytest.approx(want["ref_ppl"], rel=1e-5)
    assert v.delta_perplexity == pytest.approx(want["ppl"] - want["ref_ppl"], rel=1e-4)
    for key in ("kl_mean", "kl_median", "kl_p99", "kl_max"):
        assert getattr(v, key) == pytest.approx(want[key], rel=1e-4), key
    assert v.top1_agreement == pytest.approx(want["top1"], abs=1 / want["n"])  # one near-tie may flip


def test_a_model_against_itself_has_zero_kl_and_full_agreement(qwen3) -> None:
    [r] = evaluate([qwen3], TEXT, ctx=32, stride=16, reference=qwen3, max_tokens=100)
    assert r.vs_reference.kl_max == 0.0 and r.vs_reference.top1_agreement == 1.0
    assert r.vs_reference.delta_perplexity == 0.0


def test_several_models_in_one_pass_equal_separate_runs(qwen3, qwen2) -> None:
    both = evaluate([qwen3, qwen2], TEXT, ctx=32, stride=16, reference=qwen2, max_tokens=90)
    [alone] = evaluate([qwen3], TEXT, ctx=32, stride=16, reference=qwen2, max_tokens=90)
    assert both[0].perplexity == alone.perplexity and both[0].vs_reference == alone.vs_reference
    assert both[1].vs_reference.kl_max == 0.0


def test_different_tokenizers_are_refused(qwen3, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(fixture_dir("qwen3-tiny"), other)
    tok = json.loads((other / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    with pytest.raises(VocabularyMismatchError, match="different tokenizers"):
        evaluate([qwen3], TEXT, ctx=32, stride=16, reference=qwen_runtime.load(other), max_tokens=50)


def test_ctx_beyond_the_model_context_is_refused(qwen3) -> None:
    with pytest.raises(ValueError, match="context length"):
        evaluate([qwen3], TEXT, ctx=qwen3.config.max_position_embeddings + 1, stride=8, max_tokens=50)


# Bounds for converted copies of the bf16 fixture (KL(source || copy) per token, on textwrap.py).
# fp32 widens bf16 exactly and fp16 holds every normal bf16 value of these weights exactly, so only the
# float32 summation order differs: KL ~1e-12.  q8_0 rounds each weight to 1/254 of its block's absmax;
# measured KL mean 1.6e-3, max 1.0e-2, top-1 96%, |Δppl| 0.4%: the bounds leave ~6x margin.
KL_BOUNDS = {"fp32": (1e-6, 1e-6, 1.0), "fp16": (1e-6, 1e-6, 1.0), "q8_0": (1e-2, 6e-2, 0.85)}


@pytest.mark.parametrize("fmt", ["npy", "gguf"])
def test_converted_copies_stay_within_kl_bounds(converted: Converted, qwen3, fmt: str) -> None:
    models = [qwen_runtime.load(converted("qwen3-tiny", fmt, dtype)) for dtype in KL_BOUNDS]
    results = evaluate(models, TEXT, ctx=64, stride=32, reference=qwen3, max_tokens=400)
    for dtype, r in zip(KL_BOUNDS, results, strict=True):
        mean_bound, max_bound, top1_bound = KL_BOUNDS[dtype]
        v = r.vs_reference
        assert v.kl_mean <= mean_bound and v.kl_max <= max_bound, (dtype, v)
        assert v.top1_agreement >= top1_bound, (dtype, v)
        assert abs(v.delta_perplexity) / v.reference_perplexity <= (1e-6 if dtype != "q8_0" else 3e-2)


def test_cli_json_and_table(tmp_path: Path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    model = str(fixture_dir("qwen3-tiny"))
    assert eval_main([model, "-f", str(text), "--ctx", "32", "--stride", "16", "--max-tokens", "80", "--json",
                      "--reference", str(fixture_dir("qwen2-tiny"))]) == 0
    [r] = json.loads(capsys.readouterr().out)["results"]
    assert (r["tokens"], r["scored"], r["ctx"], r["stride"]) == (80, 79, 32, 16)
    assert "stride 16" in r["method"] and r["vs_reference"]["kl_mean"] > 0
    assert eval_main([model, "-f", str(text), "--ctx", "32", "--max-tokens", "40"]) == 0
    out = capsys.readouterr().out
    assert "sliding window of 32 tokens, stride 16" in out and "39 scored" in out


def test_the_cli_reference_keeps_an_exact_cache_so_kl_measures_the_models_cache_type(tmp_path: Path, capsys) -> None:
    """Issue 44: ``--reference M`` runs M with an f32 cache whatever ``-ctk/-ctv`` the models take (their default
    is f16), so a model against itself differs by its cache type alone: zero with f32, above zero with f16."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    model = str(fixture_dir("qwen3-tiny"))
    kl = {}
    for types in ([], ["-ctk", "f32", "-ctv", "f32"]):
        assert eval_main([model, "-f", str(text), "--ctx", "32", "--max-tokens", "64", "--json", "--reference", model,
                          *types]) == 0
        [r] = json.loads(capsys.readouterr().out)["results"]
        kl[tuple(types)] = r["vs_reference"]["kl_mean"]
    assert kl[()] > 0 and kl[("-ctk", "f32", "-ctv", "f32")] == 0


def test_cli_errors_are_one_line(tmp_path: Path, capsys) -> None:
    model = str(fixture_dir("qwen3-tiny"))
    assert eval_main([model, "-f", str(tmp_path / "missing.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qwen-eval: error:") and "missing.txt" in err and err.count("\n") == 1


def test_help_states_the_method(capsys) -> None:
    with pytest.raises(SystemExit):
        eval_main(["--help"])
    out = capsys.readouterr().out
    assert "--stride" in out and "KL(ref || model)" in out and "previous window" in out


def test_memory_does_not_grow_with_the_text(qwen3, qwen2) -> None:
    """Peak traced allocations for 1,200 tokens stay within 0.5 MB of those for 300 (a [T, V] float32 array of
    the extra 900 tokens alone would be 1.8 MB)."""
    import tracemalloc

    ids = encode_text(qwen3, TEXT * 3, max_tokens=1200)
    peaks = []
    for n in (300, 1200):
        tracemalloc.start()
        evaluate_ids([qwen3], ids[:n], 64, 32, reference=qwen2)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] - peaks[0] < 500_000, peaks  # measured: no growth (1.67 MB vs 1.58 MB)


def test_table_keeps_its_columns_with_long_paths() -> None:
    long = "/very/long/directory/of/models/" * 4
    ref = ReferenceStats(long + "reference-bf16", 10.0, 0.0, 0, 0, 0, 0, 1.0)
    results = [EvalResult(long + name, 100, 90, 32, 16, "m", 2.3, ppl, 1.0,
                          dataclasses.replace(ref, delta_perplexity=ppl - 10.0))
               for name, ppl in (("a-q8_0.gguf", 10.5), ("b-q4_0.gguf", 12.25))]
    lines = results_table(results).splitlines()
    ppl_end = lines[0].index("ppl") + len("ppl")  # right-aligned column: every value ends where its title does
    values = [line[:ppl_end].split()[-1] for line in lines[1:]]
    assert values == ["10.0000", "10.5000", "12.2500"]
    names = [line[:ppl_end].split()[0] for line in lines[1:]]
    assert all(len(n) <= NAME_COLUMN for n in names) and names[1].endswith("a-q8_0.gguf")
    assert names[0].endswith("reference-bf16") and names[2].endswith("b-q4_0.gguf")
    alike = ["/a/some/dir/model.gguf", "/b/some/dir/model.gguf"]
    assert short_names(alike, 10) == alike  # cut alike, so kept whole
