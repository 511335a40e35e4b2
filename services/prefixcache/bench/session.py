"""One benchmark session: for each mode (with the cache, then without), reach an engine, warm it up,
and run every workload on it with the same requests."""
from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace

from prefixcache.bench.driver import StreamingEndpoint, TenantSalts, drive
from prefixcache.bench.engine import EngineEndpoint, EngineFacts
from prefixcache.bench.local_platform import LocalSettings, local_platform
from prefixcache.bench.metrics import summarize
from prefixcache.bench.report import CACHE, NO_CACHE, ProgressBar, WorkloadResult
from prefixcache.bench.workloads import BenchRequest, WorkloadOptions, check_few_shot, generate


@dataclass(frozen=True)
class BenchConfig:
    workloads: tuple[str, ...]
    options: WorkloadOptions
    concurrency: int = 8
    target: str | None = None  # None: start a local platform per mode
    no_cache_target: str | None = None  # an endpoint already serving with prefix caching off
    compare_no_cache: bool = False
    auto_thrash_prefixes: bool = True  # size thrash from the engine's KV pool instead of options
    warmup_requests: int = 2
    reset_between_workloads: bool | None = None  # None: only on local platforms
    local: LocalSettings = field(default_factory=LocalSettings)
    request_timeout_s: float = 600.0
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup_requests}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout_s}")
        if "few-shot" in self.workloads:
            check_few_shot(self.options)  # before a platform starts, not after
        if self.no_cache_target and not self.compare_no_cache:
            raise ValueError("--no-cache-target is only used with --compare-no-cache")
        if self.compare_no_cache and self.target and not self.no_cache_target:
            raise ValueError(
                "--compare-no-cache with --target needs --no-cache-target (an endpoint with prefix caching off): "
                "a remote deployment cannot be restarted without its cache"
            )

    @property
    def modes(self) -> tuple[str, ...]:
        return (CACHE, NO_CACHE) if self.compare_no_cache else (CACHE,)


@dataclass
class BenchOutcome:
    """What a session measured; filled in as each workload finishes, so a run cut short keeps the rest."""

    results: dict[str, WorkloadResult]
    description: dict[str, object] = field(default_factory=dict)  # the `config` object of the JSON
    requests: dict[str, list[BenchRequest]] = field(default_factory=dict)  # what every mode sent
    options: WorkloadOptions | None = None  # as resolved against the first engine

    @classmethod
    def for_workloads(cls, workloads: Sequence[str]) -> BenchOutcome:
        return cls({name: WorkloadResult() for name in workloads})

    @property
    def finished_results(self) -> dict[str, WorkloadResult]:
        """The workloads that ran in at least one mode."""
        return {name: result for name, result in self.results.items() if result.summaries}

    def complete(self, modes: Sequence[str]) -> bool:
        """Whether every workload ran in every one of `modes`."""
        return all(set(modes) <= result.summaries.keys() for result in self.results.values())

    @property
    def failed_requests(self) -> int:
        return sum(s.failed for r in self.results.values() for s in r.summaries.values())

    def first_error(self) -> str | None:
        """The first failed request's status and message, to say why requests failed."""
        return next((record.error for result in self.results.values() for records in result.records.values()
                     for record in records if record.error), None)


