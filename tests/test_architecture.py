"""The package's imports point one way: no cycle between kvasync's modules, and the core imports
none of its consumers.

Read from the source with ``ast``, never by importing it, so an import made only inside a function
or only for type checking counts as well. What counts as an import of a module:

- ``import kvasync.a.b`` and ``from kvasync.a import b``: ``kvasync.a.b`` when it is a module,
  else ``kvasync.a`` (``from kvasync.a import name``). Relative imports are resolved first.
- Imports inside functions count: they run on a call, and a cycle through them is still one a
  reader must untangle.
- Imports under ``if TYPE_CHECKING:`` count too: they never run, but a cycle through them hurts
  readers the same (two modules that each need the other to be understood); a type that would
  need one is better given as a ``typing.Protocol`` on the side that uses it.
- Importing ``kvasync.a.b`` also runs ``kvasync.a/__init__``, but that is not counted as an
  edge: every module would otherwise depend on the package root, which re-exports the core.

The core is ``kvasync/__init__.py``, ``kvasync/_*.py`` and ``kvasync/testing.py``; the Triton
kernels (``kernels/``, shipped as ``kvasync.kernels``) are walked too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kvasync"
# Source folder -> the package name it is imported as.
SOURCES = {ROOT / "src" / "kvasync": PACKAGE, ROOT / "kernels": f"{PACKAGE}.kernels"}

# The rooms built on the core.
CONSUMER_MODULES = (
    "kvasync.share",
    "kvasync.integrations",
    "kvasync.serve",
    "kvasync.simulate",
    "kvasync.cli",
    "kvasync.__main__",
)
# Libraries only a consumer needs (optional extras, test or plotting tools): `import kvasync`
# must work without any of them.
CONSUMER_LIBRARIES = (
    "click",
    "rich",
    "prometheus_client",
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "httpx",
    "openai",
    "pytest",
    "matplotlib",
    "vllm",
)


def module_files(sources: dict[Path, str]) -> dict[str, Path]:
    """Every module's dotted name -> its file (a package by its ``__init__.py``; a compiled
    module, ``kvasync._core``, by its ``.pyi`` stub)."""
    modules: dict[str, Path] = {}
    for folder, package in sources.items():
        for path in sorted(folder.rglob("*.py*")):
            if path.suffix not in (".py", ".pyi"):
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if path.suffix == ".py" or name not in modules:
                modules[name] = path
    return modules


def is_package(module: str, files: dict[str, Path]) -> bool:
    return module in files and files[module].name == "__init__.py"


def imported_names(tree: ast.Module, module: str, files: dict[str, Path]) -> Iterator[str]:
    """The absolute names ``tree`` imports, at any depth (functions and TYPE_CHECKING included).

    A ``from X import name`` yields ``X.name`` when that is a module of ours, else ``X``.
    """
    package = module if is_package(module, files) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = from_source(node, package)
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                yield candidate if candidate in files else source


def from_source(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from X import ...`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def owner(name: str, files: dict[str, Path]) -> str | None:
    """The module of ours that ``name`` is, or is inside (``kvasync._core``, compiled, counts)."""
    if name == PACKAGE or name.startswith(PACKAGE + "."):
        while name not in files and name.count(".") > 1:
            name = name.rpartition(".")[0]
        return name
    return None


def import_graph(sources: dict[Path, str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> modules of ours it imports, module -> top-level outside packages it imports)."""
    files = module_files(sources)
    ours: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        ours[module], outside[module] = set(), set()
        for name in imported_names(tree, module, files):
            target = owner(name, files)
            if target is None:
                outside[module].add(name.partition(".")[0])
            elif target != module:
                ours[module].add(target)
    return ours, outside


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the package's size
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A path start -> ... -> start inside one strongly connected component."""
    start = min(component)
    # Breadth-first from start back to start, within the component: the shortest such cycle.
    paths = {target: [start, target] for target in graph[start] if target in component}
    frontier = list(paths)
    while start not in paths:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target in component and target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    return paths[start]


def is_core(module: str) -> bool:
    """kvasync/__init__.py, kvasync/_*.py (not __main__) and kvasync/testing.py."""
    if module == PACKAGE:
        return True
    parent, _, leaf = module.rpartition(".")
    if parent != PACKAGE:
        return False
    private = leaf.startswith("_") and not leaf.startswith("__")
    return private or leaf == "testing"


def back_arrows(ours: dict[str, set[str]], outside: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(core module, consumer module or library) for each import that points back up."""
    found = []
    for module in sorted(ours):
        if not is_core(module):
            continue
        for target in sorted(ours[module]):
            if _in_any(target, CONSUMER_MODULES):
                found.append((module, target))
        found += [(module, name) for name in sorted(outside[module]) if name in CONSUMER_LIBRARIES]
    return found


