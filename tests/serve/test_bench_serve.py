"""scripts/bench_serve.py's summaries and table rows from a run's samples (no server is started here)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

bench_serve = pytest.importorskip("bench_serve")
Sample = bench_serve.Sample


def sweep(clients: int, rounds: int, tokens: int, wall: float) -> list[Sample]:
    return [Sample("sweep", clients, r * clients + i, 0.5 + i, wall, tokens, 40, 10.0, round=r, wall=wall)
            for r in range(rounds) for i in range(clients)]


def turns(turn1: float, turn2: float) -> list[Sample]:
    return [Sample("turn1", 1, c, turn1 + c, 9.0, 16, 1500, 10.0) for c in range(3)] + \
        [Sample("turn2", 1, c, turn2 + c, 2.0, 16, 1530, 10.0) for c in range(3)]


def test_aggregate_is_tokens_over_the_rounds_wall_time() -> None:
    one = bench_serve.summarize_sweep(sweep(1, 3, 64, 4.0))  # 3 rounds of 4 s, 64 tokens each
    assert one["aggregate_tps"] == pytest.approx(192 / 12)
    eight = bench_serve.summarize_sweep(sweep(8, 1, 64, 8.0))
    assert eight["aggregate_tps"] == pytest.approx(64) and eight["ttft_p50"] == pytest.approx(4.0)


def test_table_puts_both_servers_side_by_side() -> None:
    runs = [{"server": "qwen-serve", "model": "/m/a.gguf", "load_before": [1.0], "load_after": [1.0],
             "samples": [asdict(s) for s in sweep(1, 3, 64, 4.0) + sweep(8, 1, 64, 8.0) + turns(10.0, 1.0)]},
            {"server": "llama-server", "model": "/m/a.gguf", "load_before": [1.0], "load_after": [1.0],
             "samples": [asdict(s) for s in sweep(1, 3, 64, 2.0) + sweep(8, 1, 64, 16.0) + turns(8.0, 6.0)]}]
    text = bench_serve.table({"date": "2026-12-01 18:00 UTC", "commit": "0123456789abcdef", "dirty": False,
                              "machine": "m", "threads": 2, "max_batch": 16, "max_tokens": 64, "runs": runs})
    assert "commit 0123456" in text and "a.gguf:" in text
    assert "| 1 | 16.00 | 32.00 | 0.50x |" in text and "| 8 | 64.00 | 32.00 | 2.00x |" in text
    assert "| qwen-serve | 1500 | 11.00 | 2.00 | 5.5x |" in text
    assert "| llama-server | 1500 | 9.00 | 7.00 | 1.3x |" in text


def test_hostile_rounds_are_summarised_from_their_samples() -> None:
    """--hostile-rounds: content chunks are told from role and [DONE] lines, and the summary line reads the
    stream's gaps, the hostile statuses and times, the benign TTFT and the RSS growth from the run's record."""
    assert bench_serve.has_content(b'data: {"choices": [{"delta": {"content": "x"}}]}')
    assert not bench_serve.has_content(b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}')
    assert not bench_serve.has_content(b"data: [DONE]") and not bench_serve.has_content(b"")
    assert bench_serve.gaps_ms([0.0, 0.01, 0.05]) == pytest.approx(
        {"chunks": 3, "worst_gap_ms": 40.0, "median_gap_ms": 25.0})
    run = {"alone": {"worst_gap_ms": 45.0}, "beside": {"worst_gap_ms": 56.0, "median_gap_ms": 30.0},
           "memory_before_kib": {"VmRSS": 1024}, "memory_after_kib": {"VmRSS": 3072},
           "hostile": [{"status": 400, "seconds": 0.02}, {"status": 400, "seconds": 0.05}],
           "benign": [{"ttft": 0.3}, {"ttft": 0.4}]}
    line = bench_serve.hostile_line(run)
    assert "worst gap 56 ms beside them (45 alone)" in line and "statuses [400], slowest 0.050 s" in line
    assert "benign TTFT max 0.40 s" in line and "RSS growth 2.0 MiB" in line
    assert len(bench_serve.hostile_schema_set()) == 5
