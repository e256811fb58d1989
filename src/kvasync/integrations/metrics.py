"""Prometheus metrics of an allocator (the ``kvasync[metrics]`` extra: prometheus-client).

``register(kv)`` exports an allocator to a registry. Gauges and counters are read from one
``kv.stats()`` snapshot per scrape, so they agree with ``stats()`` and with each other; the
latency histograms are fed as allocs complete (hot: answered without waiting; cold: waited for a
map or a free; ``Allocator.add_alloc_observer``) and, for maps, from the durations the mapper
records (``Allocator.take_map_seconds``, drained at each scrape: an allocator registered in two
registries gives each map's duration to the one scraped first).

A registry holds each metric name once, so every allocator registered in one registry (under one
prefix) is a sample of the same metrics, told apart by the ``allocator`` label: one collector
per registry and prefix (``_RegistryExport``) reads them all.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._errors import AllocatorClosed

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


class AllocatorCollector:
    """One allocator's metrics in a registry, as ``register`` returns them.

    ``unregister()`` removes them; the registry keeps the metric names while any other
    allocator is registered there.
    """

    def __init__(self, export: _RegistryExport, allocator: Allocator, name: str) -> None:
        self._export = export
        self.allocator = allocator
        self.name = name
        """The ``allocator`` label of its samples."""
        self._hot = export.alloc_latency.labels(name, "hot")
        self._cold = export.alloc_latency.labels(name, "cold")
        self.maps = export.map_latency.labels(name)
        # Through the allocator's public hook; each registration observes on its own.
        try:
            self._stop_observing = allocator.add_alloc_observer(self.observe_alloc)
        except BaseException:  # refused (a forked child): leave no sample behind
            export.drop_labels(name)
            raise

    def observe_alloc(self, waited: bool, seconds: float) -> None:
        (self._cold if waited else self._hot).observe(seconds)

    def unregister(self) -> None:
        """Removes this allocator's samples (and, with the last one, the metrics). Idempotent."""
        self._export.remove(self)
        self._stop_observing()


class _RegistryExport(Collector):
    """kvasync's metrics in one registry under one prefix: a sample per allocator registered."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.registry = registry
        self.prefix = prefix
        self.members: dict[str, AllocatorCollector] = {}  # by label; guarded by _LOCK
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

    def remove(self, member: AllocatorCollector) -> None:
        with _LOCK:
            if self.members.get(member.name) is not member:
                return
            del self.members[member.name]
            self.drop_labels(member.name)
            if not self.members:
                self.registry.unregister(self)
                del _EXPORTS[self.registry][self.prefix]

    def drop_labels(self, name: str) -> None:
        """Removes the histograms' samples of the allocator labelled ``name``."""
        self.alloc_latency.remove(name, "hot")
        self.alloc_latency.remove(name, "cold")
        self.map_latency.remove(name)

    def describe(self) -> Iterator[Metric]:
        """The metric names, without reading any allocator (the registry's duplicate check)."""
        for suffix, _, help_text in _GAUGES:
            yield GaugeMetricFamily(f"{self.prefix}_{suffix}", help_text, labels=["allocator"])
        for suffix, _, help_text in _COUNTERS:
            yield CounterMetricFamily(f"{self.prefix}_{suffix}", help_text, labels=["allocator"])
        yield from self.alloc_latency.describe()
        yield from self.map_latency.describe()

    def collect(self) -> Iterator[Metric]:
        with _LOCK:
            members = list(self.members.values())
        gauges = [
            GaugeMetricFamily(f"{self.prefix}_{suffix}", help_text, labels=["allocator"])
            for suffix, _, help_text in _GAUGES
        ]
        counters = [
            CounterMetricFamily(f"{self.prefix}_{suffix}", help_text, labels=["allocator"])
            for suffix, _, help_text in _COUNTERS
        ]
        for member in members:
            try:
                durations = member.allocator.take_map_seconds()
                stats = member.allocator.stats()
            except AllocatorClosed:
                # Opened by the parent of this forked process: not this process's to report
                # (Note [Fork]); the others still are.
                continue
            for seconds in durations:
                member.maps.observe(seconds)
            for gauge, (_, field, _) in zip(gauges, _GAUGES, strict=True):
                gauge.add_metric([member.name], getattr(stats, field))
            for counter, (_, field, _) in zip(counters, _COUNTERS, strict=True):
                counter.add_metric([member.name], getattr(stats, field))
        yield from gauges
        yield from counters
        yield from self.alloc_latency.collect()
        yield from self.map_latency.collect()


# registry -> prefix -> its export; _LOCK guards these and every export's members.
_EXPORTS: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, _RegistryExport]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.RLock()


def _label(export: _RegistryExport, allocator: Allocator, name: str | None) -> str:
    """The ``allocator`` label: ``name``, else the allocator's ``Config.name``, else ``kv``;
    an unnamed one gets ``-2``, ``-3``, ... when its label is taken in this registry."""
    if name is not None:
        if not name:
            raise ValueError("name must be a non-empty label value")
        if name in export.members:
            raise ValueError(
                f"an allocator labelled allocator={name!r} is already registered in this "
                "registry: pass a distinct name= to tell them apart"
            )
        return name
    base = allocator.config.name or "kv"
    candidates = itertools.chain([base], (f"{base}-{n}" for n in itertools.count(2)))
    return next(label for label in candidates if label not in export.members)


def register(
    kv: Allocator | SyncAllocator,
    registry: CollectorRegistry | None = None,
    *,
    name: str | None = None,
    prefix: str = "kvasync",
) -> AllocatorCollector:
    """Exports ``kv``'s gauges, counters and latency histograms to a Prometheus registry.

    Several allocators may share a registry: each is a sample of the same metrics, told apart by
    the ``allocator`` label.

    Args:
        kv: an open allocator (async or blocking).
        registry: where to register; prometheus-client's default ``REGISTRY`` when None.
        name: the ``allocator`` label. None: the allocator's ``Config.name``, else ``"kv"``,
            with ``-2``, ``-3``, ... appended when another allocator in this registry has it.
        prefix: the metric names' prefix.

    Returns:
        The allocator's registration (``.name`` is its label; ``.unregister()`` removes it).

    Raises:
        ValueError: ``name`` is empty or another allocator in the registry has it, ``kv`` is
            registered there already, or another collector holds these metric names
            (prometheus-client's duplicate check).
        AllocatorClosed: ``kv`` was opened by the parent of this forked process.
    """
    from .._sync import SyncAllocator

    allocator = kv.allocator if isinstance(kv, SyncAllocator) else kv
    registry = REGISTRY if registry is None else registry
    with _LOCK:
        exports = _EXPORTS.setdefault(registry, {})
        export = exports.get(prefix) or _RegistryExport(registry, prefix)
        if any(member.allocator is allocator for member in export.members.values()):
            raise ValueError(f"this allocator is registered in this registry already ({prefix})")
        label = _label(export, allocator, name)
        # First: observing the allocator is refused in a forked child (AllocatorClosed), before
        # anything is registered.
        member = AllocatorCollector(export, allocator, label)
        if prefix not in exports:
            try:
                registry.register(export)  # a ValueError when another collector has the names
            except BaseException:
                member.unregister()  # stops observing; it was in no export yet
                raise
            exports[prefix] = export
        export.members[label] = member
    return member
