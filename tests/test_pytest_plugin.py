"""The pytest plugin, run in a fresh pytest (pytester) in each mode its users run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

USER_TESTS = """
import re
from pathlib import Path

import pytest
import kvasync

{marker}
async def test_alloc_and_free(kv_allocator):
    async with kv_allocator() as kv:
        blocks = await kv.alloc(8)
        assert kv.backend == "host" and kv.num_blocks == 2048
        kv.free(blocks)

{marker}
async def test_overrides_and_faults(kv_allocator, kv_faults):
    # The README's example: the hang is left on. The close must not wait for the hung map (it
    # would for default_timeout, past the run's --timeout): the plugin releases it first.
    async with kv_allocator(max_blocks=64, reserve_pages=(0, 0), default_timeout=60.0) as kv:
        assert kv.num_blocks == 64
        kv_faults.hang()
        with pytest.raises(kvasync.AllocTimeout):
            await kv.alloc(4, timeout=0.05)
        assert kv_faults.hung_maps == 1
    assert kv_faults.hung_maps == 0

@pytest.mark.kvasync_backend("cuda")
{marker}
async def test_cuda_marker_selects_cuda(kv_allocator):
    async with kv_allocator() as kv:
        assert kv.backend == "cuda"
"""


def run(pytester: pytest.Pytester, marker: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_user=USER_TESTS.format(marker=marker))
    return pytester.runpytest("-p", "no:cacheprovider", "-q", "--timeout=20", *args)


SYNC_USER_TESTS = """
import re
from pathlib import Path

import pytest
import kvasync

def test_alloc_and_free(kv_allocator_sync):
    with kv_allocator_sync() as kv:
        assert isinstance(kv, kvasync.SyncAllocator)
        blocks = kv.alloc(8, timeout=5.0)
        assert kv.backend == "host" and kv.num_blocks == 2048
        kv.free(blocks)

def test_a_hang_left_on_is_released_before_the_close(kv_allocator_sync, kv_faults):
    with kv_allocator_sync(max_blocks=64, reserve_pages=(0, 0), default_timeout=60.0) as kv:
        kv_faults.hang()
        with pytest.raises(kvasync.AllocTimeout):
            kv.alloc(4, timeout=0.05)
        assert kv_faults.hung_maps == 1
    assert kv_faults.hung_maps == 0
"""


def test_the_sync_fixture_works_in_plain_pytest_without_an_async_plugin(pytester):
    # Issue 18: the README's async example fails under plain pytest (no pytest-asyncio, no
    # anyio): kv_allocator_sync serves a plain test.
    pytester.makepyfile(test_user=SYNC_USER_TESTS)
    result = pytester.runpytest(
        "-p", "no:cacheprovider", "-q", "--timeout=20", "-p", "no:asyncio", "-p", "no:anyio"
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 2, result.stdout.str()
    assert "failed" not in outcomes and "errors" not in outcomes


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_the_fixtures_work_in_each_pytest_asyncio_mode(pytester, mode):
    marker = "@pytest.mark.asyncio" if mode == "strict" else ""
    result = run(
        pytester,
        marker,
        "-o",
        f"asyncio_mode={mode}",
        "-o",
        "asyncio_default_fixture_loop_scope=function",
        "-p",
        "no:anyio",
    )
    # The cuda test skips on a machine without a GPU, and passes on one.
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 3, result.stdout.str()
    assert outcomes.get("passed", 0) >= 2 and "failed" not in outcomes and "errors" not in outcomes


def test_the_fixtures_work_under_anyios_plugin_on_asyncio_and_trio(pytester):
    pytester.makeconftest(
        "import pytest\n"
        "@pytest.fixture(params=['asyncio', 'trio'])\n"
        "def anyio_backend(request):\n"
        "    return request.param\n"
    )
    result = run(pytester, "@pytest.mark.anyio", "-p", "no:asyncio")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 4 and "failed" not in outcomes, result.stdout.str()


def test_the_backend_option_is_validated_by_name(pytester):
    result = run(pytester, "", "--kvasync-backend=tpu")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--kvasync-backend*invalid choice*tpu*"])


# The manual's pytest-plugin example (docs/testing.md includes it whole).
PLUGIN_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "test_with_kvasync.py"


def test_the_manuals_plugin_example_passes_as_written(pytester):
    # Issue 18: the README's example failed under plain pytest (an async test, no plugin named).
    # Its sync tests pass with no async plugin at all; all of it with pytest-asyncio, strict mode.
    pytester.makepyfile(test_example=PLUGIN_EXAMPLE.read_text())
    result = pytester.runpytest(
        "-p",
        "no:cacheprovider",
        "-q",
        "--timeout=20",
        "-p",
        "no:asyncio",
        "-p",
        "no:anyio",
        "-k",
        "not asyncio and not slow",
    )
    assert result.parseoutcomes().get("passed") == 2, result.stdout.str()
    result = pytester.runpytest(
        "-p",
        "no:cacheprovider",
        "-q",
        "--timeout=20",
        "-p",
        "no:anyio",
        "-o",
        "asyncio_mode=strict",
        "-o",
        "asyncio_default_fixture_loop_scope=function",
        "test_example.py",
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 3 and "failed" not in outcomes, result.stdout.str()
