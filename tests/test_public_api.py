"""The public surface: __all__ names exactly what kvasync exports."""

from __future__ import annotations

import inspect
import pathlib

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


def test_kernels_ship_inside_the_package():
    import kvasync.kernels

    # Installed as kvasync/kernels (CMake puts the top-level kernels/ folder there), never as a
    # bare top-level package.
    assert kvasync.kernels.__name__ == "kvasync.kernels"
    assert pathlib.Path(kvasync.kernels.__file__).parts[-3:] == (
        "kvasync",
        "kernels",
        "__init__.py",
    )


def test_the_version_has_one_source_and_the_cli_reports_it():
    import importlib.metadata

    from click.testing import CliRunner

    from kvasync.cli import main

    assert kvasync.__version__ == importlib.metadata.version("kvasync")
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output == f"kvasync, version {kvasync.__version__}\n"
    result = CliRunner().invoke(main, ["demo", "--requests", "many"])
    assert result.exit_code == 2 and "'--requests'" in result.output  # the flag, by name
    assert "[bold" not in CliRunner().invoke(main, ["--help"]).output  # no raw markup
