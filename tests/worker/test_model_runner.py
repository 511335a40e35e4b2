"""The runner's side of the step contract, its KV sizing, and how loading fails, on a tiny checkpoint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from runner_harness import HandScheduler, save_tiny_checkpoint
from safetensors.torch import save_file

from prefixcache.step.messages import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerStep,
)
from prefixcache.worker.loader import auto_dtype, resolve_dtype, weight_files
from prefixcache.worker.model_runner import ModelRunner

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def runner(tiny_dir: Path) -> ModelRunner:
    runner = ModelRunner(tiny_dir)
    runner.initialize_kv_cache(num_blocks=32, block_size=BLOCK_SIZE)
    return runner


def new_request(request_id: str, tokens: list[int], blocks: list[int], computed: int = 0,
                sampling: SamplingParams | None = None) -> NewRequestData:
    return NewRequestData(request_id, tokens, blocks, computed, sampling or SamplingParams())


PROMPT = [5, 17, 42, 99, 7, 250, 31]


def test_describe_and_kv_sizing(runner: ModelRunner) -> None:
    description = runner.describe()
    assert description.architecture == "LlamaForCausalLM"
    assert description.model_id.startswith("tiny")
    assert len(description.model_id.split("sha256:")[1]) == 16
    assert (description.num_layers, description.num_kv_heads, description.head_dim) == (3, 2, 16)
    assert description.eos_token_ids == (2,)
    # keys and values, 3 layers, 2 heads of 16 float32 values
    assert description.bytes_per_block_token == 2 * 3 * 2 * 16 * 4
    per_block = description.bytes_per_block_token * BLOCK_SIZE
    assert runner.num_blocks_for_memory(10 * per_block + per_block - 1, BLOCK_SIZE) == 10
    with pytest.raises(ValueError, match="below one block"):
        runner.num_blocks_for_memory(per_block - 1, BLOCK_SIZE)


def test_model_id_names_the_weights(tiny_dir: Path, tmp_path: Path) -> None:
    same = shutil.copytree(tiny_dir, tmp_path / tiny_dir.name)
    assert ModelRunner(same).describe().model_id == ModelRunner(tiny_dir).describe().model_id
    other = save_tiny_checkpoint("llama3", tmp_path / "other")
    assert ModelRunner(other).describe().model_id.split("@")[1] != ModelRunner(tiny_dir).model_id.split("@")[1]


def test_partial_prefill_chunk_samples_nothing(runner: ModelRunner) -> None:
    first = runner.execute(SchedulerStep(0, [new_request("a", PROMPT, [3, 9])], [], {"a": 4}))
    assert first.sampled_token_ids == {}
    second = runner.execute(SchedulerStep(1, [], [CachedRequestData("a", [], 4)], {"a": 3}))
    assert list(second.sampled_token_ids) == ["a"]
    third = runner.execute(SchedulerStep(2, [], [CachedRequestData("a", [], 7)], {"a": 1}))
    assert list(third.sampled_token_ids) == ["a"]


def test_logprobs_on_request_only(runner: ModelRunner) -> None:
    step = SchedulerStep(0, [new_request("plain", PROMPT, [0, 1]),
                             new_request("asks", PROMPT, [2, 3], sampling=SamplingParams(logprobs=2))],
                         [], {"plain": 7, "asks": 7})
    output = runner.execute(step)
    assert set(output.logprobs) == {"asks"}
    logprobs = output.logprobs["asks"]
    assert logprobs.top[0][0] == output.sampled_token_ids["asks"]  # greedy picks the best
    assert logprobs.logprob == pytest.approx(logprobs.top[0][1])
    assert output.sampled_token_ids["plain"] == output.sampled_token_ids["asks"]


def test_seeded_sampling_does_not_depend_on_the_batch(runner: ModelRunner) -> None:
    seeded = SamplingParams(temperature=1.0, seed=77)

    def generate(with_neighbours: bool) -> list[int]:
        scheduler = HandScheduler(runner, num_blocks=64, block_size=BLOCK_SIZE)
        request = scheduler.add("seeded", PROMPT, 12, sampling=seeded)
        if with_neighbours:
            scheduler.add("other", PROMPT[::-1], 12, sampling=SamplingParams(temperature=1.0, seed=1))
            scheduler.add("greedy", PROMPT[:3], 5)
        scheduler.run()
        return request.generated

    alone = generate(False)
    assert generate(True) == alone
    assert len(set(alone)) > 1


def test_seeded_sampling_survives_preemption(runner: ModelRunner) -> None:
    """A preempted request comes back as a new one with its generated tokens in its prompt; its
    seeded draws continue where they were instead of replaying the first ones."""
    seeded = SamplingParams(temperature=1.0, seed=77)
    blocks = list(range(8))

    def generate(preempt_after: int | None) -> list[int]:
        runner.initialize_kv_cache(num_blocks=32, block_size=BLOCK_SIZE)
        step = iter(range(100))
        out = runner.execute(SchedulerStep(next(step), [new_request("a", PROMPT, blocks, sampling=seeded)], [],
                                           {"a": len(PROMPT)}))
        generated = [out.sampled_token_ids["a"]]
        while len(generated) < 12:
            computed = len(PROMPT) + len(generated) - 1
            if len(generated) == preempt_after:
                runner.execute(SchedulerStep(next(step), finished_request_ids=["a"]))
                tokens = PROMPT + generated
                out = runner.execute(SchedulerStep(next(step), [new_request("a", tokens, blocks, sampling=seeded)], [],
                                                   {"a": len(tokens)}))
            else:
                out = runner.execute(SchedulerStep(next(step), [], [CachedRequestData("a", [], computed)], {"a": 1}))
            generated.append(out.sampled_token_ids["a"])
        return generated

    uninterrupted = generate(None)
    assert generate(5) == uninterrupted
    assert len(set(uninterrupted)) > 3  # really sampled, not collapsed onto one token


def test_finished_requests_are_forgotten_and_ids_can_return(runner: ModelRunner) -> None:
    runner.execute(SchedulerStep(0, [new_request("a", PROMPT, [0, 1])], [], {"a": 7}))
    assert "a" in runner.requests
    runner.execute(SchedulerStep(1, [], [], {}, ["a"]))
    assert "a" not in runner.requests
    # a preempted request comes back as new, with its generated token in token_ids
    output = runner.execute(SchedulerStep(2, [new_request("a", PROMPT + [9], [4, 5])], [], {"a": 8}))
    assert list(output.sampled_token_ids) == ["a"]


BAD_STEPS = {
    "unknown cached request": (SchedulerStep(1, [], [CachedRequestData("ghost", [], 0)], {}), "unknown"),
    "computed count disagrees": (SchedulerStep(1, [], [CachedRequestData("a", [], 3)], {"a": 1}),
                                 "num_computed_tokens=3"),
    "too many tokens scheduled": (SchedulerStep(1, [], [CachedRequestData("a", [], 7)], {"a": 2}),
                                  "num_scheduled_tokens"),
    "scheduled but unknown": (SchedulerStep(1, [], [], {"ghost": 1}), "unknown request"),
    "block id out of range": (SchedulerStep(1, [], [CachedRequestData("a", [32], 7)], {"a": 1}), "block ids"),
    "too few blocks": (SchedulerStep(1, [new_request("b", PROMPT * 2, [5, 6])], [], {"b": 14}), "too few"),
    "duplicate new request": (SchedulerStep(1, [new_request("a", PROMPT, [5, 6])], [], {}), "already running"),
    "token outside vocabulary": (SchedulerStep(1, [new_request("b", [1, 320], [5])], [], {"b": 2}), "vocabulary"),
    "bad sampling": (SchedulerStep(1, [new_request("b", PROMPT, [5, 6], sampling=SamplingParams(top_p=0))],
                                   [], {"b": 7}), "top_p"),
    "nothing to compute": (SchedulerStep(1, [new_request("b", PROMPT, [5, 6], computed=7)], [], {}),
                           "num_computed_tokens"),
}


@pytest.mark.parametrize("name", BAD_STEPS)
def test_bad_step_is_rejected_and_changes_nothing(runner: ModelRunner, tiny_dir: Path, name: str) -> None:
    first = runner.execute(SchedulerStep(0, [new_request("a", PROMPT, [0, 1])], [], {"a": 7}))
    cache_before = [key.clone() for key, _ in runner.kv_caches]
    step, message = BAD_STEPS[name]
    with pytest.raises(ValueError, match=message):
        runner.execute(step)
    assert all(torch.equal(before, key) for before, (key, _) in zip(cache_before, runner.kv_caches))
    assert set(runner.requests) == {"a"} and runner.requests["a"].num_computed_tokens == 7
    # the runner carries on exactly as if the bad step had never come
    following = runner.execute(SchedulerStep(1, [], [CachedRequestData("a", [], 7)], {"a": 1}))
    reference = ModelRunner(tiny_dir)
    reference.initialize_kv_cache(32, BLOCK_SIZE)
    reference.execute(SchedulerStep(0, [new_request("a", PROMPT, [0, 1])], [], {"a": 7}))
    expected = reference.execute(SchedulerStep(1, [], [CachedRequestData("a", [], 7)], {"a": 1}))
    assert first.sampled_token_ids and following.sampled_token_ids == expected.sampled_token_ids


def test_execute_before_kv_cache_fails(tiny_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="initialize_kv_cache"):
        ModelRunner(tiny_dir).execute(SchedulerStep(0))


def break_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "config.json").unlink(), "config.json is missing"),
        (lambda d: (d / "model.safetensors").unlink(), "no \\*.safetensors"),
        (lambda d: break_config(d, architectures=["GPT2LMHeadModel"]), "unsupported architecture"),
        (lambda d: break_config(d, hidden_act="gelu"), "hidden_act"),
        (lambda d: break_config(d, rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "rope type 'yarn'"),
        (lambda d: break_config(d, num_key_value_heads=4), "not a multiple"),
        (lambda d: break_config(d, num_hidden_layers=4), "lacks 9 weight"),
        (lambda d: break_config(d, intermediate_size=100), "shape"),
        (lambda d: (d / "model.safetensors.index.json").write_text("{oops"), "index.json is not valid JSON"),
        (lambda d: (d / "model.safetensors.index.json").write_text("[]"), "needs a non-empty \"weight_map\""),
    ],
    ids=["no config", "no weights", "architecture", "activation", "rope", "kv heads", "missing layer", "shape",
         "index not JSON", "index without a weight map"],
)
def test_loading_fails_fast_and_says_why(tiny_dir: Path, tmp_path: Path, damage, message: str) -> None:
    model_dir = shutil.copytree(tiny_dir, tmp_path / "model")
    damage(model_dir)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        ModelRunner(model_dir)


def test_a_model_path_that_is_not_a_directory_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelRunner(tmp_path / "nowhere")
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is a file, not a directory"):
        ModelRunner(tmp_path / "weights.safetensors")


def test_missing_shard_is_named(tmp_path: Path) -> None:
    model_dir = save_tiny_checkpoint("qwen2", tmp_path / "sharded", max_shard_size="100KB")
    shard = sorted(model_dir.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        ModelRunner(model_dir)


def test_an_adapter_file_beside_model_safetensors_is_not_read_as_weights(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = shutil.copytree(tiny_dir, tmp_path / "model")
    save_file({"base_model.model.lora_A.weight": torch.ones(2, 2)}, str(model_dir / "adapter_model.safetensors"))
    assert weight_files(model_dir) == [model_dir / "model.safetensors"]
    assert ModelRunner(model_dir).config.vocab_size > 0


def test_loading_reports_progress_a_line_per_quarter(tmp_path: Path) -> None:
    import io

    from prefixcache.worker.loader import load_model

    model_dir = save_tiny_checkpoint("qwen2", tmp_path / "sharded", max_shard_size="100KB")
    progress = io.StringIO()  # not a terminal: whole lines, no redrawing
    load_model(model_dir, progress=progress)
    lines = progress.getvalue().splitlines()
    percents = [int(line.split(":")[1].split("%")[0]) for line in lines]
    assert all(line.startswith("loading weights: ") and line.endswith(" MiB)") for line in lines), lines
    assert percents == sorted(percents) and percents[-1] == 100 and len(lines) >= 4


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU build of torch")
def test_asking_for_cuda_without_it_names_the_device_not_a_kernel(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="--device cuda: torch .* is a CPU build.* or use --device cpu"):
        ModelRunner(tiny_dir, device="cuda")


def test_dtype_auto_is_float32_on_the_cpu(tiny_dir: Path) -> None:
    runner = ModelRunner(tiny_dir, dtype="auto")
    assert (runner.dtype, runner.describe().dtype) == (torch.float32, "float32")


@pytest.mark.parametrize(("device_type", "capability", "dtype"), [
    ("cpu", None, "float32"),  # greedy tokens equal transformers'
    ("cuda", (9, 0), "bfloat16"), ("cuda", (8, 0), "bfloat16"),
    ("cuda", (7, 5), "float32"),  # no bfloat16 tensor cores
])
def test_auto_dtype(device_type, capability, dtype) -> None:
    assert auto_dtype(device_type, capability) == dtype


def test_a_named_dtype_is_kept_and_an_unknown_one_refused() -> None:
    assert resolve_dtype("float16", torch.device("cpu")) == "float16"
    with pytest.raises(ValueError, match="dtype must be auto or one of float32, bfloat16, float16, got 'fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))
