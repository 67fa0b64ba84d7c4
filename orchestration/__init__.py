"""The Serve app: config model, ingress, pipeline, `build_app`.

Imported lazily, so that `omniserve` (the CLI) starts without loading Ray Serve and the stages.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AppConfig", "app_builder", "build_app"]


def __getattr__(name: str) -> Any:
    if name in ("build_app", "app_builder"):
        from . import app

        return getattr(app, name)
    if name == "AppConfig":
        from .config import AppConfig

        return AppConfig
    raise AttributeError(f"module 'orchestration' has no attribute {name!r}")
