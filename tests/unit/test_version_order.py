"""Weight versions compare in their natural order, never as strings."""

from __future__ import annotations

from proxy.weight_versions import at_least, sorted_versions, version_key


def test_numbers_compare_by_value() -> None:
    assert sorted_versions(["10", "9", None, "100", "2.5"]) == ["2.5", "9", "10", "100"]
    assert version_key("9") < version_key("10")


def test_numbered_names_compare_their_numbers() -> None:
    assert sorted_versions(["step-10", "step-9", "step-100"]) == ["step-9", "step-10", "step-100"]
    assert sorted_versions(["v1.10", "v1.9", "v2.0"]) == ["v1.9", "v1.10", "v2.0"]


def test_at_least() -> None:
    assert at_least("10", "9")
    assert not at_least("9", "10")
    assert at_least("step-12", "step-9")
    assert not at_least(None, "1")  # an unknown version is not known to be fresh


def test_an_empty_output_has_no_spans_and_spans_of_one_version_are_joined() -> None:
    from proxy.weight_versions import covering, labelled

    assert covering([{"version": "v1", "start": 0, "end": 0}], 0) is None
    spans: list[dict[str, object]] = [
        {"version": "default", "start": 0, "end": 2},
        {"version": None, "start": 2, "end": 3},
        {"version": "v2", "start": 3, "end": 5},
    ]
    assert labelled(spans, "v1") == [
        {"version": "v1", "start": 0, "end": 3},
        {"version": "v2", "start": 3, "end": 5},
    ]


def test_labels_order_by_the_numbers_they_hold() -> None:
    """SGLang's default `initial`, `v0` and bare steps in one run: a version older than the bound never
    passes it because of its text (a label once sorted after every number, so `v0` >= `1000000`)."""
    assert sorted_versions(["3", "v0", "initial", "step-2", "1"]) == ["initial", "v0", "1", "step-2", "3"]
    assert not at_least("v0", "1")
    assert not at_least("v0", "1000000")
    assert not at_least("initial", "5")
    assert at_least("v7", "5")
    assert at_least("step-5", "5")
