"""kvasync.integrations: kvasync plugged into other projects.

One module each, imported only by whoever uses it, so that the core never needs their libraries:

- ``kvasync.integrations.metrics``: a Prometheus collector of an allocator's stats
  (``kvasync[metrics]``);
- ``kvasync.integrations.pytest_plugin``: the ``kv_allocator`` and ``kv_faults`` fixtures
  (registered through the ``pytest11`` entry point);
- ``kvasync.integrations.vllm``: the vLLM plugin (``kvasync[vllm]``; vLLM loads it through its
  ``vllm.general_plugins`` entry point).
"""
