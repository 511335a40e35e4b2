"""Sampling: greedy, temperature, top-k, top-p, seeds and logprobs, on logits with a known distribution."""
from __future__ import annotations

import math

import pytest
import torch

from prefixcache.step.messages import SamplingParams
from prefixcache.worker.sampler import make_generator, sample, validate_sampling

# Probabilities 0.5, 0.25, 0.125, 0.0625, then the rest spread over 96 tokens.
PROBABILITIES = torch.tensor([0.5, 0.25, 0.125, 0.0625] + [0.0625 / 96] * 96)
LOGITS = PROBABILITIES.log()[None, :]


def draws(params: SamplingParams, count: int = 200, logits: torch.Tensor = LOGITS) -> list[int]:
    generator = make_generator(params, "cpu")
    return [sample(logits, [params], [generator], [position])[0].token_id for position in range(count)]


def test_greedy_takes_the_argmax_of_each_row() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    tokens = sample(logits, [SamplingParams()] * 4, [None] * 4, [7] * 4)
    assert [token.token_id for token in tokens] == logits.argmax(dim=-1).tolist()
    assert all(token.logprobs is None for token in tokens)


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    assert draws(params) == draws(params)
    assert draws(params) != draws(SamplingParams(temperature=1.0, seed=4321))


def test_a_seeded_draw_depends_only_on_its_position() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    in_order = draws(params, count=50)
    # A fresh generator (as after a preemption) drawing position 30 gives position 30's token.
    again = [sample(LOGITS, [params], [make_generator(params, "cpu")], [p])[0].token_id for p in range(30, 50)]
    assert again == in_order[30:]


def test_temperature_sampling_follows_the_distribution() -> None:
    tokens = draws(SamplingParams(temperature=1.0, seed=5), count=2000)
    assert 0.45 < tokens.count(0) / len(tokens) < 0.55
    assert len(set(tokens)) > 10  # the tail is reachable
    cold = draws(SamplingParams(temperature=0.05, seed=5))
    assert set(cold) == {0}  # a low temperature concentrates on the mode


def test_a_vanishing_temperature_samples_the_mode_instead_of_overflowing() -> None:
    # logits / 1e-39 would be inf in float32 and leave no distribution to draw from.
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1)) * 10
    assert set(draws(SamplingParams(temperature=1e-39, seed=2), count=20, logits=logits)) == {int(logits.argmax())}


def test_top_k_and_top_p_restrict_the_support() -> None:
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, seed=3))) == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.8, seed=3))) == {0, 1, 2}  # 0.5 + 0.25 < 0.8
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.3, seed=3))) == {0}
    assert set(draws(SamplingParams(temperature=1.0, top_k=3, top_p=0.7, seed=3))) == {0, 1}


def test_logprobs_are_those_of_the_raw_distribution() -> None:
    params = SamplingParams(temperature=2.0, seed=9, logprobs=3)
    [token] = sample(LOGITS, [params], [make_generator(params, "cpu")], [0])
    assert token.logprobs is not None
    assert token.logprobs.logprob == pytest.approx(math.log(PROBABILITIES[token.token_id]), abs=1e-5)
    assert [token_id for token_id, _ in token.logprobs.top] == [0, 1, 2]
    assert [value for _, value in token.logprobs.top] == pytest.approx([math.log(p) for p in (0.5, 0.25, 0.125)])


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(logprobs=-1), "logprobs"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(seed=-5), "seed"),
    ],
)
def test_invalid_parameters_name_their_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=f"sampling.{field}"):
        validate_sampling(params)
