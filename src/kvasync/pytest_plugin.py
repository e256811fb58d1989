"""``kvasync.pytest_plugin``: the pytest plugin's name before it moved to
``kvasync.integrations.pytest_plugin`` (the ``pytest11`` entry point names the new one).
Kept so that a ``pytest_plugins = ["kvasync.pytest_plugin"]`` line keeps working."""

from .integrations.pytest_plugin import *  # noqa: F403
from .integrations.pytest_plugin import __all__ as __all__
