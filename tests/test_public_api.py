"""The public surface: __all__ names exactly what kvasync exports."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import subprocess
import sys

import pytest

import kvasync


def test_all_matches_the_public_names():
    # The names load on first use (PEP 562), so dir() lists them before any is touched.
    public = {
        name
        for name in dir(kvasync)
        if not name.startswith("_") and not inspect.ismodule(getattr(kvasync, name))
    }
    assert set(kvasync.__all__) == public
    with pytest.raises(AttributeError, match="no attribute 'Allocater'"):
        kvasync.Allocater  # noqa: B018


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter has imported after running ``code``."""
    probe = f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return set(done.stdout.split())


@pytest.mark.parametrize("option", ["--version", "--help"])
def test_version_and_help_import_neither_torch_nor_the_extension(option):
    # kvasync --version took 1.8 s when `import kvasync` imported torch (issue 18).
    modules = _modules_after(
        "from kvasync.cli import main\n"
        "try:\n"
        f"    main([{option!r}])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
    )
    assert "kvasync.cli" in modules
    assert {"torch", "numpy", "kvasync._core", "kvasync._allocator"}.isdisjoint(modules)


def test_a_public_name_imports_its_module_on_first_use():
    modules = _modules_after("import kvasync\nkvasync.KVLayout")
    assert "kvasync._layout" in modules and "kvasync._allocator" not in modules
    assert "torch" in modules  # KVLayout's dtype is a torch dtype


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


@pytest.mark.parametrize("old", ["kvasync.ledger", "kvasync.metrics", "kvasync.pytest_plugin"])
def test_the_unreleased_old_module_names_are_gone(old):
    # Issue 29: shims for names no release ever had (0.1.0 was never released); their homes are
    # kvasync.share, kvasync.integrations.metrics and kvasync.integrations.pytest_plugin.
    with pytest.raises(ModuleNotFoundError, match=old.replace(".", r"\.")):
        importlib.import_module(old)


def test_the_pytest11_entry_point_names_the_plugin_in_its_new_home():
    from importlib.metadata import entry_points

    import kvasync.integrations.pytest_plugin

    (entry,) = [e for e in entry_points(group="pytest11") if e.name == "kvasync"]
    assert entry.load() is kvasync.integrations.pytest_plugin


def test_the_size_parser_lives_in_the_core_and_the_share_verbs_reuse_it():
    from kvasync import _sizes
    from kvasync.share import _cli

    assert _cli.parse_size is _sizes.parse_size and _cli.format_bytes is _sizes.format_bytes
