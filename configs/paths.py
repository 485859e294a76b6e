"""Where specload's files live: one definition for every module.

``REPO_ROOT`` is the folder that holds ``models/`` (the embedded models) and
``data/prompts/`` (the prompt datasets); relative model paths in Serve
configs (``models/target``) resolve against it. It is, in this order:

1. ``$SPECLOAD_HOME`` when set (a checkout, or any copy of ``models/`` and ``data/``);
2. the checkout this code runs from (``python -m loadgen`` in a clone, or an
   editable install);
3. the data home of a non-editable ``pip install .``: ``pyproject.toml``
   installs ``models/`` and ``data/prompts/`` as data files under
   ``<sys.prefix>/share/specload/`` (``DATA_HOME``);
4. the current directory, when it holds ``models/target``.

If none holds the models, ``REPO_ROOT`` stays the checkout location and code
that needs a model fails naming the missing path.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent   # the folder holding configs/, actors/, ...
DATA_HOME = Path(sys.prefix) / "share" / "specload"     # where `pip install .` puts the data files
CONFIGS_DIR = Path(__file__).resolve().parent            # package data: serve.yaml, tiers.yaml


def _has_models(root: Path) -> bool:
    return (root / "models" / "target" / "config.json").is_file()


def find_root() -> Path:
    """The folder holding ``models/`` and ``data/prompts/`` (see the module docstring)."""
    env = os.environ.get("SPECLOAD_HOME")
    if env:
        return Path(env).expanduser().resolve()
    for cand in (PACKAGE_ROOT, DATA_HOME, Path.cwd()):
        if _has_models(cand):
            return cand
    return PACKAGE_ROOT


REPO_ROOT = find_root()
MODELS_DIR = REPO_ROOT / "models"
PROMPTS_DIR = REPO_ROOT / "data" / "prompts"