def room(module: str) -> str:
    """The consumer room a module is in: its subpackage of kvasync (``kvasync.serve``), or the
    module itself for a top-level one (``kvasync.cli``)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def import_bindings(tree: ast.Module, module: str, files: dict[str, Path]) -> dict[str, str]:
    """Each name an import binds in ``tree`` (at any depth) -> the absolute name it stands for."""
    package = module if is_package(module, files) else module.rpartition(".")[0]
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    head = alias.name.partition(".")[0]
                    bound[head] = head
        elif isinstance(node, ast.ImportFrom):
            source = from_source(node, package)
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{source}.{alias.name}"
    return bound


def private_accesses(sources: dict[Path, str]) -> list[str]:
    """``module:line: X._name`` for each private attribute a consumer module reads or sets on
    something other than ``self``, ``cls``, ``super()``, a module of its own room, or a name
    imported from outside kvasync (``os._exit``; a host project's class it patches); and
    ``module:line: from X import _name`` for a private name it imports from a core module (the
    core's private modules themselves are how consumers import it: those count as public).

    What a consumer needs of a core object, the object offers publicly (a documented method or
    property); reaching into its privates ties the consumer to the core's insides. A name not
    bound by an import (a parameter, a local) is taken for an object of ours: it is one here.
    """
    files = module_files(sources)
    found = []
    for module, path in sorted(files.items()):
        if is_core(module) or path.suffix == ".pyi" or module.startswith(f"{PACKAGE}.kernels"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        bound = import_bindings(tree, module, files)
        private = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not _allowed_owner(node.value, bound, module, files)
        ]
        private += _private_imports(tree, module, files)
        private.sort(key=lambda node: (node.lineno, node.col_offset))
        found += [f"{module}:{node.lineno}: {ast.unparse(node)}" for node in private]
    return found


def _private_imports(tree: ast.Module, module: str, files: dict[str, Path]) -> list[ast.stmt]:
    package = module if is_package(module, files) else module.rpartition(".")[0]
    found: list[ast.stmt] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = from_source(node, package)
        core = owner(source, files)
        if core is None or not is_core(core):
            continue
        names = [alias.name for alias in node.names]
        if any(
            name.startswith("_") and not name.startswith("__") and f"{source}.{name}" not in files
            for name in names
        ):
            found.append(node)
    return found


def _allowed_owner(
    value: ast.expr, bound: dict[str, str], module: str, files: dict[str, Path]
) -> bool:
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
        return value.func.id == "super"
    if not isinstance(value, ast.Name):
        return False  # a chain (member.allocator._pool) or a call's result
    if value.id in ("self", "cls"):
        return True
    target = bound.get(value.id)
    if target is None:
        return False  # a parameter or a local: an object of ours
    ours = owner(target, files)
    return ours is None or (not is_core(ours) and room(ours) == room(module))


def _in_any(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _describe(cycle: list[str]) -> str:
    return " -> ".join(cycle)


# -- the package ------------------------------------------------------------------------------


def test_no_import_cycle_between_kvasync_modules() -> None:
    ours, _ = import_graph(SOURCES)
    found = cycles(ours)
    assert not found, "import cycles (TYPE_CHECKING and in-function imports count):\n" + "\n".join(
        _describe(cycle) for cycle in found
    )


def test_the_core_imports_no_consumer_and_no_consumer_library() -> None:
    ours, outside = import_graph(SOURCES)
    found = back_arrows(ours, outside)
    assert not found, "core modules importing a consumer:\n" + "\n".join(
        f"{module} imports {target}" for module, target in found
    )


def test_the_walk_sees_the_core_and_its_consumers() -> None:
    # Guards the walk itself: a wrong root or a broken resolver would find nothing to fail on.
    ours, outside = import_graph(SOURCES)
    assert "kvasync._loops" in ours["kvasync._allocator"]
    assert "kvasync._core" in ours["kvasync._allocator"]  # compiled: a leaf without source
    assert "kvasync.share._ledger" in ours["kvasync.share"]
    assert "kvasync.kernels" in ours["kvasync._block_ops"]  # an import inside a function
    assert "kvasync.kernels.block_copy" in ours["kvasync.kernels"]
    assert "click" in outside["kvasync.cli"]
    assert {"kvasync._allocator", "kvasync._sizes", "kvasync.testing"} <= {
        module for module in ours if is_core(module)
    }
    assert not is_core("kvasync.__main__") and not is_core("kvasync.share._cli")


def test_import_kvasync_loads_no_consumer_and_no_consumer_library() -> None:
    # The same rule at run time, in a fresh interpreter: what `import kvasync` really loads.
    # Every public name is touched: kvasync may load them on first use (PEP 562).
    code = (
        "import sys, kvasync\n"
        "for name in kvasync.__all__: getattr(kvasync, name)\n"  # public names load on first use
        "from kvasync import *\n"
        "print(' '.join(sorted(m for m in sys.modules if m.partition('.')[0] in sys.argv[1:]\n"
        "    or m.startswith('kvasync.'))))\n"
    )
    command = [sys.executable, "-c", code, *CONSUMER_LIBRARIES]
    loaded = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    modules = loaded.stdout.split()
    assert "kvasync._allocator" in modules  # the probe sees what was imported
    assert [m for m in modules if not is_core(m)] == []  # kvasync._core (compiled) is core


def test_no_consumer_reaches_into_a_private_attribute_of_a_core_object() -> None:
    found = private_accesses(SOURCES)
    assert not found, (
        "consumers using private attributes (give the core object a public method instead):\n"
        + "\n".join(found)
    )


# -- the checks fail when they should: a small package written for each case -------------------


def _package(tmp_path: Path, files: dict[str, str]) -> dict[Path, str]:
    root = tmp_path / PACKAGE
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {root: PACKAGE}


def test_a_cycle_through_a_type_checking_import_is_found_and_printed(tmp_path: Path) -> None:
    sources = _package(
        tmp_path,
        {
            "__init__.py": "",
            "_config.py": "from . import _names\n",
            "_names.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from ._config import Config\n"
            ),
        },
    )
    ours, _ = import_graph(sources)
    assert cycles(ours) == [["kvasync._config", "kvasync._names", "kvasync._config"]]


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path: Path) -> None:
    sources = _package(
        tmp_path,
        {
            "__init__.py": "",
            "sub/__init__.py": "from .. import _a\n",
            "_a.py": "import kvasync._b\n",
            "_b.py": "def f():\n    from kvasync.sub import x\n",
        },
    )
    ours, _ = import_graph(sources)
    assert cycles(ours) == [["kvasync._a", "kvasync._b", "kvasync.sub", "kvasync._a"]]


def test_a_package_without_cycles_passes(tmp_path: Path) -> None:
    sources = _package(
        tmp_path,
        {
            "__init__.py": "from ._a import A\nfrom . import sub\n",
            "_a.py": "from ._b import B\n",
            "_b.py": "",
            "sub/__init__.py": "from .._a import A\nfrom . import _c\n",
            "sub/_c.py": "from kvasync import _b\n",
        },
    )
    ours, _ = import_graph(sources)
    assert cycles(ours) == []
    assert ours["kvasync.sub"] == {"kvasync._a", "kvasync.sub._c"}


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("import click\n", "click"),
        ("def f():\n    from rich.table import Table\n", "rich"),
        ("from .serve import _engine\n", "kvasync.serve._engine"),
        ("from . import share\n", "kvasync.share"),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import fastapi\n", "fastapi"),
    ],
)
def test_a_core_module_importing_a_consumer_is_found(
    tmp_path: Path, source: str, target: str
) -> None:
    sources = _package(
        tmp_path,
        {
            "__init__.py": "",
            "_allocator.py": source,
            "serve/__init__.py": "",
            "serve/_engine.py": "import click\n",  # a consumer may use a consumer library
            "share/__init__.py": "",
        },
    )
    ours, outside = import_graph(sources)
    assert back_arrows(ours, outside) == [("kvasync._allocator", target)]


def test_a_consumer_reaching_into_a_core_objects_privates_is_found(tmp_path: Path) -> None:
    sources = _package(
        tmp_path,
        {
            "__init__.py": "",
            "_allocator.py": "_GRACE = 5.0\nclass Allocator:\n    _pool = None\n",
            "integrations/__init__.py": "",
            "integrations/metrics.py": (
                "from .. import _allocator\n"
                "from .._allocator import Allocator, _GRACE\n"  # a private name of the core
                "def register(allocator, member):\n"
                "    allocator._observe = member.observe\n"  # set on a parameter
                "    return member.allocator._pool.take_map_seconds()\n"  # through a chain
                "def grace():\n"
                "    return _allocator._GRACE\n"  # a core module's private name
            ),
        },
    )
    assert private_accesses(sources) == [
        "kvasync.integrations.metrics:2: from .._allocator import Allocator, _GRACE",
        "kvasync.integrations.metrics:4: allocator._observe",
        "kvasync.integrations.metrics:5: member.allocator._pool",
        "kvasync.integrations.metrics:7: _allocator._GRACE",
    ]


def test_privates_of_self_of_the_own_room_and_of_outside_libraries_pass(tmp_path: Path) -> None:
    sources = _package(
        tmp_path,
        {
            "__init__.py": "",
            "_allocator.py": "",
            "serve/__init__.py": "",
            "serve/_records.py": "def _helper():\n    pass\n",
            "serve/_engine.py": (
                "import os\n"
                "from .. import _allocator\n"  # a core module: how consumers import the core
                "from .._allocator import Allocator\n"
                "from ._records import _helper\n"  # a private name of its own room
                "from vllm.v1.core.block_pool import BlockPool\n"
                "from . import _records\n"
                "class Engine(BlockPool):\n"
                "    _limit = 1\n"
                "    def step(self):\n"
                "        _records._helper()\n"  # a module of its own room
                "        super()._maybe_evict_cached_block(self._limit)\n"
                "        return BlockPool._maybe_evict_cached_block, os._exit\n"
                "    @classmethod\n"
                "    def make(cls):\n"
                "        return cls._limit\n"
            ),
        },
    )
    assert private_accesses(sources) == []


# A module a newcomer can read through: the serving engine's grew to 627 lines doing two jobs
# (issue 29), split since. Others over it wait for their own split.
MAX_MODULE_LINES = 600
SIZED_FOLDERS = (ROOT / "src" / "kvasync" / "serve",)


def test_no_serve_module_is_over_600_lines() -> None:
    over = {
        str(path.relative_to(ROOT)): lines
        for folder in SIZED_FOLDERS
        for path in sorted(folder.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not over, f"split these (one job per module): {over}"
