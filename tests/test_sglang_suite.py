"""tests/sglang_suite.py's own logic (``make sglang-test``), with no SGLang: SGLang's test files
checked against the manifest, SGLang's pins taken for what the venv installs, and outcomes read
per unittest class."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import sglang_suite
import tomllib
from sglang_suite import SetupError, Suite


def lay_out(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


@pytest.fixture
def manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, bytes]:
    """A manifest of two files for release 9.9.9, in a support folder of its own."""
    files = {"test/a/test_one.py": b"def test_x(): pass\n", "test/a/test_two.py": b"# two\n"}
    support = tmp_path / "support"
    support.mkdir()
    entries = "".join(
        f'[[file]]\npath = "{name}"\ncommit = "{"0" * 40}"\n'
        f'sha256 = "{hashlib.sha256(data).hexdigest()}"\n\n'
        for name, data in files.items()
    )
    (support / "sglang-9.9.9-tests.toml").write_text(entries)
    monkeypatch.setattr(sglang_suite, "SUPPORT", support)
    return files


def test_the_manifests_files_are_the_suites_files(
    tmp_path: Path, manifest: dict[str, bytes]
) -> None:
    lay_out(tmp_path / "tests", manifest)
    assert sglang_suite.check_tests("9.9.9", tmp_path / "tests") == list(manifest)


def test_a_missing_or_changed_test_file_is_refused_naming_each(
    tmp_path: Path, manifest: dict[str, bytes]
) -> None:
    lay_out(tmp_path / "tests", {"test/a/test_one.py": b"def test_x(): assert False\n"})
    with pytest.raises(SetupError) as refused:
        sglang_suite.check_tests("9.9.9", tmp_path / "tests")
    message = str(refused.value)
    assert "test/a/test_one.py differs from the manifest's sha256" in message
    assert "test/a/test_two.py is missing" in message
    assert "--sglang-tests" in message


def test_a_release_without_a_manifest_is_refused(manifest: dict[str, bytes]) -> None:
    with pytest.raises(SetupError, match=r"no manifest of SGLang 1\.0\.0's tests"):
        sglang_suite.check_tests("1.0.0", Path("."))


def test_the_shipped_manifest_lists_sglangs_allocator_and_radix_cache_tests() -> None:
    shipped = tomllib.loads((sglang_suite.SUPPORT / "sglang-0.5.17-tests.toml").read_text())
    names = {Path(entry["path"]).name for entry in shipped["file"]}
    assert {"test_paged_allocator.py", "test_radix_cache_unit.py"} <= names
    assert all(
        len(entry["sha256"]) == 64 and len(entry["commit"]) == 40 for entry in shipped["file"]
    )


def test_sglangs_own_pins_are_taken_and_an_undeclared_name_is_kept_as_is() -> None:
    requirements = ["openai==2.6.1", "xgrammar==0.2.1", "IPython", "pyzmq>=25.1.2"]
    wanted = ["openai", "ipython", "pyzmq", "dill"]
    assert sglang_suite.pinned(requirements, wanted) == [
        "openai==2.6.1",
        "IPython",
        "pyzmq>=25.1.2",
        "dill",
    ]


def test_outcomes_keep_the_unittest_class_that_shares_a_test_name(tmp_path: Path) -> None:
    lay_out(tmp_path, {"test/unit/test_radix.py": b""})
    (tmp_path / "plugin.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="test.unit.test_radix.TestKey" name="test_init" />'
        '<testcase classname="test.unit.test_radix.TestNode" name="test_init">'
        '<failure message="x" /></testcase>'
        '<testcase classname="test.unit.test_radix" name="test_free[3]">'
        '<skipped message="no CUDA" /></testcase>'
        "</testsuite></testsuites>"
    )
    suite = Suite("plugin")
    sglang_suite.read_outcomes(suite, tmp_path, tmp_path)
    assert suite.outcomes == {
        "test/unit/test_radix.py::TestKey::test_init": "passed",
        "test/unit/test_radix.py::TestNode::test_init": "failed",
        "test/unit/test_radix.py::test_free[3]": "skipped",
    }
    assert suite.skip_reasons == {"test/unit/test_radix.py::test_free[3]": "no CUDA"}
