"""The engine in this process, for scripts, notebooks and stepping through one request in a debugger:

    from prefixcache.llm import LLM, SamplingOptions

    with LLM(kv_cache_memory="256MiB") as llm:  # the embedded model unless model_dir says otherwise
        greedy = SamplingOptions(max_tokens=16, temperature=0.0)
        first, second = llm.generate(["Tell me about Paris.", "Tell me about Rome."], greedy)
        print(second.text, second.usage.cached_tokens)

`AsyncLLM` is the same for asyncio code, with `stream()` for one request's chunks as they come.
Importing this package loads no torch; starting an engine does.
"""
from prefixcache.llm.engine import LLM, AsyncLLM, Prompt
from prefixcache.llm.outputs import Completion, CompletionChunk, SamplingOptions

__all__ = ["LLM", "AsyncLLM", "Completion", "CompletionChunk", "Prompt", "SamplingOptions"]
