"""Tensor-parallel groups: one scheduler's page decisions mapped on every rank's device.

The scheduler's process opens a group and gives its page pool the group's backend; each rank's
process runs a ``RankMapper`` on its own backend. A map the pool asks for completes only when every
rank has mapped the same pages; a rank's failure, death or silence fails it within its deadline,
naming the rank. The mapping path is C++ on both sides (the pool's mapper thread, the rank's
mapper thread) over shared memory and futexes: no Python, no GIL (Note [Tensor parallel group] in
csrc/group/group_file.h).

Example (the scheduler's process, then one per rank)::

    config = Config(tensor_parallel=TensorParallel("engine-a", num_ranks=2))
    async with open_allocator(layout, config) as kv: ...

    mapper = RankMapper("engine-a", rank, backend, timeout=30.0)  # the same geometry

``open_group`` is the same without an allocator (a ``_core.PagePool`` on ``group.backend``).
"""

from __future__ import annotations

import atexit
import math
import re
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import TypedDict

from . import _core

__all__ = [
    "GroupGeometry",
    "RankMapper",
    "RankStatus",
    "TensorParallel",
    "TensorParallelGroup",
    "group_geometry",
    "group_path",
    "open_group",
    "scheduler_group",
]

# The directory of the groups' files: shared memory, like the share ledgers'.
GROUP_DIR = "/dev/shm"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MAX_RANKS = 16  # kGroupMaxRanks in csrc/group/group_file.h


class RankStatus(TypedDict):
    """One rank as the scheduler sees it in the group's file."""

    rank: int
    state: str  # "absent", "joined", "left", "refused", "dead"
    pid: int
    mapped_pages: int
    jobs_posted: int
    jobs_done: int
    note: str  # why it left or was refused; empty otherwise


def group_path(name: str) -> str:
    """The shared-memory file of group ``name``.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: ``name`` is not 1-100 letters, digits, ``.``, ``_`` or ``-`` (starting with
            a letter or digit).
    """
    if not isinstance(name, str):
        raise TypeError(f"group name must be a str, got {type(name).__name__}")
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"group name {name!r} must be 1-100 letters, digits, '.', '_' or '-', starting "
            "with a letter or digit"
        )
    return f"{GROUP_DIR}/kvasync-tp-{name}"


def _check_timeout(what: str, seconds: float) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(f"{what} must be a number of seconds, got {type(seconds).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {seconds!r}")
    return float(seconds)


def _close_at_exit(backend: weakref.ref[_core.GroupBackend]) -> None:
    alive = backend()
    if alive is not None:
        alive.group.close()


def scheduler_group(backend: _core.Backend) -> _core.SchedulerGroup | None:
    """The group ``backend`` maps through (``TensorParallel.open_scheduler``'s), or None."""
    return backend.group if isinstance(backend, _core.GroupBackend) else None


