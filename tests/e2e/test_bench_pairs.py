"""The benchmarks' added latency: each proxied call paired with the direct call sent just before it,
the median of the pairs' differences reported (bench.harness.PairedRounds), in bench.turn_latency
and bench.streaming_ttft alike."""

from __future__ import annotations

import math

from bench import streaming_ttft
from bench.harness import PairedRounds


def test_the_added_time_is_the_median_of_the_pairs_differences() -> None:
    rounds = PairedRounds((1,))
    rounds.prompt_tokens[1] = 100
    # The host slowed down during the second and third pairs: both calls of a pair slower. The
    # proxy added 1 ms to every call but one; the two medians' difference says 11 ms.
    rounds.direct[1] += [0.009, 0.001, 0.029]
    rounds.via_proxy[1] += [0.010, 0.020, 0.030]
    [(turn, row)] = rounds.rows().items()
    assert turn == "1"
    assert row["added_p50_ms"] == 1.0
    assert row["median_difference_ms"] == 11.0
    assert (row["direct_p50_ms"], row["proxy_p50_ms"], row["prompt_tokens"]) == (9.0, 20.0, 100)


def test_streaming_ttft_reports_paired_rounds() -> None:
    """A brief run of the module (its own stand-in engine and proxy processes): one row per measured
    turn, in PairedRounds' fields, each pair measured."""
    results = streaming_ttft.measure(2, turns=2)
    assert results["sessions"] == 2
    assert set(results["turns"]) == {"1", "2"}
    fields = {
        "prompt_tokens",
        "direct_p50_ms",
        "proxy_p50_ms",
        "added_p50_ms",
        "median_difference_ms",
        "direct_p99_ms",
        "proxy_p99_ms",
    }
    for row in results["turns"].values():
        assert set(row) == fields
        assert row["prompt_tokens"] > 0
        assert row["direct_p50_ms"] > 0
        assert row["proxy_p50_ms"] > 0
        assert all(math.isfinite(row[name]) for name in fields)
