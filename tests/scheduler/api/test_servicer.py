"""The Engine servicer over real gRPC, with the real tokenizer service, on the simulated worker: what
only the servicer decides (stop strings, which request an id names, the fields it refuses). The simulated worker computes a
step in no time, so the engine runs far ahead of the detokenizing that each output waits for."""
from __future__ import annotations

import asyncio
import gc
import re

import grpc
import pytest
from engine_harness import PROMPT, SPECIAL_IDS, engine_api
from grpc import aio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sim_worker import SimulatedWorker, reference_generation

from prefixcache.client import Completion, EngineClient, build_request
from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.protos.engine.v1 import engine_pb2_grpc as pb_grpc
from prefixcache.scheduler.api import servicer
from prefixcache.scheduler.api.codec import MAX_REQUEST_ID_BYTES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from prefixcache.scheduler.api.isolation import MAX_CACHE_SALT_BYTES, MAX_TENANT_BYTES
from prefixcache.scheduler.api.spans import MAX_HASHES_PER_EVICTION_EVENT, eviction_attributes
from prefixcache.scheduler.kv_cache import EvictionBatch, RequestRef
from prefixcache.scheduler.tokenizer_client import StreamingDetokenizer
from prefixcache.tokenizer.text import TextTokenizer


def stop_string_at(tokenizer: TextTokenizer, generated: list[int], first: int) -> tuple[int, str]:
    """(k, s): the first k >= `first` whose token's text s is new, so stop=[s] matches at token k."""
    for k in range(first, len(generated)):
        before = tokenizer.decode(generated[:k])
        through = tokenizer.decode(generated[: k + 1])
        piece = through[len(before) :]
        if len(piece.strip()) >= 2 and through.startswith(before) and "\ufffd" not in through and piece not in before:
            return k, piece
    raise AssertionError("no usable stop string in the reference generation")


def test_tokens_generated_after_a_stop_string_matched_are_not_delivered(tokenizer: TextTokenizer) -> None:
    generated = reference_generation(PROMPT, 200, tokenizer.vocab_size, frozenset(SPECIAL_IDS))
    k, stop = stop_string_at(tokenizer, generated, 3)

    async def main() -> Completion:
        async with engine_api(tokenizer) as (target, _engine), EngineClient(target) as client:
            return await client.complete(build_request(token_ids=PROMPT, max_tokens=200, stop=[stop]))

    completion = asyncio.run(asyncio.wait_for(main(), 60))
    assert completion.finish_reason == "stop"
    assert completion.text == tokenizer.decode(generated[:k])
    # The ids end with the token that completed the match, and the usage counts exactly those.
    assert completion.token_ids == generated[: k + 1]
    assert completion.usage.completion_tokens == k + 1


def test_a_stop_token_ends_the_ids_but_adds_no_text(tokenizer: TextTokenizer) -> None:
    """As in vLLM: the stop token id is the last id returned and counted, its text is left out."""
    generated = reference_generation(PROMPT, 200, tokenizer.vocab_size, frozenset(SPECIAL_IDS))
    k = next(i for i in range(3, len(generated)) if generated[i] not in generated[:i]
             and tokenizer.decode(generated[i : i + 1]).strip())

    async def main() -> Completion:
        async with engine_api(tokenizer) as (target, _engine), EngineClient(target) as client:
            return await client.complete(build_request(token_ids=PROMPT, max_tokens=200,
                                                       stop_token_ids=[generated[k]]))

    completion = asyncio.run(asyncio.wait_for(main(), 60))
    assert completion.finish_reason == "stop"
    assert completion.token_ids == generated[: k + 1] and completion.usage.completion_tokens == k + 1
    assert completion.text == tokenizer.decode(generated[:k])


