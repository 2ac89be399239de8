"""Serving-benchmark arithmetic on hand-made request records: percentiles, TPOT, goodput, cost."""

from __future__ import annotations

import pytest

from bench.records import cost_per_million
from bench.serve import summarize_records
from bench.serve_load import RequestRecord
from bench.stats import percentile


def _record(start: float, chunks: list[float], tokens: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(start=start, chunk_times=chunks, end=chunks[-1] if chunks else start,
                         output_tokens=tokens, error=error)


def test_summary_latencies_and_goodput() -> None:
    records = [
        _record(0.0, [0.1, 0.2, 0.3, 0.4, 0.5], 5),  # TTFT 100 ms, TPOT 100 ms
        _record(0.0, [1.0, 1.5, 2.0], 5),  # TTFT 1000 ms (misses the SLO), TPOT 250 ms
        _record(1.0, [1.2, 1.4], 3),  # TTFT 200 ms, TPOT 100 ms (two tokens in the last chunk)
        _record(2.0, [], 0, error="HTTP 500: b'boom'"),
    ]
    out = summarize_records(records, elapsed=4.0, slo_ttft_ms=500.0, slo_tpot_ms=200.0)
    assert out["requests"] == 4 and out["completed"] == 3 and out["errors"] == 1
    assert out["error_samples"] == ["HTTP 500: b'boom'"]
    assert out["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert out["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert out["tpot_ms"]["p99"] == pytest.approx(100.0 + 0.98 * 150.0)
    # chunk gaps: 4 x 100 ms, 2 x 500 ms, 1 x 200 ms
    assert out["itl_ms"]["p50"] == pytest.approx(100.0)
    assert out["itl_ms"]["mean"] == pytest.approx(1600.0 / 7)
    assert out["output_tokens_per_s"] == pytest.approx(13 / 4.0)
    assert out["requests_per_s"] == pytest.approx(3 / 4.0)
    assert out["goodput_requests_per_s"] == pytest.approx(2 / 4.0)  # the slow-TTFT one misses
    assert out["goodput_fraction"] == pytest.approx(2 / 4)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


def test_cost_per_million_tokens() -> None:
    # 1000 tokens/s for an hour = 3.6 M tokens for $3.60 -> $1 per million
    assert cost_per_million(1000.0, 3.60) == pytest.approx(1.0)
