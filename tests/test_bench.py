"""scripts/bench.py's paired ratios from a run's samples (no engine is run here)."""

from __future__ import annotations

import pytest

bench = pytest.importorskip("bench")


def rounds(ours: list[float], llama: list[float]) -> dict[str, list[dict[str, float]]]:
    """One dtype's samples: round i ran ours at ``ours[i]`` and llama.cpp at ``llama[i]`` tok/s (prefill twice that)."""
    return {"ours": [{"decode_tps": o, "prefill_tps": 2 * o} for o in ours],
            "llama": [{"decode_tps": x, "prefill_tps": 2 * x} for x in llama]}


def test_paired_ratios_are_the_median_of_each_rounds_ratio() -> None:
    # the machine slows down over the run: the ratio of the medians (12 / 12 = 1.0) hides that ours led each round
    raw = {"fp32": rounds([22, 13, 12, 11], [20, 12, 12, 10])}
    paired = bench.paired_ratios(raw)["fp32"]
    ratios = sorted([22 / 20, 13 / 12, 12 / 12, 11 / 10])
    assert paired["rounds"] == 4
    assert paired["decode_tps"] == pytest.approx((ratios[1] + ratios[2]) / 2)
    assert (paired["decode_tps_min"], paired["decode_tps_max"]) == (pytest.approx(1.0), pytest.approx(1.1))
    assert paired["prefill_tps"] == pytest.approx(paired["decode_tps"])


def test_paired_ratios_skip_rows_without_both_engines_and_missing_metrics() -> None:
    raw = {"q8_0": {"ours": [{"decode_tps": 50.0}]},  # --no-llama: nothing to pair
           "q4_0": {"ours": [{"decode_tps": 60.0}, {"decode_tps": 66.0}], "llama": [{"decode_tps": 60.0}]}}
    paired = bench.paired_ratios(raw)
    assert list(paired) == ["q4_0"]
    assert paired["q4_0"] == {"rounds": 1, "decode_tps": 1.0, "decode_tps_min": 1.0, "decode_tps_max": 1.0}


def test_paired_lines_name_each_model_and_dtype() -> None:
    paired = {"qwen2.5-0.5b": bench.paired_ratios({"fp32": rounds([18, 20], [20, 20])})}
    lines = bench.paired_lines(paired)
    assert lines[1] == "  qwen2.5-0.5b fp32: prefill 0.95 (0.90-1.00), decode 0.95 (0.90-1.00), 2 rounds"
    assert bench.paired_lines({"qwen2.5-0.5b": {}}) == []


def test_prefill_lengths_are_paired_per_length_and_held_to_issue_46s_targets() -> None:
    def runs(ours: list[float], llama: list[float]) -> list[list[dict[str, float]]]:
        return [[{"prefill_tps": v} for v in ours], [{"prefill_tps": v} for v in llama]]

    short, long = runs([30, 20], [20, 20]), runs([150, 90], [100, 100])
    raw = {"q8_0": {bench.prefill_key("ours", 64): short[0], bench.prefill_key("llama", 64): short[1],
                    bench.prefill_key("ours", 512): long[0], bench.prefill_key("llama", 512): long[1]}}
    paired = bench.prefill_ratios(raw, (64, 512))
    assert paired["q8_0"][64] == {"median": 1.25, "min": 1.0, "max": 1.5, "rounds": 2}
    assert paired["q8_0"][512] == pytest.approx({"median": 1.2, "min": 0.9, "max": 1.5, "rounds": 2})
    found = {t.name: (t.goal, t.met) for t in bench.prefill_targets(paired)}
    assert found == {"q8_0 prefill(64) / llama (paired)": (1.0, True),
                     "q8_0 prefill(512) / llama (paired)": (1.5, False)}
    summary = {"m": {"q8_0": {k: v[0] for k, v in raw["q8_0"].items()}}}
    table = bench.prefill_lines(summary, {"m": paired}, (64, 512))
    assert table[2] == "| m | q8_0 | 30.0 / 20.0 (1.25, 1.00-1.50) | 150.0 / 100.0 (1.20, 0.90-1.50) |"
    assert bench.prefill_lines(summary, {"m": {}}, (64,)) == []


