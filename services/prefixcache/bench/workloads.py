"""Seeded, reproducible benchmark workloads.

A workload is a plain list of `BenchRequest`s: token ids drawn from the model's ordinary vocabulary
(never a special token such as `<|im_end|>`), a tenant index and an arrival offset. The same
`WorkloadOptions` always give the same requests, so a run with the prefix cache and one without it
send exactly the same prompts. Tenant *salts* are not part of a workload: they are secrets made per
run (`driver.TenantSalts`), which keeps workloads printable and comparable across runs.

Each generator draws from its own `random.Random` seeded with the workload name and the seed, so
adding a request or a workload never shifts the tokens of another.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

# SmolLM2's special tokens are ids 0..16 (<|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...).
DEFAULT_FIRST_ORDINARY_TOKEN = 17
DEFAULT_VOCAB_SIZE = 49_152


@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    tenant: int  # index into the run's tenant salts, 0 <= tenant < WorkloadOptions.tenants
    arrival_s: float = 0.0  # offset from the start of the run at which the request may be sent (`generate`)
    after: str | None = None  # request id that must finish first (the previous turn of a conversation)


@dataclass(frozen=True, slots=True)
class IntRange:
    """An inclusive range of lengths, written `A:B` (or `N` for exactly N) on the command line."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"range {self.low}:{self.high} must satisfy 1 <= low <= high")

    @classmethod
    def parse(cls, text: str) -> IntRange:
        low, _, high = text.partition(":")
        try:
            return cls(int(low), int(high or low))
        except ValueError as error:
            raise ValueError(f"expected N or A:B with 1 <= A <= B, got {text!r}: {error}") from None

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return f"{self.low}:{self.high}"


# Unless told otherwise, thrash visits each prefix this often: the first visit is cold and every later
# one misses as `evicted`, so evictions dominate the miss reasons.
THRASH_VISITS = 3


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    num_requests: int = 32
    seed: int = 0
    tenants: int = 1
    request_rate: float = math.inf  # requests/s of the Poisson arrival process; inf sends all at once
    output_len: int = 32  # max_tokens of every request (and the length of synthetic assistant turns)
    prefix_len: int = 1000  # system prompt; total few-shot examples; each thrash prefix
    suffix_len: IntRange = field(default_factory=lambda: IntRange(50, 200))  # user turn / question
    turns: IntRange = field(default_factory=lambda: IntRange(4, 8))  # multi-turn conversation length
    few_shot_examples: int = 8
    thrash_prefixes: int = 64  # distinct prefixes; must exceed what the KV cache holds to thrash
    thrash_requests: int | None = None  # None: THRASH_VISITS visits to each prefix
    vocab_size: int = DEFAULT_VOCAB_SIZE
    first_ordinary_token: int = DEFAULT_FIRST_ORDINARY_TOKEN

    @property
    def num_thrash_requests(self) -> int:
        return self.thrash_requests or THRASH_VISITS * self.thrash_prefixes

    def __post_init__(self) -> None:
        positive = ("num_requests", "tenants", "output_len", "prefix_len", "few_shot_examples", "thrash_prefixes")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.thrash_requests is not None and self.thrash_requests < 1:
            raise ValueError(f"thrash_requests must be >= 1, got {self.thrash_requests}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf for no pacing), got {self.request_rate}")
        if not 0 <= self.first_ordinary_token < self.vocab_size:
            raise ValueError(
                f"first_ordinary_token must lie in [0, vocab_size={self.vocab_size}), got {self.first_ordinary_token}"
            )


class _Tokens:
    """Random ordinary token ids from one seeded stream."""

    def __init__(self, rng: random.Random, options: WorkloadOptions) -> None:
        self._rng = rng
        self._low = options.first_ordinary_token
        self._high = options.vocab_size - 1

    def __call__(self, count: int) -> tuple[int, ...]:
        return tuple(self._rng.randint(self._low, self._high) for _ in range(count))


def _rng(workload: str, seed: int) -> random.Random:
    return random.Random(f"{workload}:{seed}")


def _one_turn_requests(workload: str, count: int, options: WorkloadOptions,
                       prompt: Callable[[int], tuple[int, ...]],
                       tenant: Callable[[int], int] | None = None) -> list[BenchRequest]:
    """`count` independent requests, request i with `prompt(i)` (called in order, so seeded draws
    stay in the same order) and tenant `tenant(i)`, by default i modulo the tenant count."""
    return [
        BenchRequest(request_id=f"{workload}-{i}", prompt_token_ids=prompt(i), max_tokens=options.output_len,
                     tenant=i % options.tenants if tenant is None else tenant(i))
        for i in range(count)
    ]


def shared_system_prompt(options: WorkloadOptions) -> list[BenchRequest]:
    """One long system prompt shared by every request, then a varied user turn."""
    rng = _rng("shared-system-prompt", options.seed)
    tokens = _Tokens(rng, options)
    system = tokens(options.prefix_len)
    return _one_turn_requests("shared-system-prompt", options.num_requests, options,
                              lambda _: system + tokens(options.suffix_len.draw(rng)))