def test_an_id_stays_taken_until_its_call_ends_so_a_late_stop_cannot_end_its_namesake(tokenizer: TextTokenizer) -> None:
    generated = reference_generation(PROMPT, 200, tokenizer.vocab_size, frozenset(SPECIAL_IDS))
    k, stop = stop_string_at(tokenizer, generated, 150)

    async def main() -> None:
        async with engine_api(tokenizer) as (target, engine), EngineClient(target) as client:
            first = client.generate(build_request(token_ids=PROMPT, max_tokens=200, stop=[stop], request_id="x"))
            await first.read()
            while engine.num_running or engine.num_waiting:  # the engine is done with "x" ...
                await asyncio.sleep(0.001)
            # ... but its call is still detokenizing, and will abort "x" when it reaches the stop string.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.complete(build_request(token_ids=[1000, 1001, 1002], max_tokens=50, request_id="x"))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == "request_id: 'x' is already in flight"
            responses = []
            while (response := await first.read()) is not aio.EOF:
                responses.append(response)
            assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
            # Once the call has ended the id is free again.
            again = await client.complete(build_request(token_ids=[1000, 1001, 1002], max_tokens=5, request_id="x"))
            assert again.finish_reason == "length" and len(again.token_ids) == 5

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_stop_string_the_engine_finished_before_is_counted_as_stop(tokenizer: TextTokenizer) -> None:
    # The match comes late (token 150 of 200): the engine has finished the request by then, for
    # "length"; the client is told "stop", and so are the metrics.
    generated = reference_generation(PROMPT, 200, tokenizer.vocab_size, frozenset(SPECIAL_IDS))
    k, stop = stop_string_at(tokenizer, generated, 150)

    length_series = 'prefixcache_requests_finished_total{finish_reason="length",model_name="sim-model"}'
    scraped_lengths: list[str] = []  # what a Prometheus scrape would have read at every turn of the loop

    async def scrape(engine) -> None:
        while True:
            _, found, rest = engine.metrics.exposition().decode().partition(length_series)
            scraped_lengths.append(rest.split()[0] if found else "absent")
            await asyncio.sleep(0)

    async def main() -> tuple[Completion, str]:
        async with engine_api(tokenizer) as (target, engine), EngineClient(target) as client:
            scraper = asyncio.create_task(scrape(engine))
            completion = await client.complete(build_request(token_ids=PROMPT, max_tokens=200, stop=[stop]))
            scraper.cancel()
            return completion, engine.metrics.exposition().decode()

    completion, metrics = asyncio.run(asyncio.wait_for(main(), 60))
    assert completion.finish_reason == "stop" and completion.usage.completion_tokens == k + 1
    assert 'prefixcache_requests_finished_total{finish_reason="stop",model_name="sim-model"} 1.0' in metrics
    # Never counted as "length" in between: a counter that went 0 -> 1 -> 0 would read as a reset.
    assert len(scraped_lengths) > 10 and set(scraped_lengths) == {"0.0"}


