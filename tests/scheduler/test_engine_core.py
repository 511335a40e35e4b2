"""EngineCore end to end over the simulated worker: concurrency, caching, cancellation, worker loss,
bad input, shutdown. The simulated worker checks every step's diff and the KV every request reads."""
from __future__ import annotations

import asyncio
import time

import pytest
from sim_worker import SimulatedWorker, reference_generation

from prefixcache.block_identity.hashing import BlockExtras, MultiModalItem
from prefixcache.scheduler.engine_core import (
    EngineCore,
    EngineRequest,
    EngineUnavailable,
    QueueFull,
    RequestRejected,
    SchedulerConfig,
)
from prefixcache.step.messages import SamplingParams

VOCAB = 1000
BLOCK = 4


def config(**overrides) -> SchedulerConfig:
    # Scheduling ahead is the path with more states (tokens pending, two steps in flight when the
    # worker is lost): every test here takes it unless it says otherwise.
    return SchedulerConfig(block_size=BLOCK, **{"max_num_batched_tokens": 64, "schedule_ahead": True, **overrides})


def request(request_id, prompt, max_tokens=6, **kwargs) -> EngineRequest:
    return EngineRequest(request_id, list(prompt), kwargs.pop("sampling", SamplingParams()), max_tokens, **kwargs)


async def collect(stream):
    return [output async for output in stream]


def tokens_of(outputs):
    return [t for o in outputs for t in o.new_token_ids]


def run(coroutine_fn, worker=None, **config_overrides):
    """Start an engine on a simulated worker, run the test body, check nothing leaked, shut down."""
    worker = worker or SimulatedWorker(num_kv_blocks=64, vocab_size=VOCAB)

    async def main():
        engine = EngineCore(config(**config_overrides), worker)
        await engine.start()
        try:
            await coroutine_fn(engine, worker)
            await asyncio.sleep(0)
            stats = engine.cache_stats()
            assert stats.used_blocks == 0, "blocks leaked"
        finally:
            await engine.shutdown(grace_s=1.0)

    asyncio.run(asyncio.wait_for(main(), 30))


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
        assert engine._scheduler.counters.preemptions > 0

    run(body, worker)


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


def test_worker_loss_fails_in_flight_requests_and_a_restarted_worker_serves_with_an_empty_cache():
    prompt = list(range(100, 140))

    async def body(engine, worker):
        announced = []

        async def record(available: bool) -> None:
            announced.append((available, engine.is_serving))

        engine.on_worker_availability = record
        await collect(engine.add_request(request("warm", prompt)))
        stream = engine.add_request(request("doomed", range(700, 720), max_tokens=200))
        await anext(stream)
        worker.fail_next_step(down_for=2)
        with pytest.raises(EngineUnavailable, match="worker was lost"):
            await collect(stream)
        with pytest.raises(EngineUnavailable):
            engine.add_request(request("too-early", prompt))
        while not engine.is_serving:
            await asyncio.sleep(0.01)
        assert worker.initializations == 2
        # Unavailable once, when the worker was lost; available again once it served (health follows).
        assert announced == [(False, False), (True, True)]
        outputs = await collect(engine.add_request(request("after", prompt)))
        assert outputs[-1].usage.cached_tokens == 0  # the old cache died with the worker
        assert tokens_of(outputs) == reference_generation(prompt, 6, VOCAB)
        again = await collect(engine.add_request(request("again", prompt)))
        assert again[-1].usage.cached_tokens == 36
        # Counted since the engine started: the replaced cache manager's counts are not lost.
        stats = engine.cache_stats()
        assert (stats.queries, stats.hits) == (2 * len(prompt) + 20 + len(prompt), 36)
        # The engine counts the request it lost as an error; the others are counted by their
        # reader (the Engine servicer), as their clients were told.
        text = engine.metrics.exposition().decode()
        assert 'prefixcache_requests_finished_total{finish_reason="error"} 1.0' in text
        assert 'prefixcache_requests_finished_total{finish_reason="length"} 0.0' in text

    run(body)


def test_a_request_that_streamed_nothing_survives_a_worker_that_is_back_at_once():
    prompt = list(range(100, 140))

    async def body(engine, worker):
        await collect(engine.add_request(request("warm", prompt)))
        # The worker restarted while the engine was idle: only the next request's step finds out.
        worker.fail_next_step(down_for=0)
        outputs = await collect(engine.add_request(request("next", prompt)))
        assert worker.initializations == 2  # at start, and again after the loss
        assert tokens_of(outputs) == reference_generation(prompt, 6, VOCAB)
        assert outputs[-1].finish_reason == "length"
        assert outputs[-1].usage.cached_tokens == 0  # computed again, on the new worker's empty cache
        assert 'prefixcache_requests_finished_total{finish_reason="error"} 0.0' in engine.metrics.exposition().decode()
        # Each prompt counted once: "next" was admitted before the loss, and not counted again after.
        assert engine.cache_stats().queries == 2 * len(prompt)

    run(body)


