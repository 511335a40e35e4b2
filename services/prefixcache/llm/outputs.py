"""What the in-process engine takes and gives: sampling options with the Engine API's defaults, and
completions with the same fields as the Engine client's (`prefixcache.client.Completion`)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixcache.scheduler.engine import EngineRequest, RequestOutput, Usage
from prefixcache.scheduler.kv_cache import CacheAccount
from prefixcache.step.messages import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class SamplingOptions:
    """How to generate: the Engine API's `SamplingOptions`, with its defaults (stop strings aside:
    the Engine service matches those on the text it streams)."""

    max_tokens: int | None = None  # None: as many as the model's length and the KV cache leave room for
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # per request: the same seed gives the same tokens
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # alternatives returned with each token's log-probability (0: none)

    def engine_request(self, request_id: str, prompt_token_ids: list[int], capacity_tokens: int) -> EngineRequest:
        """The engine's request; without max_tokens it fills what `capacity_tokens` leaves after the prompt."""
        max_tokens = self.max_tokens if self.max_tokens is not None else max(1, capacity_tokens - len(prompt_token_ids))
        sampling = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                                  logprobs=self.logprobs)
        return EngineRequest(request_id, prompt_token_ids, sampling, max_tokens, tuple(self.stop_token_ids),
                             self.ignore_eos)


@dataclass(frozen=True)
class CompletionChunk:
    """What one engine step added to a request: its new token ids and their text."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop", "length" or "abort", on the last chunk
    usage: Usage | None = None  # on the last chunk
    cache_account: CacheAccount | None = None  # the prefix-cache lookup, on the first and the last chunk
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when asked for

    @classmethod
    def of(cls, output: RequestOutput, text: str) -> CompletionChunk:
        return cls(output.new_token_ids, text, output.finish_reason, output.usage, output.cache_account,
                   output.logprobs)


@dataclass
class Completion:
    """A whole generation: its chunks, gathered."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None  # prompt, cached and completion tokens, once finished
    cache_account: CacheAccount | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def add(self, chunk: CompletionChunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.cache_account = chunk.cache_account or self.cache_account
        if chunk.finish_reason is not None:
            self.finish_reason, self.usage = chunk.finish_reason, chunk.usage
