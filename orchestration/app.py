"""`build_app(config)`: the Serve application, read like the data path in DESIGN.md.

    client -> Ingress -> LLMStage.enhance (seed s_i) -> DiffusionStage.render (seed s_i) -> client
                     -> ImageStore (the files `response_format: "url"` links to)
                     -> VideoJobs -> LLMStage.enhance (seed) -> VideoStage.render (seed)   (`video` configured)

Each deployment gets its typed config whole, Serve's options included. Both batch-invariance switches are
resolved here, once, in the process that builds the app (`AppConfig.with_resolved_switches`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from ray import serve
from ray.serve import Deployment

from stages.diffusion import DiffusionStage
from stages.diffusion.video_stage import VideoStage
from stages.llm import LLMStage

from .config import DEPLOYMENT_NAMES, VIDEO_JOBS_NAME, AppConfig
from .image_store import ImageStore
from .ingress import Ingress
from .video_jobs import VideoJobs


def build_app(config: AppConfig | Mapping[str, Any] | None = None) -> serve.Application:
    """The whole app from one config (None: the embedded defaults, offline on 2 CPUs)."""
    config = config if isinstance(config, AppConfig) else AppConfig.model_validate(config or {})
    config = config.with_resolved_switches()
    # @serve.deployment made each class a Deployment; mypy does not apply class decorators.
    llm = (
        cast(Deployment, LLMStage)
        .options(name=DEPLOYMENT_NAMES["llm"], **config.llm.deployment_options())
        .bind(config.llm)
    )
    diffusion = (
        cast(Deployment, DiffusionStage)
        .options(name=DEPLOYMENT_NAMES["diffusion"], **config.diffusion.deployment_options())
        .bind(config.diffusion)
    )
    files = cast(Deployment, ImageStore).bind(config.ingress.image_url_store_mib << 20, config.ingress.image_url_ttl_s)
    videos = None
    if config.video is not None:
        video = (
            cast(Deployment, VideoStage)
            .options(name=DEPLOYMENT_NAMES["video"], **config.video.deployment_options())
            .bind(config.video)
        )
        videos = cast(Deployment, VideoJobs).options(name=VIDEO_JOBS_NAME).bind(llm, video, config)
    return (
        cast(Deployment, Ingress)
        .options(name=DEPLOYMENT_NAMES["ingress"], **config.ingress.deployment_options())
        .bind(llm, diffusion, config, files, videos)
    )


def app_builder(args: Mapping[str, Any] | None = None) -> serve.Application:
    """Serve's application-builder hook: YAML `args:` or `serve run module:app_builder key=value ...`."""
    return build_app(AppConfig.from_args(args))
