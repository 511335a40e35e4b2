"""Pick the next token of each request from its logits.

Greedy when temperature is 0; otherwise temperature (at least `MIN_TEMPERATURE`), then top-k, then
top-p (nucleus) filtering and a draw from the request's own generator. A seeded request's draw for
sequence position p comes from its generator reseeded with `position_seed(seed, p)`: its tokens
depend on neither what shares the batch nor preemption (a preempted request comes back to the
worker as a new one, and a generator seeded once would replay its first draws). Logprobs, when
asked for, are those of the model's raw distribution (before temperature and filtering), as
OpenAI-style APIs report them.
"""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import torch

from prefixcache.step.messages import SamplingParams, TokenLogprobs


def validate_sampling(params: SamplingParams) -> None:
    """Raise ValueError naming the first invalid field."""
    if problem := params.problem():
        field, message = problem
        raise ValueError(f"sampling.{field} {message}")


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's own random stream (None if greedy): from fresh entropy, or for a seeded request
    reseeded before each draw (see `position_seed`)."""
    if params.temperature == 0:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.manual_seed(secrets.randbits(63))
    return generator


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw at sequence `position` (a 64-bit mix of both)."""
    mixed = hashlib.blake2b(seed.to_bytes(8, "little") + position.to_bytes(8, "little"), digest_size=8)
    return int.from_bytes(mixed.digest(), "little")


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           positions: list[int]) -> list[SampledToken]:
    """logits [N, vocab] float32, one row per request → one token per request.

    `positions[i]` is the sequence position request i's token will take (its current length).
    """
    token_ids = logits.argmax(dim=-1)
    for row, (request_params, generator, position) in enumerate(zip(params, generators, positions, strict=True)):
        if request_params.temperature > 0:
            if request_params.seed is not None:
                generator.manual_seed(position_seed(request_params.seed, position))
            token_ids[row] = _draw(logits[row], request_params, generator)
    chosen = token_ids.tolist()
    return [
        SampledToken(token, _logprobs(logits[row], token, request_params.logprobs) if request_params.logprobs else None)
        for row, (token, request_params) in enumerate(zip(chosen, params))
    ]


# Positive temperatures below this are raised to it: dividing float32 logits by, say, 1e-39 overflows
# to inf and leaves nothing to sample from (vLLM clamps at the same value).
MIN_TEMPERATURE = 1e-2


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    scaled = logits / max(params.temperature, MIN_TEMPERATURE)
    if 0 < params.top_k < scaled.shape[-1]:
        kth_best = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth_best, float("-inf"))
    if params.top_p < 1:
        scaled = _top_p_filter(scaled, params.top_p)
    probabilities = scaled.softmax(dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator)[0]


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of best tokens whose probability reaches top_p (always at least one)."""
    sorted_logits, order = logits.sort(descending=True)
    probabilities = sorted_logits.softmax(dim=-1)
    mass_before = probabilities.cumsum(dim=-1) - probabilities
    sorted_logits[mass_before >= top_p] = float("-inf")
    return torch.empty_like(logits).scatter_(0, order, sorted_logits)


def _logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    logprobs = logits.log_softmax(dim=-1)
    best = logprobs.topk(top)
    return TokenLogprobs(
        logprob=float(logprobs[token]),
        top=tuple(zip(best.indices.tolist(), best.values.tolist())),
    )
