"""The cuda backend (csrc/backends/cuda_backend.cpp): what only a GPU can show.

The allocator's contract runs on cuda too (tests/test_allocator.py, the ``backend_name`` fixture);
here: views read by torch kernels, unmap safety under running kernels, memory really returned,
the handle pool, the gpu_utilization ceiling and the driver running out of memory. Two processes
starting together on one GPU are tests/test_seed_scenarios.py's two-engine test on cuda.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from conftest import wait_until

import kvasync
from kvasync import _core, _cuda

DRIVER_PROBLEM = _core.cuda_problem(0)
HAS_GPU = DRIVER_PROBLEM is None and torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason=f"needs an NVIDIA GPU: {DRIVER_PROBLEM}")

MIB = 1 << 20
PAGE = 2 * MIB
# 4 layers, K and V, 16 tokens x 2 heads x 64 x fp16: 4 KiB blocks, 512 per 2 MiB page per range.
SMALL = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}
# The benchmark geometry: 32 layers, K and V, 16 x 8 x 128 x fp16 (32 KiB blocks): a page id is
# 2 MiB in each of 64 buffers, 128 MiB.
LARGE = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}


def layout(geometry: dict[str, int], contiguous: bool) -> kvasync.KVLayout:
    return kvasync.KVLayout(**geometry, contiguous=contiguous)


def cuda_config(**overrides: object) -> kvasync.Config:
    settings: dict[str, object] = {"backend": "cuda", "max_blocks": 64 * 512, "page_size": PAGE}
    settings.update(overrides)
    return kvasync.Config(**settings)  # type: ignore[arg-type]


def sleep_cycles(seconds: float) -> int:
    """GPU clock cycles of ``torch.cuda._sleep`` that last about ``seconds``, measured."""
    torch.cuda._sleep(1000)  # loads the kernel: the timed launch below measures the spin only
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(seconds * 10_000_000 / (start.elapsed_time(end) / 1000))


# -- without a driver ---------------------------------------------------------------------------


@pytest.mark.skipif(HAS_GPU, reason="a CUDA driver is present")
@pytest.mark.asyncio
async def test_cuda_backend_without_a_driver_raises_a_clear_error():
    with pytest.raises(kvasync.KVAsyncError, match=r"no CUDA (driver|device) found"):
        await kvasync.Allocator.open(layout(SMALL, False), cuda_config())


@pytest.mark.skipif(HAS_GPU, reason="a CUDA driver is present")
@pytest.mark.asyncio
async def test_auto_backend_without_a_driver_is_host():
    async with kvasync.open_allocator(layout(SMALL, False), kvasync.Config()) as kv:
        assert kv.backend == "host"


# -- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("contiguous", [False, True], ids=["per_layer", "contiguous"])
@pytest.mark.asyncio
async def test_writes_through_layer_views_read_back_in_torch_kernels(contiguous):
    kv_layout = layout(SMALL, contiguous)
    async with kvasync.open_allocator(kv_layout, cuda_config(reserve_pages=(0, 0))) as kv:
        assert kv.backend == "cuda"
        ids = await kv.alloc(700, timeout=5.0)  # two pages: spans a page boundary
        index = torch.tensor(ids, device="cuda")
        for layer in range(kv_layout.num_layers):
            for buffer, view in enumerate(kv.layer(layer)):
                assert view.device == torch.device("cuda", 0)
                assert view.shape == (kv.num_blocks, 16, 2, 64)
                values = torch.arange(len(ids), device="cuda", dtype=torch.float16)
                fill = (values + 1000 * layer + 100 * buffer).view(-1, 1, 1, 1)
                view[index] = fill.expand(-1, 16, 2, 64)
        torch.cuda.synchronize()
        for layer in range(kv_layout.num_layers):
            for buffer, view in enumerate(kv.layer(layer)):
                got = view[index].float().mean(dim=(1, 2, 3))
                want = torch.arange(len(ids), device="cuda").float() + 1000 * layer + 100 * buffer
                torch.testing.assert_close(got, want.half().float())
        kv.free(ids)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("after", ["stream", "event"])
@pytest.mark.asyncio
async def test_unmap_after_free_with_a_fence_waits_for_the_running_kernel(after):
    kv_layout = layout(SMALL, False)
    # No refill, and the reserve may hold the page: nothing but trim() unmaps it.
    async with kvasync.open_allocator(kv_layout, cuda_config(reserve_pages=(0, 1))) as kv:
        ids = await kv.alloc(512, timeout=5.0)  # one whole page
        k, _v = kv.layer(0)
        index = torch.tensor(ids, device="cuda")
        k[index] = 3.0
        torch.cuda.synchronize()
        # A long wait, then a kernel that reads the blocks. NOTE: in slices of a quarter second:
        # a whole second at the boost clock is close to 2**31 cycles, which would wrap to a spin
        # that ends at once if the count is taken as 32-bit anywhere.
        cycles = sleep_cycles(0.25)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            # Warm the caching allocator on this stream first: a cudaMalloc for the read below
            # would synchronize the device (a fresh process has no cached segment on a new
            # stream), so the long kernel would be over before free().
            k[index].float().sum()
            for _ in range(4):
                torch.cuda._sleep(cycles)
            total = k[index].float().sum()
        fence: object = stream
        if after == "event":
            fence = torch.cuda.Event()
            fence.record(stream)
        assert not stream.query(), "the long kernel must still be running at free()"
        kv.free(ids, after=fence)
        # The unmap must wait for the kernel: with a deadline shorter than it, the trim fails
        # and the page stays mapped.
        with pytest.raises((kvasync.AllocTimeout, kvasync.MapError)):
            await kv.trim(timeout=0.05)
        # The loop's timer and the mapper's fence wait share that deadline: the trim can time out
        # while the mapper still holds the page (unmapping). Wait for it to hand the page back.
        await wait_until(lambda: kv.stats().inflight_pages == 0, 5.0)
        assert kv.stats().mapped_pages == 1
        assert kv.stats().unmaps_done == 0
        await kv.trim(timeout=5.0)  # waits on the fence, then unmaps
        assert kv.stats().unmaps_done == 1
        stream.synchronize()  # raises if the kernel faulted
        assert total.item() == 3.0 * 512 * 16 * 2 * 64


@pytest.mark.gpu
@needs_gpu
@pytest.mark.asyncio
async def test_free_after_rejects_a_stream_of_another_kind_and_an_unrecorded_event():
    async with kvasync.open_allocator(layout(SMALL, False), cuda_config()) as kv:
        ids = await kv.alloc(4)
        with pytest.raises(ValueError, match="never recorded"):
            kv.free(ids, after=torch.cuda.Event())
        with pytest.raises(ValueError, match=r"Stream or torch\.cuda\.Event"):
            kv.free(ids, after="stream")
        kv.free(ids, after=torch.cuda.current_stream())
        assert kv.stats().used_blocks == 0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("contiguous", [False, True], ids=["per_layer", "contiguous"])
@pytest.mark.asyncio
async def test_physical_memory_returns_after_trim(contiguous):
    kv_layout = layout(LARGE, contiguous)
    page_bytes = PAGE * kv_layout.num_ranges  # 128 MiB per-layer, 2 MiB contiguous
    pages = (2 << 30) // page_bytes
    blocks = pages * kv_layout.blocks_per_page(PAGE)
    config = cuda_config(max_blocks=blocks, reserve_pages=(0, 2))
    torch.cuda.synchronize()
    async with kvasync.open_allocator(kv_layout, config) as kv:
        free_before, _ = _cuda.mem_get_info(0)
        ids = await kv.alloc(blocks, timeout=10.0)
        free_full, _ = _cuda.mem_get_info(0)
        assert free_before - free_full >= 2 << 30
        kv.free(ids)
        await kv.trim(timeout=10.0)
        assert kv.stats().mapped_pages == 0
        # At most `reserve_pages[1]` page ids of handles stay pooled; the rest is released (by
        # the mapper's upkeep between jobs, so wait for it).
        spare = 2 * page_bytes
        await wait_until(lambda: _cuda.mem_get_info(0)[0] >= free_before - spare - 64 * MIB, 10.0)
        kv._backend.release_spare()  # type: ignore[attr-defined]
        await wait_until(lambda: _cuda.mem_get_info(0)[0] >= free_before - 64 * MIB, 10.0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.asyncio
async def test_maps_take_pooled_handles_and_new_ones_are_made_ahead():
    backend = _core.CudaBackend(0, 8, 16, PAGE, 4, 0.95)
    _core.backend_time_map(backend, 0, 4)  # cold: creates 4 page ids
    assert backend.settle(5.0)  # upkeep (the mapper's, between jobs; here, run directly)
    stats = backend.handle_stats()
    assert stats["created_on_map"] == 4
    assert stats["spare_pages"] == 4  # made ahead, in the background
    _core.backend_time_map(backend, 4, 4)
    assert backend.handle_stats()["taken_from_pool"] == 4
    _core.backend_time_unmap(backend, 0, 8)
    assert backend.settle(5.0)  # upkeep (the mapper's, between jobs; here, run directly)
    stats = backend.handle_stats()
    assert stats["spare_pages"] == 4  # capped at the high watermark, the rest released
    assert stats["created"] == stats["released"] + 4
    print("driver probes:", stats)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.asyncio
async def test_map_above_gpu_utilization_fails_with_map_error_and_the_allocator_recovers():
    free, total = _cuda.mem_get_info(0)
    used_share = (total - free) / total
    ceiling = min(1.0, used_share + 0.01)  # room for about 1.4 GB on an H200
    kv_layout = layout(LARGE, True)
    config = cuda_config(max_blocks=64 * 64, reserve_pages=(0, 0), gpu_utilization=ceiling)
    async with kvasync.open_allocator(kv_layout, config) as kv:
        ballast = torch.empty(int(0.02 * total), dtype=torch.uint8, device="cuda")
        with pytest.raises(kvasync.MapError, match=r"CUDA_ERROR_OUT_OF_MEMORY.*gpu_utilization"):
            await kv.alloc(64, timeout=5.0)  # 64 page ids of 2 MiB
        del ballast
        torch.cuda.empty_cache()
        ids = await kv.alloc(64, timeout=5.0)
        kv.free(ids)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("contiguous", [False, True], ids=["per_layer", "contiguous"])
@pytest.mark.asyncio
async def test_driver_out_of_memory_is_a_map_error_not_a_crash_or_a_hang(contiguous):
    kv_layout = layout(LARGE, contiguous)
    config = cuda_config(max_blocks=64 * 64, reserve_pages=(0, 0), gpu_utilization=1.0)
    async with kvasync.open_allocator(kv_layout, config) as kv:
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info()
        ballast = torch.empty(free - 32 * MIB, dtype=torch.uint8, device="cuda")
        try:
            started = time.monotonic()
            with pytest.raises((kvasync.MapError, kvasync.OutOfBlocks)) as error:
                await kv.alloc(64 * 8, timeout=10.0)  # 8 page ids (256 MiB on per-layer)
            assert time.monotonic() - started < 10.0
            assert "CUDA_ERROR_OUT_OF_MEMORY" in str(error.value)
            assert kv.stats().used_blocks == 0
        finally:
            del ballast
            torch.cuda.empty_cache()
        ids = await asyncio.wait_for(kv.alloc(64, timeout=5.0), 10.0)
        kv.free(ids)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("sync_before_unmap", [False, True], ids=["plain", "synced_unmap"])
def test_a_graph_captures_while_another_thread_maps_and_unmaps(sync_before_unmap):
    """Note [Graph capture beside the mapper]: vLLM captures CUDA graphs at start while kvasync's
    threads map, unmap, create handles and (a tensor-parallel rank) sync before an unmap. None of
    those calls may invalidate the capture; a synced unmap refused during it (the sync gate) fails
    as a value and leaves its pages mapped. Without the gate the synced case fails: the rank's
    cuCtxSynchronize invalidated the capture on an H200 (2026-12-02)."""
    backend = _core.CudaBackend(0, 2, 16, PAGE, 0, 0.95)  # no spares: every map creates handles
    backend.sync_before_unmap = sync_before_unmap
    if sync_before_unmap:
        _cuda.guard_graph_captures()  # what the vLLM plugin's ranks do
    stop, started = threading.Event(), threading.Event()
    cycles, failures = [0], []

    def churn() -> None:
        mapped = False
        while not stop.is_set():
            try:
                if not mapped:
                    _core.backend_time_map(backend, 0, 4)
                    mapped = True
                _core.backend_time_unmap(backend, 0, 4)
                mapped = False
                cycles[0] += 1
            except kvasync.KVAsyncError as error:  # the pages stay mapped: the next try unmaps
                failures.append(str(error))
            started.set()

    x = torch.ones(1 << 16, device="cuda")
    torch.cuda.synchronize()
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        assert started.wait(10.0), "the churn thread made no first map and unmap within 10 s"
        before = cycles[0]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # the default, global capture mode, as vLLM's
            y = x
            for _ in range(3000):  # long enough for the churn to run inside it
                y = y * 1.0001
        during = cycles[0] - before + len(failures)
        graph.replay()
        torch.cuda.synchronize()
    finally:
        stop.set()
        thread.join(10.0)
    assert not thread.is_alive()
    assert during > 0, "no map or unmap ran during the capture: the test proved nothing"
    assert torch.allclose(y, torch.full_like(x, 1.0001**3000), rtol=1e-3)  # fp32 rounding
    assert all("CAPTURE" in failure for failure in failures), failures
    print(f"{during} map/unmap cycles during the capture; failed unmaps: {failures[:3]}")


def test_the_graph_capture_gate_counts_captures_and_reopens_when_a_capture_fails_to_begin():
    """Note [Graph capture beside the mapper]: the gate closes for a capture and opens after it;
    a capture that fails to begin (here: no GPU, or a bad argument) leaves it open."""
    assert _core.cuda_graph_captures() == 0
    assert _core.cuda_graph_capture_begin(1.0)  # no sync in flight: closes at once
    assert _core.cuda_graph_captures() == 1
    _core.cuda_graph_capture_end()
    assert _core.cuda_graph_captures() == 0
    with pytest.raises(ValueError, match="timeout_s"):
        _core.cuda_graph_capture_begin(0.0)
    _cuda.guard_graph_captures()
    _cuda.guard_graph_captures()  # once per process: the second call changes nothing
    # A capture that fails in torch's capture_begin (here: not a graph at all, which fails on a
    # CPU machine too) must leave the gate open, or every later unmap of a rank would fail.
    with pytest.raises((AttributeError, TypeError)):
        torch.cuda.CUDAGraph.capture_begin(object())
    assert _core.cuda_graph_captures() == 0
