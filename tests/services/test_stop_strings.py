"""Stop strings over streamed text pieces."""
from __future__ import annotations

import pytest

from prefixcache.services.scheduler.stop_strings import StopStringMatcher


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
