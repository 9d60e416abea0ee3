"""Weight versions are ordered as versions, never as strings."""

from __future__ import annotations

from proxy.weight_versions import version_key, version_range, version_spans


def test_numbers_and_numbered_labels_order_as_numbers() -> None:
    assert version_range(["10", "9", None]) == ("9", "10")
    assert version_range(["step-10", "step-9"]) == ("step-9", "step-10")
    assert version_range(["v1.10", "v1.2"]) == ("v1.2", "v1.10")
    assert version_range([None, None]) == (None, None)
    # By the numbers each holds: none first, then (1, 3), (2.5,), (10,).
    assert sorted(["2.5", "10", "1e3x", "abc"], key=version_key) == ["abc", "1e3x", "2.5", "10"]


def test_version_spans_cover_the_output_and_name_the_unnamed() -> None:
    engine = [{"version": "default", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 5}]
    assert version_spans(engine, "7", 5) == [
        {"version": "7", "start": 0, "end": 2},
        {"version": "v2", "start": 2, "end": 5},
    ]
    # Spans that do not cover the output are not trusted: one span of the recorded version.
    assert version_spans(engine, "7", 6) == [{"version": "7", "start": 0, "end": 6}]
    assert version_spans(None, None, 0) == []
