"""Each deployment's configuration: one typed object per stage, defined once.

The same objects are read from YAML `args:` or the builder (`orchestration.AppConfig`), passed whole to the
deployment through `.bind(config)` and on to the engine or renderer. Serve's own options come from here too
(`deployment_options()`), so no decorator carries a value that the config would override.

Defaults fit a 2-core CPU box with no GPU and no network (embedded tiny models, fractional CPUs: ingress
0.1 + LLM 0.5 + diffusion 0.5 each). Point `model` at a real checkpoint, `device` at "cuda" and
`ray_actor_options` at `{"num_gpus": 1}` for a GPU box.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from .admission import DiffusionLimits
from .errors import InvalidRequestError
from .sampling import MAX_FRAMES, DiffusionSamplingParams, LLMSamplingParams, image_fields, optional_model


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
    # At most this many replicas per node (None: no bound): spreads replicas over nodes, so a node lost takes one.
    max_replicas_per_node: Annotated[int, Field(ge=1)] | None = None
    health_check_period_s: Annotated[float, Field(gt=0)] = 10.0
    health_check_timeout_s: Annotated[float, Field(gt=0)] = 30.0

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> Self:
        if self.autoscaling_config is not None and self.num_replicas is not None:
            raise ValueError("give num_replicas or autoscaling_config, not both")
        return self

    @property
    def configured_replicas(self) -> int | dict[str, Any]:
        """What /health reports as configured: a count, or the autoscaling bounds."""
        return dict(self.autoscaling_config) if self.autoscaling_config is not None else self.num_replicas or 1

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options(...)`."""
        options: dict[str, Any] = {
            "ray_actor_options": dict(self.ray_actor_options),
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
        }
        if self.max_replicas_per_node is not None:
            options["max_replicas_per_node"] = self.max_replicas_per_node
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
    # true: with invariance on, refuse to start outside the verified scope (contracts/scope.py), naming the
    # differences; false: start and report `verified: false`; null: follow OMNISERVE_STRICT_SCOPE (default off).
    strict: StrictBool | None = None
    # With invariance on, before it takes traffic the replica audits its own configuration here (solo against
    # co-batched, its kernels against stock: `stages.diffusion.self_audit`, `stages.llm.self_audit`) unless an earlier
    # start's record of the same configuration covers it. quick: every batch size, the target in the middle (diffusion:
    # 2 steps; LLM: the long prompt); full: first, middle and last (diffusion: 4 steps, the neighbours too; LLM: the
    # short prompt too); off: the shipped and user records alone decide.
    self_audit: Literal["quick", "full", "off"] = "quick"

    @field_validator("self_audit", mode="before")
    @classmethod
    def _yaml_off_is_off(cls, value: Any) -> Any:
        """YAML reads a bare `off` as false (`self_audit: off` in a Serve config file, `llm.self_audit=off` on
        `serve run`'s command line): the word was meant."""
        return {False: "off", True: "quick"}.get(value, value) if isinstance(value, bool) else value


class LLMStageConfig(StageConfig):
    max_model_len: Annotated[int, Field(ge=16)] = 1024
    # The engine's batch: sequences per scheduling step. 8, the batch sizes the LLM audit covers: 16 measured no
    # faster in the default app once rewrites were short (docs/performance/stages-and-app.md, balancing the pipeline).
    max_num_seqs: Annotated[int, Field(ge=1)] = 8
    kv_cache_gib: Annotated[float, Field(gt=0)] | None = None  # None (and no utilization): 0.25 GiB
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    system_prompt: str | None = None  # None: the stage's own rewriting instruction
    # Further vllm AsyncEngineArgs (e.g. tensor_parallel_size); the stage refuses ones that break invariance.
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # LoRA adapters a request's `lora` may name (chat completions; `enhance.lora` for the rewrite): PEFT directories
    # `<name>/adapter_config.json` + `adapter_model.safetensors` here, loaded into vLLM at start-up (one it refuses is
    # logged and left out); `max_loras` of them in one engine step, ranks up to `max_lora_rank` (vLLM's sizes: 1, 8,
    # 16, 32, 64, ...). None: no adapters (and vLLM's LoRA path off).
    lora_dir: str | None = None
    max_loras: Annotated[int, Field(ge=1)] = 4
    max_lora_rank: Annotated[int, Field(ge=1)] = 16
    # Sampling of the prompt rewrite; its seed is always the image's own seed s_i.
    enhance: dict[str, Any] = Field(default_factory=lambda: {"temperature": 1.0, "max_tokens": 48})

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.kv_cache_gib is not None and self.gpu_memory_utilization is not None:
            raise ValueError("give kv_cache_gib or gpu_memory_utilization, not both")
        if "seed" in self.enhance:
            raise ValueError("llm.enhance must not set seed: each image's enhancement uses the image's own seed")
        LLMSamplingParams.model_validate(self.enhance)
        return self

    def enhance_params(self, seed: int) -> LLMSamplingParams:
        """The sampling params of one image's prompt rewrite."""
        return LLMSamplingParams.model_validate({**self.enhance, "seed": seed})


