"""The scheduler service's configuration: block identity, batching limits, queue bound."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    hash_algo: str = "sha256"
    enable_prefix_caching: bool = True
    max_num_seqs: int = 32  # running requests at most
    max_num_batched_tokens: int = 2048  # tokens computed per step at most (long prompts are chunked)
    max_waiting: int = 256  # waiting requests at most; beyond, new requests are refused
    max_model_len: int = 8192
    # Send a decode step before the one running returns (see `SchedulingPolicy.can_schedule_ahead`):
    # the worker then starts it as soon as it is free instead of waiting a round trip and a
    # scheduling pass for it. It pays most where an accelerator runs the step and the CPU is idle
    # meanwhile; on the 2-core dev box it pays at low concurrency, where steps are short
    # (docs/services.md).
    schedule_ahead: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
