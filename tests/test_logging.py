"""Every module logger of the plugin sits under vLLM's ``vllm`` logger, so its INFO lines reach
vLLM's handler and format (a logger named after the module, ``dynoff.*``, falls through to
Python's last-resort handler, which drops INFO: the start-up and shutdown summaries were lost
that way)."""

from __future__ import annotations

import importlib
import logging
import pkgutil

import dynoff


def test_every_module_logger_reaches_vllms_handler() -> None:
    loggers = {}
    for info in pkgutil.walk_packages(dynoff.__path__, "dynoff."):
        module = importlib.import_module(info.name)
        logger = getattr(module, "logger", None)
        if isinstance(logger, logging.Logger):
            loggers[info.name] = logger
    assert {"dynoff.compile_pass.worker_base", "dynoff.policy.scheduler"} <= set(loggers)
    vllm_root = logging.getLogger("vllm")
    assert vllm_root.handlers, "vLLM configures a handler on its root logger"
    for name, logger in loggers.items():
        assert logger.name.startswith("vllm."), f"{name} logs as {logger.name!r}"
        assert logger.isEnabledFor(logging.INFO), name
