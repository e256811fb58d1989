"""Every public call, fed bad arguments: a clear error naming the argument, and nothing changes.

Note [Argument fuzzing]
~~~~~~~~~~~~~~~~~~~~~~~
For each argument of each public call, the bad values are generated from the argument's kind
(a count, seconds, a deadline, block ids, a flag, ...): wrong types, bools, negatives, values
past int64, NaN and infinities, floats, None, nested containers, sets and dicts, tensors and arrays
of the wrong dtype, shape or device. Each call must raise TypeError, ValueError or a KVAsyncError
(IndexError for a layer index, as indexing does) whose message names the argument, never
pybind11's signature dump, and must leave the allocator as it was: the same counters, the same
allocated ids, the same data in them, still open. A silent acceptance, a wrong exception, an
unnamed argument or a changed state is a failure; every problem is listed at once.

The calls the fuzzing found wrong before issue 7 are in ``test_the_issue_7_cases``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvasync
from kvasync.testing import FaultInjector

LAYOUT = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
PAGE_SIZE = 64 << 10  # 16 blocks of 4 KiB per page
NUM_BLOCKS = 256
ARGUMENT_ERRORS = (TypeError, ValueError, kvasync.KVAsyncError)
CALL_TIMEOUT_S = 5.0  # a bad value accepted as a long wait must not hang the test


def config(**overrides: Any) -> kvasync.Config:
    settings: dict[str, Any] = {
        "backend": "host",
        "max_blocks": NUM_BLOCKS,
        "page_size": PAGE_SIZE,
        "reserve_pages": (0, 0),  # nothing changes in the background between snapshots
    }
    settings.update(overrides)
    return kvasync.Config(**settings)


# -- bad values by kind ---------------------------------------------------------------------

BOOLS: list[object] = [True, False, np.bool_(True)]
NOT_NUMBERS: list[object] = [
    "1",
    b"1",
    [1],
    (1,),
    [[1]],
    {1: 1},
    {1},
    object(),
    1 + 1j,
    torch.tensor([1.0, 2.0]),
    np.array([1, 2]),
]


def bad_counts(*, none_ok: bool = False) -> list[object]:
    """For a positive int (a number of blocks or failures)."""
    values: list[object] = [*BOOLS, *NOT_NUMBERS, 0, -1, -(2**63), 2**63, 2**70]
    values += [1.0, 1.5, math.nan, math.inf, np.float64(2.0), torch.tensor(1.5)]
    return values if none_ok else [*values, None]


def bad_seconds(*, none_ok: bool) -> list[object]:
    """For a timeout, a delay: a finite real number >= 0."""
    values: list[object] = [*BOOLS, *NOT_NUMBERS, -1, -0.001, -1e300, math.nan, math.inf]
    values += [-math.inf, np.float64(math.nan), torch.tensor(1.0)]
    return values if none_ok else [*values, None]


def bad_flags() -> list[object]:
    return [1, 0, "yes", "", None, 1.0, [True]]


def bad_ids(held: list[int], not_held: int, *, repeats_ok: bool = False) -> list[object]:
    """For block ids to free, read or write: a sequence of allocated ints or a 1-D int tensor.

    ``repeats_ok``: a repeated id is valid (reading or zeroing a block twice is harmless).
    """
    first = held[0]
    values: list[object] = [
        None,
        first,
        True,
        "12",
        b"\x01",
        {first: 1},  # a dict would free its keys
        {first},
        frozenset(held),
        iter(held),
        [True],
        [float(first)],
        [None],
        [[first]],
        [str(first)],
        [-1],
        [NUM_BLOCKS],
        [2**63],
        [2**70],
        [not_held],
        [first, not_held],  # one bad id: the good one is not freed either
        torch.tensor([[first]]),
        torch.tensor([float(first)]),
        torch.tensor([True]),
        torch.tensor([first], device="meta"),
        np.array([[first]]),
        np.array([float(first)]),
    ]
    return values if repeats_ok else [*values, [first, first]]


# -- running a case ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One call with one bad argument."""

    label: str
    call: Callable[[], object]
    names: tuple[str, ...]  # the message must contain one of these
    errors: tuple[type[BaseException], ...] = ARGUMENT_ERRORS


