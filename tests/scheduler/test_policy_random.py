"""Random workloads (arrivals sharing prefixes, stop tokens, aborts, a small KV pool, small budgets)
driven through the policy and the checking simulated worker, also aborting while a step runs, one
step at a time and scheduling ahead (the worker runs a step as soon as it is sent; the policy
learns its tokens after scheduling the next): every request gets exactly the tokens it would get
alone, the worker's view always matches the policy's, and no block is left held."""
from __future__ import annotations

import asyncio
import random
from collections import deque
from dataclasses import dataclass

import pytest
from sim_worker import SimulatedWorker, reference_generation

from prefixcache.block_identity.hashing import BlockHasher
from prefixcache.scheduler.config import SchedulerConfig
from prefixcache.scheduler.kv_cache import KVCacheManager
from prefixcache.scheduler.policy import SchedulingPolicy
from prefixcache.scheduler.request import EngineRequest
from prefixcache.step.messages import SamplingParams, SchedulerStep

BLOCK = 4
VOCAB = 1000


@pytest.mark.parametrize("ahead", [False, True], ids=["one-step-at-a-time", "scheduling-ahead"])
def test_random_workloads_match_the_reference_and_leak_nothing(ahead):
    totals = [run_workload(seed, ahead) for seed in range(16)]
    # the workloads did exercise what they are meant to
    assert sum(c.preemptions for c in totals) >= 10
    assert sum(c.hit_tokens for c in totals) > 0 and sum(c.evictions for c in totals) > 0
    assert sum(c.stops for c in totals) >= 10
    assert (sum(c.steps_ahead for c in totals) > 100) == ahead
    assert (sum(c.preempted_in_flight for c in totals) >= 3) == ahead
    assert sum(c.aborts for c in totals) >= 10


def run_workload(seed: int, ahead: bool):
    rng = random.Random(seed)
    num_blocks = rng.randint(8, 30)
    config = SchedulerConfig(
        block_size=BLOCK,
        max_num_seqs=rng.randint(1, 12),
        max_num_batched_tokens=rng.randint(3, 64),
        enable_prefix_caching=rng.random() < 0.8,
    )
    kv = KVCacheManager(num_blocks, BlockHasher(BLOCK, "sha256", "sim-model"), config.enable_prefix_caching)
    policy = SchedulingPolicy(config, kv)
    worker = SimulatedWorker(num_kv_blocks=num_blocks, vocab_size=VOCAB)
    asyncio.run(worker.initialize(BLOCK))

    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 24))] for _ in range(3)]
    to_arrive = []
    expected: dict[str, tuple[str, list[int]]] = {}  # finish reason and tokens, unless aborted
    for i in range(25):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        max_tokens = rng.randint(1, 12)
        if -(-(len(prompt) + max_tokens) // BLOCK) > num_blocks:  # what EngineCore refuses
            continue
        generated = reference_generation(prompt, max_tokens, VOCAB)
        stop_token_ids = (rng.choice(generated),) if rng.random() < 0.4 else ()
        if stop_token_ids:
            expected[f"r{i}"] = "stop", generated[: generated.index(stop_token_ids[0]) + 1]
        else:
            expected[f"r{i}"] = "length", generated
        to_arrive.append(EngineRequest(f"r{i}", prompt, SamplingParams(), max_tokens, stop_token_ids))
    requests = {r.request_id: r for r in to_arrive}
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    finish: dict[str, str] = {}
    in_flight: deque = deque()  # steps the worker has run whose outputs the policy has not seen
    steps_ahead = preempted_in_flight = 0

    def send() -> SchedulerStep:
        step = policy.schedule()
        in_flight.append((step, worker.run(step)))
        # the worker holds exactly the running requests: new ones sent, finished/preempted ones dropped
        assert set(worker.requests) == {r.request_id for r in policy.running}
        return step

    for _ in range(5000):
        if to_arrive and rng.random() < 0.6:
            policy.add_request(to_arrive.pop(0))
        # Aborts only while requests still arrive: one stuck afterwards must fail the drain.
        if to_arrive and policy.requests and rng.random() < 0.03:
            aborted = policy.abort(rng.choice(list(policy.requests)))
            finish[aborted.request_id] = aborted.finish_reason
        if not to_arrive and not policy.has_work() and not in_flight:
            break
        if not in_flight:
            send()
        if ahead and policy.can_schedule_ahead():
            dropped = send().finished_request_ids
            steps_ahead += 1
            # preempted while the step before samples for them
            preempted_in_flight += len(set(dropped) & set(in_flight[0][0].num_scheduled_tokens) & set(policy.requests))
        step, worker_output = in_flight.popleft()
        if to_arrive and step.num_scheduled_tokens and rng.random() < 0.03:  # a client leaves while the step runs
            aborted = policy.abort(rng.choice(list(step.num_scheduled_tokens)))
            if aborted is not None:  # (it may have ended at the step before)
                finish[aborted.request_id] = aborted.finish_reason
        outputs = policy.update_from_output(step, worker_output)
        for output in outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                finish[output.request_id] = output.finish_reason
    else:
        raise AssertionError("the workload did not drain")

    assert set(finish) == set(requests)
    for request_id in requests:
        reason, generated = expected[request_id]
        if finish[request_id] == "abort":
            assert tokens[request_id] == generated[: len(tokens[request_id])]
        else:
            assert (finish[request_id], tokens[request_id]) == (reason, generated)
    assert kv.num_free_blocks == num_blocks and kv.stats().used_blocks == 0
    assert kv.reset_prefix_cache()
    return Totals(policy.counters.preemptions, policy.counters.hit_tokens, policy.counters.evictions,
                  sum(reason == "stop" for reason in finish.values()), steps_ahead, preempted_in_flight,
                  sum(reason == "abort" for reason in finish.values()))


@dataclass(frozen=True)
class Totals:
    preemptions: int
    hit_tokens: int
    evictions: int
    stops: int
    steps_ahead: int
    preempted_in_flight: int
    aborts: int
