"""vLLM's own KVCacheManager, driven through the cycle `kv_cache.py` times (run by that benchmark).

Runs inside vLLM's virtual environment (vLLM and prefixcache do not share a torch), as a child
process of `benchmarks/kv_cache.py`, which alternates cycles between the engines prompt by prompt so
that a slow phase of the machine lands on both. Protocol, one JSON object per line on stdin:
`{"num_blocks": N, "block_size": B, "max_model_len": L}` starts a fresh manager;
`{"prompt": [ids...]}` runs one cycle and answers `{"us": microseconds}`. A cycle is what vLLM's
scheduler does for one request: a `Request` built with the block hasher (so its blocks are hashed
inside the cycle, with vLLM's default sha256 over pickle), `get_computed_blocks`, `allocate_slots`
for the rest of the prompt (which caches the new full blocks), `free`.
"""
from __future__ import annotations

import json
import sys
import time

import torch
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

HASH_ALGO = "sha256"  # vLLM's default `--prefix-caching-hash-algo`


class Cycles:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        hash_fn = get_hash_fn_by_name(HASH_ALGO)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(block_size, hash_fn)
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32)
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        self.manager = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=block_size,
                                      hash_block_size=block_size, enable_caching=True)
        self.sampling = SamplingParams(max_tokens=1)
        self.count = 0

    def run(self, tokens: list[int]) -> float:
        """One request's cycle, in CPU microseconds."""
        self.count += 1
        start = time.process_time()
        request = Request(f"req-{self.count}", tokens, self.sampling, None, block_hasher=self.block_hasher)
        hits, num_computed, _ = self.manager.get_computed_blocks(request)
        if self.manager.allocate_slots(request, len(tokens) - num_computed, num_computed, hits) is None:
            raise RuntimeError("vLLM's pool could not hold the prompt")
        self.manager.free(request)
        return (time.process_time() - start) * 1e6


def main() -> None:
    cycles = None
    for line in sys.stdin:
        command = json.loads(line)
        if "prompt" in command:
            print(json.dumps({"us": cycles.run(command["prompt"])}), flush=True)
        else:
            cycles = Cycles(command["num_blocks"], command["block_size"], command["max_model_len"])
            print(json.dumps({"ok": True}), flush=True)


if __name__ == "__main__":
    main()
