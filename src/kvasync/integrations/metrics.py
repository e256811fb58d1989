"""Prometheus metrics of an allocator (the ``kvasync[metrics]`` extra: prometheus-client).

``register(kv)`` adds one collector to a registry. Gauges and counters are read from one
``kv.stats()`` snapshot per scrape, so they agree with ``stats()`` and with each other; the
latency histograms are fed as allocs complete (hot: answered without waiting; cold: waited for a
map or a free) and, for maps, from the durations the mapper records (drained at each scrape).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .._allocator import Allocator
    from .._sync import SyncAllocator

__all__ = ["AllocatorCollector", "register"]

# Allocation latency spans a microsecond (hot) to seconds (a map under driver contention).
_ALLOC_BUCKETS = (1e-6, 4e-6, 16e-6, 64e-6, 256e-6, 1e-3, 4e-3, 16e-3, 64e-3, 0.25, 1.0, 4.0)
_MAP_BUCKETS = (16e-6, 64e-6, 256e-6, 1e-3, 4e-3, 16e-3, 64e-3, 0.25, 1.0, 4.0)

# (metric suffix, stats field, help)
_GAUGES = (
    ("used_blocks", "used_blocks", "Blocks allocated now."),
    ("free_blocks", "free_blocks", "Mapped blocks free now."),
    ("mapped_pages", "mapped_pages", "Pages mapped (in use or in the reserve)."),
    ("reserve_pages", "reserve_pages", "Mapped pages with every block free."),
    ("inflight_pages", "inflight_pages", "Pages the mapper owns now (mapping + unmapping)."),
    ("mapping_pages", "mapping_pages", "Pages being mapped."),
    ("unmapping_pages", "unmapping_pages", "Pages being unmapped."),
    ("waiters", "waiters", "Allocations waiting for blocks."),
    ("queued_jobs", "queued_jobs", "Map and unmap jobs queued for the mapper."),
    ("memory_limit_pages", "memory_limit_pages", "The physical budget, in pages."),
    ("mapped_bytes", "mapped_bytes", "Physical memory mapped, in bytes."),
)
_COUNTERS = (
    ("maps", "maps_done", "Pages mapped."),
    ("unmaps", "unmaps_done", "Pages unmapped."),
    ("map_errors", "map_errors", "Backend calls that failed."),
    ("timeouts", "timeouts", "Allocations that timed out."),
    ("dropped_jobs", "dropped_jobs", "Jobs dropped because their deadline passed first."),
    ("mapper_batches", "mapper_batches", "Backend batches the mapper ran."),
)


class AllocatorCollector(Collector):
    """The collector ``register`` adds; ``registry.unregister(collector)`` removes it."""

    def __init__(self, allocator: Allocator, name: str, prefix: str) -> None:
        self._kv = allocator
        self._labels = {"allocator": name}
        self._prefix = prefix
        self.alloc_latency = Histogram(
            f"{prefix}_alloc_latency_seconds",
            "Seconds from an alloc call to its blocks; path=hot answered at once, cold waited.",
            ["allocator", "path"],
            registry=None,
            buckets=_ALLOC_BUCKETS,
        )
        self.map_latency = Histogram(
            f"{prefix}_map_latency_seconds",
            "Seconds the mapper spent on each successful map job (a batch's jobs share it).",
            ["allocator"],
            registry=None,
            buckets=_MAP_BUCKETS,
        )
        self._hot = self.alloc_latency.labels(name, "hot")
        self._cold = self.alloc_latency.labels(name, "cold")
        self._maps = self.map_latency.labels(name)

    def observe_alloc(self, waited: bool, seconds: float) -> None:
        (self._cold if waited else self._hot).observe(seconds)

    def describe(self) -> Iterator[Metric]:
        """The metric names, without reading the allocator (the registry's duplicate check)."""
        names = list(self._labels)
        for suffix, _, help_text in _GAUGES:
            yield GaugeMetricFamily(f"{self._prefix}_{suffix}", help_text, labels=names)
        for suffix, _, help_text in _COUNTERS:
            yield CounterMetricFamily(f"{self._prefix}_{suffix}", help_text, labels=names)
        yield from self.alloc_latency.describe()
        yield from self.map_latency.describe()

    def collect(self) -> Iterator[Metric]:
        for seconds in self._kv._pool.take_map_seconds():
            self._maps.observe(seconds)
        stats = self._kv.stats()
        names, values = list(self._labels), list(self._labels.values())
        for suffix, field, help_text in _GAUGES:
            gauge = GaugeMetricFamily(f"{self._prefix}_{suffix}", help_text, labels=names)
            gauge.add_metric(values, getattr(stats, field))
            yield gauge
        for suffix, field, help_text in _COUNTERS:
            counter = CounterMetricFamily(f"{self._prefix}_{suffix}", help_text, labels=names)
            counter.add_metric(values, getattr(stats, field))
            yield counter
        yield from self.alloc_latency.collect()
        yield from self.map_latency.collect()


def register(
    kv: Allocator | SyncAllocator,
    registry: CollectorRegistry | None = None,
    *,
    name: str = "kv",
    prefix: str = "kvasync",
) -> AllocatorCollector:
    """Exports ``kv``'s gauges, counters and latency histograms to a Prometheus registry.

    Args:
        kv: an open allocator (async or blocking).
        registry: where to register; prometheus-client's default ``REGISTRY`` when None.
        name: the ``allocator`` label (dashboards that merge several processes tell them
            apart by it).
        prefix: the metric names' prefix. Several allocators in one registry need distinct
            prefixes (a registry holds each metric name once).

    Returns:
        The collector (``registry.unregister(collector)`` removes it).

    Raises:
        ValueError: the registry already holds these metric names (prometheus-client's
            duplicate check), or ``name`` is empty.
    """
    from .._sync import SyncAllocator

    if not name:
        raise ValueError("name must be a non-empty label value")
    allocator = kv.allocator if isinstance(kv, SyncAllocator) else kv
    collector = AllocatorCollector(allocator, name, prefix)
    (REGISTRY if registry is None else registry).register(collector)
    allocator._observe = collector.observe_alloc  # one exporter per allocator: the latest
    return collector
