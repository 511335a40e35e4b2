"""Quoting what a client sent inside an error message, at a bounded length.

gRPC carries a status message in a header: past 8 KiB a client may drop the whole reply (it sees
RESOURCE_EXHAUSTED instead of the status we sent), and a message quoting a request's own field
verbatim would reach that with a long enough value.
"""
from __future__ import annotations

QUOTED_CHARS = 64


def quoted(text: str, limit: int = QUOTED_CHARS) -> str:
    """`repr(text)`, its first `limit` characters only when it is longer, saying how long it was."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"
