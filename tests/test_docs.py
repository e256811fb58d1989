"""The README and the manual (docs/) show only code that runs, and the manual maps the code.

- Every fenced block is a shell session (console, shell), plain text (a diagram, an output), or
  code included from examples/ (the manual: ``--8<-- "examples/x.py"``; the README: a block
  identical to a file there). tests/test_examples.py runs every file in examples/.
- Every design note named in the code is on the architecture page.
- The README stays the front door: at most 200 lines.

``mkdocs build --strict`` (in ``make test``) checks the links and the API references.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
SHELL = {"console", "shell", "text"}
SNIPPET = re.compile(r'--8<-- "(examples/[^"]+)"')
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
NOTE = re.compile(r"Note \[([^\]]+)\]")
# A note renamed or folded into another is named in a comment as "was Note [X]".
RETIRED_NOTE = re.compile(r"was Note \[([^\]]+)\]")


def fenced_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line, language, body) of each fenced block, the body dedented by its fence's indent."""
    blocks: list[tuple[int, str, str]] = []
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, language = len(opening.group(1)), opening.group(2)
        body: list[str] = []
        index += 1
        while index < len(lines) and lines[index].strip() != "```":
            body.append(lines[index][indent:])
            index += 1
        assert index < len(lines), f"{path}: a fence opened and never closed"
        blocks.append((index - len(body), language, "\n".join(body) + "\n"))
        index += 1
    return blocks


@pytest.mark.parametrize("page", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_block_of_the_manual_is_an_example_or_a_shell_session(page: Path) -> None:
    for line, language, body in fenced_blocks(page):
        if language in SHELL:
            continue
        included = SNIPPET.findall(body)
        where = f"{page.relative_to(ROOT)}:{line}"
        assert included, f"{where}: a {language or 'bare'} block that no test runs"
        assert body.strip() == "\n".join(f'--8<-- "{name}"' for name in included), where
        for name in included:
            assert (ROOT / name).is_file(), f"{where}: {name} does not exist"


def test_every_block_of_the_readme_is_an_example_verbatim_or_a_shell_session() -> None:
    examples = {path.read_text(): path.name for path in EXAMPLES.glob("*.py")}
    python_blocks = 0
    for line, language, body in fenced_blocks(README):
        if language in SHELL:
            continue
        assert language == "python", f"README.md:{line}: a {language or 'bare'} block"
        assert body in examples, f"README.md:{line}: not identical to any file in examples/"
        python_blocks += 1
    assert python_blocks >= 1, "the README shows one example that runs"


def test_the_readme_is_at_most_200_lines() -> None:
    assert len(README.read_text().splitlines()) <= 200


def note_names(pattern: re.Pattern[str], text: str) -> set[str]:
    """The notes ``pattern`` finds, a name broken over comment lines joined again."""
    return {
        " ".join(part.strip().lstrip("/#").strip() for part in raw.splitlines())
        for raw in pattern.findall(text)
    }


def test_every_design_note_in_the_code_is_on_the_architecture_page() -> None:
    sources = [
        path
        for folder in ("csrc", "src", "kernels")
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".h", ".cpp", ".py", ".pyi"}
    ]
    named: set[str] = set()
    for path in sources:
        text = path.read_text()
        named |= note_names(NOTE, text) - note_names(RETIRED_NOTE, text)
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = sorted(
        name for name in named if f"| {name} |" not in page and f"[{name}]" not in page
    )
    assert not missing, f"notes named in the code but not in docs/architecture.md: {missing}"
