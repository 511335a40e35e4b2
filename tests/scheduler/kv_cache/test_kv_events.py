"""The KV events log: numbered batches, epochs that change when the content is dropped, a bounded
replay buffer; and the manager reports to it exactly the hashes it holds."""
from __future__ import annotations

import random

from prefixcache.block_identity.hashing import BlockExtras, BlockHasher
from prefixcache.scheduler.kv_cache import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    KVCacheManager,
    KvEventBatch,
    KvEventLog,
    KVRequest,
)


def apply(held: set[bytes], batch: KvEventBatch) -> None:
    for event in batch.events:
        if isinstance(event, BlocksStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlocksRemoved):
            assert held.issuperset(event.block_hashes)
            held.difference_update(event.block_hashes)
        else:
            held.clear()


def test_the_first_batch_opens_an_epoch_and_a_clear_opens_the_next() -> None:
    log = KvEventLog()
    first = log.get(1)
    assert first.events == (CacheCleared(),) and first.epoch == log.epoch and log.last_seq == 1
    log.publish()  # nothing pending: no batch
    assert log.next_seq == 2
    log.stored([b"a", b"b"], None, 16)
    log.removed([b"x"])
    log.publish()
    assert log.get(2).events == (BlocksStored((b"a", b"b"), None, 16, False, False), BlocksRemoved((b"x",)))
    assert log.get(2).events[0].token_count == 32
    log.stored([b"c"], b"b", 16)
    log.cleared()  # publishes what is pending first, then the clear, in a new epoch
    assert log.get(3).epoch == first.epoch and log.get(4).events == (CacheCleared(),)
    assert log.get(4).epoch != first.epoch
    log.cleared()  # already empty: nothing to tell
    assert log.last_seq == 4


def test_the_replay_buffer_keeps_the_newest_batches() -> None:
    log = KvEventLog(max_buffered_entries=10)
    for i in range(20):
        log.stored([bytes([i]), bytes([i, 1])], None, 4)  # 3 entries a batch
        log.publish()
    assert log.last_seq == 21 and log.oldest_seq == 19  # 3 batches of 3 fit, not a fourth
    assert log.get(18) is None and log.get(19).seq == 19


def test_the_events_rebuild_the_managers_cached_hashes_after_every_step() -> None:
    """Random requests over a small pool (duplicates, evictions, resets): after every published batch
    the hashes the events describe are exactly the ones some block holds."""
    rng = random.Random(3)
    log = KvEventLog()
    manager = KVCacheManager(24, BlockHasher(4, "sha256", "m"), events=log)
    held: set[bytes] = set()
    applied = 0
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 30))] for _ in range(6)]
    running: list[KVRequest] = []
    for step in range(600):
        action = rng.random()
        if action < 0.45 and len(running) < 4:
            salt = rng.choice([None, "t"])
            request = KVRequest(f"r{step}", rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(0, 9))],
                                BlockExtras(cache_salt=salt))
            hits, _ = manager.get_computed_blocks(request)
            if manager.allocate_slots(request, len(request.token_ids) - len(hits) * 4, hits) is not None:
                running.append(request)
        elif action < 0.9 and running:
            manager.free(running.pop(rng.randrange(len(running))).request_id)
        elif not running:
            assert manager.reset_prefix_cache()
        manager.publish_events()
        while applied < log.last_seq:
            applied += 1
            apply(held, log.get(applied))
        assert held == set(manager.cached_hashes()), step
    assert manager.stats().evictions > 20
