"""The HTTP API's request and response schemas (OpenAI Images and Chat Completions, plus extensions).

Requests are strict (no coercion: `true`, `1.5`, `"1"` and `1.0` are not seeds: integers mean integers, as OpenAI's
published schemas and every official client read them; a form's text "1" is the integer its JSON spelling is, "1.0"
no integer), bounded in every field and refuse unknown fields, so every client mistake is a 400 that names the
field. OpenAI fields this server cannot honour are refused by name with the reason, never silently ignored. The
ingress hands these models to FastAPI as typed bodies, so `/openapi.json` documents them; every bound comes from
`contracts.sampling`. Before a body is parsed, `BODY_RULES` refuse it by its content type (415) and its size (413),
and `decode_json` by its encoding or a duplicate key (400).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Self, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .config import ParallelDegrees
from .errors import InvalidRequestError, PayloadTooLargeError, UnsupportedMediaTypeError, invalid_request
from .images import MAX_IMAGE_BYTES
from .provenance import DEFAULT_COMPRESSION, Compression, ImageOutput, OutputFormat
from .results import Usage
from .sampling import (
    MAX_LATENT_VALUES,
    MAX_SIDE,
    MIN_SIDE,
    SIDE_MULTIPLE,
    Contract,
    DiffusionSamplingParams,
    LLMSamplingParams,
    Logprobs,
    LoraChoice,
    LoraName,
    MaxTokens,
    Messages,
    MinP,
    MinTokens,
    Name,
    PartialImages,
    Penalty,
    Prompt,
    RepetitionPenalty,
    ReportedQuality,
    Seed,
    StopList,
    StopText,
    Temperature,
    TopK,
    TopP,
    image_fields,
    optional_model,
)

MAX_IMAGES = 8
MiB = 2**20
_SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")  # ASCII digits only (`\d` would take any script's digits)
#: What a request's `size` may look like (the sides' bounds are checked by `parse_size`).
SIZE_PATTERN = r"^([0-9]{1,5}x[0-9]{1,5}|auto)$"


def parse_size(size: str) -> tuple[int, int]:
    """ "WxH" -> (width, height); each side as DiffusionSamplingParams takes it."""
    match = _SIZE.fullmatch(size)
    if not match:
        raise ValueError(f"size must look like '<width>x<height>', e.g. '64x64', got {size!r}")
    width, height = int(match.group(1)), int(match.group(2))
    for side in (width, height):
        if not MIN_SIDE <= side <= MAX_SIDE or side % SIDE_MULTIPLE:
            raise ValueError(
                f"size {size!r}: width and height must be multiples of {SIDE_MULTIPLE} in [{MIN_SIDE}, {MAX_SIDE}]"
            )
    return width, height


def requested_size(size: str | None) -> tuple[int, int] | tuple[None, None]:
    """A request's `size` as (width, height); (None, None) for none or "auto": the model's default."""
    return (None, None) if size in (None, "auto") else parse_size(size)


def _when(field: str, holds: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema rule between fields: where `field` is present and `holds`, `then` applies to the request."""
    return {"if": {"properties": {field: holds}, "required": [field]}, "then": then}


def _must_be(field: str, value: Any) -> dict[str, Any]:
    return {"properties": {field: {"const": value}}, "required": [field]}


