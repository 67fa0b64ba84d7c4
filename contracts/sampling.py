"""Sampling params: the only RNG identity that crosses an actor boundary is an integer seed.

A `torch.Generator` cannot travel (its state is consumed in place and does not survive
pickling to another process), so these models refuse one and ask for `seed` instead.
Models are frozen, strict (no silent coercion: `True`, `1.0` and `"1"` are not seeds),
forbid unknown fields, and round-trip exactly through JSON.

Every bound on a sampling field is written once, as a type below; the HTTP schemas use the same types. Every integer
type is a StrictInt: a JSON `1.0` is refused as no integer (a 400 naming the field), whatever the model's strictness.

Seeds have their one home here: the range, the type, the server's pick, and the rule that gives each image of a
request its own seed:

    s_0 = seed
    s_i = int.from_bytes(sha256(f"omniserve/seed_for_image/v1/{seed}/{i}").digest()[:8], "big") >> 11   (i >= 1)

Image i of a request is a pure function of (prompt, parameters, s_i), so a request with `n=1` and `seed=s_i`
reproduces it. Derived seeds (and seeds the server picks when a request has none) lie in [0, 2**53 - 1]: inside
[MIN_SEED, MAX_SEED], and exact as JSON numbers even in JavaScript clients. Hashing the decimal text keeps every
seed of the range distinct (no int64/uint64 wrap-around aliasing).
"""

from __future__ import annotations

import functools
import hashlib
import secrets
import sys
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    create_model,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError
from typing_extensions import TypeAliasType

# Seeds: the range, the type, the server's pick, and the rule that gives each image of a request its own seed.

# The range torch.Generator.manual_seed accepts (it takes int64 and uint64 values).
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
#: A seed as every contract types it: an integer, never a bool, a string or a float (`7.0` included: integers mean
#: integers, in JSON and in every model whatever its strictness).
Seed = Annotated[StrictInt, Field(ge=MIN_SEED, le=MAX_SEED)]

#: Derived and server-picked seeds stay below 2**53: JSON numbers that every client parses exactly.
SAFE_SEED_BITS = 53
MAX_SAFE_SEED = 2**SAFE_SEED_BITS - 1
# Bump the version tag only together with a documented, deliberate change of every derived seed.
_DOMAIN = "omniserve/seed_for_image/v1"


def is_valid_seed(seed: Any) -> bool:
    """A seed is a real int (never a bool) inside [MIN_SEED, MAX_SEED]."""
    return isinstance(seed, int) and not isinstance(seed, bool) and MIN_SEED <= seed <= MAX_SEED


def seed_range_message(seed: Any) -> str:
    return f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}], got {seed!r}"


def seed_for_image(seed: int, index: int) -> int:
    """The seed of image `index` of a request whose seed is `seed` (index 0 keeps `seed` itself)."""
    if not is_valid_seed(seed):
        raise ValueError(seed_range_message(seed))
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be a non-negative integer, got {index!r}")
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{_DOMAIN}/{seed}/{index}".encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SAFE_SEED_BITS)


def seeds_for_request(seed: int, n: int) -> list[int]:
    """[s_0, ..., s_{n-1}] for a request of `n` images."""
    return [seed_for_image(seed, i) for i in range(n)]


def pick_seed() -> int:
    """A fresh seed for a request that has none (only allowed with that stage's invariance off)."""
    return secrets.randbits(SAFE_SEED_BITS)


def seed_or_picked(seed: int | None) -> int:
    """The one rule for a request without a seed: the server picks one and reports it, so the result can be reproduced
    (with the stage's invariance on the seed contract refuses such a request before it gets here)."""
    return seed if seed is not None else pick_seed()


# --- the bounds, once ------------------------------------------------------------------------------

