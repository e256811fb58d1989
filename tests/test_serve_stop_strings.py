"""Stop strings over text that arrives piece by piece (serve/_stop_strings.py)."""

import pytest

from kvasync.serve._stop_strings import StopStrings


def _run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopStrings(stops)
    sent = [matcher.feed(piece) for piece in pieces]
    if not matcher.stopped:
        sent.append(matcher.flush())
    return sent, matcher.stopped


def test_text_without_a_stop_string_passes_through_whole() -> None:
    sent, stopped = _run(["XY"], ["ab", "cX", "d"])
    assert "".join(sent) == "abcXd" and not stopped


def test_the_output_ends_before_the_first_stop_string() -> None:
    sent, stopped = _run(["cd", "b"], ["a", "bcd", "e"])
    assert sent == ["a", "", ""] and stopped  # "b" starts before "cd"


def test_a_stop_string_split_across_pieces_is_never_sent_in_part() -> None:
    sent, stopped = _run(["END"], ["x", "E", "N", "D", "more"])
    assert sent == ["x", "", "", "", ""] and stopped


def test_a_held_prefix_that_turns_out_not_to_stop_is_sent() -> None:
    sent, stopped = _run(["END"], ["E", "N", "o"])
    assert sent == ["", "", "ENo", ""] and not stopped


def test_held_text_is_flushed_at_the_end() -> None:
    sent, stopped = _run(["abc"], ["xab"])
    assert sent == ["x", "ab"] and not stopped


@pytest.mark.parametrize("stops", [[], ["zz"]])
def test_no_stop_strings_hold_nothing(stops: list[str]) -> None:
    assert StopStrings(stops).feed("abc") == "abc"