def test_a_request_that_streamed_nothing_ends_unavailable_when_the_worker_is_not_back_at_once():
    prompt = list(range(100, 140))

    async def body(engine, worker):
        worker.fail_next_step(down_for=2)
        with pytest.raises(EngineUnavailable, match="worker was lost"):
            await collect(engine.add_request(request("lost", prompt)))
        while not engine.is_serving:
            await asyncio.sleep(0.01)
        assert engine.num_waiting == engine.num_running == 0  # not submitted again
        assert worker.initializations == 2
        outputs = await collect(engine.add_request(request("after", prompt)))
        assert tokens_of(outputs) == reference_generation(prompt, 6, VOCAB)
        assert 'prefixcache_requests_finished_total{finish_reason="error"} 1.0' in engine.metrics.exposition().decode()

    run(body)


def test_a_request_that_brings_the_worker_down_again_is_resubmitted_only_once():
    class PoisonedWorker(SimulatedWorker):
        """Crashes whenever a step computes the request "poison"."""

        async def execute(self, step):
            if "poison" in step.num_scheduled_tokens:
                self.fail_next_step()
            return await super().execute(step)

    async def body(engine, worker):
        with pytest.raises(EngineUnavailable, match="worker was lost"):
            await collect(engine.add_request(request("poison", range(20))))
        while not engine.is_serving:
            await asyncio.sleep(0.01)
        assert worker.initializations == 3  # at start, after the first loss, after the second
        outputs = await collect(engine.add_request(request("healthy", range(30, 50))))
        assert tokens_of(outputs) == reference_generation(list(range(30, 50)), 6, VOCAB)

    run(body, PoisonedWorker(num_kv_blocks=64, vocab_size=VOCAB))


def test_a_held_request_ends_unavailable_when_the_first_try_hangs():
    prompt = list(range(100, 140))

    async def body(engine, worker):
        engine.held_requests_wait_s = 0.2
        worker.fail_next_step()
        worker.initialize_gate = asyncio.Event()  # the new worker accepts the call and does not answer
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match="worker was lost"):
            await collect(engine.add_request(request("held", prompt)))
        assert 0.2 <= time.monotonic() - started < 5
        assert engine.num_waiting == 0 and not engine.is_serving
        worker.initialize_gate.set()  # the same try answers at last: no second one was needed
        while not engine.is_serving:
            await asyncio.sleep(0.01)
        assert worker.initializations == 2
        outputs = await collect(engine.add_request(request("after", prompt)))
        assert tokens_of(outputs) == reference_generation(prompt, 6, VOCAB)

    run(body)


@pytest.mark.parametrize("ended_by", ["client", "shutdown"])
def test_a_request_held_for_a_lost_worker_can_still_be_ended(ended_by):
    async def body(engine, worker):
        worker.fail_next_step()
        worker.initialize_gate = asyncio.Event()  # the first try to bring the worker back is still out
        stream = engine.add_request(request("held", range(20)))
        while engine.is_serving:
            await asyncio.sleep(0.01)
        assert engine.num_waiting == 1  # held, and visible as waiting (stats, metrics, idle checks)
        assert "prefixcache_requests_waiting 1.0" in engine.metrics.exposition().decode()
        if ended_by == "client":
            engine.abort("held")
            outputs = await collect(stream)
        else:
            outputs, _ = await asyncio.gather(collect(stream), engine.shutdown(grace_s=0.1))
        assert [(o.finished, o.finish_reason, o.new_token_ids) for o in outputs] == [(True, "abort", [])]
        worker.initialize_gate.set()
        while not engine.is_serving and ended_by == "client":
            await asyncio.sleep(0.01)
        assert engine.num_waiting == engine.num_running == 0  # not submitted again

    run(body)