MAX_PROMPT_CHARS = 4000
#: The contract's step range; a deployment serves at most its own `max_inference_steps` (DiffusionLimits).
MAX_INFERENCE_STEPS = 500
#: Image sides: multiples of 8 (the VAE's factor) in [8, 4096].
MIN_SIDE, MAX_SIDE, SIDE_MULTIPLE = 8, 4096, 8
#: Short identifiers a client sends (a model id, an end-user tag, a message author's name, a generator device).
MAX_NAME_CHARS = 256
#: A chat: at most this many messages, each at most this many characters (the model's context bounds it further).
MAX_MESSAGES, MAX_MESSAGE_CHARS = 128, 32768
MAX_TOKENS = 8192
#: Stop strings: at most this many, each of 1 to MAX_STOP_CHARS characters (vLLM refuses an empty one).
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
#: Larger than any vocabulary (vLLM treats a top_k at or past the vocabulary's size as no top-k).
MAX_TOP_K = 2**20
#: Previews a streamed image may ask for (OpenAI's bound); fewer arrive when an image has too few steps.
MAX_PARTIAL_IMAGES = 3
# A video's frames (Wan: 4k + 1, its VAE compressing time 4x after the first frame); 81 is Wan 2.1's 5 s at 16 fps.
MAX_FRAMES = 81
#: Initial latents a request may give: one sample's (channels, height/8, width/8) as nested lists, at most a
#: 1024x1024 image in a 16-channel latent space (SD3's), in at most 4 levels of lists.
MAX_LATENT_VALUES, MAX_LATENT_DEPTH = 16 * 128 * 128, 4

# Characters that render as nothing: Unicode spaces, controls, format characters (zero-width space and joiners,
# direction marks, the BOM), surrogates, private-use and unassigned code points, and the "filler" letters.
_INVISIBLE_CATEGORIES = {"Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn"}
_BLANK_LETTERS = {"\u115f", "\u1160", "\u3164", "\uffa0", "\u2800"}


def _visible(char: str) -> bool:
    return char not in _BLANK_LETTERS and unicodedata.category(char) not in _INVISIBLE_CATEGORIES


def _has_visible_text(prompt: str) -> str:
    if not any(map(_visible, prompt)):
        raise PydanticCustomError(
            "empty_prompt", "prompt must contain visible text (it is empty, or only spaces and invisible characters)"
        )
    return prompt


@functools.cache
def visible_text_pattern() -> str:
    """`_has_visible_text` as a JSON Schema pattern (found anywhere in the string: one visible character): a class of
    every character that is not invisible, built from the same rule over every code point (705 ranges of invisible
    ones). BMP characters as \\uXXXX escapes (ECMA-262's and Python's alike); others as themselves."""
    ranges, start = [], None
    for point in range(sys.maxunicode + 2):
        invisible = point <= sys.maxunicode and not _visible(chr(point))
        if invisible and start is None:
            start = point
        elif not invisible and start is not None:
            ranges.append((start, point - 1))
            start = None

    def char(point: int) -> str:
        return f"\\u{point:04x}" if point <= 0xFFFF else chr(point)

    return "[^" + "".join(char(a) if a == b else f"{char(a)}-{char(b)}" for a, b in ranges) + "]"


def _bounded_nesting(value: Any) -> Any:
    """Refuse latents nested deeper, or holding more values (or lists), than the bounds, before each is validated."""
    pending, counts = [(value, 1)], {False: 0, True: 0}  # values, lists
    while pending:
        item, depth = pending.pop()
        is_list = isinstance(item, list)
        counts[is_list] += 1
        if max(counts.values()) > MAX_LATENT_VALUES:
            raise PydanticCustomError(
                "too_many_values", "latents may hold at most {count} values", {"count": MAX_LATENT_VALUES}
            )
        if is_list and depth > MAX_LATENT_DEPTH:
            raise PydanticCustomError(
                "too_deep", "latents may nest lists at most {depth} deep", {"depth": MAX_LATENT_DEPTH}
            )
        if is_list:
            pending.extend((child, depth + 1) for child in item)
    return value