async def outcome(case: Case) -> str | None:
    """What is wrong with how the call handled the bad value, or None when it was right."""
    try:
        result = case.call()
        if inspect.isawaitable(result):
            result = await asyncio.wait_for(result, CALL_TIMEOUT_S)
    except kvasync.AllocTimeout as error:  # it waited, so the bad value was taken for a good one
        return f"{case.label}: waited and timed out ({error})"
    except case.errors as error:
        message = str(error)
        if "incompatible function arguments" in message:
            return f"{case.label}: pybind11's signature dump: {message[:80]!r}"
        if not any(name in message for name in case.names):
            return f"{case.label}: {type(error).__name__} names none of {case.names}: {message!r}"
        return None
    except TimeoutError:
        return f"{case.label}: still running after {CALL_TIMEOUT_S} s"
    except Exception as error:
        return f"{case.label}: wrong exception {type(error).__name__}: {error}"
    # Not repr(result): a view over unmapped blocks would fault when printed.
    shown = repr(result) if isinstance(result, list | int | None) else type(result).__name__
    return f"{case.label}: accepted silently, returned {shown:.80}"


def allocated_ids(kv: kvasync.Allocator) -> frozenset[int]:
    every = list(range(kv.num_blocks))
    missing = set(kv._pool.unallocated(every))
    return frozenset(b for b in every if b not in missing)


def snapshot(kv: kvasync.Allocator, held: list[int]) -> tuple[object, ...]:
    stats = replace(kv.stats(), mapper_op_age=0.0)  # the only field that moves by itself
    is_open = kv._closing is None
    # Once closed, the blocks are unmapped: reading them would fault (SIGSEGV on host).
    buffers = kv.layer(0) + kv.layer(1) if is_open else ()
    data = tuple(buffer[b].clone() for buffer in buffers for b in held)
    return stats, allocated_ids(kv), data, is_open


def same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    stats_a, ids_a, data_a, open_a = a
    stats_b, ids_b, data_b, open_b = b
    equal_data = len(data_a) == len(data_b) and all(map(torch.equal, data_a, data_b))  # type: ignore[arg-type]
    return stats_a == stats_b and ids_a == ids_b and equal_data and open_a == open_b


async def check_all(kv: kvasync.Allocator, held: list[int], cases: Iterable[Case]) -> None:
    """Runs every case; fails listing each one mishandled or that changed the allocator."""
    problems = []
    ran = 0
    for case in cases:
        before = snapshot(kv, held)
        problem = await outcome(case)
        ran += 1
        if problem is not None:
            problems.append(problem)
        if not same(before, snapshot(kv, held)):
            problems.append(f"{case.label}: the allocator changed")
            break  # later snapshots would compare against a changed state
    assert ran > 0
    assert not problems, f"{len(problems)} of {ran} bad calls mishandled:\n" + "\n".join(problems)


async def open_with_data() -> tuple[kvasync.Allocator, list[int], int]:
    """An allocator holding a few blocks of known data, and a block it does not hold."""
    kv = await kvasync.Allocator.open(LAYOUT, config())
    held = await kv.alloc(3, timeout=5.0)
    for i, buffer in enumerate(kv.layer(0) + kv.layer(1)):
        for j, block in enumerate(held):
            buffer[block].fill_(i * 10 + j + 1)
    not_held = next(b for b in range(kv.num_blocks) if b not in held)
    return kv, held, not_held


def cases_for(
    label: str, values: Iterable[object], call: Callable[[object], object], *names: str
) -> list[Case]:
    return [Case(f"{label} <- {value!r:.40}", _bind(call, value), names) for value in values]


