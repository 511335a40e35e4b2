"""EngineCore end to end over the simulated worker: concurrency, caching, cancellation, shutdown,
a crashed step loop. The simulated worker checks every step's diff and the KV every request reads."""
from __future__ import annotations

import asyncio
import re

import pytest
from engine_runs import VOCAB, collect, config, request, run, tokens_of
from sim_worker import SimulatedWorker, reference_generation

from prefixcache.block_identity.hashing import BlockExtras, MultiModalItem
from prefixcache.scheduler.engine import EngineCore, EngineUnavailable, QueueFull, RequestRejected


def test_sixteen_concurrent_streams_complete_with_the_reference_tokens():
    prompts = {f"r{i}": [(i * 7 + j) % VOCAB for j in range(5 + 3 * i)] for i in range(16)}

    async def body(engine, worker):
        results = await asyncio.gather(*(collect(engine.add_request(request(rid, p, 8))) for rid, p in prompts.items()))
        for (rid, prompt), outputs in zip(prompts.items(), results):
            assert tokens_of(outputs) == reference_generation(prompt, 8, VOCAB)
            assert outputs[-1].finished and outputs[-1].finish_reason == "length"
            assert outputs[-1].usage.completion_tokens == 8
        # all 16 ran together: some step had every request in it
        assert max(len(s.num_scheduled_tokens) for s in worker.steps) == 16

    run(body, SimulatedWorker(num_kv_blocks=256, vocab_size=VOCAB), max_num_batched_tokens=512)


@pytest.mark.parametrize("schedule_ahead", [True, False])
def test_decode_steps_are_sent_while_the_step_before_runs_unless_turned_off(schedule_ahead):
    prompts = {f"r{i}": [(i * 11 + j) % VOCAB for j in range(6 + 5 * i)] for i in range(4)}

    async def body(engine, worker):
        results = await asyncio.gather(*(collect(engine.add_request(request(rid, p, 10 + i)))
                                         for i, (rid, p) in enumerate(prompts.items())))
        for i, ((rid, prompt), outputs) in enumerate(zip(prompts.items(), results)):
            assert tokens_of(outputs) == reference_generation(prompt, 10 + i, VOCAB)
        # The simulated worker checked that each step sent ahead ran right after the one it follows.
        followers = [step for step in worker.steps if step.follows_step_id is not None]
        if schedule_ahead:
            assert worker.most_in_flight == 2 and len(followers) > len(worker.steps) // 2
        else:
            assert worker.most_in_flight == 1 and not followers

    run(body, SimulatedWorker(num_kv_blocks=64, vocab_size=VOCAB, step_delay_s=0.002), schedule_ahead=schedule_ahead)


@pytest.mark.parametrize("caching", [True, False])
def test_a_shared_prefix_is_served_from_the_cache_with_the_same_output(caching):
    shared = list(range(300, 341))  # 41 tokens: 10 full blocks

    async def body(engine, worker):
        await collect(engine.add_request(request("first", shared + [1, 2, 3])))
        outputs = await collect(engine.add_request(request("second", shared + [4, 5])))
        assert tokens_of(outputs) == reference_generation(shared + [4, 5], 6, VOCAB)
        usage = outputs[-1].usage
        assert usage.prompt_tokens == 43
        assert usage.cached_tokens == (40 if caching else 0)
        assert outputs[0].cache_account.miss_reason == ("full_hit" if caching else "disabled") or not caching

    run(body, enable_prefix_caching=caching)


def test_preemption_under_a_small_pool_still_gives_every_request_its_tokens():
    worker = SimulatedWorker(num_kv_blocks=12, vocab_size=VOCAB)
    prompts = {f"r{i}": [(i * 31 + j) % VOCAB for j in range(14)] for i in range(6)}

    async def body(engine, worker):
        results = await asyncio.gather(*(collect(engine.add_request(request(rid, p, 20))) for rid, p in prompts.items()))
        for (rid, prompt), outputs in zip(prompts.items(), results):
            assert tokens_of(outputs) == reference_generation(prompt, 20, VOCAB)
        assert sum(s.finished_request_ids != [] for s in worker.steps) > 0
        assert max(o[-1].num_preemptions for o in results) > 0
        counted = re.search(r'^prefixcache_preemptions_total\{model_name="sim-model"\} (\S+)$', engine.metrics.exposition().decode(), re.M)
        assert float(counted[1]) > 0

    run(body, worker)


def test_an_image_enters_the_identity_of_the_blocks_its_placeholders_overlap():
    """On a worker that takes multimodal items, the same placeholder tokens with another image share
    only the blocks before the image (block size 4 here); the same image again hits up to the
    capped last block."""
    prompt = list(range(300, 324))  # 24 tokens, 6 blocks; the image holds tokens 9..12 (blocks 2 and 3)

    async def body(engine, worker):
        cached = []
        for index, image in enumerate(("sha256:cat", "sha256:dog", "sha256:cat")):
            extras = BlockExtras(mm_items=(MultiModalItem(image, 9, 4),))
            outputs = await collect(engine.add_request(request(f"r{index}", prompt, 2, extras=extras)))
            cached.append(outputs[-1].usage.cached_tokens)
        assert cached == [0, 8, 20]

    run(body, SimulatedWorker(num_kv_blocks=64, vocab_size=VOCAB, supports_multimodal=True))


