"""FreeBlockQueue: order of every operation, and misuse is caught."""
from __future__ import annotations

import pytest

from prefixcache.scheduler.kv_cache import FreeBlockQueue


def test_operations_keep_exact_order():
    queue = FreeBlockQueue(range(6))
    assert queue.popleft_n(2) == [0, 1]
    assert list(queue) == [2, 3, 4, 5]
    queue.remove_n([4, 2])
    assert list(queue) == [3, 5]
    queue.append_n([1, 0])
    assert list(queue) == [3, 5, 1, 0]
    queue.push_front_n([4, 2])  # pushed one after another: the last pushed is the new head
    assert list(queue) == [2, 4, 3, 5, 1, 0]
    assert len(queue) == 6 and 4 in queue and 9 not in queue
    assert queue.popleft_n(0) == []


def test_misuse_raises_runtime_error():
    queue = FreeBlockQueue(range(3))
    with pytest.raises(RuntimeError):
        queue.popleft_n(4)
    with pytest.raises(RuntimeError):
        queue.remove_n([7])
    with pytest.raises(RuntimeError):
        queue.append_n([1])
    with pytest.raises(RuntimeError):
        queue.push_front_n([2])
    assert list(queue) == [0, 1, 2]
