"""The Engine API with tenants configured, over real gRPC (the real tokenizer service, the simulated
worker): each attack of a hostile client, repeated, fails the attacker and leaves the victim's
outputs and cache as they were."""
from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from engine_harness import SPECIAL_IDS, engine_api
from grpc import aio
from sim_worker import SimulatedWorker
from tenants_file import new_key, tenants_document, write_tenants

from prefixcache.client import EngineClient, build_request
from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.scheduler.tenancy import TenantRegistry, TenantSalts
from prefixcache.tokenizer.text import TextTokenizer

SECRET_PROMPT = list(range(400, 464))  # 16 blocks of 4 tokens
KEYS = {"acme": new_key(), "globex": new_key()}
ADMIN_KEY = new_key()


@contextlib.asynccontextmanager
async def tenant_api(tokenizer: TextTokenizer, tmp_path: Path, document: dict | None = None, step_delay_s: float = 0.0,
                     num_kv_blocks: int = 256) -> AsyncIterator[tuple[dict[str, EngineClient], EngineClient, str]]:
    """(a client per tenant, an admin client, the address) of an Engine API serving the tenants file."""
    path = write_tenants(tmp_path / "tenants.json", document or tenants_document(KEYS, admins={"ops": ADMIN_KEY}))
    worker = SimulatedWorker(num_kv_blocks=num_kv_blocks, vocab_size=tokenizer.vocab_size, eos_token_ids=SPECIAL_IDS,
                             step_delay_s=step_delay_s)
    async with engine_api(tokenizer, executor=worker, registry=TenantRegistry(path, check_interval_s=0)) as (target, _):
        clients = {name: EngineClient(target, api_key=key) for name, key in KEYS.items()}
        admin = EngineClient(target, api_key=ADMIN_KEY)
        try:
            yield clients, admin, target
        finally:
            for client in (*clients.values(), admin):
                await client.close()


def greedy(token_ids: list[int], **options: object) -> pb.GenerateRequest:
    return build_request(token_ids=token_ids, temperature=0.0, **{"max_tokens": 8, **options})


async def until_idle(admin: EngineClient) -> None:
    """Until a cancelled call's request has left the engine and freed its blocks."""
    while (stats := await admin.cache_stats()).running_requests or stats.waiting_requests or stats.used_blocks:
        await asyncio.sleep(0.01)


async def refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call
    return failure.value