Finite = Annotated[float, Field(allow_inf_nan=False)]
PartialImages = Annotated[StrictInt, Field(ge=0, le=MAX_PARTIAL_IMAGES)]
PromptText = Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)]
Prompt = Annotated[
    PromptText,
    AfterValidator(_has_visible_text),
    Field(json_schema_extra=lambda schema: schema.update(pattern=visible_text_pattern())),  # the same rule, declared
]
Name = Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS)]
Steps = Annotated[StrictInt, Field(ge=1, le=MAX_INFERENCE_STEPS)]
Frames = Annotated[StrictInt, Field(ge=1, le=MAX_FRAMES)]
GuidanceScale = Annotated[Finite, Field(ge=0.0, le=100.0)]
Side = Annotated[StrictInt, Field(ge=MIN_SIDE, le=MAX_SIDE, multiple_of=SIDE_MULTIPLE)]
# Nested lists of floats: the serializable form of a latents tensor.
NestedFloats = TypeAliasType("NestedFloats", "list[Annotated[float, Field(allow_inf_nan=False)]] | list[NestedFloats]")
Latents = Annotated[NestedFloats, BeforeValidator(_bounded_nesting)]
Sigmas = Annotated[list[Finite], Field(min_length=1, max_length=MAX_INFERENCE_STEPS + 1)]
GeneratorDevice = Annotated[str, Field(pattern=r"^(cpu|cuda|xpu|mps)(:[0-9]{1,3})?$")]
#: Schedulers a request may pick (each model serves the ones of its family; None: the model's own).
SchedulerName = Literal["euler", "euler_ancestral", "dpmpp_2m", "ddim", "flow_match_euler"]
#: Image edits (image-to-image): the part of the schedule that runs, from the noised image (1: all of it).
Strength = Annotated[Finite, Field(gt=0.0, le=1.0)]
#: An edit's strength when the request gives none (OpenAI's and diffusers' img2img default).
DEFAULT_STRENGTH = 0.8

#: OpenAI's `quality` of an image, as a share of the model's default steps (the deployment's `defaults`, else the
#: model's own): "auto" and "high" (DALL-E 3's "hd") the default itself, "medium" (DALL-E's "standard") half, "low" a
#: quarter, at least one step. A request gives a quality or `num_inference_steps`, not both.
Quality = Literal["low", "medium", "high", "auto", "standard", "hd"]
QUALITY_SHARES: dict[str, float] = {"low": 0.25, "medium": 0.5, "standard": 0.5, "high": 1.0, "hd": 1.0, "auto": 1.0}


def quality_steps(quality: str, default_steps: int) -> int:
    """The steps `quality` stands for, for a model whose default is `default_steps`."""
    return max(1, round(default_steps * QUALITY_SHARES[quality]))


#: The qualities a response reports, in OpenAI's terms: its published ImagesResponse schema takes these (not "auto",
#: nor DALL-E's "standard" and "hd").
ReportedQuality = Literal["low", "medium", "high"]


def reported_quality(quality: str | None, num_inference_steps: int | None) -> ReportedQuality | None:
    """What an image was rendered at, in OpenAI's terms: the term of the same share of the default steps as the
    request's quality ("auto", or no quality at all, renders the default steps: "high"; "standard": "medium"; "hd":
    "high"). None where the request gave its own `num_inference_steps`: no OpenAI term names a step count."""
    if num_inference_steps is not None:
        return None
    share = QUALITY_SHARES[quality or "auto"]
    return next(term for term in get_args(ReportedQuality) if QUALITY_SHARES[term] == share)


#: LoRA adapters one request may compose (applied in the order given), and the bounds of a scale.
MAX_LORAS = 4
LoraName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
LoraScale = Annotated[Finite, Field(ge=-4.0, le=4.0)]
Sha256 = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]

