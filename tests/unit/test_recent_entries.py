"""The caches' shared bookkeeping (proxy/recent_entries.py): least recently used out first, within a
count and a summed cost; a value too costly for its share is not kept; the cost always adds up."""

from __future__ import annotations

from proxy.recent_entries import RecentEntries


def test_the_oldest_go_first_past_either_bound() -> None:
    entries: RecentEntries[str, int] = RecentEntries(max_entries=3, max_bytes=100)
    for n, key in enumerate("abcd"):
        entries.put(key, n, 10)
    assert [entries.get(key) for key in "abcd"] == [None, 1, 2, 3]
    entries.put("e", 4, 85)  # the cost bound: b and c go
    assert [entries.get(key) for key in "bcde"] == [None, None, 3, 4]
    assert entries.bytes == 95
    assert entries.costs() == [10, 85]


def test_a_touched_or_replaced_entry_is_the_most_recent() -> None:
    entries: RecentEntries[str, int] = RecentEntries(max_entries=2, max_bytes=100)
    entries.put("a", 1, 10)
    entries.put("b", 2, 10)
    assert entries.get("a") == 1  # not touched: still the oldest
    entries.put("a", 3, 20)  # replaced: the newest, its cost counted once
    entries.put("c", 4, 10)
    assert (entries.get("a"), entries.get("b"), entries.get("c")) == (3, None, 4)
    assert entries.bytes == 30
    entries.get("a", touch=True)
    entries.put("d", 5, 10)
    assert (entries.get("a"), entries.get("c"), entries.get("d")) == (3, None, 5)
    assert entries.entry("a") == (3, 20)


def test_a_value_over_its_share_is_not_kept_and_drops_what_it_replaces() -> None:
    entries: RecentEntries[str, str] = RecentEntries(max_entries=10, max_bytes=100, largest_share=4)
    entries.put("a", "small", 25)
    entries.put("a", "large", 26)
    assert entries.get("a") is None
    assert len(entries) == 0
    assert entries.bytes == 0
    entries.drop("missing")
    assert entries.bytes == 0
