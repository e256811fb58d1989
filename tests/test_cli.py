"""The command line as a new user meets it: a command that needs an extra says which one, at
once, before any work."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from kvasync import cli

ROOT = Path(__file__).resolve().parent.parent

# Runs a command with some modules made unimportable (a None entry in sys.modules is how Python
# spells "not installed" to an import), then reports whether torch was imported: the check must
# come before any work, and any work of these commands imports torch.
PROBE = """
import sys
for module in sys.argv[2:]:
    sys.modules[module] = None
from kvasync.cli import main
try:
    main([sys.argv[1]], prog_name="kvasync")
finally:
    print("torch imported:", "torch" in sys.modules)
"""


def run_without(command: str, *modules: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, command, *modules],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.mark.parametrize(
    ("command", "missing"),
    [("serve", "uvicorn"), ("serve", "fastapi"), ("demo", "matplotlib")],
)
def test_a_command_names_the_extra_it_needs_before_any_work(command, missing):
    # Issue 18: after `pip install ".[metrics,trio]"`, serve died on ModuleNotFoundError:
    # uvicorn, and the demo ran its whole burst before dying on matplotlib.
    done = run_without(command, missing)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (
        f"Error: kvasync {command} needs the serve extra (missing: {missing}): "
        'pip install "kvasync[serve]"'
    )
    assert "torch imported: False" in done.stdout


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them: ``prometheus_client`` is
    ``prometheus-client``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_extras_the_commands_name_install_the_modules_they_check():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    distributions = importlib.metadata.packages_distributions()
    for command, (extra, modules) in cli._EXTRAS.items():
        named = {normalized(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in extras[extra]}
        for module in modules:
            (distribution,) = {normalized(d) for d in distributions[module]}
            assert distribution in named, f"kvasync {command}: {module} is not in [{extra}]"
