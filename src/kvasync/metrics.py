"""``kvasync.metrics``: the name of the Prometheus collector before it moved to
``kvasync.integrations.metrics``. Kept so that code written against it keeps working."""

from .integrations.metrics import AllocatorCollector as AllocatorCollector
from .integrations.metrics import register as register

__all__ = ["AllocatorCollector", "register"]