def test_every_rpc_needs_a_configured_credential(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    async def main() -> None:
        async with tenant_api(tokenizer, tmp_path) as (_, _, target):
            for client in (EngineClient(target), EngineClient(target, api_key="guessed")):
                async with client:
                    for call in (client.complete(greedy(SECRET_PROMPT)), client.cache_stats(),
                                 client.reset_prefix_cache(), client.describe()):
                        error = await refused(call)
                        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                        assert "guessed" not in error.details()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_tenant_cannot_claim_or_probe_another_tenants_cache(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    """Attack 1: the victim's prompt, sent by another tenant naming the victim (as `tenant`, or with
    the victim's very salt), is refused; sent plainly, none of it hits (a hit on any block would)."""
    acme_salt = TenantSalts(tenants_document({})["salt_key"].encode()).salt_for("acme")

    async def main() -> None:
        async with tenant_api(tokenizer, tmp_path) as (clients, _, _):
            victim, attacker = clients["acme"], clients["globex"]
            first = await victim.complete(greedy(SECRET_PROMPT))
            before = await victim.complete(greedy(SECRET_PROMPT))
            assert first.usage.cached_tokens == 0 and before.usage.cached_tokens == len(SECRET_PROMPT) - 4
            for _ in range(3):  # repeated: every try fails alike
                for claim in ({"tenant": "acme"}, {"cache_salt": acme_salt}):
                    error = await refused(attacker.complete(greedy(SECRET_PROMPT, **claim)))
                    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert error.details().startswith(f"{next(iter(claim))}: ") and acme_salt not in error.details()
            guess = await attacker.complete(greedy(SECRET_PROMPT))
            assert guess.usage.cached_tokens == 0 and guess.cache_account.miss_reason == "cold"
            after = await victim.complete(greedy(SECRET_PROMPT))
            assert after.token_ids == before.token_ids == first.token_ids
            assert after.usage.cached_tokens == before.usage.cached_tokens

    asyncio.run(asyncio.wait_for(main(), 60))


def test_only_an_admin_resets_the_cache(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    """Attack 3: a tenant's ResetPrefixCache is refused and the victim's prefixes stay cached."""
    async def main() -> None:
        async with tenant_api(tokenizer, tmp_path) as (clients, admin, _):
            await clients["acme"].complete(greedy(SECRET_PROMPT))
            for _ in range(3):
                error = await refused(clients["globex"].reset_prefix_cache())
                assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            assert (await clients["acme"].complete(greedy(SECRET_PROMPT))).usage.cached_tokens > 0
            assert await admin.reset_prefix_cache()
            assert (await clients["acme"].complete(greedy(SECRET_PROMPT))).usage.cached_tokens == 0
            error = await refused(admin.complete(greedy(SECRET_PROMPT)))  # an admin is not a tenant
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED

    asyncio.run(asyncio.wait_for(main(), 60))


def test_only_an_admin_reads_the_whole_cache(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    """The KvCache service names every tenant's block hashes: a tenant's KV events stream, snapshot and
    diagnosis are refused, an anonymous caller's are UNAUTHENTICATED, and an admin's see the victim's blocks."""
    async def main() -> None:
        async with tenant_api(tokenizer, tmp_path) as (clients, admin, target):
            await clients["acme"].complete(greedy(SECRET_PROMPT))
            thief = clients["globex"]
            for call in (thief.cached_blocks(), thief.diagnose(), anext(aiter(thief.kv_events(from_seq=1)))):
                assert (await refused(call)).code() == grpc.StatusCode.PERMISSION_DENIED
            async with EngineClient(target) as anonymous:
                assert (await refused(anonymous.cached_blocks())).code() == grpc.StatusCode.UNAUTHENTICATED
            assert len((await admin.cached_blocks()).block_hashes) >= len(SECRET_PROMPT) // 4  # and its output's
            assert (await admin.diagnose()).lookups >= 1
            first = await anext(aiter(admin.kv_events(from_seq=1)))
            assert first.HasField("batch")

    asyncio.run(asyncio.wait_for(main(), 60))


def test_request_ids_are_per_tenant(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    """Attack 5: another tenant's open id neither blocks a request nor tells that it is in flight."""
    async def main() -> None:
        async with tenant_api(tokenizer, tmp_path, step_delay_s=0.02) as (clients, admin, _):
            held = clients["acme"].generate(build_request(token_ids=SECRET_PROMPT, max_tokens=400, request_id="x"))
            await held.read()
            same_id = await clients["globex"].complete(greedy([5, 6, 7], request_id="x"))
            assert same_id.finish_reason == "length" and same_id.request_id == "x"
            error = await refused(clients["acme"].complete(greedy([5, 6, 7], request_id="x")))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details() == "request_id: 'x' is already in flight"
            held.cancel()
            await until_idle(admin)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_flooding_tenant_is_held_to_its_share_and_the_other_is_served(tokenizer: TextTokenizer,
                                                                        tmp_path: Path) -> None:
    """Attack 6: 300 requests at once from one tenant get RESOURCE_EXHAUSTED beyond its limit; another
    tenant's single request, sent meanwhile, is served."""
    document = tenants_document(KEYS, admins={"ops": ADMIN_KEY}, limits={"max_in_flight": 8})

    async def flood(client: EngineClient) -> str:
        try:
            await client.complete(build_request(token_ids=[9, 10, 11], max_tokens=20, ignore_eos=True))
        except grpc.aio.AioRpcError as error:
            return error.code().name
        return "OK"

    async def main() -> None:
        async with tenant_api(tokenizer, tmp_path, document, step_delay_s=0.01) as (clients, admin, _):
            flooding = [asyncio.ensure_future(flood(clients["globex"])) for _ in range(300)]
            await asyncio.sleep(0.2)
            light = await clients["acme"].complete(greedy([21, 22, 23]))
            assert light.finish_reason == "length"
            outcomes = await asyncio.gather(*flooding)
            assert set(outcomes) == {"OK", "RESOURCE_EXHAUSTED"} and outcomes.count("OK") < 300
            stats = await admin.cache_stats()
            assert (stats.running_requests, stats.waiting_requests, stats.used_blocks) == (0, 0, 0)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_tenants_cache_stats_are_its_own(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    async def main() -> None:
        async with tenant_api(tokenizer, tmp_path) as (clients, admin, _):
            for _ in range(2):
                await clients["acme"].complete(greedy(SECRET_PROMPT))
            acme, globex, everything = (await clients["acme"].cache_stats(), await clients["globex"].cache_stats(),
                                        await admin.cache_stats())
            assert (acme.query_tokens, acme.hit_tokens) == (2 * len(SECRET_PROMPT), len(SECRET_PROMPT) - 4)
            assert (globex.query_tokens, globex.hit_tokens, globex.cached_blocks, globex.num_blocks) == (0, 0, 0, 0)
            assert everything.cached_blocks > 0 and everything.num_blocks == 256
            assert (everything.query_tokens, everything.hit_tokens) == (acme.query_tokens, acme.hit_tokens)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_identical_prompts_of_two_tenants_never_hit_each_other(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    """Two tenants send the same 150 prompts, interleaved and concurrently: every hit a request gets
    could only come from the other tenant, and there is none; within a tenant, a repeat hits."""
    rng = random.Random(29)
    prompts = [[rng.randrange(100, tokenizer.vocab_size) for _ in range(rng.choice([8, 12, 20]))] for _ in range(150)]

    async def main() -> None:
        async with tenant_api(tokenizer, tmp_path, num_kv_blocks=2048) as (clients, _, _):
            # In opposite orders: one tenant's copy of a prompt runs long before the other's, and would hit it.
            sends = [pair for pairs in zip([("acme", p) for p in prompts], [("globex", p) for p in reversed(prompts)])
                     for pair in pairs]
            completions = await asyncio.gather(*(clients[name].complete(greedy(prompt, max_tokens=2))
                                                 for name, prompt in sends))
            assert sum(c.usage.cached_tokens for c in completions) == 0
            assert len(completions) == 300 and all(c.finish_reason == "length" for c in completions)
            repeat = await clients["acme"].complete(greedy(prompts[0], max_tokens=2))
            assert repeat.usage.cached_tokens > 0

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_huge_text_costs_its_sender_invalid_argument_and_nobody_else_anything(tokenizer: TextTokenizer,
                                                                                 tmp_path: Path) -> None:
    """Attack 4: a 50 MB text is refused by size before the tokenizer sees it; another tenant's
    requests sent meanwhile are all served."""
    async def main() -> None:
        async with tenant_api(tokenizer, tmp_path) as (clients, _, _):
            huge = clients["globex"].complete(build_request(text="a" * 50_000_000, max_tokens=1))
            others = [clients["acme"].complete(build_request(text=f"Hello number {i}", max_tokens=2)) for i in range(8)]
            results = await asyncio.gather(huge, *others, return_exceptions=True)
            error = results[0]
            assert isinstance(error, aio.AioRpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details() == "text: 50000000 bytes, more than the 1048576 allowed"
            assert all(completion.finish_reason == "length" for completion in results[1:])

    asyncio.run(asyncio.wait_for(main(), 60))


def test_keys_rotate_without_a_restart(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    async def main() -> None:
        async with tenant_api(tokenizer, tmp_path) as (clients, _, target):
            assert (await clients["acme"].complete(greedy(SECRET_PROMPT))).usage.cached_tokens == 0
            rotated = new_key()
            write_tenants(tmp_path / "tenants.json", tenants_document({**KEYS, "acme": rotated}))
            error = await refused(clients["acme"].complete(greedy(SECRET_PROMPT)))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            async with EngineClient(target, api_key=rotated) as acme:  # same tenant, same salt: its cache stays
                assert (await acme.complete(greedy(SECRET_PROMPT))).usage.cached_tokens > 0

    asyncio.run(asyncio.wait_for(main(), 60))