def thrash_prefixes_for(facts: EngineFacts, prefix_len: int, concurrency: int) -> int:
    """A few more prefixes than the whole KV pool holds (an eighth more, at least two).

    Under LRU a cyclic scan over more items than fit misses every time: by a prefix's next visit the
    requests in between have allocated more blocks than the pool has. At least `concurrency`
    prefixes, so that a prefix is never revisited while its previous visit is still in flight.
    """
    fits = facts.kv_capacity_tokens // prefix_len
    return max(fits + max(2, fits // 8), concurrency)


def resolve_options(config: BenchConfig, facts: EngineFacts) -> WorkloadOptions:
    options = replace(config.options, vocab_size=facts.vocab_size)
    if config.auto_thrash_prefixes and "thrash" in config.workloads:
        options = replace(options, thrash_prefixes=thrash_prefixes_for(facts, options.prefix_len, config.concurrency))
    return replace(options, thrash_requests=options.num_thrash_requests)


def check_fits(requests: dict[str, list[BenchRequest]], facts: EngineFacts) -> None:
    for name, batch in requests.items():
        longest = max((len(r.prompt_token_ids) + r.max_tokens for r in batch), default=0)
        if longest > facts.max_model_len:
            raise ValueError(
                f"workload {name}: a prompt plus output of {longest} tokens exceeds the model's "
                f"max_model_len {facts.max_model_len}; lower --prefix-len, --suffix-len, --turns or --output-len"
            )


def check_comparable(first: EngineFacts, other: EngineFacts, target: str) -> None:
    """Refuse to compare runs on engines that differ in more than prefix caching: the ratios would
    measure the model or the settings, not the cache."""
    differences = [f"{name} {getattr(first, name)!r} against {getattr(other, name)!r}"
                   for name in ("model_id", "dtype", "block_size", "max_model_len")
                   if getattr(first, name) != getattr(other, name)]
    if differences:
        raise ValueError(f"the engine at {target} is not the first run's engine with caching off: "
                         f"{'; '.join(differences)}")


@contextlib.asynccontextmanager
async def engine_target(config: BenchConfig, mode: str) -> AsyncIterator[tuple[str, bool]]:
    """(target, whether the benchmark owns it) for `mode`."""
    if mode == NO_CACHE and config.no_cache_target:
        yield config.no_cache_target, False
    elif config.target:
        yield config.target, False
    else:
        async with local_platform(config.local, prefix_caching=mode == CACHE) as target:
            yield target, True


async def warm_up(endpoint: StreamingEndpoint, options: WorkloadOptions, count: int) -> None:
    """`count` unique requests of their own seed and salt, so that nothing they leave is reused."""
    if count == 0:
        return
    warmup = generate("unique", replace(options, num_requests=count, seed=options.seed + 1_000_003, tenants=1))
    await drive(endpoint, warmup, concurrency=count, salts=TenantSalts(1))


def _to_stderr(note: str) -> None:
    print(f"note: {note}", file=sys.stderr)


async def run_session(config: BenchConfig, note: Callable[[str], None] = _to_stderr,
                      outcome: BenchOutcome | None = None) -> BenchOutcome:
    """Run every workload in every mode, into `outcome` (a new one by default); `note` hears about
    settings that defeat a workload's point."""
    if outcome is None:
        outcome = BenchOutcome.for_workloads(config.workloads)
    if config.target and config.no_cache_target:  # both given: refuse a wrong pair before the long first run
        async with EngineEndpoint(config.no_cache_target, config.request_timeout_s) as no_cache:
            no_cache_facts = check_mode(NO_CACHE, await no_cache.facts(), config.no_cache_target)
        async with EngineEndpoint(config.target, config.request_timeout_s) as cache:
            check_comparable(check_mode(CACHE, await cache.facts(), config.target), no_cache_facts,
                             config.no_cache_target)
    first: EngineFacts | None = None
    for mode in config.modes:
        async with engine_target(config, mode) as (target, owned):
            async with EngineEndpoint(target, config.request_timeout_s) as endpoint:
                facts = check_mode(mode, await endpoint.facts(), target)
                if first is None:  # the first mode plans; every mode sends the very same requests
                    first = facts
                    plan_workloads(config, facts, outcome, note)
                else:
                    check_comparable(first, facts, target)
                await _run_mode(config, endpoint, mode, owned, outcome, note)
    return outcome


def check_mode(mode: str, facts: EngineFacts, target: str) -> EngineFacts:
    """`facts`, if the engine at `target` has prefix caching as `mode` needs it."""
    if facts.prefix_caching_enabled != (mode == CACHE):
        raise ValueError(
            f"the {mode} run needs an engine with prefix caching {'on' if mode == CACHE else 'off'}, "
            f"but {target} has it {'on' if facts.prefix_caching_enabled else 'off'}"
        )
    return facts


def plan_workloads(config: BenchConfig, facts: EngineFacts, outcome: BenchOutcome, note: Callable[[str], None]) -> None:
    """Resolve the options against the engine and generate every workload's requests into `outcome`."""
    options = resolve_options(config, facts)
    outcome.requests = {name: generate(name, options) for name in config.workloads}
    check_fits(outcome.requests, facts)
    if "thrash" in config.workloads and options.num_thrash_requests <= 2 * options.thrash_prefixes:
        note(
            f"thrash sends {options.num_thrash_requests} requests over {options.thrash_prefixes} prefixes, so "
            "first (cold) visits are at least half of its misses and `evicted` cannot dominate; raise "
            f"--num-requests above {2 * options.thrash_prefixes} or "
            + ("serve with a smaller KV cache" if config.target else "lower the KV pool (--kv-cache-memory)")
        )
    outcome.options = options
    outcome.description = _describe(config, options, facts)


async def _run_mode(config: BenchConfig, endpoint: EngineEndpoint, mode: str, owned: bool, outcome: BenchOutcome,
                    note: Callable[[str], None]) -> None:
    await warm_up(endpoint, outcome.options, config.warmup_requests)
    reset = owned if config.reset_between_workloads is None else config.reset_between_workloads
    for name, requests in outcome.requests.items():
        if reset and not await endpoint.reset_prefix_cache():
            note(f"the engine refused to reset its prefix cache (other requests hold blocks): {name} ({mode}) "
                 "starts with whatever is cached")
        bar = ProgressBar(f"{name} ({mode})", len(requests)) if config.show_progress else None
        try:
            run = await drive(
                endpoint, requests, config.concurrency, TenantSalts(outcome.options.tenants),
                on_done=bar.advance if bar else lambda record: None,
            )
        finally:  # ends the bar's line, also when the run is stopped
            if bar:
                bar.close()
        outcome.results[name].summaries[mode] = summarize(run.records, run.evictions)
        outcome.results[name].records[mode] = run.records


def _describe(config: BenchConfig, options: WorkloadOptions, facts: EngineFacts) -> dict[str, object]:
    workload_options = {}
    for option in fields(options):
        value = getattr(options, option.name)
        numeric = isinstance(value, (int, float)) and math.isfinite(value)
        workload_options[option.name] = value if numeric else str(value)  # IntRange as "A:B", rate "inf"
    return {
        "workloads": list(config.workloads),
        "modes": list(config.modes),
        "target": config.target or "local",
        "concurrency": config.concurrency,
        "warmup_requests": config.warmup_requests,
        "options": workload_options,
        "engine": asdict(facts),
    }


def parse_workloads(names: Sequence[str], known: Sequence[str]) -> tuple[str, ...]:
    """The workloads `--workload` values name (repeated or comma-separated); all of them if none is given."""
    if not names:
        return tuple(known)
    chosen = [n.strip() for text in names for n in text.split(",") if n.strip()]
    if not chosen:
        raise ValueError(f"--workload names no workload; choose from {', '.join(known)}")
    for name in chosen:
        if name not in known:
            raise ValueError(f"--workload must name one of {', '.join(known)}, got {name!r}")
    return tuple(dict.fromkeys(chosen))
