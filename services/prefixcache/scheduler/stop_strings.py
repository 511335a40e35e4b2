"""Stop strings over streamed text: emit what cannot be part of a match, cut at the first match."""
from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text pieces as they are detokenized; get back the text that is safe to send.

    Only the text that could be the start of a stop string is held back: the longest end of the
    text that some stop string begins with, until a later piece completes or rules out the match.
    On a match the text ends just before it (the match is not included) and `stopped` turns true;
    later pieces yield nothing. The work per piece is linear in its length, however long the stop
    strings are (a client chooses them).
    """

    def __init__(self, stops: Sequence[str]):
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self._automata = [_PrefixAutomaton(stop) for stop in stops]
        self._text = ""
        self._emitted = 0  # characters of _text already returned
        self.stopped = False

    def push(self, piece: str, final: bool = False) -> str:
        """Add `piece`; `final` releases everything held (the stream ends)."""
        if self.stopped:
            return ""
        base = len(self._text)
        self._text += piece
        match_starts = [base + end + 1 - len(automaton.stop)
                        for automaton in self._automata if (end := automaton.feed(piece)) is not None]
        if match_starts:
            self._text = self._text[: min(match_starts)]
            self.stopped = final = True
        held = 0 if final else max((automaton.matched for automaton in self._automata), default=0)
        end = len(self._text) - held
        if end <= self._emitted:
            return ""
        released = self._text[self._emitted : end]
        self._emitted = end
        return released


class _PrefixAutomaton:
    """Knuth-Morris-Pratt matching of one stop string over text fed piece by piece: `matched` is the
    length of the longest end of the text so far that the stop string starts with."""

    def __init__(self, stop: str):
        self.stop = stop
        self.matched = 0
        # fallback[i]: the longest proper prefix of stop[: i + 1] that is also its suffix.
        self._fallback = [0] * len(stop)
        length = 0
        for i in range(1, len(stop)):
            while length and stop[i] != stop[length]:
                length = self._fallback[length - 1]
            if stop[i] == stop[length]:
                length += 1
            self._fallback[i] = length

    def feed(self, piece: str) -> int | None:
        """Advance over `piece`; the index in it where the stop string first ends, if it does."""
        stop, fallback, matched = self.stop, self._fallback, self.matched
        for index, char in enumerate(piece):
            while matched and stop[matched] != char:
                matched = fallback[matched - 1]
            if stop[matched] == char:
                matched += 1
                if matched == len(stop):
                    self.matched = fallback[matched - 1]
                    return index
        self.matched = matched
        return None
