"""kvasync.tensor_parallel: one scheduler decides the pages, every rank maps them.

The scheduler's allocator opens a group (``Config(tensor_parallel=TensorParallel(...))``); each
rank's process builds a backend of the group's geometry and runs a ``RankMapper`` on it. An alloc
completes only when every rank has mapped its pages; a rank's failure, death or silence fails it
within its deadline, naming the rank (Note [Tensor parallel group] in csrc/group/group_file.h).

This module is the public home of those names; they are defined in ``kvasync._group``.
"""

from ._core import Backend as Backend
from ._core import HostBackend as _HostBackend
from ._group import GroupGeometry as GroupGeometry
from ._group import RankMapper as RankMapper
from ._group import TensorParallel as TensorParallel
from ._group import group_geometry as group_geometry

__all__ = [
    "Backend",
    "GroupGeometry",
    "RankMapper",
    "TensorParallel",
    "group_geometry",
    "host_backend",
]


def host_backend(geometry: GroupGeometry) -> Backend:
    """A rank's host backend (memfd + mmap) of the group's geometry.

    Args:
        geometry: what ``group_geometry`` returned: the scheduler's ranges, pages and page size.

    Returns:
        A backend to give ``RankMapper``; its ranges hold the pages the rank maps.
    """
    return _HostBackend(geometry["num_ranges"], geometry["num_pages"], geometry["page_size"])
