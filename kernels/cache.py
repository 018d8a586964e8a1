"""kvscope's cache folder: $KVSCOPE_CACHE_DIR, else ~/.cache/kvscope.

The kernels are the package's lowest stage (the engine imports them, never the reverse), so
they name the folder themselves; the C++ builds live under it (cpu_extension.py), and the
engine keeps its converted models, packed weights and profiles in the same folder
(engine/worker/loader.py, packed_cache.py, profile_cache.py).
"""

import os
from pathlib import Path

CACHE_DIR_ENV = "KVSCOPE_CACHE_DIR"


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvscope"
