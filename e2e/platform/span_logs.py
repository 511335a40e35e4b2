"""Reading the spans the services print to their logs (the console exporter), in the e2e tests."""
from __future__ import annotations

import json
import time
from pathlib import Path


def spans_in(log: Path) -> list[dict]:
    """The JSON span objects the console exporter has finished writing into a service's log.

    The service keeps exporting while a test reads, so the last object may be cut short: it is left
    for the next read."""
    text, decoder, spans = log.read_text(errors="replace"), json.JSONDecoder(), []
    start = text.find('{\n    "name"')
    while start >= 0:
        try:
            span, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            if text.find('{\n    "name"', start + 1) >= 0:
                raise  # a broken span with complete ones after it is a real defect
            break
        spans.append(span)
        start = text.find('{\n    "name"', end)
    return spans


def eventually(condition, failure: str, timeout_s: float = 15.0) -> None:
    """Poll `condition` until it holds: each service exports its spans on its own schedule."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.2)


def is_request_span(span: dict) -> bool:
    """The scheduler's span of a request, named `{operation} {model}` by the GenAI conventions."""
    return "gen_ai.request.id" in span["attributes"]


def spans_of_trace(log: Path, trace_id: int) -> list[dict]:
    return [s for s in spans_in(log) if s["context"]["trace_id"] == f"0x{trace_id:032x}"]