def test_a_client_that_stops_reading_and_times_out_leaves_no_traceback(tokenizer: TextTokenizer,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    # gRPC drops the stream at the deadline and the event loop closes its generator later, from
    # another task: no context token may be held across a yield (OpenTelemetry logs a traceback).
    async def main() -> None:
        async with engine_api(tokenizer, num_kv_blocks=4096, max_model_len=20000) as (target, engine), \
                EngineClient(target) as client:
            call = client.generate(build_request(token_ids=PROMPT, max_tokens=16000, ignore_eos=True), timeout_s=1.0)
            await call.read()  # then read no more
            assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            while engine.num_running:  # the deadline aborts the request and frees its blocks
                await asyncio.sleep(0.05)
            gc.collect()
            await asyncio.sleep(0.2)

    asyncio.run(asyncio.wait_for(main(), 60))
    assert not [r for r in caplog.records if "Failed to detach context" in r.getMessage()]


def test_errors_quote_a_long_value_only_in_part(tokenizer: TextTokenizer) -> None:
    """A status message travels in a header that clients cap (8 KiB): quoting a 20,000-character
    field whole would turn the status into RESOURCE_EXHAUSTED on the client."""
    long = "r" * 20_000

    async def main() -> None:
        async with engine_api(tokenizer) as (target, _), EngineClient(target) as client:
            for request, field, code in (
                (build_request(text="hi", lora_adapter=long, max_tokens=1), "lora_adapter",
                 grpc.StatusCode.UNIMPLEMENTED),
                (build_request(messages=[(long, "hi")], max_tokens=1), "chat.messages[0].role",
                 grpc.StatusCode.INVALID_ARGUMENT),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.complete(request)
                assert refused.value.code() == code
                details = refused.value.details()
                assert details.startswith(f"{field}: ") and "(20000 characters)" in details and len(details) < 300

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("field, limit", [("cache_salt", MAX_CACHE_SALT_BYTES), ("tenant", MAX_TENANT_BYTES)])
def test_isolation_keys_are_capped_in_bytes_and_never_quoted(tokenizer: TextTokenizer, field: str, limit: int) -> None:
    """An oversized salt or tenant is refused by name, without echoing the secret; the server goes on."""
    within = "k" * (limit - 2) + "é"  # exactly `limit` bytes in UTF-8
    beyond = within + "k"

    async def main() -> None:
        async with engine_api(tokenizer) as (target, _), EngineClient(target) as client:
            for value in (beyond, ""):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.complete(build_request(token_ids=PROMPT, max_tokens=2, **{field: value}))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = refused.value.details()
                assert details.startswith(f"{field}: ") and "kkk" not in details
            assert refused.value.details() == f"{field}: must not be empty when set"
            accepted = await client.complete(build_request(token_ids=PROMPT, max_tokens=2, **{field: within}))
            assert accepted.finish_reason == "length" and len(accepted.token_ids) == 2

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("prompt", [{"text": "Hello there"}, {"token_ids": PROMPT}], ids=["text", "token_ids"])
def test_a_tokenizer_of_another_model_is_refused_before_its_ids_reach_the_worker(tokenizer: TextTokenizer,
                                                                                 prompt: dict) -> None:
    """Text is tokenized, token ids only detokenized: either way the tokenizer's id is checked before
    the prompt reaches the worker (no cache lookup counted it)."""
    other_model = "sha256:00000000000000ff"

    async def main() -> None:
        async with engine_api(tokenizer, worker_tokenizer_id=other_model) as (target, engine), \
                EngineClient(target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.complete(build_request(**prompt, max_tokens=4))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert tokenizer.tokenizer_id in refused.value.details() and other_model in refused.value.details()
            assert engine.cache_stats().used_blocks == 0 and engine.cache_stats().queries == 0
        async with engine_api(tokenizer, worker_tokenizer_id=tokenizer.tokenizer_id) as (target, _engine), \
                EngineClient(target) as client:
            assert len((await client.complete(build_request(**prompt, max_tokens=4))).token_ids) == 4

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("prompt", [{"text": "Hello there"}, {"token_ids": PROMPT}], ids=["text", "token_ids"])
def test_an_unreachable_tokenizer_is_unavailable_without_naming_its_address(tokenizer: TextTokenizer,
                                                                            prompt: dict) -> None:
    """gRPC's details for a refused connection carry the peer's address; clients get the status
    code only, and the engine frees what the request held."""
    from prefixcache.launcher import free_port

    dead_port = free_port()

    async def main() -> None:
        async with engine_api(tokenizer, tokenizer_target=f"127.0.0.1:{dead_port}") as (target, engine), \
                EngineClient(target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await client.complete(build_request(**prompt, max_tokens=4))
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            details = failed.value.details()
            assert "tokenizer service failed (UNAVAILABLE)" in details
            assert str(dead_port) not in details and "127.0.0.1" not in details
            # Found before the prompt was scheduled: no cache lookup counted it.
            assert engine.cache_stats().used_blocks == 0 and engine.cache_stats().queries == 0

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_prompt_id_the_tokenizer_lacks_is_unavailable_not_an_internal_field(tokenizer: TextTokenizer) -> None:
    """A worker's vocabulary can be padded past its tokenizer's (or a tokenizer of a smaller model
    answers mid-rollout): an id the worker takes but the tokenizer refuses is the platform's
    problem, not a bad argument, and the client never sees the tokenizer's internal field names."""
    prompt = [*PROMPT, tokenizer.vocab_size + 3]

    async def main() -> None:
        async with engine_api(tokenizer, worker_vocab_size=tokenizer.vocab_size + 64) as (target, engine), \
                EngineClient(target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await client.complete(build_request(token_ids=prompt, max_tokens=4))
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "prefix_token_ids" not in failed.value.details()
            assert engine.cache_stats().used_blocks == 0 and engine.cache_stats().queries == 0

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("field", ["lora_adapter", "multimodal_items"])
def test_lora_adapters_and_multimodal_items_are_unimplemented_naming_the_field(tokenizer: TextTokenizer,
                                                                                field: str) -> None:
    """Block identity hashes both, but the worker applies no adapter and embeds no image: a request
    that names either is refused as UNIMPLEMENTED, before any of it reaches the engine, and
    `Describe` offers neither."""
    request = build_request(token_ids=PROMPT, max_tokens=2)
    if field == "lora_adapter":
        request.lora_adapter = "sql-adapter"
    else:
        request.multimodal_items.append(pb.MultiModalItem(content_hash="sha256:cat", offset=0, length=2))

    async def main() -> None:
        async with engine_api(tokenizer) as (target, engine), EngineClient(target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.complete(request)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert refused.value.details().startswith(f"{field}: ")
            assert engine.cache_stats().queries == 0
            async with aio.insecure_channel(target) as channel:
                description = await pb_grpc.EngineStub(channel).Describe(pb.DescribeRequest())
            assert list(description.lora_adapters) == [] and not description.multimodal
            accepted = await client.complete(build_request(token_ids=PROMPT, max_tokens=2))
            assert accepted.finish_reason == "length"

    asyncio.run(asyncio.wait_for(main(), 60))


def finished_counts(engine) -> dict[str, float]:
    text = engine.metrics.exposition().decode()
    return {reason: float(count) for reason, count in
            re.findall(r'prefixcache_requests_finished_total\{finish_reason="(\w+)",model_name="sim-model"\} (\S+)', text)}


def test_a_client_that_leaves_after_the_engine_finished_is_still_counted(tokenizer: TextTokenizer,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The servicer counts every finish. A tokenizer 10 ms away lets the engine finish the request
    before the client, which cancels after three responses, has read its end: the unread final
    output must still be counted, once."""
    push = StreamingDetokenizer.push

    async def remote_push(self, token_ids, last=False):
        await asyncio.sleep(0.01)
        return await push(self, token_ids, last)

    monkeypatch.setattr(StreamingDetokenizer, "push", remote_push)
    num_requests = 6

    async def main() -> dict[str, float]:
        async with engine_api(tokenizer) as (target, engine), EngineClient(target) as client:
            for _ in range(num_requests):
                stream = client.generate(build_request(token_ids=PROMPT, max_tokens=40, stop=["never appears"]))
                for _ in range(3):
                    await stream.read()
                stream.cancel()
            while engine.num_running or engine.num_waiting:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the calls' cleanup
            return finished_counts(engine)

    counts = asyncio.run(asyncio.wait_for(main(), 60))
    assert sum(counts.values()) == num_requests, counts


@pytest.mark.parametrize("fields, field", [
    ({"request_id": "r" * (MAX_REQUEST_ID_BYTES + 1)}, "request_id"),
    ({"stop": [f"stop {i}" for i in range(MAX_STOP_STRINGS + 1)]}, "sampling.stop"),
    ({"stop": ["fine", "s" * (MAX_STOP_STRING_CHARS + 1)]}, "sampling.stop[1]"),
], ids=["request_id", "stop-count", "stop-length"])
def test_what_every_response_or_token_would_carry_is_bounded(tokenizer: TextTokenizer, fields: dict, field: str) -> None:
    """A request id is echoed in every response, stop strings are matched at every token: both are
    capped, refused by name without quoting the value, and the bounds themselves are accepted."""
    async def main() -> None:
        async with engine_api(tokenizer) as (target, _), EngineClient(target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.complete(build_request(token_ids=PROMPT, max_tokens=2, **fields))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith(f"{field}: ") and len(refused.value.details()) < 200
            at_the_bounds = build_request(token_ids=PROMPT, max_tokens=2, request_id="r" * MAX_REQUEST_ID_BYTES,
                                          stop=["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)
            assert (await client.complete(at_the_bounds)).finish_reason == "length"

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("stop", [[], ["never appears"]], ids=["engine-counts", "servicer-counts"])
def test_a_stream_the_tokenizer_fails_is_counted_as_an_error(tokenizer: TextTokenizer, stop: list[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose vocabulary outgrows the tokenizer's generates ids the tokenizer refuses: the call
    ends UNAVAILABLE, and the metrics and the request's span say `error`, as the client was told."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(servicer, "_tracer", provider.get_tracer("test"))

    async def main() -> dict[str, float]:
        async with engine_api(tokenizer, worker_vocab_size=4 * tokenizer.vocab_size) as (target, engine), \
                EngineClient(target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await client.complete(build_request(token_ids=PROMPT, max_tokens=64, stop=stop))
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            while engine.num_running or engine.num_waiting:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # the call's cleanup
            return finished_counts(engine)

    counts = asyncio.run(asyncio.wait_for(main(), 60))
    assert counts["error"] == 1 and sum(counts.values()) == 1, counts
    (span,) = [span for span in exporter.get_finished_spans() if span.name == "text_completion sim-model"]
    assert span.attributes["gen_ai.response.finish_reasons"] == ("error",)


def test_an_eviction_event_lists_a_bounded_number_of_blocks_and_their_storers() -> None:
    """One allocation can evict thousands of blocks stored by as many requests: the event lists the
    first blocks and exactly the requests that stored those, each once."""
    storers = [RequestRef(f"request-{i // 2}") for i in range(4000)]  # two blocks each
    batch = EvictionBatch(RequestRef("taker"), "allocation", list(range(4000)),
                          [i.to_bytes(32, "big") for i in range(4000)], storers, stored_at_ns=list(range(4000)),
                          evicted_at_ns=5_000_000_000)
    attributes = eviction_attributes(batch)
    assert attributes["prefix_cache.evicted_blocks"] == 4000
    assert attributes["prefix_cache.oldest_evicted_age_s"] == 5.0
    assert len(attributes["prefix_cache.block_hashes"]) == MAX_HASHES_PER_EVICTION_EVENT
    assert attributes["prefix_cache.storing_request_ids"] == [f"request-{i}" for i in
                                                              range(MAX_HASHES_PER_EVICTION_EVENT // 2)]


def test_a_crash_after_a_request_was_run_again_counts_it_once_and_turns_health_off(tokenizer: TextTokenizer) -> None:
    """The worker is lost before the request's first token, the request is held and run again, and
    then announcing the new worker fails (a bug): the call ends UNAVAILABLE, counted once as an
    error, and health is told the engine no longer serves."""
    announced: list[bool] = []
    worker = SimulatedWorker(num_kv_blocks=256, vocab_size=tokenizer.vocab_size, eos_token_ids=SPECIAL_IDS)

    async def main() -> dict[str, float]:
        async with engine_api(tokenizer, executor=worker) as (target, engine), EngineClient(target) as client:
            async def broken_when_back(available: bool) -> None:
                announced.append(available)
                if available:
                    raise RuntimeError("a bug in announcing the new worker")

            engine.on_worker_availability = broken_when_back
            worker.fail_next_step()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await client.complete(build_request(token_ids=PROMPT, max_tokens=20))
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "internal error" in failed.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.complete(build_request(token_ids=PROMPT, max_tokens=2))
            assert "internal error" in refused.value.details()
            await asyncio.sleep(0.1)  # the call's cleanup and the health announcement
            return finished_counts(engine)

    counts = asyncio.run(asyncio.wait_for(main(), 60))
    assert counts["error"] == 1 and sum(counts.values()) == 1, counts
    assert announced == [False, True, False]


def test_finished_requests_are_counted_by_the_reason_their_clients_were_told(tokenizer: TextTokenizer) -> None:
    generated = reference_generation(PROMPT, 200, tokenizer.vocab_size, frozenset(SPECIAL_IDS))

    async def main() -> dict[str, float]:
        async with engine_api(tokenizer) as (target, engine), EngineClient(target) as client:
            for _ in range(2):
                assert (await client.complete(build_request(token_ids=PROMPT, max_tokens=3))).finish_reason == "length"
            stopped = await client.complete(build_request(token_ids=PROMPT, max_tokens=50, stop_token_ids=[generated[1]]))
            assert stopped.finish_reason == "stop"
            return finished_counts(engine)

    counts = asyncio.run(asyncio.wait_for(main(), 60))
    assert counts == {"stop": 1.0, "length": 2.0, "abort": 0.0, "error": 0.0}
