"""The Python side of the cuda backend: device views, fences, and driver queries.

The allocator's hot path (``alloc``/``free``) never calls CUDA. What needs the driver is either in
the C++ core (mapping, fences: ``_core.cuda_*``, loaded with ``dlopen`` so that kvasync imports
without a driver) or, for the few questions Python itself asks (free memory, granularity), in
cuda-python (``cuda.bindings.driver``), imported only when asked.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
from torch.utils.dlpack import from_dlpack

from . import _core

__all__ = [
    "driver_problem",
    "guard_graph_captures",
    "make_fence",
    "mem_get_info",
    "range_tensor",
]


def driver_problem(device: int = 0) -> str | None:
    """Why the cuda backend cannot be used on ``device`` here, or None when it can."""
    return _core.cuda_problem(device)


def _device_of(backend: _core.Backend) -> int:
    device = _core.cuda_device_of(backend)
    assert device is not None, "bug: a cuda-named backend that is not a live CudaBackend"
    return device


def range_tensor(backend: _core.Backend, index: int) -> torch.Tensor:
    """A uint8 tensor on ``cuda:<device>`` over the whole of range ``index``.

    It is built from a DLPack capsule that holds a reference to the backend, so the reservation
    outlives every view of it. (``__cuda_array_interface__`` would not do: torch asks the driver
    which device owns the pointer, and an unmapped reservation belongs to none.)
    """
    return from_dlpack(_core.cuda_range_dlpack(backend, index))


def make_fence(backend: _core.Backend, after: object) -> int:
    """A CUevent that completes when the device work ``after`` stands for has completed.

    * ``torch.cuda.Stream``: the work queued on that stream so far (an event recorded on it).
    * ``torch.cuda.Event``: the work its last ``record()`` captured. The fence is a new event,
      recorded on a private stream after waiting on it, so the caller may re-record or drop
      theirs at once.

    Raises:
        TypeError: ``after`` is neither.
        ValueError: ``after`` is on another device, or is an event never recorded.
    """
    device = _device_of(backend)
    if isinstance(after, torch.cuda.Stream):
        _check_device(after.device, device, "stream")
        return _core.cuda_record_fence(device, int(after.cuda_stream), 0)
    if isinstance(after, torch.cuda.Event):
        handle = int(after.cuda_event)
        if handle == 0:
            raise ValueError("free(after=event): the event was never recorded; record() it first")
        event_device = getattr(after, "device", None)
        if event_device is not None:
            _check_device(event_device, device, "event")
        return _core.cuda_record_fence(device, 0, handle)
    raise TypeError(
        f"free(after=...) takes a torch.cuda.Stream or torch.cuda.Event, got {type(after).__name__}"
    )


def _check_device(got: Any, device: int, what: str) -> None:
    index = torch.device(got).index
    if index is not None and index != device:
        raise ValueError(
            f"free(after={what}): the {what} is on cuda:{index}, the KV cache on cuda:{device}"
        )


def mem_get_info(device: int = 0) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device`` from cuMemGetInfo, through cuda-python.

    Runs in the device's primary context (PyTorch's). Raises ImportError without cuda-python.
    """
    from cuda.bindings import driver

    def ok(result: Any) -> Any:
        error, *values = result
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuda-python: {error}")
        return values[0] if len(values) == 1 else values

    ok(driver.cuInit(0))
    handle = ok(driver.cuDeviceGet(device))
    context = ok(driver.cuDevicePrimaryCtxRetain(handle))
    try:
        ok(driver.cuCtxPushCurrent(context))
        try:
            free, total = ok(driver.cuMemGetInfo())
        finally:
            ok(driver.cuCtxPopCurrent())
    finally:
        ok(driver.cuDevicePrimaryCtxRelease(handle))
    return int(free), int(total)


# How long a capture waits for a device sync already in the driver (it waits for the device's
# queued work, which a healthy engine finishes in milliseconds).
CAPTURE_GATE_TIMEOUT_S = 10.0
_guard_lock = threading.Lock()
_guarded = False


def guard_graph_captures() -> None:
    """Keeps this process's device syncs out of every CUDA graph it captures from now on.

    A tensor-parallel rank syncs the device before each unmap (Note [Bounded device sync]); a sync
    while any stream captures invalidates the capture (Note [Graph capture beside the mapper] in
    csrc/backends/cuda_backend.h). This wraps ``torch.cuda.CUDAGraph.capture_begin`` and
    ``capture_end`` (what ``torch.cuda.graph`` and vLLM's capture call) so that a capture closes
    the C++ sync gate for its duration: syncs asked for meanwhile fail (the unmap fails and its
    pages stay mapped), and one already in the driver is waited for first. Once per process;
    later calls do nothing.

    Raises:
        RuntimeError: (from a capture) a sync in flight did not return within
            ``CAPTURE_GATE_TIMEOUT_S``: the capture would have been invalidated.
    """
    global _guarded
    with _guard_lock:
        if _guarded:
            return
        graph_class = torch.cuda.CUDAGraph
        begin, end = graph_class.capture_begin, graph_class.capture_end

        @functools.wraps(begin)
        def capture_begin(self: Any, *args: Any, **kwargs: Any) -> None:
            if not _core.cuda_graph_capture_begin(CAPTURE_GATE_TIMEOUT_S):
                raise RuntimeError(
                    "kvasync: a device sync before an unmap was still running after "
                    f"{CAPTURE_GATE_TIMEOUT_S:.0f} s, so a CUDA graph captured now would be "
                    "invalidated (Note [Graph capture beside the mapper]); the device's queued "
                    "work is not finishing"
                )
            try:
                begin(self, *args, **kwargs)
            except BaseException:
                _core.cuda_graph_capture_end()
                raise

        @functools.wraps(end)
        def capture_end(self: Any) -> None:
            try:
                end(self)
            finally:
                _core.cuda_graph_capture_end()

        setattr(graph_class, "capture_begin", capture_begin)  # noqa: B010
        setattr(graph_class, "capture_end", capture_end)  # noqa: B010
        _guarded = True
