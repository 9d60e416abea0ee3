"""The start-up heap is frozen out of garbage collection: a full collection while serving would
otherwise walk the tokenizer's and templates' objects and stall one turn for 60-200 ms."""

from __future__ import annotations

import gc
import warnings

from proxy.app import YOUNG_GC_THRESHOLD
from tests.conftest import ProxyFactory


def test_the_start_up_heap_is_frozen_before_the_first_turn(start_proxy: ProxyFactory) -> None:
    gc.unfreeze()
    # What earlier tests in this process left for the collector (a client socket they did not
    # close) is collected here, not inside the proxy's start-up, where the warning would fail it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    with start_proxy():
        # The proxy's lifespan ran in this process: everything it built is in the permanent generation.
        assert gc.get_freeze_count() > 100_000
    gc.unfreeze()


def test_serving_collects_the_young_generation_less_often(start_proxy: ProxyFactory) -> None:
    """A turn allocates thousands of containers: at CPython's 700 its young generation was collected
    several times a turn (bench.concurrency; the measure is in proxy/app.py)."""
    before = gc.get_threshold()
    try:
        with start_proxy():
            assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, before[1], before[2])
    finally:
        gc.set_threshold(*before)
