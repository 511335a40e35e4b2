"""Session settings: workload selection, thrash sizing and config checks (no engine needed)."""
import pytest

from prefixcache.services.bench.engine import EngineFacts
from prefixcache.services.bench.session import BenchConfig, parse_workloads, resolve_options, thrash_prefixes_for
from prefixcache.services.bench.workloads import GENERATORS, WorkloadOptions

FACTS = EngineFacts("m", "float32", vocab_size=50_000, max_model_len=8192, block_size=16, num_kv_blocks=1456,
                    prefix_caching_enabled=True)


def test_workload_selection():
    assert parse_workloads([], list(GENERATORS)) == tuple(GENERATORS)
    assert parse_workloads(["unique,thrash", "unique"], list(GENERATORS)) == ("unique", "thrash")
    with pytest.raises(ValueError, match="--workload"):
        parse_workloads(["shared"], list(GENERATORS))


def test_thrash_is_sized_from_the_kv_pool():
    # 1,456 blocks x 16 = 23,296 tokens = 23 prefixes of 1,000; half again as many, plus one.
    assert thrash_prefixes_for(FACTS, 1000) == 36
    options = resolve_options(BenchConfig(workloads=("thrash",), options=WorkloadOptions()), FACTS)
    assert (options.thrash_prefixes, options.vocab_size) == (36, 50_000)
    fixed = BenchConfig(workloads=("thrash",), options=WorkloadOptions(thrash_prefixes=5), auto_thrash_prefixes=False)
    assert resolve_options(fixed, FACTS).thrash_prefixes == 5


@pytest.mark.parametrize("kwargs, message", [
    ({"concurrency": 0}, "concurrency"),
    ({"warmup_requests": -1}, "warmup"),
    ({"no_cache_target": "h:1"}, "only used with compare_no_cache"),
    ({"target": "h:1", "compare_no_cache": True}, "needs no_cache_target"),
])
def test_config_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(workloads=("unique",), options=WorkloadOptions(), **kwargs)
