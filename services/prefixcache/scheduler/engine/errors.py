"""Why the engine refuses or ends a request; the Engine API maps each to a gRPC status."""
from __future__ import annotations


class EngineUnavailable(Exception):
    """The engine cannot serve: the worker is down (or restarting), or the engine is stopping."""


class QueueFull(Exception):
    """The waiting queue is full; the client should retry later."""


class RequestRejected(ValueError):
    """Bad input, detected before the request was queued. `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