def multi_turn(options: WorkloadOptions) -> list[BenchRequest]:
    """Conversations of `turns` turns; each turn re-sends the whole history plus a new user message.

    Assistant replies in the history are synthetic (seeded random tokens of `output_len`), not the
    model's output, so the prompts are identical whatever the server generates. Turn k+1 of a
    conversation waits for turn k (`after`). Requests are ordered turn by turn across conversations,
    so the first turns of all conversations can run concurrently.
    """
    rng = _rng("multi-turn", options.seed)
    tokens = _Tokens(rng, options)
    conversations: list[list[BenchRequest]] = []
    remaining = options.num_requests
    while remaining > 0:
        index = len(conversations)
        turns = _conversation_length(options.turns.draw(rng), remaining, options.turns)
        remaining -= turns
        history: tuple[int, ...] = ()
        conversation: list[BenchRequest] = []
        for turn in range(turns):
            prompt = history + tokens(options.suffix_len.draw(rng))
            conversation.append(
                BenchRequest(
                    request_id=f"multi-turn-{index}-{turn}",
                    prompt_token_ids=prompt,
                    max_tokens=options.output_len,
                    tenant=index % options.tenants,
                    after=conversation[-1].request_id if conversation else None,
                )
            )
            history = prompt + tokens(options.output_len)
        conversations.append(conversation)
    longest = max(len(c) for c in conversations)
    return [c[turn] for turn in range(longest) for c in conversations if turn < len(c)]


def _conversation_length(drawn: int, remaining: int, turns: IntRange) -> int:
    """The next conversation's length: `drawn`, or the length within `turns` nearest to it, such that
    the requests left after it are none or can themselves be split into conversations within `turns`.

    So every conversation stays within the range whenever `num_requests` allows it (with the default
    4:8, any total of 4 or more); otherwise, one conversation is shorter.
    """
    fitting = [n for n in range(turns.low, min(turns.high, remaining) + 1) if _splits(remaining - n, turns)]
    if not fitting:
        return min(drawn, remaining)
    return min(fitting, key=lambda n: (abs(n - drawn), n))


def _splits(total: int, turns: IntRange) -> bool:
    """Whether `total` requests make whole conversations of lengths within `turns` (none for 0)."""
    fewest = -(-total // turns.high)  # conversations needed; more of them only need more requests
    return fewest * turns.low <= total


def check_few_shot(options: WorkloadOptions) -> None:
    """Every example needs a token of the prefix (checked only when few-shot runs)."""
    if options.few_shot_examples > options.prefix_len:
        raise ValueError(f"few_shot_examples ({options.few_shot_examples}) cannot exceed prefix_len "
                         f"({options.prefix_len})")


def few_shot(options: WorkloadOptions) -> list[BenchRequest]:
    """`few_shot_examples` shared examples (together `prefix_len` tokens), then a varied question."""
    check_few_shot(options)
    rng = _rng("few-shot", options.seed)
    tokens = _Tokens(rng, options)
    base, extra = divmod(options.prefix_len, options.few_shot_examples)
    examples = tuple(t for k in range(options.few_shot_examples) for t in tokens(base + (k < extra)))
    return _one_turn_requests("few-shot", options.num_requests, options,
                              lambda _: examples + tokens(options.suffix_len.draw(rng)))


def unique(options: WorkloadOptions) -> list[BenchRequest]:
    """Prompts that share nothing, as long as the shared-system-prompt ones (prefix + suffix)."""
    rng = _rng("unique", options.seed)
    tokens = _Tokens(rng, options)
    return _one_turn_requests("unique", options.num_requests, options,
                              lambda _: tokens(options.prefix_len + options.suffix_len.draw(rng)))


def thrash(options: WorkloadOptions) -> list[BenchRequest]:
    """`thrash_prefixes` distinct long prefixes visited in a cycle, each with a fresh suffix;
    `num_thrash_requests` requests in all.

    A cyclic scan is LRU's worst case: once the prefixes together exceed the KV cache, each one is
    evicted before its next visit, so every revisit misses with reason `evicted`. Each prefix
    belongs to one tenant: a revisit by another tenant (another salt) would miss as `cold`.
    """
    rng = _rng("thrash", options.seed)
    tokens = _Tokens(rng, options)
    prefixes = [tokens(options.prefix_len) for _ in range(options.thrash_prefixes)]
    return _one_turn_requests("thrash", options.num_thrash_requests, options,
                              lambda i: prefixes[i % len(prefixes)] + tokens(options.suffix_len.draw(rng)),
                              tenant=lambda i: i % len(prefixes) % options.tenants)


GENERATORS: dict[str, Callable[[WorkloadOptions], list[BenchRequest]]] = {
    "shared-system-prompt": shared_system_prompt,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "unique": unique,
    "thrash": thrash,
}


def poisson_arrivals(count: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival offsets of a Poisson process with `rate` events/s (all 0 when rate is infinite)."""
    if math.isinf(rate):
        return [0.0] * count
    arrivals, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        arrivals.append(now)
    return arrivals


def generate(workload: str, options: WorkloadOptions) -> list[BenchRequest]:
    """The requests of `workload`, with Poisson arrival offsets when `options.request_rate` is finite."""
    if workload not in GENERATORS:
        raise ValueError(f"workload must be one of {', '.join(GENERATORS)}, got {workload!r}")
    requests = GENERATORS[workload](options)
    arrivals = poisson_arrivals(len(requests), options.request_rate, _rng(f"{workload}/arrivals", options.seed))
    return [replace(request, arrival_s=at) for request, at in zip(requests, arrivals, strict=True)]
