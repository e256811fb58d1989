"""kvasync.simulate: ``kvasync simulate``, a simulated serving load over one allocator.

Not library code: a demonstration of the allocator under a rising and falling load, kept out of
the modules a user imports.
"""

from ._simulation import DemoOptions as DemoOptions
from ._simulation import DemoReport as DemoReport
from ._simulation import format_report as format_report
from ._simulation import run_demo as run_demo
from ._simulation import simulate_command as simulate_command

__all__ = ["DemoOptions", "DemoReport", "format_report", "run_demo", "simulate_command"]
