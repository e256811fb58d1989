"""An allocator after fork() (Note [Fork] in _allocator): in the child, an allocator the parent
opened refuses every call at once, its close touches nothing, and one opened in the child works;
the parent's allocator, its data and its share's ledger entry are as they were.

Real processes: ``os.fork``, the child answering through a pipe, each wait with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch

import kvasync
from kvasync import share

LAYOUT = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
PER_PAGE = 512  # blocks of this layout in a 2 MiB page
PAGE_BYTES = (2 << 20) * LAYOUT.num_ranges
CHILD_TIMEOUT = 30.0


@pytest.fixture
def share_name() -> Iterator[str]:
    """A fresh share name; its ledger file (if any is left) is removed at the end."""
    chosen = f"test-fork-{uuid.uuid4().hex[:12]}"
    yield chosen
    if os.path.lexists(share.path(chosen)):
        os.unlink(share.path(chosen))


def in_child(body: Callable[[], object], timeout: float = CHILD_TIMEOUT) -> object:
    """Runs ``body`` in a forked child and returns what it returned (JSON).

    The child answers through a pipe; the parent waits for the answer and for the child's exit,
    each with a deadline, and kills a child that overstays (a hang fails the test, never the run).
    """
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        # This process has threads (mappers, loop threads): fork() warns that the child has none.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: answer, then leave without running the parent's cleanups
        os.close(read_end)
        try:
            answer = {"ok": body()}
        except BaseException as error:
            answer = {"error": "".join(traceback.format_exception(error))}
        os.write(write_end, json.dumps(answer).encode())
        os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + timeout
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([read_end], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"the forked child {pid} did not answer within {timeout} s (a hang)")
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        status = reap(pid, deadline)
    if not chunks:
        pytest.fail(f"the forked child {pid} died without an answer (wait status {status})")
    answer = json.loads(b"".join(chunks))
    if "error" in answer:
        pytest.fail(f"in the child:\n{answer['error']}")
    return answer["ok"]


def reap(pid: int, deadline: float) -> int:
    """Waits for the child's exit until ``deadline`` (plus a second), then kills it; returns its
    wait status."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline + 1.0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # killed: it is gone at once
            pytest.fail(f"the forked child {pid} did not exit in time")
        time.sleep(0.01)  # polling a child's exit: there is no event to wait on without a thread


def refusals(calls: dict[str, Callable[[], object]]) -> dict[str, str]:
    """Each call's outcome in the child: the AllocatorClosed message, or what happened instead."""
    outcomes = {}
    for name, call in calls.items():
        started = time.monotonic()
        try:
            result = call()
            outcomes[name] = f"returned {result!r}"
        except kvasync.AllocatorClosed as error:
            outcomes[name] = str(error)
        except BaseException as error:
            outcomes[name] = f"raised {type(error).__name__}: {error}"
        assert time.monotonic() - started < 1.0, f"{name} took {time.monotonic() - started} s"
    return outcomes


def inherited_calls(kv: kvasync.Allocator | kvasync.SyncAllocator, held: list[int]) -> dict:
    """Every method of an allocator the parent opened, as a call made in the child."""
    calls: dict[str, Callable[[], object]] = {
        "alloc_nowait": lambda: kv.alloc_nowait(4),
        "alloc_nowait_map": lambda: kv.alloc_nowait(3 * PER_PAGE),
        "available_blocks": kv.available_blocks,
        "set_demand": lambda: kv.set_demand(8),
        "drain_from": kv.drain_from,
        "free": lambda: kv.free(held[:2]),
        "gather": lambda: kv.gather(held[:2]),
        "zero": lambda: kv.zero(held[:2]),
        "scatter": lambda: kv.scatter(held[:1], torch.ones(kv.gather(held[:1]).shape)),
        "copy": lambda: kv.copy(held[:1], held[1:2]),
        "layer": lambda: kv.layer(0),
        "stats": kv.stats,
        "take_map_seconds": kv.take_map_seconds,
        "add_alloc_observer": lambda: kv.add_alloc_observer(lambda waited, seconds: None),
    }
    if isinstance(kv, kvasync.SyncAllocator):
        calls["alloc"] = lambda: kv.alloc(3 * PER_PAGE, timeout=5.0)
        calls["alloc_hot"] = lambda: kv.alloc(1, timeout=5.0)
        calls["trim"] = lambda: kv.trim(timeout=5.0)
        calls["resize"] = lambda: kv.resize(memory_limit=PAGE_BYTES, timeout=5.0)
    else:
        allocator = kv  # awaited on a loop of the child's own: the check comes first

        def awaited(make: Callable[[], object]) -> Callable[[], object]:
            return lambda: asyncio.run(make())  # type: ignore[arg-type]

        calls["alloc"] = awaited(lambda: allocator.alloc(3 * PER_PAGE, timeout=5.0))
        calls["alloc_hot"] = awaited(lambda: allocator.alloc(1, timeout=5.0))
        calls["trim"] = awaited(lambda: allocator.trim(timeout=5.0))
        calls["resize"] = awaited(lambda: allocator.resize(memory_limit=PAGE_BYTES, timeout=5.0))
    return calls


