"""The only place environment variables are read."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """Where dequantized weights are cached: $STRATA_CACHE_DIR, else ~/.cache/strata."""
    explicit = os.environ.get("STRATA_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "strata")


def log_level() -> str:
    return os.environ.get("STRATA_LOG_LEVEL", "INFO").upper()
