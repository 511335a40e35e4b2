"""The platform in one process: the scheduler's EngineCore stepping a ModelRunner through a
LocalExecutor, and the model's TextTokenizer for text in and out. What the three services do over
gRPC happens here in plain calls, so one request can be followed in a debugger from `generate` to
the model's forward pass (which runs on the compute thread) and back.

`AsyncLLM` is for asyncio code; `LLM` runs it on an event loop of its own for everything else.
"""
from __future__ import annotations

import asyncio
import itertools
import operator
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixcache.llm.local_executor import LocalExecutor
from prefixcache.llm.outputs import Completion, CompletionChunk, SamplingOptions
from prefixcache.model_store.store import ensure_default_model
from prefixcache.scheduler.engine import EngineCore, EngineRequest, RequestOutput, SchedulerConfig
from prefixcache.scheduler.request import FINISH_STOP
from prefixcache.tokenizer.text import IncrementalDetokenizer, TextTokenizer
from prefixcache.worker.compute_thread import ComputeThread

if TYPE_CHECKING:
    from prefixcache.worker.model_runner import ModelRunner

Prompt = str | Sequence[int]  # text (tokenized without special tokens, as the Engine API does) or token ids


class AsyncLLM:
    """`async with AsyncLLM() as llm: completions = await llm.generate(["Hello"])`.

    `model_dir` is a Hugging Face model directory (default: the embedded model, pulled on first use);
    `kv_cache_memory`, `dtype`, `device` and `attention_backend` are the worker's settings, and the
    keyword arguments left are the scheduler's (`SchedulerConfig`: block_size, enable_prefix_caching,
    max_num_seqs, max_num_batched_tokens, max_model_len, ...), as `prefixcache serve` takes them.
    """

    def __init__(self, model_dir: str | Path | None = None, *, kv_cache_memory: str = "1GiB", dtype: str = "auto",
                 device: str = "cpu", attention_backend: str | None = None, **scheduler_settings: Any) -> None:
        self.config = SchedulerConfig(**scheduler_settings)
        self.model_dir = Path(model_dir) if model_dir is not None else ensure_default_model()
        self.tokenizer = TextTokenizer(self.model_dir)
        self._worker_settings = (dtype, device, attention_backend, kv_cache_memory)
        self._engine: EngineCore | None = None
        self._request_numbers = itertools.count()

    async def start(self) -> None:
        """Load the model (on the thread that will run its steps) and start the engine's step loop."""
        compute = ComputeThread()
        runner, kv_cache_bytes = await compute.run(_load_worker, self.model_dir, *self._worker_settings)
        engine = EngineCore(self.config, LocalExecutor(runner, kv_cache_bytes=kv_cache_bytes, compute=compute))
        await engine.start()
        self._engine = engine

    async def close(self) -> None:
        """Abort whatever still runs and stop the step loop."""
        if self._engine is not None:
            await self._engine.shutdown(grace_s=0)
            self._engine = None

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def engine(self) -> EngineCore:
        """The scheduler's engine: `cache_stats()`, `reset_prefix_cache()`, `worker_info`."""
        if self._engine is None:
            raise RuntimeError("the engine is not running: use `async with AsyncLLM(...)` or `await start()`")
        return self._engine

    async def generate(self, prompts: Sequence[Prompt], options: SamplingOptions | None = None) -> list[Completion]:
        """One completion per prompt, in order; the prompts run batched, as concurrent clients' would."""
        if isinstance(prompts, str):
            raise TypeError("prompts: give a list of prompts, e.g. [\"Hello\"]")
        # The engine refuses requests beyond `max_waiting` queued ones: submit no more than it queues.
        slots = asyncio.Semaphore(self.config.max_waiting)

        async def one(prompt: Prompt) -> Completion:
            async with slots:
                return await self.complete(prompt, options)

        return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))

    async def complete(self, prompt: Prompt, options: SamplingOptions | None = None) -> Completion:
        """One prompt's whole completion."""
        request, chunks = self._submit(prompt, options)
        completion = Completion(request.request_id, request.prompt_token_ids)
        async for chunk in chunks:
            completion.add(chunk)
        return completion

    def stream(self, prompt: Prompt, options: SamplingOptions | None = None) -> AsyncIterator[CompletionChunk]:
        """The request's chunks as the engine steps it; leaving the loop early aborts the request.
        Bad input raises `RequestRejected` (a ValueError naming the field) at once."""
        return self._submit(prompt, options)[1]

    def _submit(self, prompt: Prompt, options: SamplingOptions | None) -> tuple[EngineRequest,
                                                                               AsyncIterator[CompletionChunk]]:
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(map(operator.index, prompt))
        request = (options or SamplingOptions()).engine_request(f"llm-{next(self._request_numbers)}", prompt_ids,
                                                                self.engine.capacity_tokens)
        return request, self._chunks(request, self.engine.add_request(request))

    async def _chunks(self, request: EngineRequest, outputs: AsyncIterator[RequestOutput]
                      ) -> AsyncIterator[CompletionChunk]:
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, skip_special_tokens=True)
        async for output in outputs:
            yield CompletionChunk.of(output, detokenizer.push(_text_token_ids(output), last=output.finished))


def _text_token_ids(output: RequestOutput) -> list[int]:
    """The ids whose text an output carries: a stop token (EOS or one of `stop_token_ids`) that ended
    the request stays in the ids but adds no text, as in the Engine API."""
    stopped_by_token = output.finished and output.finish_reason == FINISH_STOP
    return output.new_token_ids[:-1] if stopped_by_token else output.new_token_ids


def _load_worker(model_dir: Path, dtype: str, device: str, attention_backend: str | None,
                 kv_cache_memory: str) -> tuple[ModelRunner, int]:
    """The model runner and its KV cache budget in bytes (a fraction is of what the model left free).
    torch is imported here, when a model loads, not with this package."""
    from prefixcache.worker.kv_memory import kv_cache_budget_bytes
    from prefixcache.worker.model_runner import ModelRunner

    runner = ModelRunner(model_dir, dtype=dtype, device=device, attention_backend=attention_backend)
    return runner, kv_cache_budget_bytes(kv_cache_memory, device)


class LLM:
    """The in-process engine for code without an event loop:

        with LLM(kv_cache_memory="256MiB") as llm:
            [completion] = llm.generate(["The capital of France is"], SamplingOptions(max_tokens=8, temperature=0))
            print(completion.text, completion.usage.cached_tokens)

    Takes `AsyncLLM`'s arguments. Between calls nothing runs: the engine steps only inside `generate`.
    """

    def __init__(self, model_dir: str | Path | None = None, **settings: Any) -> None:
        self._llm = AsyncLLM(model_dir, **settings)
        self._loop = asyncio.Runner()
        try:
            self._loop.run(self._llm.start())
        except BaseException:
            self._loop.close()
            raise

    @property
    def tokenizer(self) -> TextTokenizer:
        return self._llm.tokenizer

    @property
    def engine(self) -> EngineCore:
        """The scheduler's engine: `cache_stats()`, `reset_prefix_cache()`, `worker_info`."""
        return self._llm.engine

    def generate(self, prompts: Sequence[Prompt], options: SamplingOptions | None = None) -> list[Completion]:
        """One completion per prompt, in order (see `AsyncLLM.generate`)."""
        return self._loop.run(self._llm.generate(prompts, options))

    def close(self) -> None:
        try:
            self._loop.run(self._llm.close())
        finally:
            self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
