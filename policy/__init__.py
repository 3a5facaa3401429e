"""Scheduler side of dynamic offloading.

- :mod:`.config`      one frozen config, validated at start-up
- :mod:`.messages`    the scheduler <-> worker message types
- :mod:`.latency`     decode-latency estimators: measured averages and a link-aware model
- :mod:`.algorithm`   Algorithm 1 of the seed (pressure, proxy, cooldown, warm-up)
- :mod:`.block_pool`  elastic KV block pool over vLLM's BlockPool (tiers, groups, draining)
- :mod:`.scheduler`   the ``--scheduler-cls`` subclass of vLLM's AsyncScheduler
- :mod:`.trace`       JSON-lines trace of every step and level change
"""