def test_results_files_without_prefill_lengths_still_report() -> None:
    assert bench.plan_of({"plan": {**bench.QUICK.__dict__, "prefills": [64, 512]}}).prefills == (64, 512)
    old = {k: v for k, v in bench.QUICK.__dict__.items() if k != "prefills"}
    assert bench.plan_of({"plan": old}).prefills == ()


def test_prefill_share_of_the_int8_peak() -> None:
    """Prefill's multiply-adds per second (the layers' matrices per token times tok/s) against the machine's int8
    peak on the runtimes' threads; Qwen2.5-0.5B's layer matrices are 357,826,560 weights."""
    config = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
              "num_key_value_heads": 2, "num_hidden_layers": 24, "vocab_size": 151936, "tie_word_embeddings": True}
    assert bench.layer_macs(config) == 357_826_560
    runs = {"m": {"q8_0": {"ours_prefill512": {"prefill_tps": 200.0}, "llama_prefill512": {"prefill_tps": 100.0}}}}
    raw = {"q8_0": {"ours_prefill512": [{"prefill_tps": 200.0}], "llama_prefill512": [{"prefill_tps": 100.0}]}}
    paired = {"m": bench.prefill_ratios(raw, [512])}
    peak = {"int8": 0.1, "float": 0.05, "int8_form": "avx2", "threads": 2}
    lines = bench.prefill_lines(runs, paired, [512], {"m": config}, peak)
    share = 200 * 357_826_560 / (0.1e12 * 2)
    assert f"(2.00, 2.00-2.00; {share:.0%} of the avx2 int8 peak)" in lines[2]
    assert lines[-2].startswith("Machine peak, one thread: 0.100 T int8")
    assert "of the" not in bench.prefill_lines(runs, paired, [512])[2]


def test_long_prompts_per_kv_cache_are_tabled_and_held_to_issue_44s_targets() -> None:
    plan = bench.Plan(context=16384, context_new=32, context_caches=("q8_0",))
    m = {bench.context_key("ours", None): {"prefill_tps": 90.0, "decode_tps": 18.0, "VmHWM": 900.0, "ttft_s": 180.0,
                                          "RssAnon": 150.0},
         bench.context_key("llama", None): {"prefill_tps": 100.0, "decode_tps": 20.0, "VmHWM": 1000.0,
                                           "ttft_s": 160.0, "RssAnon": 600.0},
         bench.context_key("ours", "q8_0"): {"prefill_tps": 80.0, "decode_tps": 15.0, "VmHWM": 1100.0},
         bench.context_key("llama", "q8_0"): {"prefill_tps": 100.0, "decode_tps": 20.0, "VmHWM": 1000.0}}
    assert list(m) == ["ours_context", "llama_context", "ours_context_q8_0", "llama_context_q8_0"]
    table = bench.context_table({"m": {"q8_0": m}}, plan)
    assert table[0] == "Long prompt, 16384 tokens:"
    assert table[3] == ("| m | q8_0 | defaults | 90.0 / 100.0 (0.90) | 180.0 / 160.0 | 18.0 / 20.0 (0.90) "
                        "| 900 / 1000 (0.90) | 150 / 600 |")
    assert table[4].startswith("| m | q8_0 | q8_0 | 80.0 / 100.0 (0.80) |")
    found = {t.name: t.met for t in bench.context_targets({"q8_0": m}, plan)}
    assert found == {"q8_0 @16384, default cache: decode / llama": True,
                     "q8_0 @16384, default cache: prefill / llama": True,
                     "q8_0 @16384, default cache: peak RSS / llama": True,
                     "q8_0 @16384, q8_0 cache: decode / llama": False,
                     "q8_0 @16384, q8_0 cache: prefill / llama": False,
                     "q8_0 @16384, q8_0 cache: peak RSS / llama": False}
    assert bench.plan_of({"plan": {**plan.__dict__, "context_caches": ["q8_0"]}}).context_caches == ("q8_0",)
    assert bench.context_table({"m": {"q8_0": {}}}, plan) == []