def test_leaving_the_stream_aborts_the_request_and_frees_its_blocks_at_once():
    async def body(engine, worker):
        stream = engine.add_request(request("gone", range(40), max_tokens=200))
        first = await anext(stream)
        assert first.new_token_ids and engine.cache_stats().used_blocks > 0
        await stream.aclose()
        assert engine.cache_stats().used_blocks == 0
        assert engine.num_running == 0
        # the next step tells the worker to drop it
        await collect(engine.add_request(request("next", range(500, 510), 2)))
        assert "gone" not in worker.requests
        assert any("gone" in s.finished_request_ids for s in worker.steps)

    run(body)


def test_abort_ends_the_stream_with_reason_abort():
    async def body(engine, worker):
        stream = engine.add_request(request("a", range(20), max_tokens=200))
        await anext(stream)
        engine.abort("a")
        assert engine.cache_stats().used_blocks == 0
        rest = await collect(stream)
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        engine.abort("a")  # unknown now: ignored

    run(body)


@pytest.mark.parametrize("leave_by", ["abort", "cancel"])
def test_a_request_ended_before_its_first_output_hands_back_its_cache_account_and_evictions(leave_by):
    """A caller that no longer reads the stream (a cancelled call) learns what the admission did:
    from `abort`'s result, or from `on_abandon` when the engine saw the reader leave first."""
    worker = SimulatedWorker(num_kv_blocks=8, vocab_size=VOCAB)
    worker.step_delay_s = 0.2

    async def body(engine, worker):
        await collect(engine.add_request(request("filler", range(100, 120), max_tokens=1)))  # 5 cached blocks
        abandoned = []
        stream = engine.add_request(request("late", range(500, 528), max_tokens=4),  # needs 7 of 8 blocks
                                    on_abandon=abandoned.append)
        reader = asyncio.ensure_future(anext(stream))
        while engine.num_running == 0:
            await asyncio.sleep(0.01)
        if leave_by == "abort":
            output = engine.abort("late")
            assert (await reader) is output and not abandoned
        else:
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            [output] = abandoned
        assert output.finished and output.finish_reason == "abort" and output.new_token_ids == []
        assert output.cache_account is not None and output.cache_account.miss_reason == "cold"
        evicted = [event for batch in output.evictions for event in batch]
        assert evicted and {event.storing_request_id for event in evicted} == {"filler"}
        assert {event.evicting_request_id for event in evicted} == {"late"}

    run(body, worker)


def test_outputs_a_reader_left_unread_go_to_on_abandon():
    async def body(engine, worker):
        abandoned = []
        stream = engine.add_request(request("quick", range(10), max_tokens=3), on_abandon=abandoned.append)
        first = await anext(stream)
        while engine.num_running:  # the engine finishes while the reader is elsewhere
            await asyncio.sleep(0.01)
        await stream.aclose()
        assert abandoned and abandoned[-1].finished and abandoned[-1].finish_reason == "length"
        assert len(first.new_token_ids) + sum(len(o.new_token_ids) for o in abandoned) == 3

    run(body)


def test_a_slow_client_does_not_hold_up_the_others():
    async def body(engine, worker):
        slow = engine.add_request(request("slow", range(10), max_tokens=30))  # never read until the end
        fast = await collect(engine.add_request(request("fast", range(600, 610), max_tokens=30)))
        assert len(tokens_of(fast)) == 30
        assert len(tokens_of(await collect(slow))) == 30

    run(body)


def test_duplicate_request_ids_and_a_full_queue_are_refused():
    async def body(engine, worker):
        streams = [engine.add_request(request(f"q{i}", [1, 2, 3])) for i in range(2)]
        with pytest.raises(RequestRejected, match="request_id"):
            engine.add_request(request("q0", [1, 2, 3]))
        with pytest.raises(QueueFull):
            engine.add_request(request("q2", [1, 2, 3]))
        for stream in streams:
            await collect(stream)

    run(body, max_waiting=2)


def test_shutdown_aborts_what_does_not_finish_within_the_grace_period():
    async def main():
        worker = SimulatedWorker(vocab_size=VOCAB, step_delay_s=0.005)
        engine = EngineCore(config(), worker)
        await engine.start()
        stream = engine.add_request(request("long", range(10), max_tokens=200))
        await anext(stream)
        await engine.shutdown(grace_s=0.05)
        outputs = await collect(stream)
        assert outputs[-1].finish_reason == "abort"
        assert engine.cache_stats().used_blocks == 0
        with pytest.raises(EngineUnavailable, match="stopping"):
            engine.add_request(request("late", [1]))

    asyncio.run(asyncio.wait_for(main(), 30))