class TensorParallelGroup:
    """The scheduler's side of a group: its file, and the backend its page pool maps through.

    Args:
        name: the group's name (``group_path``); the ranks join it by that name.
        num_ranks: how many rank processes map every page (1..16).
        local: the scheduler process's own backend; it gives the group its geometry (ranges,
            pages, page size), which every rank's backend must have too.
        map_timeout: seconds the pool's mapper thread waits for every rank to map a job.
        unmap_timeout: the same for an unmap.
        map_local: whether ``local`` maps the pages too (the scheduler's process is a rank's
            process as well). False: it holds no KV memory; ``local`` only gives the ranges
            their addresses, never mapped, so nothing in this process may touch them.

    Raises:
        ValueError: a bad name, rank count or timeout.
        KVAsyncError: the name is in use by a live scheduler, or the file cannot be created.
    """

    def __init__(
        self,
        name: str,
        num_ranks: int,
        local: _core.Backend,
        *,
        map_timeout: float = 5.0,
        unmap_timeout: float = 5.0,
        map_local: bool = True,
    ) -> None:
        path = group_path(name)
        if not isinstance(map_local, bool):
            raise TypeError(f"map_local must be a bool, got {type(map_local).__name__}")
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int):
            raise TypeError(f"num_ranks must be an int, got {type(num_ranks).__name__}")
        map_timeout = _check_timeout("map_timeout", map_timeout)
        unmap_timeout = _check_timeout("unmap_timeout", unmap_timeout)
        self._group = _core.SchedulerGroup(
            path, name, num_ranks, local.num_ranges, local.num_pages, local.page_size
        )
        self._backend = _core.GroupBackend(
            local, self._group, map_timeout, unmap_timeout, map_local
        )
        # A group still open at exit (its pool's backend never released) is closed then: its
        # ranks leave at once and its file is removed. Held weakly: the exit hook must not keep
        # the group open until exit. Through the backend, which whoever uses the group holds
        # (this object, or the allocator that open_scheduler gave it to): the SchedulerGroup's
        # Python object goes with this one, and a hook on it found nothing at exit, leaving the
        # file of every allocator that was not closed.
        atexit.register(_close_at_exit, weakref.ref(self._backend))

    @property
    def name(self) -> str:
        """The group's name."""
        return self._group.name

    @property
    def num_ranks(self) -> int:
        """How many ranks map every page."""
        return self._group.num_ranks

    @property
    def backend(self) -> _core.Backend:
        """The backend to build the scheduler's page pool on."""
        return self._backend

    @property
    def broken(self) -> str | None:
        """Why every map now fails at once (a rank died or left), or None."""
        return self._group.broken

    def wait_ready(self, timeout: float) -> None:
        """Waits until every rank has joined.

        Raises:
            KVAsyncError: a rank did not join within ``timeout`` seconds (named), or was refused
                (its backend's geometry differs), or died.
        """
        self._group.wait_ready(_check_timeout("timeout", timeout))

    def ranks(self) -> list[RankStatus]:
        """Every rank's state, pid, pages held and jobs posted and done."""
        return [
            RankStatus(
                rank=int(view["rank"]),
                state=str(view["state"]),
                pid=int(view["pid"]),
                mapped_pages=int(view["mapped_pages"]),
                jobs_posted=int(view["jobs_posted"]),
                jobs_done=int(view["jobs_done"]),
                note=str(view["note"]),
            )
            for view in self._group.ranks()
        ]

    def close(self) -> None:
        """Tells every rank the group is over (they unmap and leave) and removes its file.

        Close the page pool first: its unmaps go through this group.
        """
        self._group.close()

    def __enter__(self) -> TensorParallelGroup:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_group(
    name: str,
    num_ranks: int,
    local: _core.Backend,
    *,
    ready_timeout: float | None = None,
    map_timeout: float = 5.0,
    unmap_timeout: float = 5.0,
    map_local: bool = True,
) -> TensorParallelGroup:
    """Opens a group (``TensorParallelGroup``), waiting for its ranks when ``ready_timeout``.

    Returns:
        The open group; closed again when its ranks did not all join in time.

    Raises:
        KVAsyncError: the name is in use by a live scheduler, or a rank did not join in time.
    """
    group = TensorParallelGroup(
        name,
        num_ranks,
        local,
        map_timeout=map_timeout,
        unmap_timeout=unmap_timeout,
        map_local=map_local,
    )
    if ready_timeout is not None:
        try:
            group.wait_ready(ready_timeout)
        except BaseException:
            group.close()
            raise
    return group


@dataclass(frozen=True)
class TensorParallel:
    """``Config.tensor_parallel``: the allocator is the scheduler of a tensor-parallel group.

    Its backend (the one ``Config.backend`` picks, in this process) becomes the group's local
    backend; every page it maps is mapped by each rank's ``RankMapper`` too, and an alloc
    completes only when all of them have. ``Allocator.close()`` unmaps every page on every
    rank, then closes the group: the ranks leave and its file is removed. An allocator never
    closed has its group closed at exit (or when its backend is released, if that comes first).

    Args:
        group: the group's name (``group_path``), which the ranks join.
        num_ranks: how many rank processes map every page (1..16).
        ready_timeout: seconds the allocator's open waits for every rank to join, blocking the
            caller; None: it does not wait (the first map waits, within ``map_timeout``).
        map_timeout: seconds the mapper thread waits for every rank to map a job.
        unmap_timeout: the same for an unmap.
        map_local: False when the allocator's process holds no KV memory (vLLM's EngineCore
            beside its rank processes): its ranges are reserved, never mapped, and it must not
            touch them (``Config.zero_on_alloc`` is refused; block copies run on the ranks).

    Raises:
        TypeError, ValueError: a bad name, rank count or timeout.
    """

    group: str
    num_ranks: int
    ready_timeout: float | None = None
    map_timeout: float = 5.0
    unmap_timeout: float = 5.0
    map_local: bool = True

    def __post_init__(self) -> None:
        group_path(self.group)
        if not isinstance(self.map_local, bool):
            raise TypeError(f"map_local must be a bool, got {type(self.map_local).__name__}")
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int):
            raise TypeError(f"num_ranks must be an int, got {type(self.num_ranks).__name__}")
        if not 1 <= self.num_ranks <= MAX_RANKS:
            raise ValueError(f"num_ranks must be in 1..{MAX_RANKS}, got {self.num_ranks}")
        if self.ready_timeout is not None:
            _check_timeout("ready_timeout", self.ready_timeout)
        _check_timeout("map_timeout", self.map_timeout)
        _check_timeout("unmap_timeout", self.unmap_timeout)

    def open_scheduler(self, local: _core.Backend) -> _core.Backend:
        """Opens the group on ``local`` and returns the backend to build the pool on.

        Raises:
            KVAsyncError: the name is in use by a live scheduler, or a rank did not join within
                ``ready_timeout``.
        """
        group = open_group(
            self.group,
            self.num_ranks,
            local,
            ready_timeout=self.ready_timeout,
            map_timeout=self.map_timeout,
            unmap_timeout=self.unmap_timeout,
            map_local=self.map_local,
        )
        return group.backend


