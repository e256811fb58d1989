"""Test support: inject delays, hangs and failures into the mapper thread's backend calls."""

from __future__ import annotations

from . import _core, _validate

__all__ = ["FaultInjector"]


class FaultInjector:
    """Delays, hangs or fails the backend's maps, inside the mapper thread.

    Pass it as ``Config(faults=...)``. Settings take effect for the next backend call and can be
    changed while the allocator runs.
    """

    def __init__(self) -> None:
        self._state = _core.FaultState()

    def delay(self, seconds: float) -> None:
        """Make each map and unmap take ``seconds`` longer (at most 600 s; ``release()`` ends it).

        Raises:
            TypeError: ``seconds`` is not a number (or is a bool).
            ValueError: ``seconds`` is negative or not finite.
        """
        self._state.delay(_validate.seconds(seconds, "seconds"))

    def hang(self) -> None:
        """Make maps block inside the mapper thread until ``release()``."""
        self._state.hang()

    def fail(self, count: int = 1) -> None:
        """Make the next ``count`` maps fail as the driver's out-of-memory error.

        Raises:
            TypeError: ``count`` is not an int (or is a bool).
            ValueError: ``count`` is not positive.
        """
        self._state.fail(_validate.count(count, "count"))

    def release(self) -> None:
        """End a hang and clear the delay and any pending failures."""
        self._state.release()

    @property
    def hung_maps(self) -> int:
        """Maps blocked by ``hang()`` right now (lets a test wait for the hang to bite)."""
        return int(self._state.hung_maps)
