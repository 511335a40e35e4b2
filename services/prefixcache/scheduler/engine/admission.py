"""Whether a request can run on a worker at all: the checks made before it is queued, and again
before a request held through a worker loss runs on the new worker."""
from __future__ import annotations

from prefixcache.scheduler.config import SchedulerConfig
from prefixcache.scheduler.engine.errors import RequestRejected
from prefixcache.scheduler.engine.executor import WorkerInfo
from prefixcache.scheduler.request import EngineRequest


def effective_max_model_len(config: SchedulerConfig, info: WorkerInfo | None) -> int:
    """Prompt plus output at most: the configured limit, lowered to the model's once it is known."""
    return min(config.max_model_len, info.max_model_len) if info is not None else config.max_model_len


def check_prompt_length(num_tokens: int, max_len: int) -> None:
    """Raise RequestRejected for a prompt that leaves no room to generate within `max_len`: checked
    first, and by the API before it copies a prompt's ids, so that an oversized prompt costs nothing."""
    if num_tokens >= max_len:
        raise RequestRejected(
            "prompt_token_ids", f"the prompt ({num_tokens} tokens) leaves no room to generate within the "
            f"maximum length {max_len}")


def check_fits_worker(request: EngineRequest, info: WorkerInfo, config: SchedulerConfig) -> None:
    """Raise RequestRejected, naming the field, if `request` cannot run on the worker `info` describes."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise RequestRejected("prompt_token_ids", "the prompt is empty")
    max_len = effective_max_model_len(config, info)
    check_prompt_length(len(prompt), max_len)
    bad = next((t for t in prompt if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise RequestRejected("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
    if request.max_tokens <= 0:
        raise RequestRejected("max_tokens", f"must be positive, got {request.max_tokens}")
    if request.sampling.logprobs > info.vocab_size:
        raise RequestRejected("logprobs", f"asks for {request.sampling.logprobs} alternatives; "
                              f"the vocabulary has {info.vocab_size} tokens")
    if len(prompt) + request.max_tokens > max_len:
        raise RequestRejected(
            "max_tokens",
            f"prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) exceeds the maximum length {max_len}",
        )
    # KV slots a request can hold at once: every token but the last one generated, which is
    # sampled and never fed back.
    block_size = config.block_size
    prompt_blocks = -(-len(prompt) // block_size)
    if prompt_blocks > info.num_kv_blocks:
        raise RequestRejected(
            "prompt_token_ids",
            f"the prompt ({len(prompt)} tokens) needs {prompt_blocks} KV blocks; "
            f"the worker has {info.num_kv_blocks}",
        )
    blocks_needed = -(-(len(prompt) + request.max_tokens - 1) // block_size)
    if blocks_needed > info.num_kv_blocks:
        raise RequestRejected(
            "max_tokens",
            f"prompt + max_tokens needs {blocks_needed} KV blocks; the worker has {info.num_kv_blocks}",
        )
    if problem := request.sampling.problem():
        raise RequestRejected(*problem)
    if request.extras.mm_items and not info.supports_multimodal:
        raise RequestRejected("multimodal", f"the model {info.model_id!r} takes text only")
    bad_stop = next((t for t in request.stop_token_ids if not 0 <= t < info.vocab_size), None)
    if bad_stop is not None:
        raise RequestRejected("stop_token_ids", f"token id {bad_stop} is outside the vocabulary")
