"""Where spmdrl keeps what it builds on first use: models, task files, compiled kernels.

``$SPMDRL_CACHE``, or ``~/.cache/spmdrl``. Built-in models and tasks go under
``models/`` and ``data/`` (``spmdrl.builtin``), the native engine's C++ kernels
under ``kernels/`` and inductor's fused kernels under ``inductor/``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$SPMDRL_CACHE or ~/.cache/spmdrl."""
    return Path(os.environ.get("SPMDRL_CACHE", Path.home() / ".cache" / "spmdrl"))
