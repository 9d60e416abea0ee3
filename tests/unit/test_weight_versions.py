"""Weight versions are ordered as versions, never as strings."""

from __future__ import annotations

from proxy.weight_versions import version_key, version_range


def test_numbers_and_numbered_labels_order_as_numbers() -> None:
    assert version_range(["10", "9", None]) == ("9", "10")
    assert version_range(["step-10", "step-9"]) == ("step-9", "step-10")
    assert version_range(["v1.10", "v1.2"]) == ("v1.2", "v1.10")
    assert version_range([None, None]) == (None, None)
    assert sorted(["2.5", "10", "1e3x", "abc"], key=version_key) == ["2.5", "10", "1e3x", "abc"]
