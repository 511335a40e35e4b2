"""Stop strings over streamed text: emit what cannot be part of a match, cut at the first match."""
from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text pieces as they are detokenized; get back the text that is safe to send.

    Only the text that could be the start of a stop string is held back: the longest end of the
    text that some stop string begins with, until a later piece completes or rules out the match.
    On a match the text ends just before it (the match is not included) and `stopped` turns true;
    later pieces yield nothing.
    """

    def __init__(self, stops: Sequence[str]):
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._longest_partial = max((len(stop) for stop in stops), default=1) - 1
        self._text = ""
        self._emitted = 0  # characters of _text already returned
        self.stopped = False

    def push(self, piece: str, final: bool = False) -> str:
        """Add `piece`; `final` releases everything held (the stream ends)."""
        if self.stopped:
            return ""
        self._text += piece
        # A match ends inside the new piece; what came before it was a partial match, held back.
        start = max(self._emitted, len(self._text) - len(piece) - self._longest_partial)
        matches = [i for i in (self._text.find(stop, start) for stop in self._stops) if i >= 0]
        if matches:
            self._text = self._text[: min(matches)]
            self.stopped = final = True
        end = len(self._text) if final else len(self._text) - self._partial_match_length()
        if end <= self._emitted:
            return ""
        released = self._text[self._emitted : end]
        self._emitted = end
        return released

    def _partial_match_length(self) -> int:
        """Length of the longest unsent end of the text that a stop string starts with."""
        text = self._text
        for length in range(min(self._longest_partial, len(text) - self._emitted), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
