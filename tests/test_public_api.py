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


def test_the_old_names_resolve_to_the_objects_in_their_new_homes():
    # Moved by the layout of issue 15; the README's "Where things moved" lists them.
    import kvasync.integrations.metrics
    import kvasync.integrations.pytest_plugin
    import kvasync.ledger
    import kvasync.metrics
    import kvasync.pytest_plugin
    import kvasync.share

    moves = [
        (kvasync.ledger, kvasync.share),
        (kvasync.metrics, kvasync.integrations.metrics),
        (kvasync.pytest_plugin, kvasync.integrations.pytest_plugin),
    ]
    for old, new in moves:
        # The old name keeps what it had; names added since live only in the new home.
        assert set(old.__all__) <= set(new.__all__), old.__name__
        for name in old.__all__:
            assert getattr(old, name) is getattr(new, name), f"{old.__name__}.{name}"


def test_the_pytest11_entry_point_names_the_plugin_in_its_new_home():
    from importlib.metadata import entry_points

    import kvasync.integrations.pytest_plugin

    (entry,) = [e for e in entry_points(group="pytest11") if e.name == "kvasync"]
    assert entry.load() is kvasync.integrations.pytest_plugin


def test_the_size_parser_lives_in_the_core_and_the_share_verbs_reuse_it():
    from kvasync import _sizes
    from kvasync.share import _cli

    assert _cli.parse_size is _sizes.parse_size and _cli.format_bytes is _sizes.format_bytes
