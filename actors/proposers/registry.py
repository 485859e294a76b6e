"""Strategy id -> proposer class. Adding a strategy = one file + one line here.

Imports are lazy so the registry can be read without importing torch-heavy
modules, and a strategy whose module fails to import is reported by name.
"""

from __future__ import annotations

import importlib

PROPOSERS: dict[str, str] = {
    "autoregressive": "actors.proposers.autoregressive:AutoregressiveProposer",
    "draft_model": "actors.proposers.draft_model:DraftModelProposer",
    "ngram": "actors.proposers.ngram:NgramProposer",
    "dflash": "actors.proposers.dflash:DFlashProposer",
    "dflash2": "actors.proposers.dflash2:DFlash2Proposer",
    "dspark": "actors.proposers.dspark:DSparkProposer",
}


def get_proposer_class(strategy: str):
    """The proposer class for ``strategy``; raises ValueError listing the known ids."""
    if strategy not in PROPOSERS:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {sorted(PROPOSERS)}")
    mod, cls = PROPOSERS[strategy].split(":")
    return getattr(importlib.import_module(mod), cls)
