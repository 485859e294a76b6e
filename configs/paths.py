"""Where specload's files live: one definition for every module.

In a checkout these are folders of the repository. After a non-editable
``pip install .`` the embedded models and prompt files are found through
``SPECLOAD_HOME`` (a checkout or an unpacked copy of ``models/`` and
``data/``) or, failing that, relative to the current directory.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def _find_root() -> Path:
    env = os.environ.get("SPECLOAD_HOME")
    if env:
        return Path(env).expanduser().resolve()
    for cand in (PACKAGE_ROOT, Path.cwd()):
        if (cand / "models" / "target").is_dir():
            return cand
    return PACKAGE_ROOT


REPO_ROOT = _find_root()
MODELS_DIR = REPO_ROOT / "models"
PROMPTS_DIR = REPO_ROOT / "data" / "prompts"
CONFIGS_DIR = Path(__file__).resolve().parent
