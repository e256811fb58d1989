"""The public surface: __all__ names exactly what kvasync exports."""

from __future__ import annotations

import inspect

import kvasync


def test_all_matches_the_public_names():
    public = {
        name
        for name, value in vars(kvasync).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert set(kvasync.__all__) == public


def test_errors_subclass_what_callers_expect():
    assert issubclass(kvasync.AllocTimeout, TimeoutError)
    for error in (
        kvasync.AllocTimeout,
        kvasync.OutOfBlocks,
        kvasync.WouldBlock,
        kvasync.MapError,
        kvasync.AllocatorClosed,
    ):
        assert issubclass(error, kvasync.KVAsyncError)
