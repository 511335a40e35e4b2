"""Who is calling the Engine API and what that caller holds: the identity a call's credentials prove
(`prefixcache.scheduler.tenancy`), the namespace its request ids live in, its open Generate calls
against its tenant's limit, and the cache counters it may read.

Every request id is scoped by its tenant's one-way label (`<label>/<id>` inside the engine, in spans
and eviction events): two tenants may use the same id at once, and neither can tell whether the
other's id is in flight. Without tenants configured the ids are the client's own, as before.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass

import grpc
from grpc import aio

from prefixcache.rpc.quoting import quoted
from prefixcache.scheduler.api.codec import InvalidRequest
from prefixcache.scheduler.tenancy import ANONYMOUS, Identity, TenantRegistry, Unauthenticated
from prefixcache.scheduler.tenancy.identity import Role

log = logging.getLogger(__name__)


class TenantBusy(Exception):
    """The tenant already holds as many Generate calls as its limit allows (RESOURCE_EXHAUSTED)."""


async def identify(registry: TenantRegistry | None, context: aio.ServicerContext) -> Identity:
    """The caller of this RPC; the call ends UNAUTHENTICATED if tenants are configured and its
    credentials prove none of them."""
    if registry is None:
        return ANONYMOUS
    authorization = next((value for key, value in context.invocation_metadata() or ()
                          if key == "authorization"), None)
    peer_names = [name.decode(errors="replace") for name in context.peer_identities() or ()]
    try:
        return registry.identify(authorization if isinstance(authorization, str) else None, peer_names)
    except Unauthenticated as error:
        log.debug("refused a call from %s: %s", context.peer(), error)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
        raise  # abort raises; this only tells type checkers that nothing follows


async def require_admin(registry: TenantRegistry | None, context: aio.ServicerContext, action: str) -> None:
    """End the call PERMISSION_DENIED unless its caller may see or change the whole cache: an admin,
    or anyone where no tenants are configured. `action` completes "… takes an admin credential"."""
    identity = await identify(registry, context)
    if identity.role is Role.TENANT:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"authorization: {action} takes an admin credential")


def engine_request_id(identity: Identity, request_id: str) -> str:
    """The id the engine, spans and eviction events know a request by."""
    return f"{identity.label}/{request_id}" if identity.label else request_id


class OpenCalls:
    """Generate calls not yet ended, by engine request id and by tenant. An id stays taken until its
    call ends, not only until the engine finishes the request: the call still aborts by id when it
    stops or is cancelled."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._per_tenant: Counter[str] = Counter()
        self.none_open = asyncio.Event()
        self.none_open.set()

    def enter(self, engine_id: str, request_id: str, identity: Identity, max_in_flight: int | None) -> None:
        """Raises InvalidRequest for an id in flight in the caller's scope, TenantBusy over its limit."""
        if engine_id in self._ids:
            raise InvalidRequest("request_id", f"{quoted(request_id)} is already in flight")
        if max_in_flight is not None and self._per_tenant[identity.label] >= max_in_flight:
            raise TenantBusy(f"your tenant has {self._per_tenant[identity.label]} requests in flight, the most "
                             "it may; retry when one has finished")
        self._ids.add(engine_id)
        self._per_tenant[identity.label] += 1
        self.none_open.clear()

    def leave(self, engine_id: str, identity: Identity) -> None:
        self._ids.discard(engine_id)
        self._per_tenant[identity.label] -= 1
        if not self._per_tenant[identity.label]:
            del self._per_tenant[identity.label]
        if not self._ids:
            self.none_open.set()


@dataclass
class TenantCounters:
    """A tenant's own share of the prefix-cache counters: all it may read of the cache's statistics."""

    query_tokens: int = 0
    hit_tokens: int = 0
