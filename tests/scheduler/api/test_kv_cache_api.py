"""The KvCache service over real gRPC on the simulated worker: the KV events stream rebuilds the cached
hashes through evictions, resets and a worker loss; gaps are told in-band; the snapshot resyncs; the
diagnosis predicts what twice the memory would hit; bad input is refused by field."""
from __future__ import annotations

import asyncio
import contextlib
import random

import grpc
import pytest
from engine_harness import SPECIAL_IDS, engine_api
from sim_worker import SimulatedWorker

from prefixcache.bench.workloads import IntRange, WorkloadOptions, thrash
from prefixcache.client import EngineClient, build_request
from prefixcache.protos.engine.v1 import kv_cache_pb2 as pb
from prefixcache.scheduler.engine import EngineCore
from prefixcache.scheduler.kv_cache import BlocksRemoved, BlocksStored
from prefixcache.tokenizer.text import TextTokenizer


class Replica:
    """What a KV events reader rebuilds: the cached hashes after each batch, by sequence number."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.epoch: int | None = None
        self.by_seq: dict[int, frozenset[bytes]] = {}
        self.last_seq = 0
        self.gaps: list[pb.KvEventsGap] = []

    def apply(self, message: pb.KvEventsMessage) -> None:
        if message.HasField("gap"):
            self.gaps.append(message.gap)
            return
        batch = message.batch
        assert self.last_seq == 0 or batch.seq == self.last_seq + 1, "batches out of order"
        kinds = [event.WhichOneof("event") for event in batch.events]
        assert (batch.epoch != self.epoch) == (kinds == ["cleared"]), "an epoch changes exactly with a clear"
        for event in batch.events:
            if event.HasField("stored"):
                stored = event.stored
                assert stored.token_count == len(stored.block_hashes) * stored.block_size == len(stored.block_hashes) * 4
                self.held.update(stored.block_hashes)
            elif event.HasField("removed"):
                assert self.held.issuperset(event.removed.block_hashes), "removed what was never stored"
                self.held.difference_update(event.removed.block_hashes)
            else:
                self.held.clear()
        self.epoch, self.last_seq = batch.epoch, batch.seq
        self.by_seq[batch.seq] = frozenset(self.held)


async def read_into(replica: Replica, engine: EngineClient, from_seq: int | None = None) -> None:
    async for message in engine.kv_events(from_seq):
        replica.apply(message)


def check_every_batch_against(engine: EngineCore) -> list[int]:
    """At every batch the engine publishes, what its events describe equals what its cache holds."""
    held: set[bytes] = set()
    checked: list[int] = []

    def check() -> None:
        batch = engine.kv_events.get(engine.kv_events.last_seq)
        for event in batch.events:
            if isinstance(event, BlocksStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlocksRemoved):
                held.difference_update(event.block_hashes)
            else:
                held.clear()
        _, seq, hashes = engine.cached_blocks()
        assert (seq, held) == (batch.seq, set(hashes)), batch.seq
        checked.append(seq)

    engine.kv_events.add_listener(check)
    return checked


def test_the_kv_events_stream_rebuilds_the_cached_hashes_through_evictions_resets_and_a_worker_loss(
        tokenizer: TextTokenizer) -> None:
    rng = random.Random(11)
    prefixes = [[rng.randrange(100, 5000) for _ in range(rng.randint(4, 40))] for _ in range(8)]
    worker = SimulatedWorker(num_kv_blocks=40, vocab_size=tokenizer.vocab_size, eos_token_ids=SPECIAL_IDS)

    async def main() -> None:
        async with engine_api(tokenizer, executor=worker) as (target, engine), EngineClient(target) as client:
            checked = check_every_batch_against(engine)
            replica = Replica()
            reader = asyncio.create_task(read_into(replica, client, from_seq=1))
            snapshots: list[pb.CachedBlocks] = []
            lost = False

            async def one(index: int) -> None:
                prompt = rng.choice(prefixes) + [rng.randrange(100, 5000) for _ in range(rng.randint(0, 12))]
                with contextlib.suppress(grpc.aio.AioRpcError):  # the worker loss fails what was streaming
                    await client.complete(build_request(token_ids=prompt, max_tokens=rng.randint(1, 8),
                                                        request_id=f"r{index}"))
                snapshots.append(await client.cached_blocks())

            for wave in range(25):
                if wave == 12 and not lost:
                    worker.fail_next_step()
                    lost = True
                await asyncio.gather(*(one(wave * 10 + i) for i in range(rng.randint(1, 4))))
                if rng.random() < 0.25:
                    await client.reset_prefix_cache()  # refused (False) while anything holds a block
                snapshots.append(await client.cached_blocks())
            while replica.last_seq < engine.kv_events.last_seq:
                await asyncio.sleep(0.01)
            reader.cancel()
            stats = await client.cache_stats()
            assert stats.evictions > 10 and worker.initializations == 2
            assert len(checked) == engine.kv_events.last_seq - 1  # every batch after the first
            assert len({s.epoch for s in snapshots}) >= 3  # start, the loss, at least one reset
            for snapshot in snapshots:
                assert replica.by_seq[snapshot.seq] == set(snapshot.block_hashes), snapshot.seq
            assert not replica.gaps

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_reader_behind_the_replay_buffer_is_told_in_band_and_resyncs_from_a_snapshot(tokenizer: TextTokenizer) -> None:
    async def main() -> None:
        async with engine_api(tokenizer, num_kv_blocks=30) as (target, engine), EngineClient(target) as client:
            engine.kv_events.max_buffered_entries = 12
            for index in range(8):
                await client.complete(build_request(token_ids=list(range(200 + 20 * index, 220 + 20 * index)),
                                                    max_tokens=2))
            oldest = engine.kv_events.oldest_seq
            assert oldest > 2
            snapshot = await client.cached_blocks()
            messages = client.kv_events(from_seq=1)
            gap = (await messages.read()).gap
            assert (gap.first_missed_seq, gap.resume_seq) == (1, oldest)
            replica = Replica()
            # Resync: the snapshot, then the batches after it.
            replica.held, replica.epoch, replica.last_seq = set(snapshot.block_hashes), snapshot.epoch, snapshot.seq
            for _ in range(oldest, snapshot.seq + 1):
                await messages.read()  # batches the snapshot already covers
            await client.complete(build_request(token_ids=list(range(900, 930)), max_tokens=2))
            replica.apply(await messages.read())
            assert replica.held == set((await client.cached_blocks()).block_hashes)
            messages.cancel()
            assert engine.metrics.kv_events_dropped == oldest - 1

    asyncio.run(asyncio.wait_for(main(), 60))


def test_bad_input_is_refused_naming_the_field(tokenizer: TextTokenizer) -> None:
    async def main() -> None:
        async with engine_api(tokenizer) as (target, engine), EngineClient(target) as client:
            future = engine.kv_events.next_seq + 1
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.kv_events(from_seq=future).read()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith(f"from_seq: {future} is beyond the next batch")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.diagnose(window=-3)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith("window: must be >= 0")

    asyncio.run(asyncio.wait_for(main(), 60))


def test_cache_stats_count_missed_tokens_by_reason_and_name_the_model(tokenizer: TextTokenizer) -> None:
    async def main() -> None:
        async with engine_api(tokenizer, num_kv_blocks=12) as (target, _), EngineClient(target) as client:
            prefix = list(range(300, 332))  # 8 blocks
            await client.complete(build_request(token_ids=prefix + [7, 7], max_tokens=1))  # cold, 2-token tail
            await client.complete(build_request(token_ids=prefix, max_tokens=1))  # full hit: the last block capped
            await client.complete(build_request(token_ids=list(range(600, 640)), max_tokens=1))  # evicts the prefix
            await client.complete(build_request(token_ids=prefix + [8], max_tokens=1))  # evicted
            stats = await client.cache_stats()
            assert stats.model_name == "sim-model" and stats.lookups == 4 and stats.evicted_lookups == 1
            missed = dict(stats.missed_tokens_by_reason)
            assert missed.keys() == {"cold", "evicted", "capped", "partial_tail"}
            assert (missed["cold"], missed["capped"], missed["partial_tail"]) == (32 + 40, 4, 2 + 1)
            assert 0 < missed["evicted"] <= 32
            assert stats.hit_tokens + sum(missed.values()) == stats.query_tokens
            assert stats.idle_cached_blocks == stats.cached_blocks > 0  # nothing runs

    asyncio.run(asyncio.wait_for(main(), 60))


def run_thrash(tokenizer: TextTokenizer, num_kv_blocks: int) -> tuple[float, pb.CacheDiagnosis]:
    """The thrash workload one request at a time: (measured hit rate, the diagnosis afterwards)."""
    options = WorkloadOptions(thrash_prefixes=8, prefix_len=24, suffix_len=IntRange(2, 6), output_len=2, seed=5)

    async def main() -> tuple[float, pb.CacheDiagnosis]:
        async with engine_api(tokenizer, num_kv_blocks=num_kv_blocks) as (target, _), EngineClient(target) as client:
            prompt_tokens = cached_tokens = 0
            for request in thrash(options):
                completion = await client.complete(build_request(token_ids=request.prompt_token_ids, max_tokens=2))
                prompt_tokens += completion.usage.prompt_tokens
                cached_tokens += completion.usage.cached_tokens
            return cached_tokens / prompt_tokens, await client.diagnose()

    return asyncio.run(asyncio.wait_for(main(), 120))


def test_diagnose_predicts_the_hit_rate_of_twice_the_memory_from_a_thrashing_run(tokenizer: TextTokenizer) -> None:
    """Eight 6-block prefixes visited in turn, three times: 40 blocks hold about five of them, so every
    visit misses (LRU's worst case); 80 hold them all. What the 40-block run predicts for 2x is what
    the 80-block run measures, and the verdict says to raise the budget."""
    small_rate, diagnosis = run_thrash(tokenizer, 40)
    double_rate, _ = run_thrash(tokenizer, 80)
    what_if = {w.memory_factor: w.hit_rate for w in diagnosis.what_if}
    assert small_rate < 0.05 and double_rate > 0.4
    assert abs(what_if[2.0] - double_rate) <= 0.05, (what_if, double_rate)
    assert abs(what_if[1.0] - small_rate) <= 0.05 and diagnosis.hit_rate == pytest.approx(small_rate)
    assert diagnosis.verdict.startswith("thrashing: raise the KV budget to ")
    assert 1.0 < diagnosis.recommended_memory_factor <= 2.0
    assert diagnosis.evicted_lookups == 16 and diagnosis.evicted_miss_share > 0.5
    assert [p.count for p in diagnosis.top_evicted_prefixes] == [2] * 8  # each prefix came back twice
    assert diagnosis.median_evicted_age_s > 0
