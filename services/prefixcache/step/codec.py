"""Conversions between the step dataclasses (`step.py`) and the worker protocol's messages.

The only place the step contract meets protobuf: the scheduler and the model runner keep working
with plain dataclasses, the worker client and server convert at the edge.
"""
from __future__ import annotations

from prefixcache.protos.common.v1 import logprobs_pb2
from prefixcache.protos.worker.v1 import worker_pb2 as pb
from prefixcache.step.messages import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerStep,
    StepOutput,
    TokenLogprobs,
)


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        logprobs=params.logprobs,
    )


def sampling_from_proto(message: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        logprobs=message.logprobs,
    )


def step_to_proto(step: SchedulerStep) -> pb.Step:
    return pb.Step(
        step_id=step.step_id,
        new_requests=[
            pb.NewRequest(
                request_id=r.request_id,
                token_ids=r.token_ids,
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                sampling=sampling_to_proto(r.sampling),
            )
            for r in step.new_requests
        ],
        cached_requests=[
            pb.CachedRequest(
                request_id=r.request_id, new_block_ids=r.new_block_ids, num_computed_tokens=r.num_computed_tokens
            )
            for r in step.cached_requests
        ],
        num_scheduled_tokens=step.num_scheduled_tokens,
        finished_request_ids=step.finished_request_ids,
        follows_step_id=step.follows_step_id,
    )


def step_from_proto(message: pb.Step) -> SchedulerStep:
    return SchedulerStep(
        step_id=message.step_id,
        new_requests=[
            NewRequestData(
                request_id=r.request_id,
                token_ids=list(r.token_ids),
                block_ids=list(r.block_ids),
                num_computed_tokens=r.num_computed_tokens,
                sampling=sampling_from_proto(r.sampling),
            )
            for r in message.new_requests
        ],
        cached_requests=[
            CachedRequestData(
                request_id=r.request_id, new_block_ids=list(r.new_block_ids), num_computed_tokens=r.num_computed_tokens
            )
            for r in message.cached_requests
        ],
        num_scheduled_tokens=dict(message.num_scheduled_tokens),
        finished_request_ids=list(message.finished_request_ids),
        follows_step_id=message.follows_step_id if message.HasField("follows_step_id") else None,
    )


def output_to_proto(output: StepOutput) -> pb.StepResult:
    return pb.StepResult(
        step_id=output.step_id,
        sampled_token_ids=output.sampled_token_ids,
        logprobs={request_id: logprobs_to_proto(lp) for request_id, lp in output.logprobs.items()},
    )


def logprobs_to_proto(logprobs: TokenLogprobs) -> logprobs_pb2.TokenLogprobs:
    """One token's log-probabilities as the message the Worker and Engine APIs share."""
    return logprobs_pb2.TokenLogprobs(
        logprob=logprobs.logprob,
        top=[logprobs_pb2.TopLogprob(token_id=token_id, logprob=value) for token_id, value in logprobs.top],
    )


def output_from_proto(message: pb.StepResult) -> StepOutput:
    return StepOutput(
        step_id=message.step_id,
        sampled_token_ids=dict(message.sampled_token_ids),
        logprobs={
            request_id: TokenLogprobs(logprob=lp.logprob, top=tuple((t.token_id, t.logprob) for t in lp.top))
            for request_id, lp in message.logprobs.items()
        },
    )
