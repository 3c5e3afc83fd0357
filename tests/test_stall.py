"""The stall check posts arrivals to the store it is given (the one the world was built on) and
names the ranks that did not arrive."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from testbed.stall import KEY, Arrivals

pytestmark = pytest.mark.unit


def test_arrivals_post_to_the_store_they_are_given_and_name_who_is_missing() -> None:
    store = dist.HashStore()  # no process group: nothing but this store to post to
    arrivals = Arrivals(0, 3, 60.0, store)
    try:
        arrivals.arrive(5)
        deadline = time.monotonic() + 5.0
        while not store.check([KEY.format(0)]) and time.monotonic() < deadline:
            time.sleep(0.01)
        store.set(KEY.format(1), f"5:{time.time()}")  # rank 1 arrived; rank 2 never posted
        assert arrivals.missing(5) == ([2], {0: 5, 1: 5})
    finally:
        arrivals.close()