Temperature = Annotated[Finite, Field(ge=0.0, le=2.0)]
TopP = Annotated[Finite, Field(gt=0.0, le=1.0)]
TopK = Annotated[StrictInt, Field(ge=1, le=MAX_TOP_K)]
MinP = Annotated[Finite, Field(ge=0.0, le=1.0)]
MaxTokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)]
MinTokens = Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS)]
StopText = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)]
Logprobs = Annotated[StrictInt, Field(ge=0, le=20)]
Penalty = Annotated[Finite, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[Finite, Field(gt=0.0, le=2.0)]

GENERATOR_HINT = (
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
                    raise ValueError(f"{key}: {GENERATOR_HINT}")
        return data

    @classmethod
    def from_params(cls, params: Any = None, /, **kwargs: Any) -> Self:
        """Normalise an instance, a mapping, or diffusers-style keyword arguments.

        Every caller field is kept: unknown ones are an error, never dropped, and the
        caller's seed is never replaced. Keyword arguments update `params`.
        """
        if _is_generator(params):
            raise TypeError(GENERATOR_HINT)
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
    content: Annotated[StrictStr, Field(max_length=MAX_MESSAGE_CHARS)]
    name: Name | None = None


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class LoraChoice(Contract):
    """One adapter of a request: its name among the replica's adapters, its scale, and the sha256 of its weights file
    (filled in by the replica that resolves it, so provenance names the weights; a request that gives one, as
    `omniserve verify` does, is refused by a replica whose file differs)."""

    name: LoraName
    scale: LoraScale = 1.0
    sha256: Sha256 | None = None


def _distinct_adapters(choices: list[LoraChoice]) -> list[LoraChoice]:
    if len({c.name for c in choices}) != len(choices):
        raise PydanticCustomError("duplicate_lora", "each adapter may be named once (give one scale per adapter)")
    return choices


Loras = Annotated[
    list[LoraChoice],
    Field(min_length=1, max_length=MAX_LORAS, json_schema_extra={"x-unique-by": "name"}),  # `_distinct_adapters`
    AfterValidator(_distinct_adapters),
]


#: Step caching's threshold bounds: the relative change accumulated before a sample's denoiser runs again.
MAX_CACHE_THRESHOLD = 10.0


class StepCache(
    Contract,
    json_schema_extra={  # `_no_threshold_when_off`, declared
        "allOf": [
            {
                "if": {"properties": {"method": {"const": "off"}}},
                "then": {"properties": {"threshold": {"type": "null"}}},
            },
        ]
    },
):
    """Per-sample step caching (an extension; stages.diffusion.engine.sample): TeaCache's rule, decided for each
    sample from its own values alone, so a cached sample's bits never depend on its neighbours. "teacache": the
    relative L1 change of the sample's denoiser input is accumulated step by step; while it stays under `threshold`,
    the sample's last prediction is reused and its rows stay out of the denoiser call. Without a threshold, the one
    measured for the model's family (`Family.cache_threshold`: 0.2 for SD's UNet and the tiny FLUX DiT), which the
    replica fills in, so an image's record holds the threshold it ran with; a family without a measurement refuses
    it. "off": every step computed (overrides a deployment's default)."""

    method: Literal["teacache", "off"]
    threshold: Annotated[Finite, Field(gt=0.0, le=MAX_CACHE_THRESHOLD)] | None = None

    @model_validator(mode="after")
    def _no_threshold_when_off(self) -> Self:
        if self.method == "off" and self.threshold is not None:
            raise PydanticCustomError(
                "cache_threshold", "a threshold goes with method 'teacache' only, none with 'off'"
            )
        return self

    @property
    def active(self) -> bool:
        return self.method != "off"


@dataclass(frozen=True)
class Served:
    """Where one image sampling field goes besides DiffusionSamplingParams, declared beside its type, so that a new
    field is one line here: the HTTP request models, the deployments' defaults, the rendered-image record and the
    whole-request batch key are derived from these markers (`image_fields`, `optional_model`).

    request:  "all": a JSON field of generations (and edits); "edit": of edits only; None: not a body field as
              itself (height and width arrive as `size`)
    default:  a deployment may configure its default (`DiffusionDefaults`)
    rendered: a RenderedImage reports it, as the image was rendered
    batch:    how it enters the whole-request batch key: "value", "presence", or None (per sample)
    """

    request: Literal["all", "edit"] | None = "all"
    default: bool = False
    rendered: bool = False
    batch: Literal["value", "presence"] | None = None


class DiffusionSamplingParams(Contract):
    """How one image is sampled. `None` means the serving model's configured default."""

    seed: Annotated[Seed | None, Served(rendered=True)] = None
    num_inference_steps: Annotated[Steps | None, Served(default=True, rendered=True, batch="value")] = None
    guidance_scale: Annotated[GuidanceScale | None, Served(default=True, rendered=True, batch="value")] = None
    height: Annotated[Side | None, Served(request=None, default=True, rendered=True, batch="value")] = None
    width: Annotated[Side | None, Served(request=None, default=True, rendered=True, batch="value")] = None
    negative_prompt: Annotated[PromptText | None, Served(batch="presence")] = None
    scheduler: Annotated[SchedulerName | None, Served()] = None
    # FLUX's true classifier-free guidance (a second branch on the negative prompt, when one is given); None: off (1.0).
    # Its `guidance_scale` is the distilled guidance the transformer embeds.
    true_cfg_scale: Annotated[GuidanceScale | None, Served(batch="value")] = None
    strength: Annotated[Strength | None, Served(request="edit")] = None  # image edits only: None is DEFAULT_STRENGTH
    # The three inputs the seed contract forbids under invariance (see contracts.invariance).
    generator_device: Annotated[GeneratorDevice | None, Served(batch="value")] = None
    latents: Annotated[Latents | None, Served(batch="presence")] = None
    sigmas: Annotated[Sigmas | None, Served(batch="value")] = None
    # LoRA adapters (step engine only): each row's low-rank updates in its own call rows, the base weights untouched.
    lora: Annotated[Loras | None, Served()] = None
    # Step caching (step engine only): a sample's denoiser calls skipped while its input barely changes; None: the
    # deployment's default (none unless configured).
    cache: Annotated[StepCache | None, Served(default=True)] = None
    # OpenAI's quality, a share of the model's default steps (QUALITY_SHARES); resolved into num_inference_steps by
    # the stage, so a rendered image records its steps, not its quality.
    quality: Annotated[Quality | None, Served()] = None
    # A video model's frame count (its family checks the model's own rule); None for an image, and for a video the
    # family's default. Not an image request's field.
    num_frames: Annotated[Frames | None, Served(request=None, batch="value")] = None

    @model_validator(mode="after")
    def _quality_or_steps(self) -> Self:
        if self.quality is not None and self.num_inference_steps is not None:
            raise PydanticCustomError(
                "quality_and_steps", "give quality or num_inference_steps, not both (a quality stands for steps)"
            )
        return self

    def batch_parts(self) -> tuple[tuple[str, Any], ...]:
        """What decides whether two requests may share a whole-request batch: each field marked `batch`, by value
        (lists as tuples) or by presence (`has_<name>`). Equal parts: the same shapes and schedule."""
        parts = []
        for name, info in image_fields(type(self)).items():
            how, value = next(m for m in info.metadata if isinstance(m, Served)).batch, getattr(self, name)
            if how == "value":
                parts.append((name, tuple(value) if isinstance(value, list) else value))
            elif how == "presence":
                parts.append((f"has_{name}", value is not None))
        return tuple(parts)


def image_fields(model: type[BaseModel] = DiffusionSamplingParams, **where: Any) -> dict[str, FieldInfo]:
    """`model`'s fields whose `Served` marker has every given value, e.g. `image_fields(rendered=True)`."""
    found = {}
    for name, info in model.model_fields.items():
        served = next((m for m in info.metadata if isinstance(m, Served)), None)
        if served is not None and all(getattr(served, key) == value for key, value in where.items()):
            found[name] = info
    return found


def optional_model(name: str, fields: Mapping[str, FieldInfo], *, base: type[BaseModel], doc: str) -> type[Any]:
    """A model of `fields` with their types and bounds, each None unless given: a derived declaration."""
    definitions: dict[str, Any] = {field: (info.annotation, None) for field, info in fields.items()}
    return create_model(name, __base__=base, __doc__=doc, **definitions)


def required_model(name: str, fields: Mapping[str, FieldInfo], *, base: type[BaseModel], doc: str) -> type[Any]:
    """A model of `fields` with their types and bounds, each required and never None (what was really used)."""
    definitions: dict[str, Any] = {field: (_not_none(info.annotation), ...) for field, info in fields.items()}
    return create_model(name, __base__=base, __doc__=doc, **definitions)


def _not_none(annotation: Any) -> Any:
    members = [arg for arg in get_args(annotation) if arg is not type(None)]
    return members[0] if len(members) == 1 else annotation


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
    # A LoRA adapter of the LLM stage's `lora_dir` (an extension; stages.llm.lora); None: the base model.
    lora: LoraName | None = None

    @model_validator(mode="after")
    def _min_tokens_fit(self) -> Self:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        return self

    def to_vllm(self, **extra: Any):
        """Build `vllm.SamplingParams` (import deferred: only stage actors have vLLM)."""
        from vllm import SamplingParams

        fields = self.model_dump(exclude={"lora"})  # vLLM takes the adapter beside the params (a LoRARequest)
        fields["top_k"] = fields["top_k"] or 0  # vLLM: 0 disables top-k
        fields["stop"] = fields["stop"] or None
        return SamplingParams(**fields, **extra)
