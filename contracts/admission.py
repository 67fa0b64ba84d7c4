"""Admission: the rules a request must pass before a model runs, in one place.

The ingress admits every HTTP request with these functions before any replica is called; each stage admits
what it is handed with the same functions, so a stage called without the ingress (a handle, the audit)
refuses bad input with the same message and the same code. Every refusal is an InvalidRequestError naming
the field.
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
)
from .seeds import seed_or_picked

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
