"""The platform over real gRPC: streaming, the prefix cache, cancellation, bad input, a full queue."""
from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import grpc
import pytest
from platform_harness import run, scrape_metrics, start_platform, stop_platform, wait_idle
from platform_prompts import question, shared_prefix

from prefixcache.client import Completion, EngineClient, build_request
from prefixcache.launcher import LocalPlatform
from prefixcache.protos.engine.v1 import engine_pb2 as pb

pytestmark = pytest.mark.slow
BLOCK = 16


def test_sixteen_concurrent_streams_complete(target: str) -> None:
    async def main() -> list[Completion]:
        async with EngineClient(target) as engine:
            requests = [
                build_request(
                    text=f"Write a sentence about the number {n}.",
                    max_tokens=8,
                    temperature=0.0,
                    ignore_eos=True,
                    request_id=f"c{n}",
                )
                for n in range(16)
            ]
            return await asyncio.gather(*(engine.complete(r, timeout_s=180) for r in requests))

    completions = run(main())
    assert sorted(c.request_id for c in completions) == sorted(f"c{n}" for n in range(16))
    for completion in completions:
        assert completion.finish_reason == "length"
        assert completion.usage.completion_tokens == len(completion.token_ids) == 8
        assert completion.text  # detokenized by the tokenizer service
        assert completion.num_chunks >= 2  # streamed, not one reply at the end


@pytest.fixture(scope="module")
def uncached_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    platform: LocalPlatform = start_platform(tmp_path_factory.mktemp("uncached-logs"), ["--no-prefix-caching"])
    yield platform.engine_address
    stop_platform(platform)


def test_shared_prefix_is_served_from_the_cache_with_identical_output(target: str, uncached_target: str) -> None:
    prefix = shared_prefix(1000, "the valley")
    first = prefix + question("Which year was note 3 written?")
    second = prefix + question("What was surveyed in note 5?")
    assert len(second) // BLOCK * BLOCK > 992  # the second prompt's block 62 mixes prefix and question

    def greedy(token_ids: list[int]) -> pb.GenerateRequest:
        return build_request(token_ids=token_ids, max_tokens=12, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[Completion, Completion, Completion]:
        async with EngineClient(target) as engine, EngineClient(uncached_target) as uncached:
            cold = await engine.complete(greedy(first), timeout_s=300)
            warm = await engine.complete(greedy(second), timeout_s=300)
            reference = await uncached.complete(greedy(second), timeout_s=300)
            return cold, warm, reference

    cold, warm, reference = run(main())
    assert cold.usage.cached_tokens == 0
    assert warm.usage.prompt_tokens == len(second)
    assert warm.usage.cached_tokens == 992  # 62 full blocks of the shared 1,000 tokens
    assert warm.cache_account.hit_tokens == 992 and warm.cache_account.hit_blocks == 62
    assert reference.usage.cached_tokens == 0 and reference.cache_account.miss_reason == "disabled"
    assert warm.token_ids == reference.token_ids and warm.text == reference.text


def test_a_cancelled_stream_frees_its_blocks(target: str) -> None:
    async def main() -> pb.CacheStats:
        async with EngineClient(target) as engine:
            request = build_request(text="Tell me a very long story.", max_tokens=400, temperature=0.0, ignore_eos=True)
            call = engine.generate(request, timeout_s=300)
            received = 0
            async for chunk in call:
                received += len(chunk.token_ids)
                if received >= 3:
                    break
            busy = await engine.cache_stats()
            call.cancel()
            assert busy.used_blocks > 0 and busy.running_requests == 1
            return await wait_idle(target, timeout_s=10)

    stats = run(main())
    assert stats.used_blocks == 0 and stats.running_requests == 0


def greedy_with_and_without(target: str, prompt: str, max_tokens: int, **option) -> tuple[Completion, Completion]:
    """The same greedy request twice, the second with one more option: (without, with)."""

    async def main() -> tuple[Completion, Completion]:
        async with EngineClient(target) as engine:
            plain = build_request(text=prompt, max_tokens=max_tokens, temperature=0.0)
            varied = build_request(text=prompt, max_tokens=max_tokens, temperature=0.0, **option)
            return await engine.complete(plain, timeout_s=120), await engine.complete(varied, timeout_s=120)

    return run(main())


def test_stop_strings_end_the_text_before_the_match(platform: LocalPlatform, target: str) -> None:
    prompt = "Count from one to ten in words, separated by commas: one, two,"
    before = scrape_metrics(platform)
    free, stopped = greedy_with_and_without(target, prompt, 24, stop=["five"])
    assert "five" in free.text, f"the model should count past five: {free.text!r}"
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index("five")]
    assert stopped.usage.completion_tokens < free.usage.completion_tokens
    # The metrics count what the clients were told: the free run's reason, and "stop", never "abort".
    after = scrape_metrics(platform)
    expected = {"length": 0, "stop": 1, "abort": 0}
    expected[free.finish_reason] += 1
    for reason, more in expected.items():
        series = f'prefixcache_requests_finished_total{{finish_reason="{reason}"}}'
        assert after.get(series, 0) - before.get(series, 0) == more, reason


