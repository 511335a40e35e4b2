"""The engine: the step loop over the scheduling policy and a worker, admission, worker recovery.

Pure asyncio, no gRPC and no torch: the Engine API (`prefixcache.scheduler.api`) serves it over
gRPC, `prefixcache.llm` runs it in-process over a model runner.
"""
from prefixcache.scheduler.config import SchedulerConfig
from prefixcache.scheduler.engine.core import EngineCore
from prefixcache.scheduler.engine.errors import EngineUnavailable, QueueFull, RequestRejected
from prefixcache.scheduler.engine.executor import StepExecutor, WorkerInfo, WorkerUnavailable
from prefixcache.scheduler.request import EngineRequest, RequestOutput, Usage

__all__ = [
    "EngineCore",
    "EngineRequest",
    "EngineUnavailable",
    "QueueFull",
    "RequestOutput",
    "RequestRejected",
    "SchedulerConfig",
    "StepExecutor",
    "Usage",
    "WorkerInfo",
    "WorkerUnavailable",
]
