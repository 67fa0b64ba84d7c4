"""`build_app(config)`: the Serve application, read like the data path in DESIGN.md.

    client -> Ingress -> LLMStage.enhance (seed s_i) -> DiffusionStage.generate (seed s_i) -> client

Each stage's batch-invariance switch is resolved here, once, in the process that builds the app, and
passed to its replicas as an explicit boolean: an actor on another node never consults the builder's
environment, and the ingress reports exactly the values the stages were given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve

from contracts.invariance import resolve_batch_invariant
from stages.diffusion import DiffusionStage
from stages.llm import LLMStage

from .config import AppConfig, ServingSettings
from .ingress import Ingress

#: Deployment names (fixed: Serve config files and /health refer to them).
DEPLOYMENT_NAMES = {"ingress": "Ingress", "llm": "LLMStage", "diffusion": "DiffusionStage"}


def build_app(config: AppConfig | Mapping[str, Any] | None = None) -> serve.Application:
    """The whole app from one config (None: the embedded defaults, offline on 2 CPUs)."""
    config = config if isinstance(config, AppConfig) else AppConfig.model_validate(config or {})
    switches = {
        stage: resolve_batch_invariant(stage, override=getattr(config, stage).batch_invariant)
        for stage in ("llm", "diffusion")
    }
    llm = LLMStage.options(name=DEPLOYMENT_NAMES["llm"], **config.llm.deployment_options()).bind(
        config.llm.model, **config.llm.stage_kwargs(switches["llm"])
    )
    diffusion = DiffusionStage.options(name=DEPLOYMENT_NAMES["diffusion"], **config.diffusion.deployment_options()).bind(
        config.diffusion.model, **config.diffusion.stage_kwargs(switches["diffusion"])
    )
    settings = ServingSettings.of(config, switches, DEPLOYMENT_NAMES)
    return Ingress.options(name=DEPLOYMENT_NAMES["ingress"], **config.ingress.deployment_options()).bind(
        llm, diffusion, settings.model_dump()
    )


def app_builder(args: Mapping[str, Any] | None = None) -> serve.Application:
    """Serve's application-builder hook: YAML `args:` or `serve run module:app_builder key=value ...`."""
    return build_app(AppConfig.from_args(args))
