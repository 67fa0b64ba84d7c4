"""Embedded tiny models: real architectures built locally from a fixed seed; the one registry of their ids.

No model weights can be downloaded on the machines this project targets, so the tests build small
real-architecture models on first use, cache them under `contracts.envs.cache_root()`, and reuse them. Building is
deterministic: the same seed and library versions give the same weights. The exceptions are the two defaults:
trained by the project (`training.shapes`, `training.rewriter`), committed.

    EMBEDDED_MODELS   id -> (stage, recipe): every embedded model, by the id a config or request names
    DEFAULT_MODELS    the stage defaults (a config's `model: null`); both are trained, not random, committed with
                      their training records: the diffusion default draws shapes (`training.scenes`), the LLM
                      default rewrites free prompts into their words and chats (`training.rewriter`)
    build_cached      the one cache builder: build aside, marker last, one atomic rename
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from contracts.envs import cache_root
from stages.trust import UntrustedCacheError, distrust, ours_to_replace

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODELS",
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "MARKER",
    "build_cached",
    "cache_root",
    "embedded_adapters",
    "embedded_models",
]


@dataclass(frozen=True)
class EmbeddedModel:
    id: str
    stage: Literal["llm", "diffusion"]
    # diffusion: "unet" | "dit" | "sdxl" | "flux" | "qwen" | "pixart" | "shapes"; LLM: a TinyLlamaSpec name, "rewriter"
    recipe: str
    default: bool = False  # the stage's model when its config says `model: null`
    # Trained weights (committed, `training.shapes`) rather than random ones built from a seed.
    trained: bool = False
    # A pipeline the step engine has no family for, built to show the whole-request fallback: not in the audited and
    # benchmarked set (`embedded_models`).
    fallback: bool = False
    # Its LoRA adapters (committed, `training.shapes_lora`): the adapters directory a replica serving it uses
    # when its config names none (`lora_dir`).
    adapters: str | None = None
    # A video model (recipe "wan"): rendered by the step engine's video family, not in the image audits and benchmarks.
    video: bool = False


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.id: m
    for m in (
        EmbeddedModel(
            "omniserve/tiny-shapes-sd",
            "diffusion",
            "shapes",
            default=True,
            trained=True,
            adapters="tiny-shapes-sd-loras",
        ),
        EmbeddedModel("omniserve/tiny-sd-unet", "diffusion", "unet"),
        EmbeddedModel("omniserve/tiny-sd3-dit", "diffusion", "dit"),
        EmbeddedModel("omniserve/tiny-sdxl-unet", "diffusion", "sdxl"),
        EmbeddedModel("omniserve/tiny-flux-dit", "diffusion", "flux"),
        EmbeddedModel("omniserve/tiny-qwen-image", "diffusion", "qwen"),
        EmbeddedModel("omniserve/tiny-pixart-dit", "diffusion", "pixart", fallback=True),
        EmbeddedModel("omniserve/tiny-wan-video", "diffusion", "wan", video=True),
        # Random weights from a seed: the audits' and benchmarks' LLM (`embedded_models`), served by name.
        EmbeddedModel("embedded:tiny-llama", "llm", "tiny-llama"),
        # The LLM default: the same architecture trained here to rewrite free prompts into the image default's words
        # and to chat (`training.rewriter`, committed).
        EmbeddedModel("embedded:tiny-rewriter", "llm", "rewriter", default=True, trained=True),
        EmbeddedModel("embedded:wide-llama", "llm", "wide-llama"),
        # Llama 3.2 1B's widths and depth, random weights: the real-size LLM of the real-width audit (3.9 GB, built
        # on first use).
        EmbeddedModel("embedded:llama-1b-width", "llm", "llama-1b-width"),
    )
}
DEFAULT_MODELS: dict[str, str] = {m.stage: m.id for m in EMBEDDED_MODELS.values() if m.default}


def embedded_models(stage: str) -> tuple[str, ...]:
    """Every random-weight embedded model id of `stage` the step engine drives (the audits' and benchmarks' models),
    in registry order.

    Random weights are the wider test of the kernels: every value path is exercised, none learned away. The
    trained models, both defaults among them, are left out (DEFAULT_MODELS names them), and so are video models.
    """
    return tuple(
        m.id for m in EMBEDDED_MODELS.values() if m.stage == stage and not (m.trained or m.fallback or m.video)
    )


def embedded_adapters(model: str) -> str | None:
    """The committed adapters directory of embedded model `model`; None for any other model."""
    entry = EMBEDDED_MODELS.get(model)
    return str(Path(__file__).resolve().parent / entry.adapters) if entry and entry.adapters else None


#: Written last into a built directory: its presence means the build is complete.
MARKER = "omniserve-built.json"


def is_built(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def build_cached(target: Path, build: Callable[[Path], dict[str, Any]]) -> Path:
    """`target`, built by `build(directory) -> record` on first use and reused after.

    The build happens in a temporary directory beside the target; the record is written last as MARKER,
    then one atomic rename: a concurrent process sees all of it or nothing. A directory without the marker
    (a crash mid-build) is never trusted: it is replaced. Nor is one that another user owns or could write
    (`stages.trust`): it is rebuilt when it is this user's to replace, else refused.
    """
    if is_built(target):
        reason = distrust(target) or distrust(target / MARKER)
        if reason is None:
            return target
        if not ours_to_replace(target):
            raise UntrustedCacheError(f"refusing the cached model at {target}: {reason}")
        logger.warning("rebuilding the cached model at %s: %s", target, reason)
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the cache from replicas running as another user
    try:
        record = build(staging)
        (staging / MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        try:
            os.rename(staging, target)
        except OSError:
            if not is_built(target):  # a broken leftover, not a finished concurrent build: replace it
                shutil.rmtree(target, ignore_errors=True)
                os.rename(staging, target)
            # else another process finished first; its build is identical, ours is discarded below.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