def check_refused(outcomes: dict[str, str], parent: int) -> None:
    for name, outcome in outcomes.items():
        assert outcome.startswith(f"this allocator was opened in process {parent};"), (
            name,
            outcome,
        )
        assert "a forked child must open its own allocator" in outcome, (name, outcome)


def ledger_view(name: str) -> set[tuple[int, str, int]]:
    return {(e.pid, e.name, e.committed_bytes) for e in share.snapshot(name)}


def share_config(share_name: str, name: str = "parent") -> kvasync.Config:
    return kvasync.Config(
        backend="host",
        max_blocks=8 * PER_PAGE,
        reserve_pages=(0, 0),
        share=share_name,
        device_budget=8 * PAGE_BYTES,
        name=name,
        default_timeout=5.0,
    )


def written(kv: kvasync.Allocator | kvasync.SyncAllocator, blocks: list[int]) -> torch.Tensor:
    """Writes a pattern into ``blocks`` and returns it: the parent reads it back after the child.

    A few blocks only: the kernels run in Triton's interpreter here, about 1 ms a program.
    """
    shape = kv.gather(blocks).shape
    pattern = torch.arange(shape.numel(), dtype=torch.float32) % 1000 + 1
    pattern = pattern.reshape(shape).to(LAYOUT.dtype)
    kv.scatter(blocks, pattern)
    return pattern


async def test_an_inherited_allocator_refuses_every_call_in_a_forked_child_and_the_parent_goes_on(
    share_name: str,
) -> None:
    async with kvasync.open_allocator(LAYOUT, share_config(share_name)) as kv:
        held = await kv.alloc(PER_PAGE + 4)  # two pages, charged to the share
        marked = held[:2] + held[-2:]  # in both pages
        pattern = written(kv, marked)
        stats_before = kv.stats()
        ledger_before = ledger_view(share_name)
        assert (os.getpid(), "parent", 2 * PAGE_BYTES) in ledger_before
        parent = os.getpid()

        def child() -> object:
            outcomes = refusals(inherited_calls(kv, held))
            started = time.monotonic()
            asyncio.run(kv.close(timeout=5.0))  # nothing here is the child's to close
            asyncio.run(kv.close(timeout=5.0))
            closed_in = time.monotonic() - started
            # The properties still describe it: they read no pool and wait for no thread.
            described = [kv.num_blocks, kv.page_size, kv.backend, kv.config.name]
            return {"outcomes": outcomes, "closed_in": closed_in, "described": described}

        answer = in_child(child)
        assert isinstance(answer, dict)
        check_refused(answer["outcomes"], parent)
        assert len(answer["outcomes"]) == 18
        assert answer["closed_in"] < 1.0
        assert answer["described"] == [8 * PER_PAGE, 2 << 20, "host", "parent"]
        # The parent's allocator, its data and its ledger entry are as they were, and it serves.
        assert ledger_view(share_name) == ledger_before
        assert kv.stats() == stats_before
        assert torch.equal(kv.gather(marked), pattern)
        more = await kv.alloc(2 * PER_PAGE)  # needs maps: the parent's mapper is alive
        assert ledger_view(share_name) == {(parent, "parent", 4 * PAGE_BYTES)}
        kv.free(held + more)
        await kv.trim(timeout=5.0)
        assert kv.stats().mapped_pages == 0


