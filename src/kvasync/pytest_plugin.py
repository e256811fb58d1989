"""``kvasync.pytest_plugin``: the pytest plugin's name before it moved to
``kvasync.integrations.pytest_plugin`` (the ``pytest11`` entry point names the new one).

Kept so that a ``pytest_plugins = ["kvasync.pytest_plugin"]`` line keeps working, with the entry
point loaded or not (``-p no:kvasync``, ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``).
"""

import pytest

from .integrations import pytest_plugin as _plugin
from .integrations.pytest_plugin import kv_allocator as kv_allocator
from .integrations.pytest_plugin import kv_faults as kv_faults

__all__ = ["kv_allocator", "kv_faults"]  # what it had; kv_allocator_sync is only in the new home


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    # The plugin's hooks (its option, its marker) come from the plugin itself, registered once:
    # not re-exported here, where the entry point's copy would add the option a second time, and
    # not through pytest_plugins, which pluggy refuses when the entry point registered the same
    # module under its own name. Historic hooks (addoption, configure) replay for it.
    if not pluginmanager.is_registered(_plugin):
        pluginmanager.register(_plugin, "kvasync.integrations.pytest_plugin")
