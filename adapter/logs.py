"""jacklring's loggers follow the program's logging configuration; nothing here runs at import.

Every module logs to a child of the "jacklring" logger and never adds a handler or sets a level
on its own, so a program that configures nothing sees jacklring's warnings and errors only
(Python's last-resort handler) and a program that configures logging (Ray, Lightning, a
basicConfig) decides what it sees. Per-rank formation details are DEBUG records.

MLX_RING_VERBOSE=1 (the launcher's --verbose) is the explicit request for more: it sets the
"jacklring" logger to DEBUG and, when the program has configured no handler anywhere, gives it a
stderr handler of its own (never the root logger's: the program's own basicConfig must still work).
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

ROOT_LOGGER = "jacklring"
VERBOSE_VARIABLE = "MLX_RING_VERBOSE"
_TRUE = ("1", "true", "yes", "on")


def verbose_requested(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(VERBOSE_VARIABLE, "").strip().lower() in _TRUE


def apply_verbose_setting(environ: Mapping[str, str] = os.environ) -> bool:
    """When MLX_RING_VERBOSE asks for it, make jacklring's DEBUG records visible (idempotent).
    Called where a group is formed or a newcomer waits to join one, never at import. Returns
    whether it was asked."""
    if not verbose_requested(environ):
        return False
    logger = logging.getLogger(ROOT_LOGGER)
    logger.setLevel(logging.DEBUG)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
        logger.addHandler(handler)
    return True