def test_a_worker_answer_that_does_not_fit_the_step_is_handled_as_a_lost_worker():
    async def body(engine, worker):
        stream = engine.add_request(request("confused", range(20), max_tokens=200))
        await anext(stream)
        worker.answer_wrongly_next = True
        with pytest.raises(EngineUnavailable):
            await collect(stream)
        while not engine.is_serving:
            await asyncio.sleep(0.01)
        assert worker.initializations == 2
        assert len(tokens_of(await collect(engine.add_request(request("fine", range(20)))))) == 6

    run(body)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: request("x", []), "prompt_token_ids"),
        (lambda: request("x", [1, VOCAB]), "prompt_token_ids"),
        (lambda: request("x", [-1]), "prompt_token_ids"),
        (lambda: request("x", [1], max_tokens=0), "max_tokens"),
        (lambda: request("x", range(100), max_tokens=4000), "max_tokens"),  # beyond max_model_len
        (lambda: request("x", range(100), max_tokens=200), "max_tokens"),  # beyond the KV cache
        (lambda: request("x", range(1100), max_tokens=1), "prompt_token_ids"),  # the prompt alone is beyond it
        (lambda: request("x", [1], sampling=SamplingParams(temperature=-1)), "temperature"),
        (lambda: request("x", [1], sampling=SamplingParams(temperature=float("nan"))), "temperature"),
        (lambda: request("x", [1], sampling=SamplingParams(temperature=float("inf"))), "temperature"),
        (lambda: request("x", range(4096)), "prompt_token_ids"),  # no room left to generate
        (lambda: request("x", [1], sampling=SamplingParams(top_p=0)), "top_p"),
        (lambda: request("x", [1], sampling=SamplingParams(top_p=1.5)), "top_p"),
        (lambda: request("x", [1], sampling=SamplingParams(top_k=-1)), "top_k"),
        (lambda: request("x", [1], stop_token_ids=(VOCAB,)), "stop_token_ids"),
        (lambda: request("x", [1, 2], extras=BlockExtras(mm_items=(MultiModalItem("img", 0, 1),))), "multimodal"),
    ],
)
def test_bad_input_is_rejected_naming_the_field_and_the_engine_still_serves(make, field):
    async def body(engine, worker):
        with pytest.raises(RequestRejected) as error:
            engine.add_request(make())
        assert error.value.field == field
        assert len(await collect(engine.add_request(request("ok", [1, 2, 3])))) == 6

    run(body, SimulatedWorker(num_kv_blocks=64, vocab_size=VOCAB, max_model_len=4096), max_model_len=2048)


def test_more_logprobs_than_the_vocabulary_has_are_refused():
    async def body(engine, worker):
        with pytest.raises(RequestRejected, match="vocabulary has 12 tokens") as error:
            engine.add_request(request("x", [1], sampling=SamplingParams(logprobs=13)))
        assert error.value.field == "logprobs"
        assert len(await collect(engine.add_request(request("ok", [1, 2], sampling=SamplingParams(logprobs=12))))) == 6

    run(body, SimulatedWorker(num_kv_blocks=64, vocab_size=12))


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
        assert "prefixcache_prefix_cache_queries_total 100.0" in text
        assert "prefixcache_prefix_cache_hits_total 48.0" in text
        assert "prefixcache_generation_tokens_total 12.0" in text
        assert 'prefixcache_requests_finished_total{finish_reason="length"} 0.0' in text  # the reader counts
        assert 'prefixcache_kv_blocks{state="used"} 0.0' in text
        assert 'prefixcache_kv_blocks{state="free"} 64.0' in text  # the states add up to the pool
        # 13 blocks of 55 computed tokens, and b's own copy of block 12 (its prompt ends inside it: no hit)
        assert "prefixcache_kv_cached_blocks 14.0" in text
        assert "prefixcache_requests_running 0.0" in text

    run(body)


def test_the_engine_core_imports_no_torch_and_no_grpc():
    import subprocess
    import sys

    code = (
        "import sys, prefixcache.scheduler.engine_core, prefixcache.llm.local_executor\n"
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


def test_a_request_that_fills_the_pool_exactly_is_served_and_one_token_more_is_refused():
    """A request holds KV for every token but its last, which is sampled and never fed back: on 4
    blocks of 4, a 16-token prompt may generate 1 token, an 8-token prompt 9."""
    async def body(engine, worker):
        for prompt_len, max_tokens in ((16, 1), (8, 9)):
            prompt = list(range(10, 10 + prompt_len))
            outputs = await collect(engine.add_request(request(f"fits-{prompt_len}", prompt, max_tokens)))
            assert tokens_of(outputs) == reference_generation(prompt, max_tokens, VOCAB)
        for prompt_len, max_tokens, field in ((17, 1, "prompt_token_ids"), (8, 10, "max_tokens")):
            with pytest.raises(RequestRejected) as refused:
                engine.add_request(request(f"too-big-{prompt_len}", list(range(10, 10 + prompt_len)), max_tokens))
            assert refused.value.field == field

    run(body, SimulatedWorker(num_kv_blocks=4, vocab_size=VOCAB))


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