class DiffusionDefaults(
    optional_model(  # type: ignore[misc]  # a base made by pydantic.create_model
        "_Defaults", image_fields(default=True), base=_Config, doc="the fields marked `default`"
    )
):
    """Sampling defaults for fields a request leaves out (those DiffusionSamplingParams marks `default`); None: the
    model's own."""


class ParallelDegrees(_Config):
    """One image across several workers of a replica (`stages.diffusion.group`): `cfg` 2 puts the two branches of
    classifier-free guidance (each denoiser call's rows, split in order) on two workers; `sp` (sequence parallel, SD3
    DiTs) splits each part's image tokens among `sp` workers. A degree the model cannot take refuses the replica's
    start, naming the field."""

    cfg: Annotated[int, Field(ge=1, le=2)] = 1
    sp: Annotated[int, Field(ge=1)] = 1

    @property
    def workers(self) -> int:
        return self.cfg * self.sp


class DiffusionStageConfig(StageConfig, DiffusionLimits):
    """The diffusion stage; its serving limits (`max_pixels`, `max_inference_steps`) come from DiffusionLimits."""

    max_batch_size: Annotated[int, Field(ge=1)] = 8
    batch_wait_timeout_s: Annotated[float, Field(ge=0)] = 0.05
    max_queued: Annotated[int, Field(ge=1)] = 64  # the stage's own bound; past it: QueueFullError (503)
    # "step": samples join and leave between denoising steps (pipelines the step engine knows; others fall back
    # to "request"); "request": whole requests of one key per batch (`batch_wait_timeout_s` applies to it).
    batching: Literal["step", "request"] = "step"
    # Step batching of a family that packs sizes (FLUX): samples of different image sizes share a forward (padded
    # tokens, attention per sample); false: one latent shape per forward, as for the other families.
    pack_sizes: bool = True
    # LoRA adapters a request may name (`lora`): `<name>.safetensors` or `<name>/pytorch_lora_weights.safetensors` in
    # this directory, in the diffusers/PEFT or kohya formats; loaded on first use and kept, least recently used
    # dropped first, within `lora_cache_mib` of weights. None: the embedded model's own adapters where it has some (the
    # default's "twins", `training.shapes_lora`), else none; "": none.
    lora_dir: str | None = None
    lora_cache_mib: Annotated[int, Field(ge=1)] = 256
    defaults: DiffusionDefaults = Field(default_factory=DiffusionDefaults)
    warm_up: bool = True
    # The health check fails (and Serve replaces the replica) when one step of the step engine, or one whole
    # batch with request batching, has run longer than this: the compute thread is stuck. Generous for CPUs.
    stuck_after_s: Annotated[float, Field(gt=0)] = 600.0
    # Workers per replica for one image (CFG parallel); more than one: the replica and its workers are placed together.
    parallel: ParallelDegrees = Field(default_factory=ParallelDegrees)

    # One request's work, images x steps x pixels, at most this (8 images of 512x512 at 50 steps by default);
    # fields a request leaves out count at their configured default, or at the limit when none is configured.
    max_request_work: Annotated[int, Field(ge=1)] = 8 * 50 * 512 * 512

    #: Whether its deployment renders videos (VideoStageConfig) or images; its model must be of that kind.
    serves_video: ClassVar[bool] = False

    def check_request_work(self, images: int, params: DiffusionSamplingParams) -> None:
        """Refuse a request whose images x steps x pixels exceed `max_request_work` (a 400 naming `n`)."""
        steps = params.num_inference_steps or self.defaults.num_inference_steps or self.max_inference_steps
        height, width = params.height or self.defaults.height, params.width or self.defaults.width
        pixels = height * width if height and width else self.max_pixels
        if images * steps * pixels > self.max_request_work:
            raise InvalidRequestError(
                f"{images} image(s) x {steps} steps x {pixels} pixels exceeds this server's limit of "
                f"{self.max_request_work} pixel-steps per request; ask for fewer images, steps or pixels",
                param="n",
                code="out_of_range",
            )

    def deployment_options(self) -> dict[str, Any]:
        """Serve's options; with a parallel group, a placement group of one bundle per worker (the replica's first,
        its actor options' resources in each), STRICT_PACK: the group is scheduled whole on one node or not at all."""
        options = super().deployment_options()
        if self.parallel.workers > 1:
            actor = self.ray_actor_options
            bundle = {"CPU": max(float(actor.get("num_cpus", 1)), 0.01)}
            if actor.get("num_gpus"):
                bundle["GPU"] = float(actor["num_gpus"])
            options["placement_group_bundles"] = [bundle] * self.parallel.workers
            options["placement_group_strategy"] = "STRICT_PACK"
        return options

    @field_validator("defaults", mode="before")
    @classmethod
    def _no_defaults(cls, value: Any) -> Any:
        return {} if value is None else value  # `defaults: null` in YAML: the model's own

    @model_validator(mode="after")
    def _queue_holds_a_batch(self) -> Self:
        if self.max_queued < self.max_batch_size:
            raise ValueError("need max_batch_size <= max_queued")
        return self


