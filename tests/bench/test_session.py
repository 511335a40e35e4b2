"""Session settings: workload selection, thrash sizing and config checks (no engine needed)."""
from dataclasses import replace

import pytest

from prefixcache.bench.engine import EngineFacts
from prefixcache.bench.session import (
    BenchConfig,
    BenchOutcome,
    check_comparable,
    parse_workloads,
    plan_workloads,
    resolve_options,
    thrash_prefixes_for,
)
from prefixcache.bench.workloads import GENERATORS, WorkloadOptions
from prefixcache.cli.main import main as cli_main

FACTS = EngineFacts("m", "float32", vocab_size=50_000, max_model_len=8192, block_size=16, num_kv_blocks=1456,
                    prefix_caching_enabled=True)


def test_workload_selection():
    assert parse_workloads([], list(GENERATORS)) == tuple(GENERATORS)
    assert parse_workloads(["unique,thrash", "unique"], list(GENERATORS)) == ("unique", "thrash")
    with pytest.raises(ValueError, match="--workload"):
        parse_workloads(["shared"], list(GENERATORS))
    with pytest.raises(ValueError, match="names no workload"):
        parse_workloads([","], list(GENERATORS))


def test_thrash_is_sized_from_the_kv_pool():
    # 1,456 blocks x 16 = 23,296 tokens = 23 prefixes of 1,000; two more (an eighth of 23 rounds down to 2).
    assert thrash_prefixes_for(FACTS, 1000, concurrency=8) == 25
    assert thrash_prefixes_for(FACTS, 100, concurrency=8) == 232 + 29  # an eighth more
    assert thrash_prefixes_for(FACTS, 20_000, concurrency=8) == 8  # never fewer than requests in flight
    options = resolve_options(BenchConfig(workloads=("thrash",), options=WorkloadOptions()), FACTS)
    assert (options.thrash_prefixes, options.vocab_size) == (25, 50_000)
    assert options.thrash_requests == 75  # three visits each: two of every three misses are `evicted`
    fixed = BenchConfig(workloads=("thrash",), options=WorkloadOptions(thrash_prefixes=5, thrash_requests=7),
                        auto_thrash_prefixes=False)
    assert (resolve_options(fixed, FACTS).thrash_prefixes, resolve_options(fixed, FACTS).thrash_requests) == (5, 7)


def test_a_thrash_run_too_short_for_evictions_to_dominate_is_noted():
    notes = []
    config = BenchConfig(workloads=("thrash",), options=WorkloadOptions(thrash_requests=50))
    plan_workloads(config, FACTS, BenchOutcome({}), notes.append)
    assert len(notes) == 1 and "raise --num-requests above 50" in notes[0]
    notes.clear()
    plan_workloads(replace(config, options=WorkloadOptions(thrash_requests=51)), FACTS, BenchOutcome({}), notes.append)
    assert notes == []


@pytest.mark.parametrize("kwargs, message", [
    ({"concurrency": 0}, "concurrency"),
    ({"warmup_requests": -1}, "warmup"),
    ({"request_timeout_s": 0.0}, "request_timeout"),
    ({"no_cache_target": "h:1"}, "--no-cache-target is only used with --compare-no-cache"),
    ({"target": "h:1", "compare_no_cache": True}, "--compare-no-cache with --target needs --no-cache-target"),
])
def test_config_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(workloads=("unique",), options=WorkloadOptions(), **kwargs)


def test_runs_compare_only_on_engines_that_differ_in_caching_alone():
    check_comparable(FACTS, replace(FACTS, prefix_caching_enabled=False, num_kv_blocks=7), "h:2")
    other = replace(FACTS, model_id="tiny-random@1", dtype="bfloat16", prefix_caching_enabled=False)
    with pytest.raises(ValueError, match=f"the engine at h:2 is not the first run's engine with caching off: "
                                         f"model_id '{FACTS.model_id}' against 'tiny-random@1'; dtype"):
        check_comparable(FACTS, other, "h:2")


def test_few_shot_lengths_are_checked_only_when_few_shot_runs():
    short = WorkloadOptions(prefix_len=4, few_shot_examples=8)
    BenchConfig(workloads=("unique", "shared-system-prompt"), options=short)
    with pytest.raises(ValueError, match="few_shot_examples \\(8\\) cannot exceed prefix_len \\(4\\)"):
        BenchConfig(workloads=("unique", "few-shot"), options=short)


@pytest.mark.parametrize("args, message", [
    (["--suffix-len", "5:2"], "1 <= A <= B, got '5:2'"),
    (["--turns", "x"], "expected N or A:B"),
    (["--json", "/nonexistent-dir/out.json"], "--json /nonexistent-dir/out.json: no such directory"),
    (["--plot", "."], "--plot .: is a directory"),
])
def test_the_cli_refuses_bad_arguments_and_outputs_before_running(args, message, capsys):
    # No --target and no engine: each is refused before a platform would start.
    try:
        status = cli_main(["bench", *args])
    except SystemExit as exit:  # argparse's own refusals
        status = exit.code
    assert status == 2
    assert message in capsys.readouterr().err
