"""The workload generators: deterministic per seed, shaped as the issue describes."""
import math
import random
from collections import Counter
from dataclasses import replace

import pytest

from prefixcache.bench.workloads import (
    GENERATORS,
    IntRange,
    WorkloadOptions,
    generate,
    poisson_arrivals,
)

SMALL = WorkloadOptions(num_requests=20, prefix_len=64, suffix_len=IntRange(5, 20), output_len=4, thrash_prefixes=3)


def common_prefix_len(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("workload", list(GENERATORS))
def test_same_seed_same_requests_other_seed_other_tokens(workload):
    first = generate(workload, SMALL)
    assert first == generate(workload, SMALL)
    other = generate(workload, replace(SMALL, seed=1))
    assert [r.prompt_token_ids for r in first] != [r.prompt_token_ids for r in other]


@pytest.mark.parametrize("workload", list(GENERATORS))
def test_counts_ids_and_token_range(workload):
    options = replace(SMALL, vocab_size=1000, first_ordinary_token=17, tenants=3)
    requests = generate(workload, options)
    assert len(requests) == (options.num_requests if workload != "thrash" else 3 * options.thrash_prefixes)
    assert len({r.request_id for r in requests}) == len(requests)
    assert all(r.max_tokens == options.output_len for r in requests)
    assert {r.tenant for r in requests} == {0, 1, 2}
    tokens = [t for r in requests for t in r.prompt_token_ids]
    assert min(tokens) >= 17 and max(tokens) <= 999


def test_shared_system_prompt_shares_exactly_the_prefix():
    requests = generate("shared-system-prompt", WorkloadOptions(num_requests=10, prefix_len=1000))
    system = requests[0].prompt_token_ids[:1000]
    for r in requests:
        assert r.prompt_token_ids[:1000] == system
        assert 50 <= len(r.prompt_token_ids) - 1000 <= 200
    # The user turns differ right after the system prompt (a random token collides with p=1/49135).
    assert sum(common_prefix_len(a.prompt_token_ids, b.prompt_token_ids) > 1000
               for a, b in zip(requests, requests[1:])) <= 1


def test_multi_turn_resends_history_and_orders_dependencies():
    options = WorkloadOptions(num_requests=30, suffix_len=IntRange(10, 20), output_len=8)
    requests = generate("multi-turn", options)
    by_id = {r.request_id: r for r in requests}
    position = {r.request_id: i for i, r in enumerate(requests)}
    conversations = {}
    for r in requests:
        conversation, turn = r.request_id.removeprefix("multi-turn-").split("-")
        conversations.setdefault(conversation, []).append((int(turn), r))
    for turns in conversations.values():
        turns.sort()
        assert [t for t, _ in turns] == list(range(len(turns)))
        assert len(turns) <= 8
        for (_, previous), (_, current) in zip(turns, turns[1:]):
            assert current.after == previous.request_id and position[previous.request_id] < position[current.request_id]
            assert current.prompt_token_ids[: len(previous.prompt_token_ids)] == previous.prompt_token_ids
            new = len(current.prompt_token_ids) - len(previous.prompt_token_ids)
            assert 8 + 10 <= new <= 8 + 20  # synthetic assistant reply + the new user message
        assert turns[0][1].after is None
    assert all(4 <= len(t) for t in conversations.values())
    assert set(by_id) == {r.request_id for r in requests}


def test_few_shot_shares_the_examples():
    requests = generate("few-shot", WorkloadOptions(num_requests=5, prefix_len=803, few_shot_examples=8))
    assert all(r.prompt_token_ids[:803] == requests[0].prompt_token_ids[:803] for r in requests)


def test_unique_prompts_share_nothing():
    requests = generate("unique", SMALL)
    firsts = [r.prompt_token_ids[:4] for r in requests]
    assert len(set(firsts)) == len(firsts)


def test_thrash_cycles_through_distinct_prefixes():
    requests = generate("thrash", SMALL)
    prefixes = [r.prompt_token_ids[:64] for r in requests]
    assert len(set(prefixes)) == 3 and len(requests) == 9  # three visits each, unless told otherwise
    assert all(prefixes[i] == prefixes[i % 3] for i in range(len(prefixes)))
    assert len(generate("thrash", replace(SMALL, thrash_requests=4))) == 4


@pytest.mark.parametrize("tenants", [2, 3, 5])
def test_every_visit_to_a_thrash_prefix_comes_from_its_one_tenant(tenants):
    """A revisit by another tenant would miss as `cold` (another salt), never as `evicted`."""
    requests = generate("thrash", replace(SMALL, thrash_prefixes=6, thrash_requests=18, tenants=tenants))
    tenant_of: dict[tuple[int, ...], set[int]] = {}
    for request in requests:
        tenant_of.setdefault(request.prompt_token_ids[:64], set()).add(request.tenant)
    assert len(tenant_of) == 6 and all(len(owners) == 1 for owners in tenant_of.values())
    assert {owner for owners in tenant_of.values() for owner in owners} == set(range(min(tenants, 6)))


def test_poisson_arrivals():
    assert poisson_arrivals(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]
    arrivals = poisson_arrivals(4000, 20.0, random.Random(0))
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] / len(arrivals) == pytest.approx(1 / 20.0, rel=0.05)  # mean gap is 1/rate
    requests = generate("unique", replace(SMALL, request_rate=5.0))
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests) and requests[0].arrival_s > 0


@pytest.mark.parametrize(
    "change, field",
    [({"num_requests": 0}, "num_requests"), ({"tenants": 0}, "tenants"), ({"request_rate": 0.0}, "request_rate"),
     ({"output_len": 0}, "output_len"), ({"first_ordinary_token": 50_000}, "first_ordinary_token")],
)
def test_bad_options_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        WorkloadOptions(**change)


def test_int_range_parsing():
    assert IntRange.parse("50:200") == IntRange(50, 200)
    assert IntRange.parse("7") == IntRange(7, 7)
    for bad in ("0:3", "5:2", "x"):
        with pytest.raises(ValueError):
            IntRange.parse(bad)
    with pytest.raises(ValueError, match="workload must be one of"):
        generate("nope", SMALL)



@pytest.mark.parametrize("turns", [IntRange(4, 8), IntRange(2, 3), IntRange(3, 4), IntRange(5, 5)])
def test_multi_turn_conversations_stay_within_the_turns_range(turns):
    for num_requests in range(1, 40):
        # Whole conversations within the range exist for this total: k conversations of low..high turns.
        splits = any(k * turns.low <= num_requests <= k * turns.high for k in range(1, num_requests + 1))
        for seed in range(4):
            requests = generate("multi-turn", WorkloadOptions(num_requests=num_requests, seed=seed, turns=turns,
                                                              prefix_len=8, suffix_len=IntRange(2, 4), output_len=2))
            lengths = Counter(r.request_id.rsplit("-", 1)[0] for r in requests).values()
            assert len(requests) == num_requests
            assert max(lengths) <= turns.high
            assert min(lengths) >= turns.low or not splits, (num_requests, seed, sorted(lengths))


def test_the_split_check_agrees_with_trying_every_number_of_conversations():
    from prefixcache.bench.workloads import _splits

    for turns in (IntRange(1, 1), IntRange(4, 8), IntRange(3, 4), IntRange(5, 5), IntRange(2, 9)):
        for total in range(0, 80):
            brute = total == 0 or any(k * turns.low <= total <= k * turns.high for k in range(1, total + 1))
            assert _splits(total, turns) == brute, (turns, total)
