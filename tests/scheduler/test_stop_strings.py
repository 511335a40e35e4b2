"""Stop strings over streamed text pieces."""
from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.scheduler.stop_strings import StopStringMatcher


def stream(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stops)
    out = [matcher.push(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return out, matcher.stopped


def test_without_stops_text_passes_through_at_once() -> None:
    assert stream([], ["a", "bc", ""]) == (["a", "bc", ""], False)


def test_a_match_split_across_pieces_is_cut_and_never_emitted() -> None:
    out, stopped = stream(["STOP"], ["one two ST", "O", "P three", " four"])
    assert stopped and "".join(out) == "one two "
    assert out[0] == "one two "  # "ST" is held: it could begin "STOP"
    assert out[3] == ""  # nothing after the stop


def test_the_earliest_of_several_stops_wins() -> None:
    out, stopped = stream(["world", "lo"], ["hello world"])
    assert stopped and "".join(out) == "hel"


def test_held_text_is_released_at_the_end() -> None:
    out, stopped = stream(["</answer>"], ["forty", "-two <", "/ans"])
    assert not stopped and "".join(out) == "forty-two </ans"
    assert out == ["forty", "-two ", "</ans"]


def test_a_stop_at_the_very_start() -> None:
    assert stream(["\n"], ["\nrest"]) == ([""], True)


def test_empty_stop_strings_are_refused() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_text_that_cannot_begin_a_stop_string_is_sent_at_once() -> None:
    out, stopped = stream(["QQQQQQQQ", "a young"], [" there", " was", " a", " y", "et", " another", ""])
    assert not stopped
    assert out == [" there", " was", " ", "", "a yet", " another", ""]  # "a y" could begin "a young"


def test_a_partial_match_ruled_out_is_released_and_a_later_one_still_stops() -> None:
    out, stopped = stream(["abc"], ["xab", "d ab", "c tail"])
    assert stopped and out == ["x", "abd ", ""]
    assert "".join(out) == "xabd "


def test_a_stop_string_repeating_its_own_start_is_found_after_a_false_start() -> None:
    out, stopped = stream(["aab"], ["a", "a", "a", "b"])
    assert stopped and "".join(out) == "a"


def _reference(stops: list[str], pieces: list[str]) -> list[str]:
    """What a client should receive, from the whole text so far at each piece: everything before the
    first match once there is one; otherwise all but the longest end some stop string starts with."""
    out, sent, text = [], 0, ""
    for index, piece in enumerate(pieces):
        text += piece
        starts = [found for stop in stops if (found := text.find(stop)) >= 0]
        if starts:
            out.append(text[sent : min(starts)])
            return out + [""] * (len(pieces) - index - 1)
        final = index == len(pieces) - 1
        held = 0 if final else max((n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])),
                                   default=0)
        end = max(sent, len(text) - held)
        out.append(text[sent:end])
        sent = end
    return out


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=5), min_size=1, max_size=3),
       pieces=st.lists(st.text(alphabet="abc", max_size=6), min_size=1, max_size=8))
def test_matches_a_whole_text_reference(stops: list[str], pieces: list[str]) -> None:
    assert stream(stops, pieces)[0] == _reference(stops, pieces)


def test_a_long_partial_match_costs_time_linear_in_the_text() -> None:
    """A client picks the stop strings: a long one the model keeps starting must not make a piece
    cost the square of what is held back. Checking every held end against the stop string took
    1.6 s for the last piece here (and grows with the square); matching as an automaton, 0.02 s."""
    stop = "a" * 300_000 + "b"
    matcher = StopStringMatcher([stop])
    assert all(matcher.push("a" * 1_000) == "" for _ in range(300))  # all of it could begin the stop
    started = time.process_time()
    assert matcher.push("ac") == "a" * 300_001 + "c"  # ruled out: everything goes
    assert time.process_time() - started < 0.5
    assert not matcher.stopped
