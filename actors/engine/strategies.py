"""Strategy id -> proposer class, loaded from the one table in ``configs.metric_names``.

Imports are lazy so the table can be read without importing torch-heavy
modules, and a strategy whose module fails to import is reported by name.
"""

from __future__ import annotations

import importlib

from configs.metric_names import PROPOSER_CLASSES

PROPOSERS = PROPOSER_CLASSES


def get_proposer_class(strategy: str):
    """The proposer class for ``strategy``.

    Raises:
        ValueError: ``strategy`` is not a known id (the message lists them).
    """
    if strategy not in PROPOSERS:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {sorted(PROPOSERS)}")
    mod, cls = PROPOSERS[strategy].split(":")
    return getattr(importlib.import_module(mod), cls)
