"""Worker loss over the simulated worker: in-flight requests that streamed tokens fail, those that
streamed nothing are held and run again on the next worker (once, and only if it answers at once),
and the engine serves again with an empty cache."""
from __future__ import annotations

import asyncio
import time

import pytest
from engine_runs import VOCAB, collect, request, run, tokens_of
from sim_worker import SimulatedWorker, reference_generation

from prefixcache.scheduler.engine import EngineUnavailable


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
        assert 'prefixcache_requests_finished_total{finish_reason="error",model_name="sim-model"} 1.0' in text
        assert 'prefixcache_requests_finished_total{finish_reason="length",model_name="sim-model"} 0.0' in text

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
        assert 'prefixcache_requests_finished_total{finish_reason="error",model_name="sim-model"} 0.0' in engine.metrics.exposition().decode()
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
        assert 'prefixcache_requests_finished_total{finish_reason="error",model_name="sim-model"} 1.0' in engine.metrics.exposition().decode()

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
        assert 'prefixcache_requests_waiting{model_name="sim-model"} 1.0' in engine.metrics.exposition().decode()
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