def _bind(call: Callable[[object], object], value: object) -> Callable[[], object]:
    return lambda: call(value)


# -- the allocator's methods ------------------------------------------------------------------


async def test_alloc_and_alloc_nowait_reject_bad_counts_timeouts_and_deadlines() -> None:
    kv, held, _ = await open_with_data()
    try:
        loop = asyncio.get_running_loop()
        counts = [*bad_counts(), NUM_BLOCKS + 1]
        cases = cases_for("alloc(n)", counts, lambda v: kv.alloc(v, timeout=1.0), "n")  # type: ignore[arg-type]
        cases += cases_for("alloc_nowait(n)", counts, kv.alloc_nowait, "n")  # type: ignore[arg-type]
        timeouts = bad_seconds(none_ok=True)
        cases += cases_for("alloc(timeout)", timeouts, lambda v: kv.alloc(1, timeout=v), "timeout")  # type: ignore[arg-type]
        cases += cases_for(
            "alloc(deadline)",
            [*timeouts, -(10**9)],
            lambda v: kv.alloc(1, deadline=v),  # type: ignore[arg-type]
            "deadline",
        )
        both = Case(
            "alloc(timeout and deadline)",
            lambda: kv.alloc(1, timeout=1.0, deadline=loop.time() + 1.0),
            ("timeout",),
        )
        await check_all(kv, held, [*cases, both])
    finally:
        await kv.close(timeout=5.0)


async def test_free_rejects_bad_ids_and_frees_nothing() -> None:
    kv, held, not_held = await open_with_data()
    try:
        ids = bad_ids(held, not_held)
        cases = cases_for("free(ids)", ids, kv.free, "ids", "block")  # type: ignore[arg-type]
        after = [object(), "stream", 1, torch.zeros(1)]
        cases += cases_for("free(after)", after, lambda v: kv.free(held[:1], after=v), "after")
        await check_all(kv, held, cases)
    finally:
        await kv.close(timeout=5.0)


async def test_trim_resize_and_close_reject_bad_timeouts_and_limits() -> None:
    kv, held, _ = await open_with_data()
    try:
        page_bytes = kv.stats().page_bytes
        timeouts = bad_seconds(none_ok=True)
        cases = cases_for("trim(timeout)", timeouts, lambda v: kv.trim(timeout=v), "timeout")  # type: ignore[arg-type]
        cases += cases_for(
            "trim(release_handles)",
            [1, 0, None, "yes"],
            lambda v: kv.trim(release_handles=v),  # type: ignore[arg-type]
            "release_handles",
        )
        limits = [*bad_counts(none_ok=True), 1, page_bytes - 1]
        cases += cases_for(
            "resize(memory_limit)",
            limits,
            lambda v: kv.resize(memory_limit=v, timeout=1.0),  # type: ignore[arg-type]
            "memory_limit",
        )
        cases += cases_for(
            "resize(timeout)",
            timeouts,
            lambda v: kv.resize(memory_limit=None, timeout=v),  # type: ignore[arg-type]
            "timeout",
        )
        cases += cases_for("close(timeout)", timeouts, lambda v: kv.close(timeout=v), "timeout")  # type: ignore[arg-type]
        await check_all(kv, held, cases)
    finally:
        await kv.close(timeout=5.0)


async def test_layer_rejects_bad_indices() -> None:
    kv, held, _ = await open_with_data()
    try:
        indices = [*BOOLS, 1.0, "0", None, [0], torch.tensor([0, 1]), -1, 2, 2**70, -(2**70)]
        cases = [
            replace(case, errors=(*ARGUMENT_ERRORS, IndexError))
            for case in cases_for("layer(index)", indices, kv.layer, "index")  # type: ignore[arg-type]
        ]
        await check_all(kv, held, cases)
    finally:
        await kv.close(timeout=5.0)


