"""``stop`` strings, applied by the HTTP layer over the engine's text stream.

The output ends just before the first occurrence of any stop string (which is not returned), and
the request is then aborted. While streaming, text that could be the start of a stop string is
held back until the next pieces show whether it is one, so that no part of a stop string is ever
sent.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopStrings"]


class StopStrings:
    """Finds the first stop string in text that arrives piece by piece.

    Args:
        stops: the stop strings (non-empty); none means the text never stops early.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        assert all(stops), "bug: an empty stop string reached the matcher"
        self._stops = tuple(stops)
        self._held = ""  # the tail of the text so far that may begin a stop string
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Takes the next piece; returns the text that is now safe to send.

        After a stop string is found (``stopped``), the text before it is returned and every
        later piece is dropped.
        """
        if self.stopped:
            return ""
        text = self._held + piece
        found = [i for i in (text.find(stop) for stop in self._stops) if i >= 0]
        if found:
            self.stopped = True
            self._held = ""
            return text[: min(found)]
        # NOTE: the held tail is the longest suffix that is a proper prefix of a stop string, so a
        # stop string that begins in text already sent cannot exist: it would have been held.
        keep = max((_overlap(text, stop) for stop in self._stops), default=0)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held text, once the output has ended without a stop string."""
        held, self._held = self._held, ""
        return held


def _overlap(text: str, stop: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0