def test_logprobs_come_with_each_token_and_agree_with_greedy_choice(target: str) -> None:
    plain, scored = greedy_with_and_without(target, "The capital of France is", 6, logprobs=3)
    assert plain.logprobs == []  # only on request
    assert scored.token_ids == plain.token_ids  # asking for logprobs changes nothing else
    assert len(scored.logprobs) == len(scored.token_ids)
    for token_id, entry in zip(scored.token_ids, scored.logprobs):
        top = [(t.token_id, t.logprob) for t in entry.top]
        assert len(top) == 3 and all(a[1] >= b[1] for a, b in zip(top, top[1:]))  # most likely first
        assert top[0][0] == token_id  # greedy picks the most likely token
        assert entry.logprob == pytest.approx(top[0][1]) and -20 < entry.logprob <= 0
        assert math.fsum(math.exp(logprob) for _, logprob in top) <= 1 + 1e-5


BAD_REQUESTS = {
    "empty prompt": (dict(text=""), "text"),
    "empty token ids": (dict(token_ids=[]), "token_ids"),
    "token id outside the vocabulary": (dict(token_ids=[1, 2, 49152]), "token_ids"),
    "prompt + max_tokens beyond the model": (dict(token_ids=[1, 2, 3], max_tokens=9000), "sampling.max_tokens"),
    "max_tokens zero": (dict(text="hi", max_tokens=0), "sampling.max_tokens"),
    "max_tokens negative": (dict(text="hi", max_tokens=-3), "sampling.max_tokens"),
    "negative temperature": (dict(text="hi", temperature=-0.5), "sampling.temperature"),
    # NaN passes `< 0`; the worker would refuse the step, which must never look like a lost worker.
    "NaN temperature": (dict(text="hi", temperature=float("nan")), "sampling.temperature"),
    "prompt alone at the maximum length": (dict(token_ids=[1] * 8192), "token_ids"),
    "top_p zero": (dict(text="hi", top_p=0.0), "sampling.top_p"),
    "top_p above one": (dict(text="hi", top_p=1.5), "sampling.top_p"),
    "more than 20 logprobs": (dict(text="hi", logprobs=21), "sampling.logprobs"),
    "empty cache salt": (dict(text="hi", cache_salt=""), "cache_salt"),
    "empty tenant": (dict(text="hi", tenant=""), "tenant"),
    "no chat messages": (dict(messages=[]), "chat.messages"),
    "unknown chat role": (dict(messages=[("wizard", "hi")]), "chat.messages[0].role"),
    "empty chat content": (dict(messages=[("user", "")]), "chat.messages[0].content"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_the_server_still_serves(target: str, case: str) -> None:
    kwargs, field = BAD_REQUESTS[case]

    async def main() -> Completion:
        async with EngineClient(target) as engine:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await engine.complete(build_request(**kwargs), timeout_s=60)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.value.details().startswith(field + ":"), error.value.details()
            return await engine.complete(build_request(text="Hello", max_tokens=2, temperature=0.0), timeout_s=60)

    assert run(main()).usage.completion_tokens == 2


@pytest.mark.parametrize("field", ["lora_adapter", "multimodal_items"])
def test_lora_adapters_and_multimodal_items_are_unimplemented(target: str, field: str) -> None:
    async def main() -> None:
        async with EngineClient(target) as engine:
            request = build_request(token_ids=[1, 2, 3], max_tokens=2)
            if field == "lora_adapter":
                request.lora_adapter = "sql"
            else:
                request.multimodal_items.add(content_hash="ab" * 32, offset=0, length=2)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await engine.complete(request, timeout_s=60)
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert error.value.details().startswith(f"{field}:")

    run(main())


def test_a_full_waiting_queue_is_resource_exhausted(target: str) -> None:
    # At most 16 arrivals wait for admission (max-waiting); the rest are refused, not queued. How many
    # the step loop admits while the burst arrives varies, but the 16 waiting slots are always usable.
    # Token-id prompts need no tokenizing (only a short handshake opening their detokenize stream), so the
    # burst arrives nearly at once.
    async def one(engine: EngineClient, n: int) -> grpc.StatusCode:
        request = build_request(token_ids=[1, 2, 3, 100 + n], max_tokens=8, temperature=0.0, ignore_eos=True)
        try:
            await engine.complete(request, timeout_s=300)
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    async def main() -> list[grpc.StatusCode]:
        async with EngineClient(target) as engine:
            return await asyncio.gather(*(one(engine, n) for n in range(40)))

    codes = run(main())
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.count(grpc.StatusCode.OK) >= 16


def test_a_deadline_ends_the_request_and_frees_its_blocks(target: str) -> None:
    async def main() -> grpc.StatusCode:
        async with EngineClient(target) as engine:
            request = build_request(text="Recite a very long poem.", max_tokens=400, temperature=0.0, ignore_eos=True)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await engine.complete(request, timeout_s=1.5)
            return error.value.code()

    assert run(main()) == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = run(wait_idle(target, timeout_s=10))
    assert stats.used_blocks == 0 and stats.running_requests == 0


def test_tenants_and_salts_isolate_cached_prefixes(target: str) -> None:
    prompt = shared_prefix(80, "the plateau")  # five full blocks

    async def cached(**isolation: str) -> int:
        async with EngineClient(target) as engine:
            request = build_request(token_ids=prompt, max_tokens=1, temperature=0.0, **isolation)
            return (await engine.complete(request, timeout_s=120)).usage.cached_tokens

    async def main() -> list[int]:
        return [
            await cached(tenant="acme"),
            await cached(tenant="globex"),  # same prompt, another tenant: no hit
            await cached(tenant="acme"),
            await cached(cache_salt="an explicit salt"),
            await cached(),  # no salt at all is its own domain too
        ]

    assert run(main()) == [0, 0, 64, 0, 0]  # 80 tokens: the 5th block is the last, recomputed


def test_describe_and_reset_prefix_cache(target: str) -> None:
    prompt = shared_prefix(48, "the meadow")

    async def main() -> None:
        async with EngineClient(target) as engine:
            description = await engine.describe()
            assert description.model_id.startswith("SmolLM2-135M-Instruct@") and description.vocab_size == 49152
            assert (description.block_size, description.hash_algo, description.max_model_len) == (16, "sha256", 8192)
            assert description.prefix_caching_enabled and description.num_kv_blocks > 0

            request = build_request(token_ids=prompt, max_tokens=1, temperature=0.0)
            await engine.complete(request, timeout_s=120)
            assert (await engine.complete(request, timeout_s=120)).usage.cached_tokens == 32

            busy = engine.generate(build_request(text="Go on and on.", max_tokens=300, ignore_eos=True), timeout_s=120)
            await busy.read()  # running: it holds blocks, so a reset is refused
            assert not await engine.reset_prefix_cache()
            busy.cancel()
            await wait_idle(target)
            assert await engine.reset_prefix_cache()
            assert (await engine.cache_stats()).cached_blocks == 0
            assert (await engine.complete(request, timeout_s=120)).usage.cached_tokens == 0

    run(main())


def test_a_request_id_already_in_flight_is_refused(target: str) -> None:
    async def main() -> grpc.aio.AioRpcError:
        async with EngineClient(target) as engine:
            busy = engine.generate(
                build_request(text="Keep going.", max_tokens=300, ignore_eos=True, request_id="same-id"), timeout_s=120
            )
            await busy.read()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await engine.complete(build_request(text="Hi", max_tokens=1, request_id="same-id"), timeout_s=60)
            busy.cancel()
            return error.value

    error = run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("request_id:")


@pytest.fixture(scope="module")
def one_step_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPlatform]:
    platform = start_platform(tmp_path_factory.mktemp("one-step-logs"), ["--no-schedule-ahead"])
    yield platform
    stop_platform(platform)


def test_scheduling_ahead_changes_no_token(platform: LocalPlatform, one_step_platform: LocalPlatform) -> None:
    """Eight concurrent greedy requests, half of them free to stop at EOS, on the real worker: the
    tokens, their count and the finish reasons are the same when decode steps are sent ahead (the
    default) as one step at a time."""
    prefix = shared_prefix(200, "the harbour")

    def requests() -> list[pb.GenerateRequest]:
        return [build_request(token_ids=prefix + question(f"What happened in note {n}?"), max_tokens=6 + 2 * n,
                              temperature=0.0, ignore_eos=n % 2 == 0, request_id=f"ahead-{n}") for n in range(8)]

    async def complete_all(target: str) -> dict[str, Completion]:
        async with EngineClient(target) as engine:
            completions = await asyncio.gather(*(engine.complete(r, timeout_s=300) for r in requests()))
        return {c.request_id: c for c in completions}

    before = scrape_metrics(platform)["prefixcache_steps_scheduled_ahead_total"]
    one_at_a_time = run(complete_all(one_step_platform.engine_address))
    ahead = run(complete_all(platform.engine_address))
    for request_id, completion in one_at_a_time.items():
        assert (ahead[request_id].token_ids, ahead[request_id].finish_reason) == (
            completion.token_ids, completion.finish_reason), request_id
    assert scrape_metrics(platform)["prefixcache_steps_scheduled_ahead_total"] > before + 5
    assert scrape_metrics(one_step_platform)["prefixcache_steps_scheduled_ahead_total"] == 0
