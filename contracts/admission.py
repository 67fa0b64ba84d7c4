"""Admission: the rules a request must pass before a model runs, in one place.

The ingress admits every HTTP request with these functions before any replica is called; each stage admits
what it is handed with the same functions, so a stage called without the ingress (a handle, the audit)
refuses bad input with the same message and the same code. Every refusal is an InvalidRequestError naming
the field.

What one diffusion replica's model can render (`ModelCapabilities`) is plain data computed once when the model loads
(`stages.diffusion.renderer.DiffusionRenderer`) and read alike by that replica's admission (`ModelCapabilities.check`,
from `DiffusionRenderer.resolve`), its /health (`details.capabilities`) and the ingress's OpenAPI document
(`orchestration.openapi`), so the document states exactly the rules the replica refuses by. The adapters a replica
serves are not here: they are read from its adapter directory on every request (an adapter dropped there is served
without a restart), and /health lists them beside (`details.loras`).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .errors import InvalidRequestError, describe_validation_error, invalid_request
from .invariance import validate_seed_contract
from .sampling import (
    MAX_INFERENCE_STEPS,
    ChatMessage,
    Contract,
    DiffusionSamplingParams,
    LLMSamplingParams,
    Messages,
    Prompt,
    seed_or_picked,
)

P = TypeVar("P", bound=Contract)
_PROMPT = TypeAdapter(Prompt)
_MESSAGES = TypeAdapter(Messages)


def _validated(adapter: TypeAdapter, value: Any, field: str) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError as err:
        errors = [{**e, "loc": (field, *e["loc"])} for e in err.errors(include_url=False)]
        message, param, code = describe_validation_error(errors)
        raise InvalidRequestError(message, param=param, code=code) from None


def admit_prompt(prompt: Any) -> str:
    """A prompt: a string, not blank, at most MAX_PROMPT_CHARS characters."""
    return _validated(_PROMPT, prompt, "prompt")


def admit_messages(messages: Any) -> list[ChatMessage]:
    """A chat: a non-empty list of {role, content} messages."""
    return _validated(_MESSAGES, messages, "messages")


def admit_params(kind: type[P], params: Any, *, batch_invariant: bool) -> P:
    """`params` as `kind` (an instance, a mapping or None), checked against the seed contract."""
    try:
        admitted = kind.from_params(params)
    except ValidationError as err:
        raise invalid_request(err) from None
    except TypeError as err:  # not params at all (a generator, a list, ...)
        raise InvalidRequestError(str(err), param="params", code="invalid_type") from None
    validate_seed_contract(admitted, batch_invariant=batch_invariant)
    return admitted


def admit_diffusion_params(params: Any, *, batch_invariant: bool) -> DiffusionSamplingParams:
    return admit_params(DiffusionSamplingParams, params, batch_invariant=batch_invariant)


def admit_llm_params(params: Any, *, batch_invariant: bool) -> LLMSamplingParams:
    return admit_params(LLMSamplingParams, params, batch_invariant=batch_invariant)


class DiffusionLimits(BaseModel):
    """A deployment's serving limits (tighter than the contract's): checked at the ingress and in the stage."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_pixels: Annotated[int, Field(ge=64)] = 512 * 512
    # The serving limit on steps (the contract allows up to MAX_INFERENCE_STEPS): refused with a 400 above it.
    max_inference_steps: Annotated[int, Field(ge=1, le=MAX_INFERENCE_STEPS)] = 50

    def admit(self, asked: DiffusionSamplingParams, *, batch_invariant: bool) -> int:
        """What an image request and a video request share at the ingress: these limits, the seed contract (a missing
        seed refused under invariance), then the seed: the request's, or one the server picks and reports."""
        self.check_limits(asked)
        admit_diffusion_params(asked, batch_invariant=batch_invariant)
        return seed_or_picked(asked.seed)

    def check_limits(self, params: DiffusionSamplingParams) -> None:
        """Refuse what exceeds the limits; fields left to the model's defaults are checked once filled."""
        steps = params.num_inference_steps
        if steps is not None and steps > self.max_inference_steps:
            raise InvalidRequestError(
                f"num_inference_steps must be <= {self.max_inference_steps} on this server, got {steps}",
                param="num_inference_steps",
                code="out_of_range",
            )
        if params.height is not None and params.width is not None and params.height * params.width > self.max_pixels:
            raise InvalidRequestError(
                f"size {params.width}x{params.height} exceeds this server's limit of {self.max_pixels} pixels",
                param="size",
                code="out_of_range",
            )


# The model's capabilities: what one loaded model can render, as plain data.