def _declare_rules(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The rules between a request's fields (its `RULES`, and `NOT_ABOVE`: comparisons JSON Schema has no keyword
    for), declared in its JSON Schema beside the fields."""
    rules, not_above = getattr(model, "RULES", []), getattr(model, "NOT_ABOVE", {})
    if rules:
        schema["allOf"] = list(rules)
    if not_above:
        schema["x-not-above"] = dict(not_above)


class _Request(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, json_schema_extra=_declare_rules)

    #: OpenAI fields this server cannot honour -> why: refused by name unless null.
    UNSUPPORTED: ClassVar[dict[str, str]] = {}
    #: The rules between fields its validators enforce, as JSON Schema (`_when`), so the document states them.
    RULES: ClassVar[list[dict[str, Any]]] = []
    #: What a request asking to stream is told where streaming is not served ("" where it is).
    WHOLE: ClassVar[str] = "results"

    @field_validator("stream", check_fields=False)
    @classmethod
    def _no_stream(cls, value: bool | None) -> bool | None:
        if value and cls.WHOLE:
            raise PydanticCustomError(
                "unsupported_value", "stream is not supported: {what} are returned whole", {"what": cls.WHOLE}
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, why in cls.UNSUPPORTED.items():
            if data.get(name) is not None:
                raise PydanticCustomError(
                    "unsupported_field", "{name} is not supported: {why}", {"name": name, "why": why}
                )
        return {k: v for k, v in data.items() if k not in cls.UNSUPPORTED}

    @classmethod
    def from_form(cls, fields: Mapping[str, str | bytes]) -> Self:
        """Validate form fields. A non-text field's text is read as its JSON value ("4", "4.5", "true"; empty: null),
        so each field has exactly the type and bounds it has in a JSON body ("4" is an `n`, "4.0" and "4.5" are not)."""
        text = _text_fields(cast(type[BaseModel], cls))  # its dynamic base hides that a class is hashable
        data = {
            name: value if name in text or not isinstance(value, str) else _json_value(value)
            for name, value in fields.items()
        }
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise invalid_request(err) from None

    @classmethod
    def form_schema(cls) -> dict[str, Any]:
        """The form as OpenAPI documents it (`ref_template` for its components); fields refused by name left out."""
        schema = cls.model_json_schema(ref_template="#/components/schemas/{model}")
        schema.pop("$defs", None)  # only the refused `latents` refers to one
        for name in cls.UNSUPPORTED:
            schema["properties"].pop(name, None)
        return schema


def _needs(field: str, switch: str, why: str = ""):
    """A validator: `field` may be set (non-zero) only with `switch` true (an earlier field of the same request)."""

    def check(cls, value: Any, info: ValidationInfo) -> Any:
        if value and not info.data.get(switch):
            raise PydanticCustomError(
                "invalid_value", "{field} needs {switch}=true{why}", {"field": field, "switch": switch, "why": why}
            )
        return value

    return field_validator(field)(classmethod(check))


def _present(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


class _OpenAIImageRequest(_Request):
    """OpenAI's fields of an image request (generations and edits); `quality` is a sampling field (contracts.sampling)."""

    UNSUPPORTED = {
        "style": "DALL-E 3's styles are not served; describe the look in the prompt",
        "background": "images are rendered opaque; transparent backgrounds are not served",
        "moderation": "this server has no moderation levels",
    }
    WHOLE = ""  # streamed as OpenAI streams images (server-sent events, `orchestration.api`)
    RULES = [
        _when("partial_images", {"type": "integer", "minimum": 1}, _must_be("stream", True)),
        _when(
            "output_compression",
            {"type": "integer"},
            {"properties": {"output_format": {"enum": ["jpeg", "webp"]}}, "required": ["output_format"]},
        ),
        _when("response_format", {"const": "url"}, {"properties": {"stream": {"not": {"const": True}}}}),
        _when("quality", {"type": "string"}, {"properties": {"num_inference_steps": {"type": "null"}}}),
    ]

    prompt: Prompt
    model: Name | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_IMAGES)] | None = None
    # "<width>x<height>" (multiples of 8 within the server's pixel limit) or "auto": the model's default size.
    size: Annotated[StrictStr, Field(pattern=SIZE_PATTERN)] | None = None
    # "url": a link to the app's image store (GET /v1/images/{id}), kept the ingress's `image_url_ttl_s` seconds.
    response_format: Literal["b64_json", "url"] | None = None
    output_format: OutputFormat | None = None
    output_compression: Compression | None = None  # jpeg and webp only: the encoder's quality (100: least loss)
    stream: StrictBool | None = None
    partial_images: PartialImages | None = None  # with stream=true only
    user: Name | None = None  # OpenAI's end-user tag: accepted, not used

    @field_validator("size")
    @classmethod
    def _size_is_w_x_h(cls, size: str | None) -> str | None:
        if size is not None:
            try:
                requested_size(size)
            except ValueError as err:
                raise PydanticCustomError("invalid_size", str(err)) from None
        return size

    _partials_need_stream = _needs("partial_images", "stream", ": partial images are streamed")

    @field_validator("output_compression")
    @classmethod
    def _lossy_only(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("output_format") not in ("jpeg", "webp"):
            raise PydanticCustomError(
                "invalid_value", "output_compression needs output_format 'jpeg' or 'webp' (PNG is lossless)"
            )
        return value

    @field_validator("stream")
    @classmethod
    def _streams_inline(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("response_format") == "url":
            raise PydanticCustomError(
                "invalid_value", "stream=true sends each image in its event: leave response_format out or 'b64_json'"
            )
        return value

    @property
    def output(self) -> ImageOutput:
        fmt = self.output_format or "png"
        compression = DEFAULT_COMPRESSION if self.output_compression is None else self.output_compression
        return ImageOutput(fmt, None if fmt == "png" else compression)


class ImageGenerationRequest(
    optional_model(  # type: ignore[misc]  # a base made by pydantic.create_model
        "_ImageExtensions", image_fields(request="all"), base=_OpenAIImageRequest, doc="the sampling extensions"
    )
):
    """`POST /v1/images/generations`: OpenAI's fields, then this server's extensions (pass them through the openai
    client's `extra_body`): every sampling field DiffusionSamplingParams marks `request="all"`, with its own type and
    bounds (those the seed contract forbids under invariance are refused by the ingress then; passed to the stage
    otherwise), and `enhance_prompt`."""

    enhance_prompt: StrictBool = True

    @field_validator("quality", check_fields=False)
    @classmethod
    def _quality_or_steps(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("num_inference_steps") is not None:
            raise PydanticCustomError(
                "invalid_value", "give quality or num_inference_steps, not both: a quality stands for a step count"
            )
        return value

    @property
    def count(self) -> int:
        return self.n or 1

    def diffusion_params(self, seed: int | None) -> DiffusionSamplingParams:
        """The sampling params of one image: every sampling field this request has, its size as height and width,
        and `seed`; `None` fields are the stage's configured defaults."""
        width, height = requested_size(self.size)
        given = {name: getattr(self, name) for name in image_fields() if name in type(self).model_fields}
        return DiffusionSamplingParams.model_validate(
            _present(**{**given, "seed": seed, "height": height, "width": width})
        )


class ImageEditRequest(
    optional_model(  # type: ignore[misc]  # a base made by pydantic.create_model
        "_EditExtensions", image_fields(request="edit"), base=ImageGenerationRequest, doc="edit fields"
    )
):
    """`POST /v1/images/edits` (multipart/form-data): the generation request's fields, the edit-only sampling
    fields (`strength`) and the image.

    The image is rendered at its own size (a requested `size` must be it) from `strength` into the schedule
    (`contracts.images`, `stages.diffusion.engine.img2img`). `from_form` reads the form: text for every field, bytes for
    the image.
    """

    UNSUPPORTED = {
        **_OpenAIImageRequest.UNSUPPORTED,
        "mask": "this server edits the whole image (image-to-image); masks (inpainting) are not served",
        "input_fidelity": "this server's edits follow the image as far as `strength` says",
        "latents": "an edit's initial latents come from its image",
    }

    image: bytes = Field(
        description=f"the image to edit: PNG, JPEG or WebP, at most {MAX_IMAGE_BYTES // MiB} MiB; rendered at its own "
        f"size, so its width and height are multiples of {SIDE_MULTIPLE} in [{MIN_SIDE}, {MAX_SIDE}] (`x-image-size`; "
        "a deployment's document narrows the multiple to its model's and adds its pixel limit)",
        json_schema_extra={
            "x-max-bytes": MAX_IMAGE_BYTES,
            "x-image-size": {"multipleOf": SIDE_MULTIPLE, "minimum": MIN_SIDE, "maximum": MAX_SIDE},
        },
    )


@functools.cache
def _text_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` that take text (a form gives them as they are)."""

    def takes_text(schema: dict[str, Any]) -> bool:
        return any(s.get("type") == "string" and "format" not in s for s in schema.get("anyOf", [schema]))

    return frozenset(name for name, schema in model.model_json_schema()["properties"].items() if takes_text(schema))


def _json_value(text: str) -> Any:
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: validation names the field and the type it wants


class StreamOptions(BaseModel):
    """OpenAI's `stream_options` of a streamed chat completion."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    # A last chunk with no choices and the whole completion's `usage` (and `usage: null` on every other chunk).
    include_usage: StrictBool | None = None


class ChatCompletionRequest(_Request):
    """`POST /v1/chat/completions`: the LLM stage alone, OpenAI's fields plus vLLM's sampling extensions."""

    UNSUPPORTED = {
        "tools": "this server has no tool calling",
        "tool_choice": "this server has no tool calling",
        "functions": "this server has no function calling",
        "function_call": "this server has no function calling",
        "response_format": "this server has no JSON mode",
        "logit_bias": "this server does not bias logits",
    }
    WHOLE = ""  # streamed as OpenAI streams chat (`chat.completion.chunk` events, then `[DONE]`; orchestration.api)
    #: min_tokens at most the first of these fields the request gives, else LLMSamplingParams' default max_tokens
    #: (`LLMSamplingParams._min_tokens_fit`): in the document as `x-not-above`.
    NOT_ABOVE: ClassVar[dict[str, dict[str, Any]]] = {
        "min_tokens": {
            "first_of": ["max_completion_tokens", "max_tokens"],
            "default": LLMSamplingParams.model_fields["max_tokens"].default,
        }
    }
    RULES = [
        _when("stream_options", {"type": "object"}, _must_be("stream", True)),
        _when("top_logprobs", {"type": "integer", "minimum": 1}, _must_be("logprobs", True)),
    ]

    model: Name | None = None
    messages: Messages
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    seed: Seed | None = None
    stop: StopText | StopList | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None  # with stream=true only
    logprobs: StrictBool | None = None
    top_logprobs: Logprobs | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: Name | None = None  # accepted, not used
    # Extensions (vLLM's names).
    top_k: TopK | None = None
    min_p: MinP | None = None
    min_tokens: MinTokens | None = None
    repetition_penalty: RepetitionPenalty | None = None
    # Extension: a LoRA adapter of the LLM stage (its `lora_dir`); unknown: 404.
    lora: LoraName | None = None

    _top_logprobs_need_logprobs = _needs("top_logprobs", "logprobs")
    _stream_options_need_stream = _needs("stream_options", "stream")

    def llm_params(self, seed: int | None) -> LLMSamplingParams:
        """The LLM stage's sampling params; unset fields keep LLMSamplingParams' defaults."""
        return LLMSamplingParams.model_validate(
            _present(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                max_tokens=self.max_completion_tokens or self.max_tokens,
                min_tokens=self.min_tokens,
                stop=[self.stop] if isinstance(self.stop, str) else self.stop,
                seed=seed,
                logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                lora=self.lora,
            )
        )


# --- responses (built through these models, so the documented shape cannot drift) --------------------


class StageInvariance(BaseModel):
    """What one stage ran with: its switch, the kernels it installed, and whether this request used it."""

    batch_invariant: bool
    kernel_backend: str | None = None
    used: bool = True
    # An audit record covers what ran (contracts/scope.py): the replica's configuration and, for images, their
    # size; when not, why (the nearest record's differences). None: not known (the stage was not used).
    verified: bool | None = None
    verified_by: list[str] = []  # when verified: the record each result's replica matched, and its self-check
    scope_differences: list[str] = []
    # The workers that rendered the images, where a replica's parallel group did (`diffusion.parallel`); the bytes are
    # one worker's whatever the grid.
    parallel: ParallelDegrees | None = None


def _absent(value: Any) -> bool:
    return value is None


class ImageData(BaseModel):
    # The file inline, or (`response_format: "url"`) a link to it: one of the two, the other left out.
    b64_json: str | None = Field(default=None, exclude_if=_absent)
    url: str | None = Field(default=None, exclude_if=_absent)
    revised_prompt: str
    seed: int  # s_i: a request with n=1 and this seed reproduces this image bit for bit
    sha256: str  # of the file's bytes (the PNG, or the JPEG or WebP it was delivered as)
    # Extensions for observability: which diffusion replica rendered it, the most samples that shared one of its
    # denoiser calls, how many of its steps were shared, and how many ran the denoiser (step caching skips some).
    replica: str | None = None
    batch_size: int | None = None
    steps_co_batched: int | None = None
    steps_computed: int | None = None
    # The ingress's exact result cache (an extension): "hit" when this image was answered from it, "miss" when
    # rendered; absent where the app keeps none.
    cache: Literal["hit", "miss"] | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    model: str
    size: str
    # What the images were rendered at, in OpenAI's terms (`reported_quality`); left out where the request gave its
    # own num_inference_steps (OpenAI's schema has no term for a step count, and no "auto" in a response).
    quality: ReportedQuality | None = Field(default=None, exclude_if=_absent)
    output_format: OutputFormat = "png"
    invariance: dict[str, StageInvariance]


class _ImageEvent(BaseModel):
    """A server-sent event of a streamed generation or edit (`stream: true`): OpenAI's fields, then extensions."""

    type: str  # "<kind>.partial_image" | "<kind>.completed", kind "image_generation" or "image_edit"
    b64_json: str
    created_at: int
    size: str  # "<width>x<height>"
    # `reported_quality`, or "auto" where there is no OpenAI term for what was rendered (the request gave its steps):
    # OpenAI's event schemas require the field and take "auto" there.
    quality: ReportedQuality | Literal["auto"] = "auto"
    background: Literal["opaque"] = "opaque"
    output_format: OutputFormat = "png"
    # Extension: which of the request's n images the event is of (OpenAI's events have none: they stream n=1).
    image_index: int = 0


class ImagePartialEvent(_ImageEvent):
    """A preview: the image's current estimate, decoded (deterministic, not part of the reproducibility promise)."""

    partial_image_index: int


class ImageTokensDetails(BaseModel):
    image_tokens: int = 0
    text_tokens: int


class ImageUsage(BaseModel):
    """OpenAI's usage of a completed image; here the tokens of the LLM stage's rewrite of its prompt (0 without one)."""

    input_tokens: int
    input_tokens_details: ImageTokensDetails
    output_tokens: int
    total_tokens: int


class ImageCompletedEvent(ImageData, _ImageEvent):
    """The image itself: the bytes, seed and sha256 a non-streamed request returns for it."""

    usage: ImageUsage


#: The events' type names per route (OpenAI's).
STREAM_EVENT_KINDS = {"generation": "image_generation", "edit": "image_edit"}


class TokenLogprob(BaseModel):
    token: str  # vLLM's "token_id:<id>" form: the stage returns ids, not token text
    logprob: float
    bytes: list[int] | None = None


class ContentLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[ContentLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None  # required by OpenAI's schema (nullable): this model never refuses in words


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str
    # Extensions: the seed that reproduces this completion, its token ids, the stage's invariance state.
    seed: int | None
    token_ids: list[int]
    invariance: dict[str, StageInvariance]
    lora: LoraChoice | None = None  # the LoRA adapter it ran with, and its weights' sha256
    cache: Literal["hit", "miss"] | None = None  # the ingress's exact result cache; absent where the app keeps none


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = (
        None  # the first chunk's only: absent from the others (no null in OpenAI's schema)
    )
    content: str | None = None

    @model_serializer(mode="wrap")
    def _role_only_where_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body = handler(self)
        if body.get("role") is None:
            body.pop("role", None)
        return body


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (OpenAI's `chat.completion.chunk`): every chunk of a stream
    has its `id` and `created`; the deltas' contents concatenated are the non-streamed completion's content."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # with stream_options.include_usage: null, then the last chunk's
    # Extensions: the seed, and the token ids this chunk adds (concatenated: the completion's `token_ids`).
    seed: int | None = None
    token_ids: list[int] = []


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omniserve"
    stage: Literal["llm", "diffusion"]  # extension: which stage serves it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoraCard(BaseModel):
    """One LoRA adapter a request's `lora` may name (an extension: OpenAI has no adapters)."""

    id: str
    object: Literal["lora"] = "lora"


class LoraList(BaseModel):
    object: Literal["list"] = "list"
    data: list[LoraCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, OpenAI's shape."""

    error: ErrorDetail


# --- request bodies: their content types and size limits, and strict JSON --------------------------------

#: A JSON request without latents: every other field at its bound fits well within it.
MAX_JSON_BODY_BYTES = MiB
#: The most a latents value takes as JSON text, its separator included ("-1.2345678901234567e-100, ").
LATENT_VALUE_JSON_BYTES = 26
#: A generation may carry initial latents (MAX_LATENT_VALUES of them) on top of the rest.
MAX_GENERATION_BODY_BYTES = MAX_JSON_BODY_BYTES + MAX_LATENT_VALUES * LATENT_VALUE_JSON_BYTES
#: An edit's multipart form: its image and its text fields.
MAX_EDIT_BODY_BYTES = MAX_IMAGE_BYTES + MiB


@dataclass(frozen=True)
class BodyRule:
    """What one route's body must be: its content type (else 415) and at most `max_bytes` (else 413; the rest of a
    refused body is read and dropped within a bound before the answer, so the client reads it: orchestration.api)."""

    media_type: str
    max_bytes: int
    what: str = "the body"
    param: str | None = None  # the field that makes a body too large, where one does
    also: str | None = None  # a second content type the route reads (POST /v1/videos: JSON or a form)

    def check_headers(self, content_type: str | None, content_length: str | None) -> None:
        """Refuse from the headers alone, before the body is read."""
        sent = (content_type or "").split(";")[0].strip().lower()
        if sent not in (self.media_type, self.also):
            said = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
            wanted = self.media_type + (f" or {self.also}" if self.also else "")
            raise UnsupportedMediaTypeError(
                f"send {self.what} as {wanted}; the request has {said}", code="unsupported_media_type"
            )
        if content_length and content_length.isascii() and content_length.isdigit():
            self.check_size(
                int(content_length) if len(content_length) <= 18 else math.inf
            )  # int() refuses 4300+ digits

    def check_size(self, size: float) -> None:
        """Refuse a body of `size` bytes (declared, or read so far) if it is over the limit."""
        if size > self.max_bytes:
            raise PayloadTooLargeError(
                f"{self.what} is over this route's limit of {self.max_bytes} bytes ({self.max_bytes / MiB:g} MiB)",
                param=self.param,
                code="body_too_large",
            )


#: Each POST route's body, in one place (docs/api.md lists them).
BODY_RULES = {
    "/v1/images/generations": BodyRule("application/json", MAX_GENERATION_BODY_BYTES),
    "/v1/chat/completions": BodyRule("application/json", MAX_JSON_BODY_BYTES),
    "/v1/images/edits": BodyRule("multipart/form-data", MAX_EDIT_BODY_BYTES, "the edit", "image"),
    "/v1/videos": BodyRule("application/json", MAX_JSON_BODY_BYTES, also="multipart/form-data"),
}


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for key, value in pairs:
        if key in body:
            raise InvalidRequestError(
                f"the body is not valid JSON for this server: the key {key!r} is given more than once",
                code="duplicate_key",
            )
        body[key] = value
    return body


def decode_json(raw: bytes | str) -> Any:
    """A JSON body, strictly: UTF-8 and each object's keys once (two parsers cannot read it two ways)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except InvalidRequestError:
        raise
    except UnicodeDecodeError as err:
        raise InvalidRequestError(
            f"the body is not valid JSON: it is not UTF-8 ({err.reason} at byte {err.start})", code="json_invalid"
        ) from None
    except RecursionError:
        raise InvalidRequestError(
            "the body is not valid JSON for this server: it is nested too deeply", code="json_invalid"
        ) from None
    except ValueError as err:  # JSONDecodeError, or an integer of more digits than Python converts
        raise InvalidRequestError(f"the body is not valid JSON: {err}", code="json_invalid") from None


def is_request_error(err: ValidationError) -> bool:
    """Whether `err` is the validation of client input (a request or sampling-params model), not of server data."""

    def family(cls: type) -> set[str]:
        subclasses: list[type] = cls.__subclasses__()
        return {cls.__name__}.union(*(family(sub) for sub in subclasses))

    return err.title in family(Contract) | family(_Request)
