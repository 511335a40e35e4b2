"""Step dataclasses survive the trip through the worker protocol's bytes unchanged."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prefixcache.protos.worker.v1 import worker_pb2 as pb
from prefixcache.step.codec import output_from_proto, output_to_proto, step_from_proto, step_to_proto
from prefixcache.step.messages import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerStep,
    StepOutput,
    TokenLogprobs,
)

ids = st.lists(st.integers(0, 2**32 - 1), max_size=40)
request_ids = st.text(min_size=1, max_size=12)
# float32 on the wire: only values exactly representable in it survive unchanged
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
sampling = st.builds(
    SamplingParams,
    temperature=f32,
    top_p=f32,
    top_k=st.integers(0, 1000),
    seed=st.none() | st.integers(0, 2**64 - 1),
    logprobs=st.integers(0, 20),
)
new_request = st.builds(
    NewRequestData,
    request_id=request_ids,
    token_ids=ids,
    block_ids=ids,
    num_computed_tokens=st.integers(0, 10_000),
    sampling=sampling,
)
cached_request = st.builds(
    CachedRequestData, request_id=request_ids, new_block_ids=ids, num_computed_tokens=st.integers(0, 10_000)
)
steps = st.builds(
    SchedulerStep,
    step_id=st.integers(0, 2**63),
    new_requests=st.lists(new_request, max_size=4),
    cached_requests=st.lists(cached_request, max_size=4),
    num_scheduled_tokens=st.dictionaries(request_ids, st.integers(1, 4096), max_size=8),
    finished_request_ids=st.lists(request_ids, max_size=4),
)
outputs = st.builds(
    StepOutput,
    step_id=st.integers(0, 2**63),
    sampled_token_ids=st.dictionaries(request_ids, st.integers(0, 2**32 - 1), max_size=8),
    logprobs=st.dictionaries(
        request_ids,
        st.builds(TokenLogprobs, logprob=f32, top=st.lists(st.tuples(st.integers(0, 2**32 - 1), f32), max_size=5).map(tuple)),
        max_size=4,
    ),
)


@given(steps)
def test_step_round_trips(step: SchedulerStep) -> None:
    wire = step_to_proto(step).SerializeToString()
    assert step_from_proto(pb.Step.FromString(wire)) == step


@given(outputs)
def test_step_output_round_trips(output: StepOutput) -> None:
    wire = output_to_proto(output).SerializeToString()
    assert output_from_proto(pb.StepResult.FromString(wire)) == output


def test_unset_seed_stays_unset() -> None:
    step = SchedulerStep(step_id=1, new_requests=[NewRequestData("a", [1, 2], [0], 0, SamplingParams(seed=None))])
    decoded = step_from_proto(pb.Step.FromString(step_to_proto(step).SerializeToString()))
    assert decoded.new_requests[0].sampling.seed is None
    seeded = SchedulerStep(step_id=1, new_requests=[NewRequestData("a", [1], [0], 0, SamplingParams(seed=0))])
    assert step_from_proto(step_to_proto(seeded)).new_requests[0].sampling.seed == 0
