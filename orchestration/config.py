"""The app's configuration: one pydantic model, per stage model, placement, scaling, batching and switch.

Defaults fit a 2-core CPU box with no GPU and no network (embedded tiny models, fractional CPUs:
ingress 0.1 + LLM 0.5 + diffusion 0.5 each). Point `model` at a real checkpoint, `device` at "cuda"
and `ray_actor_options` at `{"num_gpus": 1}` for a GPU box.

`AppConfig.from_args(args)` accepts Serve application-builder arguments: YAML `args:` (nested
mappings) or `serve run ... key=value` pairs with dotted keys (`diffusion.num_replicas=2`), each value
parsed as a YAML scalar (`true`, `2`, `0.5`, `null`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from contracts.sampling import LLMSamplingParams


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeploymentConfig(_Config):
    """How Serve places and scales one deployment."""

    num_replicas: Annotated[int, Field(ge=1)] | None = None  # None without autoscaling: 1
    # Serve's autoscaling_config (min_replicas, max_replicas, target_ongoing_requests, ...); excludes num_replicas.
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.5})
    max_ongoing_requests: Annotated[int, Field(ge=1)] = 64
    # Serve's own back-pressure: past this many queued calls a caller gets BackPressureError (503).
    max_queued_requests: Annotated[int, Field(ge=1)] = 128

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> DeploymentConfig:
        if self.autoscaling_config is not None and self.num_replicas is not None:
            raise ValueError("give num_replicas or autoscaling_config, not both")
        return self

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options(...)`."""
        options = {
            "ray_actor_options": dict(self.ray_actor_options),
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
        }
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = dict(self.autoscaling_config)
        else:
            options["num_replicas"] = self.num_replicas or 1
        return options


class StageConfig(DeploymentConfig):
    """A model-serving stage: what it loads, where, and its batch-invariance switch."""

    model: str | None = None  # None: the embedded tiny default (built locally, no download)
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # true/false: this stage's switch; null: follow OMNI_<STAGE>_BATCH_INVARIANT / VLLM_BATCH_INVARIANT.
    batch_invariant: StrictBool | None = None
    # Threads per replica (None: torch's default, all cores); several replicas on one box should split them.
    torch_threads: Annotated[int, Field(ge=1)] | None = 1


class LLMConfig(StageConfig):
    max_model_len: Annotated[int, Field(ge=16)] = 1024
    max_num_seqs: Annotated[int, Field(ge=1)] = 8  # the engine's batch: sequences per scheduling step
    kv_cache_gib: Annotated[float, Field(gt=0)] | None = None
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    system_prompt: str | None = None
    # Further vllm AsyncEngineArgs (e.g. tensor_parallel_size); the stage refuses ones that break invariance.
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # Sampling of the prompt rewrite; its seed is always the image's own seed s_i.
    enhance: dict[str, Any] = Field(default_factory=lambda: {"temperature": 1.0, "max_tokens": 48})

    @model_validator(mode="after")
    def _enhance_is_seedless_sampling(self) -> LLMConfig:
        if "seed" in self.enhance:
            raise ValueError("llm.enhance must not set seed: each image's enhancement uses the image's own seed")
        LLMSamplingParams.model_validate(self.enhance)
        return self

    def stage_kwargs(self, batch_invariant: bool) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "batch_invariant": batch_invariant,
            "device": self.device,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "kv_cache_gib": self.kv_cache_gib,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "torch_threads": self.torch_threads,
            **self.engine_args,
        }
        if self.system_prompt is not None:
            kwargs["system_prompt"] = self.system_prompt
        return kwargs


class DiffusionConfig(StageConfig):
    max_batch_size: Annotated[int, Field(ge=1)] = 8
    batch_wait_timeout_s: Annotated[float, Field(ge=0)] = 0.05
    max_queued: Annotated[int, Field(ge=1)] = 64  # the stage's own bound; past it: QueueFullError (503)
    max_pixels: Annotated[int, Field(ge=64)] = 512 * 512
    # Sampling defaults for fields a request leaves out (num_inference_steps, guidance_scale, height, width).
    defaults: dict[str, Any] | None = None
    # The serving limit on steps (the contract allows up to 500): refused with a 400 above it.
    max_inference_steps: Annotated[int, Field(ge=1, le=500)] = 50
    warm_up: bool = True

    def stage_kwargs(self, batch_invariant: bool) -> dict[str, Any]:
        return {
            "batch_invariant": batch_invariant,
            "device": self.device,
            "dtype": self.dtype,
            "torch_threads": self.torch_threads,
            "max_batch_size": self.max_batch_size,
            "batch_wait_timeout_s": self.batch_wait_timeout_s,
            "max_queued": self.max_queued,
            "defaults": self.defaults,
            "max_pixels": self.max_pixels,
            "warm_up": self.warm_up,
        }


class IngressConfig(DeploymentConfig):
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.1})
    # Seconds a /health probe waits for each stage's describe().
    health_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    # Bound on one HTTP request end to end (both stages, all images); past it: 504.
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0


class AppConfig(_Config):
    """The whole app. `build_app(AppConfig(...))`; every field has a default that runs offline on 2 CPUs."""

    name: str = "omniserve"
    llm: LLMConfig = Field(default_factory=LLMConfig)
    diffusion: DiffusionConfig = Field(default_factory=DiffusionConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)

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


class ServingSettings(_Config):
    """What the ingress needs, resolved once in `build_app` and passed to it explicitly (plain data)."""

    # The switches as resolved when the app was built; each stage got the same value explicitly.
    batch_invariant: dict[str, bool]
    # Names a request's `model` may use besides what each stage reports serving ("llm", "diffusion").
    model_aliases: dict[str, list[str]]
    enhance: dict[str, Any]
    max_inference_steps: int
    max_pixels: int
    configured_replicas: dict[str, int | dict[str, Any]]
    deployment_names: dict[str, str]
    health_timeout_s: float
    request_timeout_s: float

    @classmethod
    def of(cls, config: AppConfig, batch_invariant: dict[str, bool], names: dict[str, str]) -> ServingSettings:
        def replicas(stage: DeploymentConfig) -> int | dict[str, Any]:
            return dict(stage.autoscaling_config) if stage.autoscaling_config is not None else stage.num_replicas or 1

        return cls(
            batch_invariant=dict(batch_invariant),
            model_aliases={
                stage: [alias for alias in (getattr(config, stage).model, stage) if alias]
                for stage in ("llm", "diffusion")
            },
            enhance=dict(config.llm.enhance),
            max_inference_steps=config.diffusion.max_inference_steps,
            max_pixels=config.diffusion.max_pixels,
            configured_replicas={name: replicas(getattr(config, name)) for name in ("ingress", "llm", "diffusion")},
            deployment_names=dict(names),
            health_timeout_s=config.ingress.health_timeout_s,
            request_timeout_s=config.ingress.request_timeout_s,
        )
