"""The parts of ``bench/bench_colocate_many.py``, which keeps the command line and the docstring
that explains the cases, the calibration, the arithmetic and the metrics ("the docstring" in these
modules). Imported as ``_colocate_many`` with bench/ on the path, as the script runs.

    shapes       presets: budgets, request shapes, SLOs; what a page id holds
    traces       the seeded traces and the KV demand they imply
    paper        the arithmetic before the runs; the planned wall time
    calibration  what is measured before any trace exists
    worker       one engine in a worker process (``--worker``)
    harness      the pool of workers; one run of one variant
    runs         a case at one N and its variants
    analysis     the figures of a run
    report       the tables, the plots, the regime checks, the goals
"""
