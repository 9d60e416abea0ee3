"""Prompt ids that carry their JSON text (proxy/engines/prompt_json.py) are written exactly as their
values would be; anything derived from them carries none; the engines' bodies take the text as
it is, and write the values of ids that carry none."""

from __future__ import annotations

import numpy as np
import orjson
from hypothesis import given
from hypothesis import strategies as st

from proxy.engines.base import SamplingParams
from proxy.engines.prompt_json import WrittenIds, items_of, joined, json_value, with_items
from proxy.engines.sglang import _request_payload
from proxy.engines.vllm_protocol import completions_payload, generate_payload

ids_lists = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=64)


def _written_from_parts(parts: list[list[int]]) -> np.ndarray:
    """Ids joined part by part as the planner and recorder join them: each step's items from the
    previous step's and the new part's."""
    ids = np.zeros(0, dtype=np.int32)
    items = items_of(ids)
    for part in parts:
        added = np.asarray(part, dtype=np.int32)
        ids = np.concatenate([ids, added])
        items = joined(items, items_of(added))
    return with_items(ids, items)


@given(st.lists(ids_lists, max_size=6))
def test_items_joined_part_by_part_are_the_json_of_the_whole(parts: list[list[int]]) -> None:
    written = _written_from_parts(parts)
    whole = [token for part in parts for token in part]
    assert orjson.loads(orjson.dumps({"ids": json_value(written)})) == {"ids": whole}
    assert orjson.dumps(json_value(written)) == orjson.dumps(whole)


def test_a_slice_or_concatenation_of_written_ids_carries_no_text() -> None:
    written = _written_from_parts([[1, 2, 3], [4, 5]])
    assert isinstance(written, WrittenIds)
    head = written[:2]
    assert getattr(head, "items", None) is None
    assert (
        orjson.dumps(json_value(head), option=orjson.OPT_SERIALIZE_NUMPY) == b"[1,2]"
    )  # written from its values, not the whole's text
    longer = np.concatenate([written, np.asarray([6], dtype=np.int32)])
    assert orjson.dumps(json_value(longer), option=orjson.OPT_SERIALIZE_NUMPY) == b"[1,2,3,4,5,6]"
    assert items_of(head) == b"1,2"


def test_ids_without_text_are_passed_to_the_serializer_as_they_are() -> None:
    plain = np.asarray([7, 8], dtype=np.int32)
    assert json_value(plain) is plain
    assert json_value([7, 8]) == [7, 8]
    assert with_items(plain, None) is plain
    assert items_of([7, 8]) == b"7,8"
    assert items_of(np.zeros(0, dtype=np.int32)) == b""


def test_engine_bodies_hold_the_carried_text() -> None:
    written = _written_from_parts([[10, 11], [12]])
    params = SamplingParams(max_new_tokens=4)
    sglang = orjson.loads(orjson.dumps(_request_payload(written, params, "r" * 32, stream=False)))
    assert sglang["input_ids"] == [10, 11, 12]
    vllm = orjson.loads(orjson.dumps(generate_payload(written, params, "r" * 32, stream=False)))
    assert vllm["token_ids"] == [10, 11, 12]
    completions = completions_payload(written, params, "r" * 32, model="m", max_tokens=4, stream=True)
    assert orjson.loads(orjson.dumps(completions))["prompt"] == [10, 11, 12]
