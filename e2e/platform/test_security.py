"""A platform as hostile clients meet it, with real processes and the embedded model: tenants with API
keys, the Engine API over TLS, the tokenizer and the worker over mutual TLS (only the scheduler holds
a client certificate they accept). Every attack a hostile client tried, repeated, fails the attacker
and leaves the victim's greedy output and cached prefix as they were; logs, traces and metrics hold
no key and no salt; readiness follows the tokenizer."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from platform_harness import GRACE_S, KV_CACHE_MEMORY, TRACING_ENV, run, scrape_metrics

from prefixcache.client import EngineClient, build_request
from prefixcache.launcher import LocalPlatform, PlatformConfig, free_port
from prefixcache.protos.worker.v1 import worker_pb2, worker_pb2_grpc
from prefixcache.rpc.tls import ChannelTls
from prefixcache.scheduler.tenancy import hash_api_key

pytestmark = pytest.mark.slow
import trustme

VICTIM, ATTACKER, ADMIN = "tenant-acme-3c9e", "tenant-globex-71bd", "ops-5e2a"
SYSTEM = " ".join(f"Rule {n}: answer briefly and never reveal the launch code AZ-{n:04d}." for n in range(12))
ENGINE_SERVICE = "prefixcache.engine.v1.Engine"


@dataclass
class Secure:
    platform: LocalPlatform
    engine_tls: ChannelTls
    internal_ca: Path
    keys: dict[str, str]  # principal name -> API key
    salt_key: str
    health_port: int
    tls_dir: Path

    def client(self, principal: str | None, tls: bool = True) -> EngineClient:
        return EngineClient(self.platform.engine_address, api_key=self.keys.get(principal),
                            tls=self.engine_tls if tls else None)

    @property
    def secrets(self) -> dict[str, str]:
        """Everything that must never be written anywhere: keys, their hashes, the salt key, the salts."""
        found = {"salt key": self.salt_key}
        for name, key in self.keys.items():
            found[f"{name}'s key"] = key
            found[f"{name}'s key hash"] = hash_api_key(key).removeprefix("sha256:")
            found[f"{name}'s salt"] = hmac.new(self.salt_key.encode(), name.encode(), hashlib.sha256).hexdigest()
        return found


def pem_pair(ca: trustme.CA, directory: Path, name: str, *identities: str) -> list[str]:
    issued = ca.issue_cert(*identities)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    return [str(cert), str(key)]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    from prefixcache.model_store.store import ensure_default_model

    tls_dir = tmp_path_factory.mktemp("tls")
    internal, engine = trustme.CA(), trustme.CA()
    internal_ca, engine_ca = tls_dir / "internal-ca.pem", tls_dir / "engine-ca.pem"
    internal.cert_pem.write_to_path(str(internal_ca))
    engine.cert_pem.write_to_path(str(engine_ca))
    tokenizer_pair = pem_pair(internal, tls_dir, "tokenizer", "127.0.0.1")
    worker_pair = pem_pair(internal, tls_dir, "worker", "127.0.0.1")
    scheduler_pair = pem_pair(internal, tls_dir, "scheduler", "scheduler.internal")
    engine_pair = pem_pair(engine, tls_dir, "engine", "127.0.0.1")
    keys = {name: secrets.token_hex(32) for name in (VICTIM, ATTACKER, ADMIN)}
    salt_key = secrets.token_hex(32)
    tenants = tls_dir / "tenants.json"
    tenants.write_text(json.dumps({
        "salt_key": salt_key, "limits": {"max_in_flight": 4},
        "tenants": [{"name": name, "api_keys": [hash_api_key(keys[name])]} for name in (VICTIM, ATTACKER)],
        "admins": [{"name": ADMIN, "api_keys": [hash_api_key(keys[ADMIN])]}]}))
    mutual = ["--tls-client-ca", str(internal_ca)]
    health_port = free_port()
    scheduler_channel = ChannelTls.from_files(internal_ca, *map(Path, scheduler_pair))
    config = PlatformConfig(
        model_dir=ensure_default_model(), log_dir=tmp_path_factory.mktemp("secure-logs"), engine_port=free_port(),
        engine_host="127.0.0.1", kv_cache_memory=KV_CACHE_MEMORY, env=TRACING_ENV, grace_s=GRACE_S,
        scheduler_args=["--max-num-seqs", "16", "--max-waiting", "16", "--metrics-port", str(free_port()),
                        "--tenants", str(tenants), "--tls-cert", engine_pair[0], "--tls-key", engine_pair[1],
                        "--health-port", str(health_port), "--tokenizer-tls-ca", str(internal_ca),
                        "--worker-tls-ca", str(internal_ca), "--client-tls-cert", scheduler_pair[0],
                        "--client-tls-key", scheduler_pair[1]],
        worker_args=["--tls-cert", worker_pair[0], "--tls-key", worker_pair[1], *mutual],
        tokenizer_args=["--tls-cert", tokenizer_pair[0], "--tls-key", tokenizer_pair[1], *mutual],
        service_tls={"tokenizer": scheduler_channel, "worker": scheduler_channel,
                     "scheduler": ChannelTls.from_files(engine_ca)},
    )
    platform = LocalPlatform(config)
    platform.start()
    try:
        run(platform.wait_ready(timeout_s=240))
    except BaseException:
        platform.stop()
        raise
    state = Secure(platform, ChannelTls.from_files(engine_ca), internal_ca, keys, salt_key, health_port, tls_dir)
    try:
        yield state
        run(idle(state))
    finally:
        assert platform.stop() == {"scheduler": 0, "worker": 0, "tokenizer": 0}


async def idle(secure: Secure) -> None:
    """No request left and no block held, as the admin sees the whole cache."""
    async with secure.client(ADMIN) as admin:
        for _ in range(300):
            stats = await admin.cache_stats()
            if not (stats.running_requests or stats.waiting_requests or stats.used_blocks):
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the engine is not idle: {stats}")


async def failure(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call
    return failed.value


def victim_request() -> object:
    return build_request(messages=[("system", SYSTEM), ("user", "What is the capital of France?")],
                         max_tokens=8, temperature=0.0)


def test_the_engine_api_serves_tls_and_only_configured_credentials(secure: Secure) -> None:
    async def main() -> None:
        async with secure.client(VICTIM, tls=False) as plaintext:
            assert (await failure(plaintext.describe())).code() == grpc.StatusCode.UNAVAILABLE
        for principal in (None, "nobody"):
            async with secure.client(principal) as client:
                assert (await failure(client.describe())).code() == grpc.StatusCode.UNAUTHENTICATED
        async with secure.client(VICTIM) as client:
            assert (await client.describe()).model_id
        async with aio.insecure_channel(f"127.0.0.1:{secure.health_port}") as probe:  # what a kubelet sees
            reply = await health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(service=ENGINE_SERVICE))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

    run(main())


async def attack_the_worker(secure: Secure) -> None:
    """Attack 2: a foreign client's InitializeCache (which would wipe the cache) and ExecuteStep (which
    would overwrite cached KV) never reach the worker: plaintext, TLS without a client certificate,
    and a certificate of another CA are all refused in the handshake."""
    stranger = trustme.CA()
    stranger_pair = [Path(p) for p in pem_pair(stranger, secure.tls_dir, "stranger", "scheduler.internal")]
    for tls in (None, ChannelTls.from_files(secure.internal_ca),
                ChannelTls.from_files(secure.internal_ca, *stranger_pair)):
        channel = aio.secure_channel(secure.platform.worker.address, tls.credentials()) if tls else \
            aio.insecure_channel(secure.platform.worker.address)
        async with channel:
            worker = worker_pb2_grpc.WorkerStub(channel)
            for call in (worker.InitializeCache(worker_pb2.InitializeCacheRequest(block_size=16), timeout=5),
                         worker.ExecuteStep(worker_pb2.Step(step_id=1), timeout=5)):
                assert (await failure(call)).code() == grpc.StatusCode.UNAVAILABLE


def test_every_attack_fails_the_attacker_and_leaves_the_victim_intact(secure: Secure) -> None:
    async def main() -> None:
        async with secure.client(VICTIM) as victim, secure.client(ATTACKER) as attacker:
            await victim.complete(victim_request())
            before = await victim.complete(victim_request())
            assert before.usage.cached_tokens > 64
            victim_salt = secure.secrets[f"{VICTIM}'s salt"]
            for _ in range(2):
                # 1: claiming the victim's tenant, or its salt, is refused; the prompt sent plainly misses.
                for claim in ({"tenant": VICTIM}, {"cache_salt": victim_salt}):
                    request = victim_request()
                    setattr(request, *next(iter(claim.items())))
                    assert (await failure(attacker.complete(request))).code() == grpc.StatusCode.PERMISSION_DENIED
                await attack_the_worker(secure)
                # 3: resetting everyone's cache takes an admin.
                assert (await failure(attacker.reset_prefix_cache())).code() == grpc.StatusCode.PERMISSION_DENIED
                # 4: a 50 MB text costs its sender INVALID_ARGUMENT, while the victim is served.
                huge = attacker.complete(build_request(text="x" * 50_000_000, max_tokens=1))
                outcomes = await asyncio.gather(huge, victim.complete(victim_request()), return_exceptions=True)
                assert outcomes[0].code() == grpc.StatusCode.INVALID_ARGUMENT and outcomes[0].details().startswith("text: ")
                assert outcomes[1].token_ids == before.token_ids
                # 5: the victim's request id, held open, is no business of the attacker's.
                held = victim.generate(build_request(text="Count to one hundred.", max_tokens=64, request_id="shared-id"))
                await held.read()
                same_id = await attacker.complete(build_request(text="Hi", max_tokens=2, request_id="shared-id"))
                assert same_id.finish_reason == "length"
                held.cancel()
                await idle(secure)
                # 6: a flood beyond the attacker's limit gets RESOURCE_EXHAUSTED; the victim is served meanwhile.
                flood = [attacker.complete(build_request(text=f"Flood {i}", max_tokens=8, ignore_eos=True))
                         for i in range(12)]
                outcomes = await asyncio.gather(*flood, victim.complete(victim_request()), return_exceptions=True)
                refused = [o for o in outcomes[:-1] if isinstance(o, grpc.aio.AioRpcError)]
                assert refused and {o.code() for o in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
                assert outcomes[-1].token_ids == before.token_ids
            guess = await attacker.complete(victim_request())
            assert guess.usage.cached_tokens == 0
            await idle(secure)
            after = await victim.complete(victim_request())
            assert after.token_ids == before.token_ids and after.usage.cached_tokens == before.usage.cached_tokens

    run(main())


def test_readiness_follows_the_tokenizer(secure: Secure) -> None:
    async def engine_status() -> int:
        async with aio.insecure_channel(f"127.0.0.1:{secure.health_port}") as probe:
            request = health_pb2.HealthCheckRequest(service=ENGINE_SERVICE)
            return (await health_pb2_grpc.HealthStub(probe).Check(request, timeout=5)).status

    async def becomes(status: int) -> None:
        deadline = time.monotonic() + 30
        while await engine_status() != status:
            assert time.monotonic() < deadline, f"the Engine's health never became {status}"
            await asyncio.sleep(0.2)

    tokenizer = secure.platform.tokenizer
    tokenizer.kill()
    run(becomes(health_pb2.HealthCheckResponse.NOT_SERVING))
    tokenizer.start()
    run(becomes(health_pb2.HealthCheckResponse.SERVING))

    async def served() -> None:
        async with secure.client(VICTIM) as victim:
            assert (await victim.complete(build_request(text="Hello", max_tokens=2))).finish_reason == "length"

    run(served())


def test_logs_traces_and_metrics_hold_no_key_or_salt(secure: Secure) -> None:
    """Last: by now the services have logged every attack above, with their spans (console exporter)."""
    time.sleep(1.0)  # the spans of the last requests are exported
    logs = {service.name: service.log_path.read_text(errors="replace") for service in secure.platform.services}
    labels = set(_labels(logs["scheduler"]))
    assert len(labels) == 2  # the traces are there, and carry the two tenants' one-way labels only
    metrics = "\n".join(scrape_metrics(secure.platform))
    for where, text in {**logs, "metrics": metrics}.items():
        for what, secret in {**secure.secrets, "a tenant's name": VICTIM, "another's name": ATTACKER}.items():
            assert secret not in text, f"{what} is in the {where}"


def _labels(scheduler_log: str) -> Iterator[str]:
    marker = '"prefix_cache.tenant": "'
    start = scheduler_log.find(marker)
    while start >= 0:
        start += len(marker)
        yield scheduler_log[start: scheduler_log.index('"', start)]
        start = scheduler_log.find(marker, start)
