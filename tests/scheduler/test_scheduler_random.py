"""Random workloads (arrivals sharing prefixes, aborts, a small KV pool, small budgets) driven through
the scheduler and the checking simulated worker, also aborting while a step runs: every request gets exactly the tokens it would get
alone, the worker's view always matches the scheduler's, and no block is left held."""
from __future__ import annotations

import asyncio
import random

from prefixcache.services.common.block_identity import BlockHasher
from prefixcache.services.common.step import SamplingParams
from prefixcache.services.scheduler.kv_cache import KVCacheManager
from prefixcache.services.scheduler.request import EngineRequest
from prefixcache.services.scheduler.scheduler import Scheduler, SchedulerConfig

from sim_worker import SimulatedWorker, reference_generation

BLOCK = 4
VOCAB = 1000


def test_random_workloads_match_the_reference_and_leak_nothing():
    totals = [run_workload(seed) for seed in range(16)]
    # the workloads did exercise what they are meant to
    assert sum(c.preemptions for c in totals) >= 10
    assert sum(c.hit_tokens for c in totals) > 0 and sum(c.evictions for c in totals) > 0


def run_workload(seed: int):
    rng = random.Random(seed)
    num_blocks = rng.randint(8, 30)
    config = SchedulerConfig(
        block_size=BLOCK,
        max_num_seqs=rng.randint(1, 12),
        max_num_batched_tokens=rng.randint(3, 64),
        enable_prefix_caching=rng.random() < 0.8,
    )
    kv = KVCacheManager(num_blocks, BlockHasher(BLOCK, "sha256", "sim-model"), config.enable_prefix_caching)
    scheduler = Scheduler(config, kv)
    worker = SimulatedWorker(num_kv_blocks=num_blocks, vocab_size=VOCAB)
    asyncio.run(worker.initialize(BLOCK))

    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 24))] for _ in range(3)]
    to_arrive = []
    for i in range(25):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        max_tokens = rng.randint(1, 12)
        if -(-(len(prompt) + max_tokens) // BLOCK) <= num_blocks:  # what EngineCore admits
            to_arrive.append(EngineRequest(f"r{i}", prompt, SamplingParams(), max_tokens))
    requests = {r.request_id: r for r in to_arrive}
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    finish: dict[str, str] = {}

    for _ in range(5000):
        if to_arrive and rng.random() < 0.6:
            scheduler.add_request(to_arrive.pop(0))
        if scheduler.requests and rng.random() < 0.03:
            aborted = scheduler.abort(rng.choice(list(scheduler.requests)))
            finish[aborted.request_id] = aborted.finish_reason
        if not to_arrive and not scheduler.has_work():
            break
        step = scheduler.schedule()
        worker_output = worker.run(step)
        # the worker holds exactly the running requests: new ones sent, finished/preempted ones dropped
        assert set(worker.requests) == {r.request_id for r in scheduler.running}
        if step.num_scheduled_tokens and rng.random() < 0.03:  # a client leaves while the step runs
            aborted = scheduler.abort(rng.choice(list(step.num_scheduled_tokens)))
            finish[aborted.request_id] = aborted.finish_reason
        outputs = scheduler.update_from_output(step, worker_output)
        for output in outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                finish[output.request_id] = output.finish_reason
    else:
        raise AssertionError("the workload did not drain")

    assert set(finish) == set(requests)
    for request_id, request in requests.items():
        expected = reference_generation(request.prompt_token_ids, request.max_tokens, VOCAB)
        if finish[request_id] == "abort":
            assert tokens[request_id] == expected[: len(tokens[request_id])]
        else:
            assert (finish[request_id], tokens[request_id]) == ("length", expected)
    assert kv.num_free_blocks == num_blocks and kv.stats().used_blocks == 0
    assert kv.reset_prefix_cache()
    return scheduler.counters
