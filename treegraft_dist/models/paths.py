"""Where the models' files live: the cache of prepared models and what each module keeps there, and the files
one module writes beside a model folder for another to read. A leaf: it imports nothing of the package."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "TREEGRAFT_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/treegraft/models"
GROUPS_FILE = "treegraft-weight-groups.safetensors"  # written by prepare.py beside a converted GGUF model


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir` if given, else $TREEGRAFT_CACHE, else ~/.cache/treegraft/models."""
    return Path(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()