class GroupGeometry(TypedDict):
    """What a rank's backend must have: the scheduler's ranges, pages and page size."""

    num_ranks: int
    num_ranges: int
    num_pages: int
    page_size: int


def group_geometry(name: str, timeout: float) -> GroupGeometry:
    """The geometry of group ``name``, waiting up to ``timeout`` seconds for it to be opened.

    A rank builds its backend from it (``HostBackend(num_ranges, num_pages, page_size)``, or the
    cuda one with the same figures), so that it is the scheduler's by construction.

    Raises:
        KVAsyncError: no open group of that name within ``timeout``, or a file that is not one.
    """
    found = _core.read_group_geometry(group_path(name), name, _check_timeout("timeout", timeout))
    return GroupGeometry(
        num_ranks=found["num_ranks"],
        num_ranges=found["num_ranges"],
        num_pages=found["num_pages"],
        page_size=found["page_size"],
    )


class RankMapper:
    """A rank's side of a group: a C++ thread mapping the scheduler's pages on ``backend``.

    Args:
        name: the group's name.
        rank: this process's rank, 0..num_ranks-1.
        backend: this rank's own backend, of the group's geometry.
        timeout: seconds to wait for the scheduler to open the group.

    Raises:
        KVAsyncError: no open group of that name within ``timeout``, a geometry that differs from
            the group's (the scheduler is told), or a rank taken before.
    """

    def __init__(self, name: str, rank: int, backend: _core.Backend, *, timeout: float = 5.0):
        path = group_path(name)
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        self._mapper = _core.RankMapper(
            path, name, rank, backend, _check_timeout("timeout", timeout)
        )
        self._backend = backend

    @property
    def rank(self) -> int:
        """This rank."""
        return self._mapper.rank

    @property
    def backend(self) -> _core.Backend:
        """The rank's own backend (its ranges hold the pages mapped)."""
        return self._backend

    @property
    def mapped_pages(self) -> int:
        """How many pages this rank holds mapped now."""
        return self._mapper.mapped_pages

    def mapped_page_ids(self) -> list[int]:
        """The pages this rank holds mapped now, ascending."""
        return self._mapper.mapped_page_ids()

    def committed_page_ids(self) -> list[int]:
        """The pages this rank holds whose map the whole group did, ascending.

        Only these may be written by this process: a page this rank mapped while the group's map
        failed elsewhere (another rank failed it or was late) is unmapped again by its rollback.
        A committed page stays mapped until the scheduler unmaps it.
        """
        return self._mapper.committed_page_ids()

    @property
    def jobs_done(self) -> int:
        """Jobs (maps and unmaps) this rank has run."""
        return self._mapper.jobs_done

    @property
    def left(self) -> bool:
        """Whether the rank has left (scheduler gone or closed the group, or ``close()``)."""
        return self._mapper.left

    @property
    def left_reason(self) -> str:
        """Why the rank left; empty while it has not."""
        return self._mapper.left_reason

    def wait_left(self, timeout: float) -> bool:
        """Waits until the rank has left; returns False at ``timeout`` seconds."""
        return self._mapper.wait_left(_check_timeout("timeout", timeout))

    def close(self, timeout: float = 1.0) -> bool:
        """Stops the mapper, unmaps every page held and leaves the group.

        Returns:
            False when the mapper was stuck in a backend call and was abandoned.
        """
        return self._mapper.close(_check_timeout("timeout", timeout))

    def __enter__(self) -> RankMapper:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