async def test_block_operations_reject_bad_ids_and_tensors_and_write_nothing() -> None:
    kv, held, not_held = await open_with_data()
    try:
        ids = bad_ids(held, not_held)
        readable = bad_ids(held, not_held, repeats_ok=True)
        shape = (1, LAYOUT.num_layers, LAYOUT.kv_buffers, 16, 2, 64)
        good = torch.ones(shape, dtype=torch.float16)
        tensors: list[object] = [
            None,
            1.0,
            [[1.0]],
            good.numpy(),
            good.float(),
            good[..., :32],
            torch.ones(2, *shape[1:], dtype=torch.float16),
            torch.ones(shape[::-1], dtype=torch.float16).permute(5, 4, 3, 2, 1, 0),
            torch.ones(shape, dtype=torch.float16, device="meta"),
        ]
        cases = cases_for("gather(ids)", readable, kv.gather, "ids")  # type: ignore[arg-type]
        cases += cases_for("zero(ids)", readable, kv.zero, "ids")  # type: ignore[arg-type]
        cases += cases_for("scatter(ids)", ids, lambda v: kv.scatter(v, good), "ids", "src")  # type: ignore[arg-type]
        cases += cases_for("copy(src_ids)", readable, lambda v: kv.copy(v, [held[2]]), "src_ids")  # type: ignore[arg-type]
        cases += cases_for("copy(dst_ids)", ids, lambda v: kv.copy([held[0]], v), "dst_ids")  # type: ignore[arg-type]
        cases += cases_for("gather(out)", tensors[1:], lambda v: kv.gather(held[:1], v), "out")  # type: ignore[arg-type]
        cases += cases_for("scatter(src)", tensors, lambda v: kv.scatter(held[:1], v), "src")  # type: ignore[arg-type]
        await check_all(kv, held, cases)
    finally:
        await kv.close(timeout=5.0)


# -- construction -----------------------------------------------------------------------------

LAYOUT_FIELDS = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}


def layout_cases() -> list[Case]:
    cases = []
    for name in LAYOUT_FIELDS:
        for value in [*bad_counts(), 2**40]:
            fields = {**LAYOUT_FIELDS, name: value}
            cases.append(
                Case(f"KVLayout({name}={value!r:.40})", _make(kvasync.KVLayout, fields), (name,))
            )
    others: dict[str, list[object]] = {
        "kv_buffers": [2.0, 1.0, True, 3, 0, -1, "2", None, 2**70],
        "dtype": ["float16", torch.float64, torch.int64, None, np.float16, 1],
        "contiguous": bad_flags(),
    }
    for name, values in others.items():
        for value in values:
            fields = {**LAYOUT_FIELDS, name: value}
            cases.append(
                Case(f"KVLayout({name}={value!r:.40})", _make(kvasync.KVLayout, fields), (name,))
            )
    return cases


CONFIG_BAD: dict[str, list[object]] = {
    "backend": ["tpu", "", "HOST", None, 1, b"host", ["host"]],
    "max_blocks": bad_counts(),
    "memory_limit": bad_counts(none_ok=True),
    "page_size": [0, -4096, 4095, 4097, True, 4096.0, "4096", 2**70, [4096]],
    "reserve_pages": [
        (1,),
        (1, 2, 3),
        [1, 4],
        (4, 1),
        (-1, 1),
        (0, 2**70),
        (True, 4),
        (1.0, 4),
        (0, math.nan),
        None,
        "14",
        {1: 4},
    ],
    "default_timeout": [*bad_seconds(none_ok=False), 0, 0.0],
    "zero_on_alloc": bad_flags(),
    "faults": [object(), FaultInjector, True, {}, "x", 1],
    "device": [-1, True, 1.5, "0", None, 2**40, [0]],
    "gpu_utilization": [0, -0.1, 1.01, math.nan, math.inf, True, "0.5", None, [0.5]],
}


