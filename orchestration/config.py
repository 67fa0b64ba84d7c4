"""The app's configuration: one pydantic model holding each deployment's typed config.

Each section is the config object its deployment receives whole (`contracts.config`): `llm` ->
LLMStageConfig, `diffusion` -> DiffusionStageConfig, `ingress` -> IngressConfig.

`AppConfig.from_args(args)` accepts Serve application-builder arguments: YAML `args:` (nested
mappings) or `serve run ... key=value` pairs with dotted keys (`diffusion.num_replicas=2`), each value
parsed as a YAML scalar (`true`, `2`, `0.5`, `null`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contracts.config import (
    DEFAULT_REWRITE_CACHE_ENTRIES,
    DeploymentConfig,
    DiffusionStageConfig,
    IngressConfig,
    LLMStageConfig,
    VideoStageConfig,
)
from contracts.invariance import STAGES, Switches, resolve_batch_invariant

#: Deployment names (fixed: Serve config files, /health and operators refer to them).
#: Each config section's deployment (`video`'s only where it is set: `AppConfig.parts`); the video jobs' has no section.
DEPLOYMENT_NAMES = {"ingress": "Ingress", "llm": "LLMStage", "diffusion": "DiffusionStage", "video": "VideoStage"}
VIDEO_JOBS_NAME = "VideoJobs"


class AppConfig(BaseModel):
    """The whole app. `build_app(AppConfig(...))`; every field has a default that runs offline on 2 CPUs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "omniserve"
    llm: LLMStageConfig = Field(default_factory=LLMStageConfig)
    diffusion: DiffusionStageConfig = Field(default_factory=DiffusionStageConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    # The video stage and the Videos API (`/v1/videos`); None: not served (`video: {}` serves the tiny Wan).
    video: VideoStageConfig | None = None

    def with_resolved_switches(self) -> AppConfig:
        """Each stage's `batch_invariant` decided now (config, else environment), as an explicit bool.

        Done once, in the process that builds the app: a replica on another node never consults the
        builder's environment, and the ingress reports exactly the values the stages were given.
        """
        update: dict[str, Any] = {
            stage: getattr(self, stage).model_copy(
                update={
                    "batch_invariant": resolve_batch_invariant(stage, override=getattr(self, stage).batch_invariant)
                }
            )
            for stage in STAGES
        }
        if self.video is not None:  # a diffusion deployment: the diffusion stage's environment decides it unless set
            resolved = resolve_batch_invariant("diffusion", override=self.video.batch_invariant)
            update["video"] = self.video.model_copy(update={"batch_invariant": resolved})
        return self.model_copy(update=update)

    @property
    def switches(self) -> Switches:
        """Both stages' switches; call on a resolved config."""
        return Switches(llm=bool(self.llm.batch_invariant), diffusion=bool(self.diffusion.batch_invariant))

    @property
    def rewrite_cache_entries(self) -> int:
        """The ingress's rewrite cache bound; unset: on (DEFAULT_REWRITE_CACHE_ENTRIES) only when the LLM is invariant."""
        if self.ingress.rewrite_cache_entries is not None:
            return self.ingress.rewrite_cache_entries
        return DEFAULT_REWRITE_CACHE_ENTRIES if self.switches.llm else 0

    def deployment(self, part: str) -> DeploymentConfig:
        return getattr(self, part)

    @property
    def parts(self) -> list[str]:
        """The config sections whose deployments this app runs (`video` only where set)."""
        return [part for part in DEPLOYMENT_NAMES if getattr(self, part) is not None]

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> AppConfig:
        """From Serve builder args: nested mappings, or dotted `key=value` strings from the command line."""
        import copy

        import yaml

        nested: dict[str, Any] = {}
        for key, value in (args or {}).items():
            if isinstance(value, str):
                value = yaml.safe_load(value) if value.strip() else value
            value = copy.deepcopy(value)  # never alias (and later mutate) the caller's mappings
            *parents, leaf = str(key).split(".")
            target = nested
            for part in parents:
                target = target.setdefault(part, {})
                if not isinstance(target, dict):
                    raise ValueError(f"argument {key!r} conflicts with another argument")
            if isinstance(value, Mapping) and isinstance(target.get(leaf), dict):
                target[leaf].update(value)
            else:
                target[leaf] = value
        return cls.model_validate(nested)
