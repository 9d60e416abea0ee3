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
