"""What the engine needs from a worker, whatever the transport: the gRPC worker client, or
`local_executor.LocalExecutor` over a model runner in this process."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from prefixcache.step.messages import SchedulerStep, StepOutput


@dataclass(frozen=True)
class WorkerInfo:
    """The worker's description of its model and KV cache."""

    model_id: str  # names the exact weights; part of every block hash
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int  # blocks of the scheduler's block size the worker's KV cache holds
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = ""
    supports_multimodal: bool = False
    tokenizer_id: str = ""  # of the model's tokenizer.json; "" when unknown
    kv_bytes_per_token: int = 0  # KV memory one token takes, all layers; 0 when unknown


class WorkerUnavailable(Exception):
    """Raised by a StepExecutor when the worker is gone (crashed, unreachable)."""


class StepExecutor(Protocol):
    async def initialize(self, block_size: int) -> WorkerInfo:
        """(Re)initialize the worker's KV cache for this block size and describe the model."""
        ...

    async def execute(self, step: SchedulerStep) -> StepOutput:
        """Run one step. Raises WorkerUnavailable if the worker is gone."""
        ...
