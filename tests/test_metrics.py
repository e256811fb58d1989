"""kvasync.integrations.metrics: a scrape agrees with stats(); the latency histograms fill."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvasync
from kvasync.integrations import metrics

LAYOUT = kvasync.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
PER_PAGE = 512


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def test_a_scrape_agrees_with_stats_and_the_histograms_count_every_alloc(
    kv_allocator, kv_faults
):
    faults = kv_faults  # the plugin's fixtures, under pytest-asyncio's auto mode
    async with kv_allocator(reserve_pages=(0, 0)) as kv:
        registry = CollectorRegistry()
        metrics.register(kv, registry, name="model-a")
        cold = await kv.alloc(PER_PAGE + 3)  # waits for two maps
        hot = [await kv.alloc(2) for _ in range(5)]  # answered at once from page 1
        faults.hang()
        try:
            with pytest.raises(kvasync.AllocTimeout):
                await kv.alloc(PER_PAGE, timeout=0.05)
            samples = scrape(registry)
            stats = kv.stats()
        finally:
            faults.release()
        label = (("allocator", "model-a"),)
        for field in (
            "used_blocks",
            "free_blocks",
            "mapped_pages",
            "reserve_pages",
            "inflight_pages",
            "mapping_pages",
            "waiters",
            "mapped_bytes",
        ):
            assert samples[(f"kvasync_{field}", label)] == getattr(stats, field), field
        assert samples[("kvasync_maps_total", label)] == stats.maps_done == 2
        assert samples[("kvasync_timeouts_total", label)] == stats.timeouts == 1
        assert samples[("kvasync_map_errors_total", label)] == stats.map_errors == 0
        assert samples[("kvasync_unmaps_total", label)] == stats.unmaps_done
        assert samples[("kvasync_inflight_pages", label)] == 1  # the hung map, at scrape time
        hot_label = (("allocator", "model-a"), ("path", "hot"))
        cold_label = (("allocator", "model-a"), ("path", "cold"))
        assert samples[("kvasync_alloc_latency_seconds_count", hot_label)] == 5
        assert samples[("kvasync_alloc_latency_seconds_count", cold_label)] == 1
        assert samples[("kvasync_map_latency_seconds_count", label)] == 1  # one batch, one job
        kv.free(cold + [b for blocks in hot for b in blocks])


def test_register_counts_the_blocking_facade_and_rejects_a_duplicate():
    with kvasync.open_allocator_sync(LAYOUT, kvasync.Config(backend="host")) as kv:
        registry = CollectorRegistry()
        collector = metrics.register(kv, registry)
        kv.free(kv.alloc(4, timeout=5.0))
        samples = scrape(registry)
        assert samples[("kvasync_used_blocks", (("allocator", "kv"),))] == 0
        with pytest.raises(ValueError):
            metrics.register(kv, registry)  # same names, same labels
        with pytest.raises(ValueError, match="name"):
            metrics.register(kv, CollectorRegistry(), name="")
        collector.unregister()
        assert "kvasync_used_blocks" not in generate_latest(registry).decode()


def test_two_allocators_in_one_registry_are_told_apart_by_the_allocator_label():
    # Issue 18: the second registration raised DuplicateTimeseries (a ValueError).
    config = kvasync.Config(backend="host", reserve_pages=(0, 0))
    with (
        kvasync.open_allocator_sync(LAYOUT, config) as first,
        kvasync.open_allocator_sync(LAYOUT, config) as second,
        kvasync.open_allocator_sync(LAYOUT, replace(config, name="coder")) as third,
    ):
        registry = CollectorRegistry()
        registrations = [metrics.register(kv, registry) for kv in (first, second, third)]
        assert [r.name for r in registrations] == ["kv", "kv-2", "coder"]  # Config.name first
        held = [first.alloc(3, timeout=5.0), second.alloc(PER_PAGE + 1, timeout=5.0)]
        samples = scrape(registry)
        for registration, kv in zip(registrations, (first, second, third), strict=True):
            label = (("allocator", registration.name),)
            stats = kv.stats()
            assert samples[("kvasync_used_blocks", label)] == stats.used_blocks
            assert samples[("kvasync_mapped_pages", label)] == stats.mapped_pages
            assert samples[("kvasync_maps_total", label)] == stats.maps_done
            cold = (("allocator", registration.name), ("path", "cold"))
            assert samples[("kvasync_alloc_latency_seconds_count", cold)] == (kv is not third)
        mapped = {n: samples[("kvasync_mapped_pages", (("allocator", n),))] for n in ("kv", "kv-2")}
        assert mapped == {"kv": 1, "kv-2": 2}
        with pytest.raises(ValueError, match="registered in this registry already"):
            metrics.register(second, registry, name="again")
        # One goes; the others stay, and the names go with the last.
        registrations[1].unregister()
        left = {labels for name, labels in scrape(registry) if name == "kvasync_used_blocks"}
        assert left == {(("allocator", "kv"),), (("allocator", "coder"),)}
        with pytest.raises(ValueError, match="allocator='coder' is already registered"):
            metrics.register(second, registry, name="coder")  # a name must tell them apart
        registrations[0].unregister()
        registrations[2].unregister()
        assert "kvasync_" not in generate_latest(registry).decode()
        metrics.register(third, registry).unregister()  # the names are free again
        first.free(held[0])
        second.free(held[1])


def test_an_allocator_in_two_registries_is_observed_by_each_until_unregistered():
    # Through Allocator.add_alloc_observer: was one exporter per allocator, the latest.
    with kvasync.open_allocator_sync(LAYOUT, kvasync.Config(backend="host")) as kv:
        registries = [CollectorRegistry(), CollectorRegistry()]
        registrations = [metrics.register(kv, registry) for registry in registries]
        held = [kv.alloc(2, timeout=5.0) for _ in range(3)]
        hot = (("allocator", "kv"), ("path", "hot"))
        cold = (("allocator", "kv"), ("path", "cold"))

        def allocs(registry: CollectorRegistry) -> float:
            samples = scrape(registry)
            return (
                samples[("kvasync_alloc_latency_seconds_count", hot)]
                + samples[("kvasync_alloc_latency_seconds_count", cold)]
            )

        assert [allocs(registry) for registry in registries] == [3, 3]
        registrations[0].unregister()
        held.append(kv.alloc(2, timeout=5.0))
        assert allocs(registries[1]) == 4
        registrations[1].unregister()
        kv.free(kv.alloc(2, timeout=5.0))
        assert "kvasync_" not in generate_latest(registries[1]).decode()
        kv.free([block for blocks in held for block in blocks])