def config_cases() -> list[Case]:
    return [
        Case(f"Config({name}={value!r:.40})", _make(kvasync.Config, {name: value}), (name,))
        for name, values in CONFIG_BAD.items()
        for value in values
    ]


def _make(kind: Callable[..., object], fields: dict[str, object]) -> Callable[[], object]:
    return lambda: kind(**fields)


@pytest.mark.parametrize("cases", [layout_cases, config_cases], ids=["KVLayout", "Config"])
async def test_layout_and_config_reject_bad_fields_at_construction(
    cases: Callable[[], list[Case]],
) -> None:
    problems = [problem for case in cases() if (problem := await outcome(case)) is not None]
    assert not problems, "\n".join(problems)


async def test_opening_rejects_what_is_not_a_layout_or_a_config() -> None:
    layouts: list[object] = [None, {}, {"num_layers": 2}, "layout", config(), 1, kvasync.KVLayout]
    configs: list[object] = [
        {},
        {"backend": "host"},
        "host",
        True,
        object(),
        LAYOUT,
        kvasync.Config,
    ]
    loops: list[object] = [None, "loop", object(), asyncio.new_event_loop]
    opened: list[kvasync.Allocator] = []

    async def open_allocator(layout: object, settings: object) -> None:
        async with kvasync.open_allocator(layout, settings) as kv:  # type: ignore[arg-type]
            opened.append(kv)

    async def open_on(loop: object) -> None:
        opened.append(kvasync.Allocator(LAYOUT, config(), loop))  # type: ignore[arg-type]

    cases = cases_for(
        "open_allocator(layout)", layouts, lambda v: open_allocator(v, config()), "layout"
    )
    cases += cases_for(
        "open_allocator(config)", configs, lambda v: open_allocator(LAYOUT, v), "config"
    )
    cases += cases_for(
        "Allocator.open(layout)", layouts, lambda v: kvasync.Allocator.open(v, None), "layout"
    )  # type: ignore[arg-type]
    cases += cases_for(
        "Allocator.open(config)", configs, lambda v: kvasync.Allocator.open(LAYOUT, v), "config"
    )  # type: ignore[arg-type]
    cases += cases_for("Allocator(loop)", loops, open_on, "loop")
    problems = [problem for case in cases if (problem := await outcome(case)) is not None]
    for kv in opened:
        await kv.close(timeout=5.0)
    assert not problems, "\n".join(problems)
    assert not opened


async def test_fault_injector_rejects_bad_delays_and_counts() -> None:
    faults = FaultInjector()
    cases = cases_for("delay(seconds)", bad_seconds(none_ok=False), faults.delay, "seconds")  # type: ignore[arg-type]
    cases += cases_for("fail(count)", bad_counts(), faults.fail, "count")  # type: ignore[arg-type]
    problems = [problem for case in cases if (problem := await outcome(case)) is not None]
    assert not problems, "\n".join(problems)


# -- the cases issue 7 reported, each pinned by name ------------------------------------------


