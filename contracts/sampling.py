"""Sampling params: the only RNG identity that crosses an actor boundary is an integer seed.

A `torch.Generator` cannot travel (its state is consumed in place and does not survive
pickling to another process), so these models refuse one and ask for `seed` instead.
Models are frozen, strict (no silent coercion: `True`, `1.0` and `"1"` are not seeds),
forbid unknown fields, and round-trip exactly through JSON.

Every bound on a sampling field is written once, as a type below; the HTTP schemas use the same types.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictStr, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import TypeAliasType

from .seeds import Seed

# --- the bounds, once ------------------------------------------------------------------------------

MAX_PROMPT_CHARS = 4000
#: The contract's step range; a deployment serves at most its own `max_inference_steps` (DiffusionLimits).
MAX_INFERENCE_STEPS = 500
#: Image sides: multiples of 8 (the VAE's factor) in [8, 4096].
MIN_SIDE, MAX_SIDE, SIDE_MULTIPLE = 8, 4096, 8


def _not_blank(prompt: str) -> str:
    if not prompt.strip():
        raise PydanticCustomError("empty_prompt", "prompt must not be empty")
    return prompt


Finite = Annotated[float, Field(allow_inf_nan=False)]
PromptText = Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)]
Prompt = Annotated[PromptText, AfterValidator(_not_blank)]
Steps = Annotated[int, Field(ge=1, le=MAX_INFERENCE_STEPS)]
GuidanceScale = Annotated[Finite, Field(ge=0.0, le=100.0)]
Side = Annotated[int, Field(ge=MIN_SIDE, le=MAX_SIDE, multiple_of=SIDE_MULTIPLE)]
# Nested lists of floats: the serializable form of a latents tensor.
NestedFloats = TypeAliasType("NestedFloats", "list[Annotated[float, Field(allow_inf_nan=False)]] | list[NestedFloats]")
Sigmas = Annotated[list[Finite], Field(min_length=1)]
GeneratorDevice = Annotated[str, Field(pattern=r"^(cpu|cuda|xpu|mps)(:\d+)?$")]
#: Schedulers a request may pick (each model serves the ones of its family; None: the model's own).
SchedulerName = Literal["euler", "euler_ancestral", "dpmpp_2m", "ddim", "flow_match_euler"]
#: Image edits (image-to-image): the part of the schedule that runs, from the noised image (1: all of it).
Strength = Annotated[Finite, Field(gt=0.0, le=1.0)]
#: An edit's strength when the request gives none (OpenAI's and diffusers' img2img default).
DEFAULT_STRENGTH = 0.8

Temperature = Annotated[Finite, Field(ge=0.0, le=2.0)]
TopP = Annotated[Finite, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=1)]
MinP = Annotated[Finite, Field(ge=0.0, le=1.0)]
MaxTokens = Annotated[int, Field(ge=1, le=8192)]
MinTokens = Annotated[int, Field(ge=0)]
StopList = Annotated[list[StrictStr], Field(max_length=16)]
Logprobs = Annotated[int, Field(ge=0, le=20)]
Penalty = Annotated[Finite, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[Finite, Field(gt=0.0, le=2.0)]

_GENERATOR_HINT = (
    "a torch.Generator cannot cross an actor boundary (its state is consumed in place and "
    "does not survive pickling); pass seed=<int> instead"
)


def _is_generator(value: Any) -> bool:
    # Checked by type name so that this module never imports torch.
    values = value if isinstance(value, list | tuple) else [value]
    return any(type(v).__name__ == "Generator" and type(v).__module__.startswith("torch") for v in values)


class Contract(BaseModel):
    """Base for every request type that crosses an actor boundary."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _refuse_generators(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for key, value in data.items():
                if key == "generator" or _is_generator(value):
                    raise ValueError(f"{key}: {_GENERATOR_HINT}")
        return data

    @classmethod
    def from_params(cls, params: Any = None, /, **kwargs: Any) -> Self:
        """Normalise an instance, a mapping, or diffusers-style keyword arguments.

        Every caller field is kept: unknown ones are an error, never dropped, and the
        caller's seed is never replaced. Keyword arguments update `params`.
        """
        if _is_generator(params):
            raise TypeError(_GENERATOR_HINT)
        if isinstance(params, cls) and not kwargs:
            return params
        if params is None:
            fields: dict[str, Any] = {}
        elif isinstance(params, cls):
            fields = params.model_dump(exclude_unset=True)
        elif isinstance(params, Mapping):
            fields = dict(params)
        else:
            raise TypeError(
                f"{cls.__name__}.from_params takes a {cls.__name__}, a mapping or keyword "
                f"arguments, not {type(params).__name__}"
            )
        return cls.model_validate({**fields, **kwargs})


class ChatMessage(Contract):
    """One message of a chat: what the LLM stage is asked."""

    role: Literal["system", "user", "assistant"]
    content: StrictStr
    name: StrictStr | None = None


Messages = Annotated[list[ChatMessage], Field(min_length=1)]


class DiffusionSamplingParams(Contract):
    """How one image is sampled. `None` means the serving model's configured default."""

    seed: Seed | None = None
    num_inference_steps: Steps | None = None
    guidance_scale: GuidanceScale | None = None
    height: Side | None = None
    width: Side | None = None
    negative_prompt: PromptText | None = None
    scheduler: SchedulerName | None = None
    strength: Strength | None = None  # image edits only: None is DEFAULT_STRENGTH
    # The three inputs the seed contract forbids under invariance (see contracts.invariance).
    generator_device: GeneratorDevice | None = None
    latents: NestedFloats | None = None
    sigmas: Sigmas | None = None


class LLMSamplingParams(Contract):
    """How the LLM stage samples tokens; `to_vllm()` builds vLLM's type inside the actor."""

    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK | None = None
    min_p: MinP = 0.0
    max_tokens: MaxTokens = 64
    min_tokens: MinTokens = 0
    stop: StopList = Field(default_factory=list)
    seed: Seed | None = None
    logprobs: Logprobs | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0

    @model_validator(mode="after")
    def _min_tokens_fit(self) -> Self:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        return self

    def to_vllm(self, **extra: Any):
        """Build `vllm.SamplingParams` (import deferred: only stage actors have vLLM)."""
        from vllm import SamplingParams

        fields = self.model_dump()
        fields["top_k"] = fields["top_k"] or 0  # vLLM: 0 disables top-k
        fields["stop"] = fields["stop"] or None
        return SamplingParams(**fields, **extra)
