"""`benchmarks/vs_vllm.py`'s dtypes: what `--dtype` accepts, how each side's actual dtype is found (ours
from the Engine's Describe, on a real local platform; vLLM's from the engine configuration its log
holds, since vLLM itself needs its own venv and minutes to start), and the note when a forced dtype is
not the one a side runs."""
import asyncio

import pytest
import torch
import vs_vllm

from prefixcache.bench.engine import EngineEndpoint
from prefixcache.bench.local_platform import LocalSettings, local_platform
from prefixcache.worker.loader import resolve_dtype

# Lines shaped like those vLLM's OpenAI server logs at start; only the engine core's config line names
# the dtype it runs (the argument line says what was asked).
VLLM_LOG = """\
INFO 12-07 10:00:01 [api_server.py:1500] non-default args: {'model': '/m/SmolLM2', 'dtype': 'auto'}
INFO 12-07 10:00:09 [model.py:700] Resolved architecture: LlamaForCausalLM
(EngineCore_DP0 pid=4242) INFO 12-07 10:00:12 [core.py:90] Initializing a V1 LLM engine (v0.32.0) with \
config: model='/m/SmolLM2', speculative_config=None, tokenizer='/m/SmolLM2', skip_tokenizer_init=False, \
dtype=torch.bfloat16, max_seq_len=8192, download_dir=None, load_format=auto, kv_cache_dtype=auto
(EngineCore_DP0 pid=4242) INFO 12-07 10:01:20 [cpu_worker.py:80] KV cache: 128-token blocks
"""


def test_dtype_is_auto_unless_a_known_one_is_named(capsys):
    parser = vs_vllm.build_parser()
    assert parser.parse_args([]).dtype == "auto"
    assert parser.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err


def test_vllm_dtype_comes_from_its_logged_engine_config():
    assert vs_vllm.logged_dtype(VLLM_LOG) == "bfloat16"
    assert vs_vllm.logged_dtype(VLLM_LOG.replace("dtype=torch.bfloat16", "dtype=torch.float32")) == "float32"
    assert vs_vllm.logged_dtype(VLLM_LOG.splitlines()[0]) is None  # the asked-for 'auto' is no answer


def test_a_forced_dtype_a_side_does_not_run_is_noted():
    assert vs_vllm.dtype_notes("auto", {"prefixcache": "float32", "vllm": "bfloat16"}) == []
    assert vs_vllm.dtype_notes("bfloat16", {"prefixcache": "bfloat16", "vllm": "bfloat16"}) == []
    assert vs_vllm.dtype_notes("float32", {"prefixcache": "float32", "vllm": "bfloat16"}) == [
        "vllm runs bfloat16, not the float32 asked for: the ratios compare different dtypes"]


def test_the_table_heads_name_each_sides_dtype():
    summaries = {"prefixcache": {}, "vllm": {}}
    served = {"prefixcache": "float32", "vllm": "bfloat16"}
    assert list(vs_vllm.with_dtypes(summaries, served)) == ["prefixcache float32", "vllm bfloat16"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_our_engine_reports_the_dtype_it_runs(dtype):
    """What the benchmark prints as our dtype: the worker's choice, read back through Describe."""

    async def served_dtype() -> str:
        async with local_platform(LocalSettings(dtype=dtype, kv_cache_memory="16MiB"), prefix_caching=True) as target:
            async with EngineEndpoint(target) as engine:
                return (await engine.facts()).dtype

    assert asyncio.run(served_dtype()) == resolve_dtype(dtype, torch.device("cpu"))