def test_shutdown_lets_short_requests_finish():
    async def main():
        engine = EngineCore(config(), SimulatedWorker(vocab_size=VOCAB))
        await engine.start()
        stream = engine.add_request(request("short", range(10), max_tokens=5))
        await engine.shutdown(grace_s=5)
        outputs = await collect(stream)
        assert outputs[-1].finish_reason == "length" and len(tokens_of(outputs)) == 5

    asyncio.run(asyncio.wait_for(main(), 30))


def test_metrics_expose_cache_and_queue_counters():
    async def body(engine, worker):
        shared = list(range(50))
        await collect(engine.add_request(request("a", shared)))
        await collect(engine.add_request(request("b", shared)))
        text = engine.metrics.exposition().decode()
        assert 'prefixcache_prefix_cache_queries_total{model_name="sim-model"} 100.0' in text
        assert 'prefixcache_prefix_cache_hits_total{model_name="sim-model"} 48.0' in text
        assert 'prefixcache_generation_tokens_total{model_name="sim-model"} 12.0' in text
        assert 'prefixcache_requests_finished_total{finish_reason="length",model_name="sim-model"} 0.0' in text  # the reader counts
        assert 'prefixcache_kv_blocks{model_name="sim-model",state="used"} 0.0' in text
        assert 'prefixcache_kv_blocks{model_name="sim-model",state="free"} 64.0' in text  # the states add up to the pool
        # 13 blocks of 55 computed tokens, and b's own copy of block 12 (its prompt ends inside it: no hit)
        assert 'prefixcache_kv_cached_blocks{model_name="sim-model"} 14.0' in text
        assert 'prefixcache_requests_running{model_name="sim-model"} 0.0' in text

    run(body)


def samples(engine) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels but model_name) -> value; every sample is labelled with the model."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(engine.metrics.exposition().decode()):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == "sim-model", sample
            found[sample.name, frozenset(labels.items())] = sample.value
    return found


def test_metrics_time_each_request_and_explain_its_misses():
    async def body(engine, worker):
        shared = list(range(50))
        await collect(engine.add_request(request("a", shared, max_tokens=4)))
        await collect(engine.add_request(request("b", shared, max_tokens=4)))
        found = samples(engine)
        first_token = {hit: found["prefixcache_time_to_first_token_seconds_count", frozenset({("prefix_cache_hit", hit)})]
                       for hit in ("true", "false")}
        assert first_token == {"true": 1, "false": 1}
        assert found["prefixcache_inter_token_latency_seconds_count", frozenset()] == 2 * 3
        for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time"):
            assert found[f"prefixcache_{name}_seconds_count", frozenset()] == 2, name
            assert found[f"prefixcache_{name}_seconds_bucket", frozenset({("le", "+Inf")})] == 2, name
        missed = {reason: found["prefixcache_prefix_cache_missed_tokens_total", frozenset({("reason", reason)})]
                  for reason in ("cold", "evicted", "capped", "partial_tail")}
        assert missed == {"cold": 48, "evicted": 0, "capped": 0, "partial_tail": 2 + 2}
        assert found["prefixcache_prefix_cache_lookups_total", frozenset()] == 2
        assert found["prefixcache_prefix_cache_ghost_hits_total", frozenset()] == 0
        assert found["prefixcache_kv_cache_usage_perc", frozenset()] == 0.0
        assert found["prefixcache_kv_cached_idle_blocks", frozenset()] == found["prefixcache_kv_cached_blocks", frozenset()]

    run(body)


def test_the_engine_core_imports_no_torch_and_no_grpc():
    import subprocess
    import sys

    code = (
        "import sys, prefixcache.scheduler.engine, prefixcache.llm.local_executor\n"
        "print(sorted(m for m in ('torch', 'grpc', 'triton') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_reset_prefix_cache_is_refused_while_blocks_are_held_and_empties_the_cache_when_idle():
    prompt = list(range(200, 230))

    async def body(engine, worker):
        await collect(engine.add_request(request("a", prompt)))
        assert engine.cache_stats().cached_blocks > 0
        stream = engine.add_request(request("busy", range(400, 420), max_tokens=200))
        await anext(stream)
        assert engine.reset_prefix_cache() is False
        engine.abort("busy")
        await collect(stream)
        assert engine.reset_prefix_cache() is True
        assert engine.cache_stats().cached_blocks == 0
        outputs = await collect(engine.add_request(request("b", prompt)))
        assert outputs[-1].usage.cached_tokens == 0

    run(body)


def test_a_step_loop_that_crashes_ends_every_stream_instead_of_leaving_it_waiting():
    async def body(engine, worker):
        async def broken_announcement(available: bool) -> None:
            raise RuntimeError("a bug in recovery")

        engine.on_worker_availability = broken_announcement
        stream = engine.add_request(request("streaming", range(700, 720), max_tokens=200))
        await anext(stream)
        worker.fail_next_step()
        with pytest.raises(EngineUnavailable, match="internal error"):
            await asyncio.wait_for(collect(stream), 5)
        assert not engine.is_serving
        with pytest.raises(EngineUnavailable):
            engine.add_request(request("later", range(10, 20)))

    run(body)