class VideoStageConfig(DiffusionStageConfig):
    """The video stage (`stages.diffusion.video_stage`): a diffusion deployment of a video model, the embedded tiny Wan
    by default, and the jobs of the Videos API (`orchestration.video_jobs`). Its switch follows the diffusion stage's
    environment (OMNI_DIFFUSION_BATCH_INVARIANT) unless set here."""

    serves_video: ClassVar[bool] = True
    model: str | None = "omniserve/tiny-wan-video"
    max_batch_size: Annotated[int, Field(ge=1)] = 4
    max_queued: Annotated[int, Field(ge=1)] = 16
    fps: Annotated[int, Field(ge=1, le=60)] = 8  # of the MP4; a request's `seconds` are seconds x fps + 1 frames
    max_frames: Annotated[int, Field(ge=1, le=MAX_FRAMES)] = 33
    # A video's whole state every this many denoising steps, kept by its job: a replica lost mid-render, the render
    # goes on from its last checkpoint on another replica instead of from its first step (0: none). Its cost: the
    # state's bytes (the latents, the scheduler's) once per so many steps, small beside a step of a video.
    checkpoint_every: Annotated[int, Field(ge=0)] = 4
    # The jobs (`/v1/videos`): at most `max_jobs` kept, finished ones dropped oldest first for a new one (none
    # finished: 503); each kept `ttl_s` after it finished; the MP4s kept at most `store_mib` (oldest dropped first).
    max_jobs: Annotated[int, Field(ge=1)] = 32
    store_mib: Annotated[int, Field(ge=1)] = 256
    ttl_s: Annotated[float, Field(gt=0)] = 3600.0

    def check_frames(self, frames: int) -> None:
        if frames > self.max_frames:
            raise InvalidRequestError(
                f"{frames} frames is over this server's limit of {self.max_frames} ({(self.max_frames - 1) // self.fps} s "
                f"at {self.fps} frames per second); ask for fewer seconds or num_frames",
                param="num_frames",
                code="out_of_range",
            )


class IngressConfig(DeploymentConfig):
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.1})
    # Seconds a /health probe waits for each stage's describe().
    health_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    # Bound on one HTTP request end to end (both stages, all images, retries included); past it: 504.
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    # A stage call that failed for an infrastructure reason (replica, actor, node or engine gone) is sent again, to
    # another replica, until `retry_window_s` after its first failure (0: never; always within request_timeout_s):
    # sized so that Serve's detection of a dead replica fits inside it (its health check: 10 s period + 30 s timeout
    # by default). The waits between start at `retry_backoff_s` and double, jittered (orchestration/retries.py).
    retry_window_s: Annotated[float, Field(ge=0)] = 60.0
    retry_backoff_s: Annotated[float, Field(ge=0)] = 0.25
    # Prompt rewrites kept by each ingress replica, least recently used dropped first (0: none). None: DEFAULT_
    # REWRITE_CACHE_ENTRIES when the LLM stage is batch-invariant (a rewrite is then a pure function of the prompt
    # and its seeded params, so a kept one is exact), else 0 (a rewrite then depends on its batch).
    rewrite_cache_entries: Annotated[int, Field(ge=0)] | None = None
    # Each ingress replica's exact result caches (orchestration/result_cache.py), images and chat completions, each
    # within this many MiB, the least recently used dropped first; 0: none. Only results whose stages were invariant
    # and verified are kept, and a repeated request is then answered from it byte for
    # byte (`cache: "hit"`). examples/omni_app turns it on; off here, so an app built without it runs every request.
    result_cache_mib: Annotated[int, Field(ge=0)] = 0
    # `response_format: "url"`: the files its links serve (orchestration/image_store.py, one replica for the app),
    # each for `image_url_ttl_s` seconds (OpenAI's links last 60 minutes), the oldest dropped first past the bound.
    image_url_store_mib: Annotated[int, Field(ge=1)] = 64
    image_url_ttl_s: Annotated[float, Field(gt=0)] = 3600.0


#: The rewrite cache's default bound, in entries (each one rewrite: its text, token ids and logprobs, ~2 KB).
DEFAULT_REWRITE_CACHE_ENTRIES = 1024
