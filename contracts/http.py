"""The HTTP API's request and response schemas (OpenAI Images and Chat Completions, plus extensions).

Requests are strict (no coercion: `true`, `1.0` and `"1"` are not seeds) and refuse unknown fields, so
every client mistake is a 400 that names the field. OpenAI fields this server cannot honour are refused
by name with the reason, never silently ignored. Parse a request body with `parse_body(Model, raw)`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .errors import InvalidRequestError
from .sampling import DiffusionSamplingParams, LLMSamplingParams, NestedFloats, Seed

MAX_IMAGES = 8
MAX_PROMPT_CHARS = 4000
_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")


class ModelNotFoundError(InvalidRequestError):
    """A request names a model this server does not serve (404, as OpenAI answers)."""

    status_code = 404


Prompt = Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


def parse_size(size: str) -> tuple[int, int]:
    """"WxH" -> (width, height); each side a multiple of 8 in [8, 4096], as DiffusionSamplingParams needs."""
    match = _SIZE.fullmatch(size)
    if not match:
        raise ValueError(f"size must look like '<width>x<height>', e.g. '64x64', got {size!r}")
    width, height = int(match.group(1)), int(match.group(2))
    for side in (width, height):
        if not 8 <= side <= 4096 or side % 8:
            raise ValueError(f"size {size!r}: width and height must be multiples of 8 in [8, 4096]")
    return width, height


class _Request(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    #: OpenAI fields this server cannot honour -> why: refused by name unless null.
    UNSUPPORTED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, why in cls.UNSUPPORTED.items():
            if data.get(name) is not None:
                raise PydanticCustomError("unsupported_field", "{name} is not supported: {why}", {"name": name, "why": why})
        return {k: v for k, v in data.items() if k not in cls.UNSUPPORTED}


class ImageGenerationRequest(_Request):
    """`POST /v1/images/generations`: OpenAI's fields, then this server's extensions."""

    UNSUPPORTED = {
        name: "this server's images are PNGs rendered by the configured diffusion model"
        for name in ("quality", "style", "background", "moderation", "output_compression", "partial_images")
    }

    prompt: Prompt
    model: StrictStr | None = None
    n: Annotated[int, Field(ge=1, le=MAX_IMAGES)] | None = None
    size: StrictStr | None = None
    response_format: StrictStr | None = None
    output_format: StrictStr | None = None
    stream: StrictBool | None = None
    user: StrictStr | None = None  # OpenAI's end-user tag: accepted, not used
    # Extensions (pass them through the openai client's `extra_body`).
    seed: Seed | None = None
    num_inference_steps: Annotated[int, Field(ge=1, le=500)] | None = None
    guidance_scale: Annotated[Finite, Field(ge=0.0, le=100.0)] | None = None
    negative_prompt: Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    enhance_prompt: StrictBool = True
    # Refused under diffusion invariance by the seed contract; passed to the stage otherwise.
    generator_device: StrictStr | None = None
    latents: NestedFloats | None = None
    sigmas: Annotated[list[Finite], Field(min_length=1)] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, prompt: str) -> str:
        if not prompt.strip():
            raise PydanticCustomError("empty_prompt", "prompt must not be empty")
        return prompt

    @field_validator("size")
    @classmethod
    def _size_is_w_x_h(cls, size: str | None) -> str | None:
        if size is not None:
            try:
                parse_size(size)
            except ValueError as err:
                raise PydanticCustomError("invalid_size", str(err)) from None
        return size

    @field_validator("response_format")
    @classmethod
    def _b64_only(cls, value: str | None) -> str | None:
        if value not in (None, "b64_json"):
            if value == "url":
                raise PydanticCustomError(
                    "unsupported_value", "response_format 'url' is not supported: images come inline; use 'b64_json'"
                )
            raise PydanticCustomError("invalid_value", "response_format must be 'b64_json'")
        return value

    @field_validator("output_format")
    @classmethod
    def _png_only(cls, value: str | None) -> str | None:
        if value not in (None, "png"):
            raise PydanticCustomError("unsupported_value", "output_format must be 'png': this server encodes PNG")
        return value

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool | None) -> bool | None:
        if value:
            raise PydanticCustomError("unsupported_value", "stream is not supported: images are returned whole")
        return value

    @property
    def count(self) -> int:
        return self.n or 1

    @property
    def dimensions(self) -> tuple[int, int] | None:
        """(width, height) if the request gave a size."""
        return parse_size(self.size) if self.size else None

    def diffusion_params(self, seed: int | None) -> DiffusionSamplingParams:
        """The sampling params of one image; `None` fields are the stage's configured defaults."""
        width, height = self.dimensions or (None, None)
        fields = {
            "seed": seed,
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": self.guidance_scale,
            "height": height,
            "width": width,
            "negative_prompt": self.negative_prompt,
            "generator_device": self.generator_device,
            "latents": self.latents,
            "sigmas": self.sigmas,
        }
        return DiffusionSamplingParams.model_validate({k: v for k, v in fields.items() if v is not None})