class ModelCapabilities(BaseModel):
    """One loaded model's rules. Every default is what the ingress assumes of a stage that has not described itself
    yet (scaled to zero, starting): the contract's own bounds, nothing model-specific."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = ""
    #: Where it renders: a request's `generator_device` must be the CPU or this device's kind.
    device: str = "cpu"
    #: The step engine's family (`stages.diffusion.engine.families`); None: the engine does not know the pipeline.
    family: str | None = None
    #: Whether this replica runs the step engine, which alone decides per sample: step caching, adapters, schedulers.
    per_sample: bool = False
    #: Sizes are whole latent patches: the VAE's factor times the DiT's patch, or the family's 2x2 token packing.
    size_multiple: int = 8
    #: 2 where the scheduler stretches the schedule to a terminal sigma (one step would divide 0 by 0), else 1.
    min_steps: int = 1
    #: Whether the scheduler takes a custom schedule (`sigmas`).
    sigmas: bool = False
    #: Whether the pipeline has true classifier-free guidance (`true_cfg_scale`: FLUX, Qwen-Image).
    true_cfg: bool = False
    #: Initial latents a request may give: (channels, height / vae_factor, width / vae_factor); no channels: none.
    latent_channels: int | None = None
    vae_factor: int = 8
    #: The schedulers the family runs per sample (a request's `scheduler`; served where `per_sample`).
    schedulers: tuple[str, ...] = ()
    #: Step caching's threshold where a request gives none (None: a request must give one).
    cache_threshold: float | None = None
    #: A video model's frame counts, frame_step x k + 1 (None: not a video model).
    frame_step: int | None = None

    @classmethod
    def described(cls, description: dict[str, Any]) -> ModelCapabilities:
        """A stage's capabilities from its description as /health reports it; a stage not described yet: the
        defaults."""
        return cls.model_validate(description.get("details", {}).get("capabilities") or {})

    def served_schedulers(self) -> list[str]:
        """The `scheduler` values a request may name here (none where whole requests are batched)."""
        return list(self.schedulers) if self.per_sample else []

    def check(self, params: DiffusionSamplingParams) -> None:
        """Refuse resolved params this model cannot render (a 400 naming the field)."""
        for name in ("height", "width"):
            value = getattr(params, name)
            if value % self.size_multiple:
                raise InvalidRequestError(
                    f"{name} must be a multiple of {self.size_multiple} for {self.model}, got {value}", param=name
                )
        if (params.num_inference_steps or 0) < self.min_steps:
            raise InvalidRequestError(
                f"num_inference_steps must be at least {self.min_steps} for {self.model}: its scheduler stretches "
                "the schedule to a terminal sigma, which takes two steps",
                param="num_inference_steps",
            )
        if params.sigmas is not None:
            if not self.sigmas:
                raise InvalidRequestError(f"{self.model}'s scheduler does not take sigmas", param="sigmas")
            if len(params.sigmas) != params.num_inference_steps:
                raise InvalidRequestError("sigmas must have num_inference_steps entries", param="sigmas")
        if params.generator_device and params.generator_device.split(":")[0] not in ("cpu", self.device.split(":")[0]):
            raise InvalidRequestError(
                f"generator_device {params.generator_device!r} is not available here", param="generator_device"
            )
        if params.latents is not None:
            self.check_latents(params)
        if params.true_cfg_scale is not None and not self.true_cfg:
            raise InvalidRequestError(
                f"true_cfg_scale applies to pipelines with true classifier-free guidance (FLUX, Qwen-Image), not "
                f"{self.model}",
                param="true_cfg_scale",
                code="unsupported_value",
            )

    def latent_shape(self, params: DiffusionSamplingParams) -> tuple[int, ...]:
        """The (C, h, w) of a request's initial latents at its resolved size."""
        assert self.latent_channels is not None and params.height is not None and params.width is not None
        return (self.latent_channels, params.height // self.vae_factor, params.width // self.vae_factor)

    def check_latents(self, params: DiffusionSamplingParams) -> None:
        """A request's initial latents: taken by this model, rectangular, and of the shape its size makes. Checked
        at admission, not inside a batch."""
        if self.latent_channels is None:
            raise InvalidRequestError(f"{self.model} does not take initial latents", param="latents")
        try:
            shape = _shape(params.latents)
        except ValueError as err:
            raise InvalidRequestError(f"latents must be a rectangular nested list: {err}", param="latents") from err
        if shape != self.latent_shape(params):
            raise InvalidRequestError(
                f"latents must have shape {list(self.latent_shape(params))}, got {list(shape)}", param="latents"
            )


def _shape(value: Any) -> tuple[int, ...]:
    """The shape of a rectangular nested list (a number: ()); ValueError where its rows differ."""
    if not isinstance(value, list | tuple):
        return ()
    shapes = {_shape(item) for item in value}
    if len(shapes) > 1:
        raise ValueError(f"rows of {len(value)} lists differ in shape: {sorted(shapes)}")
    return (len(value), *(shapes.pop() if shapes else ()))