def test_an_inherited_blocking_allocator_refuses_in_a_forked_child_instead_of_hanging(
    share_name: str,
) -> None:
    # Issue 18: SyncAllocator.alloc of blocks that needed a map never returned in the child.
    with kvasync.open_allocator_sync(LAYOUT, share_config(share_name)) as kv:
        held = kv.alloc(PER_PAGE + 4, timeout=5.0)
        marked = held[:2] + held[-2:]  # in both pages
        pattern = written(kv, marked)
        stats_before = kv.stats()
        ledger_before = ledger_view(share_name)
        parent = os.getpid()

        def child() -> object:
            outcomes = refusals(inherited_calls(kv, held))
            started = time.monotonic()
            kv.close(timeout=5.0)  # neither the loop thread nor the pool is the child's
            kv.close(timeout=5.0)
            return {"outcomes": outcomes, "closed_in": time.monotonic() - started}

        answer = in_child(child)
        assert isinstance(answer, dict)
        check_refused(answer["outcomes"], parent)
        assert len(answer["outcomes"]) == 18
        assert answer["closed_in"] < 1.0
        assert ledger_view(share_name) == ledger_before
        assert kv.stats() == stats_before
        assert torch.equal(kv.gather(marked), pattern)
        more = kv.alloc(2 * PER_PAGE, timeout=5.0)
        kv.free(held + more)
        kv.trim(timeout=5.0)
        assert kv.stats().mapped_pages == 0
    assert not os.path.lexists(share.path(share_name))  # the parent's close left the share


def test_an_allocator_opened_in_a_forked_child_works_and_joins_the_share_as_the_child(
    share_name: str,
) -> None:
    with kvasync.open_allocator_sync(LAYOUT, share_config(share_name)) as kv:
        held = kv.alloc(4, timeout=5.0)
        ledger_before = ledger_view(share_name)

        def child() -> object:
            # Blocking, then asyncio: each opens its own threads in this process.
            with kvasync.open_allocator_sync(LAYOUT, share_config(share_name, "child")) as own:
                blocks = own.alloc(2 * PER_PAGE, timeout=5.0)  # two maps by the child's mapper
                seen = sorted(ledger_view(share_name))
                own.free(blocks)

            async def on_a_loop() -> int:
                async with kvasync.open_allocator(
                    LAYOUT, share_config(share_name, "child")
                ) as mine:
                    got = await mine.alloc(PER_PAGE + 1)
                    mine.free(got)
                    return len(got)

            return {"pid": os.getpid(), "seen": seen, "async": asyncio.run(on_a_loop())}

        answer = in_child(child)
        assert isinstance(answer, dict)
        parent_entry = [os.getpid(), "parent", PAGE_BYTES]
        assert answer["seen"] == sorted([parent_entry, [answer["pid"], "child", 2 * PAGE_BYTES]])
        assert answer["async"] == PER_PAGE + 1
        assert ledger_view(share_name) == ledger_before  # the child's entries left with it
        kv.free(held)


def test_registering_an_inherited_allocator_for_metrics_is_refused_and_changes_nothing() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvasync.integrations import metrics

    config = kvasync.Config(backend="host", max_blocks=8 * PER_PAGE, reserve_pages=(0, 0))
    with (
        kvasync.open_allocator_sync(LAYOUT, config) as kv,
        kvasync.open_allocator_sync(LAYOUT, config) as other,
    ):
        registry = CollectorRegistry()
        metrics.register(other, registry, name="other")

        def child() -> object:
            # A scrape in the child (a forked web worker's /metrics) skips the parent's
            # allocators instead of failing, and reports one of the child's own.
            before = generate_latest(registry).decode()
            try:
                metrics.register(kv, registry, name="inherited")
                refused = ""
            except kvasync.AllocatorClosed as error:
                refused = str(error)
            same = generate_latest(registry).decode() == before
            with kvasync.open_allocator_sync(LAYOUT, config) as own:
                metrics.register(own, registry, name="own")
                held = own.alloc(3, timeout=5.0)
                text = generate_latest(registry).decode()
                own.free(held)
            return {"refused": refused, "same": same, "before": before, "after": text}

        answer = in_child(child)
        assert isinstance(answer, dict)
        assert "a forked child must open its own allocator" in answer["refused"]
        assert answer["same"], "the refused registration left samples behind"
        # Its gauges and counters (read from the allocator) are not reported there; its
        # histograms are this registry's own memory, copied by the fork, and stay as they were.
        assert 'kvasync_used_blocks{allocator="other"}' not in answer["before"]
        assert 'kvasync_used_blocks{allocator="own"} 3.0' in answer["after"]
        # In the parent, the same registry still reports its allocator.
        assert 'kvasync_used_blocks{allocator="other"} 0.0' in generate_latest(registry).decode()
