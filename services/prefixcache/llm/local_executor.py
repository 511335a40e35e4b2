"""Run steps on a model runner in this process: the worker side of `prefixcache.llm.LLM`.

The runner is used through the methods of `prefixcache.worker.model_runner.ModelRunner`
(describe, num_blocks_for_memory, initialize_kv_cache, execute), so this module imports no torch.
Steps run on one compute thread: the event loop keeps serving clients while the model computes.
"""
from __future__ import annotations

from typing import Protocol

from prefixcache.scheduler.engine import WorkerInfo
from prefixcache.step.messages import SchedulerStep, StepOutput
from prefixcache.worker.compute_thread import ComputeThread


class ModelRunnerLike(Protocol):
    def describe(self): ...  # -> ModelDescription
    def num_blocks_for_memory(self, memory_bytes: int, block_size: int) -> int: ...
    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None: ...
    def execute(self, step: SchedulerStep) -> StepOutput: ...


class LocalExecutor:
    """A StepExecutor over an in-process model runner. The KV cache is sized by a block count or by
    a memory budget in bytes (exactly one of them). `compute` is the thread the runner was loaded on,
    if it was (one thread for all of a model's work, see `ComputeThread`)."""

    def __init__(
        self, runner: ModelRunnerLike, *, num_kv_blocks: int | None = None, kv_cache_bytes: int | None = None,
        compute: ComputeThread | None = None,
    ) -> None:
        if (num_kv_blocks is None) == (kv_cache_bytes is None):
            raise ValueError("give exactly one of num_kv_blocks and kv_cache_bytes")
        if num_kv_blocks is not None and num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {num_kv_blocks}")
        self.runner = runner
        self._num_kv_blocks = num_kv_blocks
        self._kv_cache_bytes = kv_cache_bytes
        self._compute = compute or ComputeThread()

    async def initialize(self, block_size: int) -> WorkerInfo:
        description = self.runner.describe()
        num_blocks = self._num_kv_blocks or self.runner.num_blocks_for_memory(self._kv_cache_bytes, block_size)
        await self._compute.run(self.runner.initialize_kv_cache, num_blocks, block_size)
        return WorkerInfo(
            model_id=description.model_id,
            vocab_size=description.vocab_size,
            max_model_len=description.max_model_len,
            num_kv_blocks=num_blocks,
            eos_token_ids=tuple(description.eos_token_ids),
            dtype=description.dtype,
            tokenizer_id=description.tokenizer_id,
            kv_bytes_per_token=description.bytes_per_block_token,
        )

    async def execute(self, step: SchedulerStep) -> StepOutput:
        return await self._compute.run(self.runner.execute, step)
