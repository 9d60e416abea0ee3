"""A context another process recorded is rebuilt from the nearest cached ancestor exactly as from
the segment's root."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.store.codec import pack_ids
from proxy.store.prompts import extend, rebuild


@dataclass(frozen=True)
class Row:
    id: int
    parent_id: int | None
    prompt_added: bytes
    output_ids: bytes
    request: dict[str, Any]
    response_message: dict[str, Any]


def _segment() -> list[Row]:
    """A root and two branches: 1 -> 2 -> 3 -> 5, and 2 -> 4."""
    rows = [
        Row(1, None, pack_ids([1, 2]), pack_ids([3]), {"messages": [{"role": "user", "content": "a"}]}, {})
    ]
    for call_id, parent in ((2, 1), (3, 2), (4, 2), (5, 3)):
        added = {"messages_added": [{"role": "tool", "content": f"r{call_id}"}]}
        reply = {"role": "assistant", "content": f"c{call_id}"}
        rows.append(
            Row(call_id, parent, pack_ids([10 * call_id]), pack_ids([10 * call_id + 1]), added, reply)
        )
    rows[0] = Row(1, None, rows[0].prompt_added, rows[0].output_ids, rows[0].request, {"role": "assistant"})
    return rows


def test_extending_a_cached_ancestor_gives_the_context_a_full_rebuild_gives() -> None:
    rows = _segment()
    by_id = {row.id: row for row in rows}
    whole = rebuild(rows, 5)
    for ancestor, chain in ((3, [5]), (2, [3, 5]), (1, [2, 3, 5])):
        extended = extend(rebuild(rows, ancestor), [by_id[i] for i in chain])
        assert extended.ids.tolist() == whole.ids.tolist()
        assert extended.conversation == whole.conversation
    assert extend(None, [by_id[i] for i in (1, 2, 4)]).ids.tolist() == rebuild(rows, 4).ids.tolist()
