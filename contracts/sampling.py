"""Sampling params: the only RNG identity that crosses an actor boundary is an integer seed.

A `torch.Generator` cannot travel (its state is consumed in place and does not survive
pickling to another process), so these models refuse one and ask for `seed` instead.
Models are frozen, strict (no silent coercion: `True`, `1.0` and `"1"` are not seeds),
forbid unknown fields, and round-trip exactly through JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing_extensions import TypeAliasType

from .invariance import MAX_SEED, MIN_SEED

Seed = Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)]

# Nested lists of floats: the serializable form of a latents tensor.
NestedFloats = TypeAliasType("NestedFloats", "list[Annotated[float, Field(allow_inf_nan=False)]] | list[NestedFloats]")

_GENERATOR_HINT = (
    "a torch.Generator cannot cross an actor boundary (its state is consumed in place and "
    "does not survive pickling); pass seed=<int> instead"
)


def _is_generator(value: Any) -> bool:
    # Checked by type name so that this module never imports torch.
    values = value if isinstance(value, list | tuple) else [value]
    return any(type(v).__name__ == "Generator" and type(v).__module__.startswith("torch") for v in values)


class Contract(BaseModel):
    """Base for every type that crosses an actor boundary."""

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


class DiffusionSamplingParams(Contract):
    """How one image is sampled. `None` means the serving model's configured default."""

    seed: Seed | None = None
    num_inference_steps: Annotated[int, Field(ge=1, le=500)] | None = None
    guidance_scale: Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)] | None = None
    height: Annotated[int, Field(ge=8, le=4096, multiple_of=8)] | None = None
    width: Annotated[int, Field(ge=8, le=4096, multiple_of=8)] | None = None
    negative_prompt: str | None = None
    # The three inputs the seed contract forbids under invariance (see contracts.invariance).
    generator_device: Annotated[str, Field(pattern=r"^(cpu|cuda|xpu|mps)(:\d+)?$")] | None = None
    latents: NestedFloats | None = None
    sigmas: Annotated[list[Annotated[float, Field(allow_inf_nan=False)]], Field(min_length=1)] | None = None


class LLMSamplingParams(Contract):
    """How the LLM stage samples tokens; `to_vllm()` builds vLLM's type inside the actor."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    max_tokens: Annotated[int, Field(ge=1, le=8192)] = 64
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop: list[str] = Field(default_factory=list, max_length=16)
    seed: Seed | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0

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