async def test_the_issue_7_cases() -> None:
    kv, held, _ = await open_with_data()
    try:
        before = snapshot(kv, held)
        with pytest.raises(TypeError, match=r"n .* bool"):
            await kv.alloc(True)
        with pytest.raises(TypeError, match=r"timeout .* bool"):
            await kv.alloc(1, timeout=True)
        with pytest.raises(ValueError, match=r"n \(the number of blocks\) must be <="):
            await kv.alloc(2**63)
        with pytest.raises(ValueError, match="deadline"):
            await kv.alloc(1, deadline=-1.0)
        with pytest.raises(TypeError, match=r"ids .* dict"):
            kv.free({held[0]: 0})
        with pytest.raises(ValueError, match="ids must be a 1-D"):
            kv.free(torch.tensor([held[:2]]))
        assert same(before, snapshot(kv, held))
    finally:
        await kv.close(timeout=5.0)
    with pytest.raises(TypeError, match=r"KVLayout\.kv_buffers"):
        kvasync.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=1, kv_buffers=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Config\.zero_on_alloc"):
        kvasync.Config(zero_on_alloc=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Config\.reserve_pages\[1\]"):
        kvasync.Config(reserve_pages=(0, 2**70))
    with pytest.raises(TypeError, match=r"Config\.faults"):
        kvasync.Config(faults=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layout"):
        await kvasync.Allocator.open(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        await kvasync.Allocator.open(LAYOUT, {})  # type: ignore[arg-type]


# -- a wrong type is a TypeError, a wrong value a ValueError (issue 27) -----------------------

WRONG_TYPES: list[object] = ["5", 1.5, True, None, np.bool_(True), [5], torch.tensor(5.0)]


def argument_type_cases(kv: kvasync.Allocator, held: list[int]) -> list[Case]:
    """Each public call's parameters, fed wrong types (only a TypeError passes) then wrong values
    of the right type (only a ValueError passes)."""
    sync = kvasync.SyncAllocator(kv)  # argument checks run before its thread check
    good = kv.gather(held[:1])
    cases: list[Case] = []

    def add(
        label: str,
        call: Callable[[Any], object],
        names: tuple[str, ...],
        *,
        types: Iterable[object] = (),
        values: Iterable[object] = (),
    ) -> None:
        for error, bad in ((TypeError, types), (ValueError, values)):
            for value in bad:
                case = Case(f"{label} <- {value!r:.40}", _bind(call, value), names, (error,))
                cases.append(case)

    add("set_demand", kv.set_demand, ("blocks",), types=WRONG_TYPES, values=[-1, 2**63])
    add("sync set_demand", sync.set_demand, ("blocks",), types=WRONG_TYPES, values=[-1])
    ints = [v for v in WRONG_TYPES if v is not None]  # None is "no limit" there
    add("free_block_ids", kv.free_block_ids, ("limit",), types=ints, values=[-1])
    add("sync free_block_ids", sync.free_block_ids, ("limit",), types=ints, values=[-1])
    for label, alloc in [
        ("alloc(n)", lambda v: kv.alloc(v, timeout=1.0)),
        ("alloc_nowait(n)", kv.alloc_nowait),
        ("sync alloc(n)", lambda v: sync.alloc(v, timeout=1.0)),
    ]:
        add(label, alloc, ("n",), types=WRONG_TYPES, values=[0, -1])
    seconds = ["1", True, [1], torch.tensor([1.0])]
    for label, call in [
        ("alloc(timeout)", lambda v: kv.alloc(1, timeout=v)),
        ("alloc(deadline)", lambda v: kv.alloc(1, deadline=v)),
        ("sync alloc(timeout)", lambda v: sync.alloc(1, timeout=v)),
        ("sync alloc(deadline)", lambda v: sync.alloc(1, deadline=v)),
        ("trim(timeout)", lambda v: kv.trim(timeout=v)),
        ("resize(timeout)", lambda v: kv.resize(memory_limit=None, timeout=v)),
        ("close(timeout)", lambda v: kv.close(timeout=v)),
    ]:
        name = label.split("(")[1][:-1]
        add(label, call, (name,), types=seconds, values=[-1.0, math.nan, math.inf])
    flags = [1, "yes", None]
    add(
        "trim(release_handles)",
        lambda v: kv.trim(release_handles=v),
        ("release_handles",),
        types=flags,
    )
    add(
        "sync trim(release_handles)",
        lambda v: sync.trim(release_handles=v),
        ("release_handles",),
        types=flags,
    )
    limits = ["8MiB", 2.5e6, True, [1]]
    add(
        "resize(memory_limit)",
        lambda v: kv.resize(memory_limit=v, timeout=1.0),
        ("memory_limit",),
        types=limits,
        values=[0, 1],
    )
    add(
        "sync resize(memory_limit)",
        lambda v: sync.resize(memory_limit=v, timeout=1.0),
        ("memory_limit",),
        types=limits,
        values=[0, 1],
    )
    add("layer(index)", kv.layer, ("index",), types=["0", 1.0, True, None])
    id_types: list[object] = ["12", 5, None, {held[0]}, [float(held[0])], [True], [None]]
    id_types.append(torch.tensor([float(held[0])]))
    id_values: list[object] = [[-1], [NUM_BLOCKS], torch.tensor([[held[0]]])]
    for label, call in [
        ("free(ids)", kv.free),
        ("gather(ids)", kv.gather),
        ("zero(ids)", kv.zero),
        ("scatter(ids)", lambda v: kv.scatter(v, good)),
        ("copy(src_ids)", lambda v: kv.copy(v, [held[2]])),
        ("copy(dst_ids)", lambda v: kv.copy([held[0]], v)),
    ]:
        name = label.split("(")[1][:-1]
        # The pool's own messages say "block id" (free: block id 256 is out of range ...).
        add(label, call, (name, "block id"), types=id_types, values=id_values)
    tensors: list[object] = [[[1.0]], good.numpy(), good.float(), 1.0]
    shapes = [good[..., :32], torch.ones(2, *good.shape[1:], dtype=good.dtype)]
    add("gather(out)", lambda v: kv.gather(held[:1], v), ("out",), types=tensors, values=shapes)
    add(
        "scatter(src)",
        lambda v: kv.scatter(held[:1], v),
        ("src",),
        types=[None, *tensors],
        values=shapes,
    )
    add("add_alloc_observer", kv.add_alloc_observer, ("observer",), types=[5, "f", None])
    return cases


async def test_a_wrong_type_is_a_type_error_naming_the_parameter() -> None:
    # Issue 27: set_demand('5' | 1.5 | True | None) raised ValueError naming "demand", not the
    # parameter `blocks`; free_block_ids(limit), the block operations' ids, out and src, and
    # SyncAllocator.alloc(deadline=True) (accepted as 1.0) had the same defect.
    kv, held, _ = await open_with_data()
    try:
        await check_all(kv, held, argument_type_cases(kv, held))
    finally:
        await kv.close(timeout=5.0)


def test_construction_and_layout_methods_raise_type_errors_for_wrong_types() -> None:
    for make, name in [
        (lambda: kvasync.Config(backend=5), "Config.backend"),  # type: ignore[arg-type]
        (lambda: kvasync.Config(name=5), "Config.name"),  # type: ignore[arg-type]
        (lambda: LAYOUT.page_unit("4096"), "page_size"),  # type: ignore[arg-type]
        (lambda: LAYOUT.page_unit(True), "page_size"),  # type: ignore[arg-type]
        (lambda: LAYOUT.blocks_per_page(4096.0), "page_size"),  # type: ignore[arg-type]
        (lambda: LAYOUT.unusable_blocks(4096, "8"), "num_blocks"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(TypeError, match=name):
            make()
    for make, name in [
        (lambda: kvasync.Config(backend="tpu"), "Config.backend"),
        (lambda: kvasync.Config(name=""), "Config.name"),
        (lambda: LAYOUT.page_unit(0), "page_size"),
        (lambda: LAYOUT.unusable_blocks(4096, -1), "num_blocks"),
    ]:
        with pytest.raises(ValueError, match=name):
            make()


async def test_a_deadline_already_past_times_out_at_once_unless_the_blocks_are_free() -> None:
    kv = await kvasync.Allocator.open(LAYOUT, config())
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(kvasync.AllocTimeout):
            await kv.alloc(1, deadline=started - 10.0)  # nothing is mapped: no wait
        assert loop.time() - started < 1.0
        held = await kv.alloc(1, timeout=5.0)  # maps a page: its other blocks are free now
        more = await kv.alloc(1, deadline=0.0)
        assert kv.stats().used_blocks == 2
        kv.free(held + more)
    finally:
        await kv.close(timeout=5.0)


# -- arbitrary values, against a reference of what is valid -----------------------------------

ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.complex_numbers(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.lists(st.integers(-3, 3), max_size=3),
    st.tuples(st.integers(-3, 3), st.integers(-3, 3)),
    st.dictionaries(st.integers(-3, 3), st.integers(), max_size=2),
    st.frozensets(st.integers(-3, 3), max_size=2),
    st.integers(-(2**70), 2**70),
    st.sampled_from([np.int32(2), np.uint8(3), np.bool_(True), np.float32(1.5), np.float64(0.5)]),
    st.builds(torch.tensor, st.integers(-3, 3)),
    st.builds(torch.tensor, st.lists(st.floats(0, 3), max_size=2)),
)


def is_int(value: object) -> bool:
    """A reference for 'an int as kvasync takes one': has __index__, is not a bool."""
    if isinstance(value, bool | np.bool_):
        return False
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def is_seconds(value: object) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool | np.bool_)
        and math.isfinite(value)
        and value >= 0
    )


def fuzz_field(kind: Callable[..., object], name: str, value: object, valid: bool) -> None:
    """``kind(**{name: value})`` succeeds when ``valid``, else raises an error naming ``name``."""
    try:
        kind(**{name: value})
    except ARGUMENT_ERRORS as error:
        assert not valid, f"{name}={value!r} is valid but raised {error!r}"
        assert name in str(error), f"{name}={value!r}: {error!r} does not name it"
    else:
        assert valid, f"{name}={value!r} was accepted"


@settings(max_examples=200, deadline=None)
@given(value=ANYTHING)
def test_config_counts_and_seconds_take_exactly_the_valid_values(value: object) -> None:
    as_count = is_int(value) and 1 <= operator.index(value) <= (1 << 63) - 1  # type: ignore[arg-type]
    fuzz_field(kvasync.Config, "max_blocks", value, as_count)
    fuzz_field(kvasync.Config, "memory_limit", value, as_count or value is None)
    fuzz_field(kvasync.Config, "default_timeout", value, is_seconds(value) and value > 0)  # type: ignore[operator]
    fuzz_field(kvasync.Config, "zero_on_alloc", value, isinstance(value, bool))
    fuzz_field(kvasync.Config, "faults", value, value is None)


@settings(max_examples=200, deadline=None)
@given(value=ANYTHING)
def test_layout_fields_and_fault_settings_take_exactly_the_valid_values(value: object) -> None:
    fields = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_size": 1}
    as_size = is_int(value) and 1 <= operator.index(value) <= 1 << 31  # type: ignore[arg-type]
    fuzz_field(lambda **kw: kvasync.KVLayout(**{**fields, **kw}), "head_dim", value, as_size)
    valid_buffers = is_int(value) and operator.index(value) in (1, 2)  # type: ignore[arg-type]
    fuzz_field(
        lambda **kw: kvasync.KVLayout(**{**fields, **kw}), "kv_buffers", value, valid_buffers
    )
    faults = FaultInjector()
    fuzz_field(lambda seconds: faults.delay(seconds), "seconds", value, is_seconds(value))
    as_count = is_int(value) and 1 <= operator.index(value) <= (1 << 63) - 1  # type: ignore[arg-type]
    fuzz_field(lambda count: faults.fail(count), "count", value, as_count)
    faults.release()


def test_numpy_and_tensor_integers_are_stored_as_plain_ints() -> None:
    layout = kvasync.KVLayout(
        num_layers=np.int64(2), num_kv_heads=np.int32(2), head_dim=torch.tensor(64), block_size=16
    )
    cfg = kvasync.Config(max_blocks=np.int64(256), default_timeout=np.float32(2.0))
    values = [layout.num_layers, layout.num_kv_heads, layout.head_dim, cfg.max_blocks]
    assert [type(v) for v in values] == [int] * 4
    assert type(cfg.default_timeout) is float
    assert layout == LAYOUT
