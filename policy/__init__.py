"""Scheduler side of dynamic offloading.

- :mod:`.config`      one frozen config, validated at start-up
- :mod:`.messages`    the scheduler <-> worker message types
- :mod:`.latency`     decode-latency estimators: measured averages and a link-aware model
- :mod:`.algorithm`   the priced rule (default) and the seed's Algorithm 1
- :mod:`.pricing`     what a level change costs (stalls), the climb margin
- :mod:`.audit`       each climb measured against the window before it; the back-off
- :mod:`.geometry`    the capacity plan: pages, groups, KV layout, what each level adds
- :mod:`.controller`  policy + elastic pool + the command protocol, step by step
- :mod:`.hacks`       every private vLLM symbol the scheduler side touches
- :mod:`.block_pool`  elastic KV block pool over vLLM's BlockPool (tiers, groups, draining)
- :mod:`.scheduler`   the ``--scheduler-cls`` subclass of vLLM's AsyncScheduler
- :mod:`.trace`       JSON-lines trace of every step and level change
- :mod:`.status`      the status board: live state to the API server, operator controls back
- :mod:`.metrics`     Prometheus metrics (``vllm.stat_logger_plugins`` entry point)
- :mod:`.endpoint`    the status endpoint and level controls (``vllm.endpoint_plugins``)
"""
