"""Embedded tiny models: real architectures with random weights, built locally from a fixed seed.

No model weights can be downloaded on the machines this project targets, so every test and the
embedded default build small real-architecture models on first use, cache them under
`cache_root()`, and reuse them. Building is deterministic: the same seed and library versions
give the same weights.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where built models live: $OMNISERVE_CACHE, else $XDG_CACHE_HOME/omniserve, else ~/.cache/omniserve."""
    explicit = os.environ.get("OMNISERVE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "omniserve"