class ChatMessage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: StrictStr
    name: StrictStr | None = None


class ChatCompletionRequest(_Request):
    """`POST /v1/chat/completions`: the LLM stage alone, OpenAI's fields plus vLLM's sampling extensions."""

    UNSUPPORTED = {
        "tools": "this server has no tool calling",
        "tool_choice": "this server has no tool calling",
        "functions": "this server has no function calling",
        "function_call": "this server has no function calling",
        "response_format": "this server has no JSON mode",
        "logit_bias": "this server does not bias logits",
        "stream_options": "this server does not stream",
    }

    model: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    temperature: Annotated[Finite, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=8192)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=8192)] | None = None
    seed: Seed | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = None
    stream: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    presence_penalty: Annotated[Finite, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Finite, Field(ge=-2.0, le=2.0)] | None = None
    user: StrictStr | None = None  # accepted, not used
    # Extensions (vLLM's names).
    top_k: Annotated[int, Field(ge=1)] | None = None
    min_p: Annotated[Finite, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    repetition_penalty: Annotated[Finite, Field(gt=0.0, le=2.0)] | None = None

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool | None) -> bool | None:
        if value:
            raise PydanticCustomError("unsupported_value", "stream is not supported: completions are returned whole")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "top_logprobs needs logprobs=true")
        return value

    def llm_params(self, seed: int | None) -> LLMSamplingParams:
        """The LLM stage's sampling params; unset fields keep LLMSamplingParams' defaults."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        fields = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_tokens": self.max_completion_tokens or self.max_tokens,
            "min_tokens": self.min_tokens,
            "stop": stop,
            "seed": seed,
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        return LLMSamplingParams.model_validate({k: v for k, v in fields.items() if v is not None})


# --- responses (documentation of the shape; built through these so it cannot drift) ----------------


class StageInvariance(BaseModel):
    """What one stage ran with: its switch, the kernels it installed, and whether this request used it."""

    batch_invariant: bool
    kernel_backend: str | None = None
    used: bool = True


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str
    seed: int  # s_i: a request with n=1 and this seed reproduces this image bit for bit
    sha256: str  # of the PNG bytes
    # Extensions for observability: which diffusion replica rendered it, and in a batch of how many.
    replica: str | None = None
    batch_size: int | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    model: str
    size: str
    output_format: Literal["png"] = "png"
    invariance: dict[str, StageInvariance]


# --- parsing and error description ------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)
_UNION_TAG = re.compile(r"^(int|str|float|bool|none|constrained-\w+|(list|dict|function-\w+|json-or-python)\[.*\])$")


def describe_validation_error(err: ValidationError) -> tuple[str, str | None, str]:
    """(message, param, code) for the first problem in `err`, worded for an API client."""
    first = err.errors(include_url=False)[0]
    loc = [str(part) for part in first.get("loc", ())]
    # Union members add their type to the location ("seed.int"); the client's field is what matters.
    loc = [part for part in loc if not _UNION_TAG.match(part)]
    param = ".".join(loc) or None
    kind, message = first["type"], first["msg"]
    if kind == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif kind == "json_invalid":
        message = f"the body is not valid JSON: {message.removeprefix('Invalid JSON: ')}"
        param = None
    elif kind == "model_type" and not loc:
        message = "the body must be a JSON object"
    elif kind == "missing":
        message = f"{param} is required"
    elif param and kind not in {"unsupported_field", "unsupported_value", "invalid_value", "invalid_size", "empty_prompt"}:
        message = f"{param}: {message}"
    if kind == "unsupported_field":
        param = first["ctx"]["name"] if first.get("ctx") else param
    return message, param, kind


def parse_body(model: type[M], raw: bytes | str) -> M:
    """Validate a JSON body into `model`; any problem becomes an InvalidRequestError naming the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        message, param, code = describe_validation_error(err)
        raise InvalidRequestError(message, param=param, code=code) from None
