"""The OpenAPI document an app serves (`GET /openapi.json`): FastAPI's, generated from the request models, narrowed to
what this deployment enforces, so that a request the document calls valid is served and one it calls invalid is
refused (a schema-driven fuzzer checks both: tests/orchestration/test_schema_fuzz.py).

From the app's config: `seed` required under a stage's invariance (the seed contract: for chat, only where it samples,
temperature not 0), the inputs the contract forbids then (`generator_device`, `latents`, `sigmas`) left out, the step
and pixel limits. From the stages themselves (their `describe()`, asked once): the model ids a request may name, the
adapters and schedulers a replica serves, the size multiple and the fewest steps of its model, whether it takes
`true_cfg_scale` and per-sample fields (`cache`, `lora`), and step caching's measured default threshold. Sizes carry
`format: "image-size"` with `x-max-pixels` and `x-size-multiple` (a pattern cannot say "width x height at most N
pixels"); an edit's image its `x-image-size` (the sides it may have: it renders at them). Integer bounds are the exact
integers the server enforces (the seed's up to 2**64 - 1), and `info.x-json-integers` says that an integer field takes
a JSON integer only (JSON Schema's `integer` takes 1.0; this server refuses it). The server-sent events of a streamed request are declared
with OpenAPI 3.2's `itemSchema`.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, cast

from pydantic import BaseModel

from contracts.admission import ModelCapabilities
from contracts.http import ChatCompletionChunk, ImageCompletedEvent, ImagePartialEvent
from contracts.sampling import MAX_INFERENCE_STEPS, MAX_SEED, MIN_SEED
from contracts.videos import MAX_SECONDS

from .config import AppConfig
from .health import HealthProbe

#: The seed contract's inputs: refused under diffusion invariance (contracts.invariance), so not declared then.
SEED_CONTRACT_FIELDS = ("generator_device", "latents", "sigmas")
IMAGE_REQUESTS = ("ImageGenerationRequest", "ImageEditRequest")


class ServedDocument:
    """An ingress replica's document, made once every stage has described itself (a stage scaled to zero is not woken:
    until it runs, its part stays as the config says, and the document is made again on the next request)."""

    def __init__(self, config: AppConfig):
        self.config = config
        self._made: dict[str, Any] | None = None

    async def served(self, generated: dict[str, Any], probe: HealthProbe) -> dict[str, Any]:
        if self._made is not None:
            return self._made
        running = await asyncio.to_thread(probe.replica_counts)
        described = {
            stage: (await probe.describe(stage)).model_dump(mode="json")
            for stage in probe.handles  # the stages: llm, diffusion, and video where the app serves videos
            if running[stage].get("running") != 0
        }
        document = served_schema(
            copy.deepcopy(generated),
            self.config,
            described.get("diffusion", {}),
            described.get("llm", {}),
            described.get("video", {}),
        )
        if len(described) == len(probe.handles):
            self._made = document
        return document


def served_schema(
    document: dict[str, Any],
    config: AppConfig,
    diffusion: dict[str, Any],
    llm: dict[str, Any],
    video: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`document` (FastAPI's) narrowed to this deployment; `diffusion`, `llm` and `video`: each stage's description as
    /health reports it (`model`, `details`; empty: not described yet, its part as the config says)."""
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in _image_schemas(document):
        _narrow_images(schema, config, diffusion, llm, require_seed=name != "edit-form")
    loras = diffusion.get("details", {}).get("loras", [])
    _adapters(components, loras)
    _step_cache(components, ModelCapabilities.described(diffusion))
    chat = components.get("ChatCompletionRequest")
    if chat is not None:
        _narrow_chat(chat, config, llm)
    _narrow_videos(document, config, video or {}, llm)
    _declare_events(document, components)
    _exact_integers(document)
    # What JSON Schema cannot say (its `integer` takes 1.0): an integer field takes a JSON integer only.
    document.setdefault("info", {})["x-json-integers"] = True
    return document


def _image_schemas(document: dict[str, Any]):
    components = document["components"]["schemas"]
    for name in IMAGE_REQUESTS:
        if name in components:
            yield name, components[name]
    form = document["paths"].get("/v1/images/edits", {}).get("post", {}).get("requestBody", {})
    schema = form.get("content", {}).get("multipart/form-data", {}).get("schema")
    if schema is not None:
        yield "edit-form", schema


def _adapters(components: dict[str, Any], loras: list[str]) -> None:
    """A request's adapters: the names this deployment serves; their sha256 (what `omniserve verify` sends back from
    a file, refused when it differs from the replica's) left undeclared."""
    choice = components.get("LoraChoice")
    if choice is not None:
        choice["properties"]["name"] = {"type": "string", "enum": list(loras)}
        choice["properties"].pop("sha256", None)


def _step_cache(components: dict[str, Any], capabilities: ModelCapabilities) -> None:
    """A TeaCache request's threshold: left out, the one measured for the model's family (`cache_threshold`, as the
    stage reports it); required where the family has none."""
    schema = components.get("StepCache")
    if schema is None:
        return
    measured = capabilities.cache_threshold
    if measured is None:
        required = {"required": ["threshold"], "properties": {"threshold": {"type": "number"}}}
        schema.setdefault("allOf", []).append(
            {"if": {"properties": {"method": {"const": "teacache"}}}, "then": required}
        )
    else:
        schema["properties"]["threshold"]["description"] = (
            f"left out with 'teacache': {measured}, measured for this model"
        )


def _rewritten_prompt_fits(schema: dict[str, Any], llm: dict[str, Any]) -> None:
    """With the rewrite on (`enhance_prompt` not false), a prompt at most the characters whose tokens surely fit the
    LLM's rewrite (`rewrite_prompt_tokens`, as the stage reports it): 4 per character, a UTF-8 byte each at most."""
    budget = llm.get("details", {}).get("rewrite_prompt_tokens")
    if budget is not None:
        longest = {"properties": {"prompt": {"maxLength": max(1, (budget - 8) // 4)}}}
        rule = {
            "if": {"properties": {"enhance_prompt": {"const": False}}, "required": ["enhance_prompt"]},
            "else": longest,
        }
        schema.setdefault("allOf", []).append(rule)


def _narrow_images(
    schema: dict[str, Any], config: AppConfig, diffusion: dict[str, Any], llm: dict[str, Any], require_seed: bool
) -> None:
    properties = schema["properties"]
    limits, capabilities = config.diffusion, ModelCapabilities.described(diffusion)
    if config.switches.diffusion:
        for name in SEED_CONTRACT_FIELDS:
            properties.pop(name, None)
        if require_seed:
            _require(schema, "seed")
    steps = _nullable(properties, "num_inference_steps")
    steps.update(minimum=capabilities.min_steps, maximum=min(limits.max_inference_steps, MAX_INFERENCE_STEPS))
    size = _nullable(properties, "size")
    size.update(
        {"format": "image-size", "x-max-pixels": limits.max_pixels, "x-size-multiple": capabilities.size_multiple}
    )
    image = properties.get("image")
    if image is not None:  # an edit renders at its image's size: the same multiple and pixel limit as `size`
        image["x-image-size"].update(multipleOf=size["x-size-multiple"], **{"x-max-pixels": limits.max_pixels})
    _only(properties, "model", _model_ids(config, "diffusion", diffusion))
    if not capabilities.true_cfg:
        properties.pop("true_cfg_scale", None)
    if not capabilities.per_sample or not diffusion.get("details", {}).get("loras"):
        properties.pop("lora", None)
    if not capabilities.per_sample:
        properties.pop("cache", None)
    schedulers = capabilities.served_schedulers()
    _only(properties, "scheduler", schedulers) if schedulers else properties.pop("scheduler", None)
    _rewritten_prompt_fits(schema, llm)


def _narrow_videos(document: dict[str, Any], config: AppConfig, described: dict[str, Any], llm: dict[str, Any]) -> None:
    """A video body (JSON and form alike): its seed required under the video stage's invariance, its model, steps,
    size and frames within the video stage's config and its model's rules (as the stage describes them: the size
    multiple, the fewest steps, the frame counts its VAE makes, Wan's 4k + 1), `seconds` only where they make such a
    count within the limit, and, given both, `num_frames` what `seconds` make (`VideoCreateRequest.frames`)."""
    body = document["paths"].get("/v1/videos", {}).get("post", {}).get("requestBody", {})
    video, capabilities = config.video, ModelCapabilities.described(described)
    content = document["paths"].get("/v1/videos/{video_id}/content", {}).get("get", {})
    for parameter in content.get("parameters", []):
        if parameter["name"] == "variant":  # a video's content is its MP4: no thumbnail, no spritesheet
            parameter["schema"]["enum"] = ["video"]
    for content in body.get("content", {}).values():
        schema = content["schema"]
        properties = schema["properties"]
        assert video is not None  # the routes exist only where the app serves videos
        if video.batch_invariant:
            _require(schema, "seed")
        _only(properties, "model", [cast(str, video.model), "video"])
        steps = _nullable(properties, "num_inference_steps")
        steps.update(minimum=capabilities.min_steps, maximum=video.max_inference_steps)
        size = _nullable(properties, "size")
        size.update(
            {"format": "image-size", "x-max-pixels": video.max_pixels, "x-size-multiple": capabilities.size_multiple}
        )
        step = capabilities.frame_step or 1
        counts = [frames for frames in range(1, video.max_frames + 1) if (frames - 1) % step == 0]
        _nullable(properties, "num_frames").update(enum=counts)
        _whole_seconds(schema, [s for s in range(1, MAX_SECONDS + 1) if s * video.fps + 1 in counts], video.fps)
        _rewritten_prompt_fits(schema, llm)


def _whole_seconds(schema: dict[str, Any], seconds: list[int], fps: int) -> None:
    """`seconds` (a number, or OpenAI's string) only as the given counts, and `num_frames` beside it what they make."""
    if not seconds:
        schema["properties"].pop("seconds", None)  # none makes a count served here: refused as an unknown field
        return
    for branch in schema["properties"]["seconds"].get("anyOf", []):
        if branch.get("type") == "integer":
            branch["enum"] = seconds
        elif branch.get("type") == "string":
            branch.pop("pattern", None)
            branch["enum"] = [str(s) for s in seconds]
    made = [
        {
            "if": {"properties": {"seconds": {"enum": [s, str(s)]}}, "required": ["seconds"]},
            "then": {"properties": {"num_frames": {"enum": [s * fps + 1, None]}}},
        }
        for s in seconds
    ]
    schema.setdefault("allOf", []).extend(made)


def _narrow_chat(schema: dict[str, Any], config: AppConfig, llm: dict[str, Any]) -> None:
    properties = schema["properties"]
    if config.switches.llm:  # the seed contract (admit_chat): a sampled completion needs its seed, a greedy one not
        seeded = {"required": ["seed"], "properties": {"seed": copy.deepcopy(_nullable(properties, "seed"))}}
        greedy = {"properties": {"temperature": {"const": 0}}, "required": ["temperature"]}
        schema.setdefault("allOf", []).append({"if": greedy, "else": seeded})
    _only(properties, "model", _model_ids(config, "llm", llm))
    context = llm.get("details", {}).get("context_tokens")
    if context is not None:  # a sum over fields, which JSON Schema has no keyword for
        schema["x-context-tokens"] = {
            "tokens": context,
            "counts": "each message's content, at most a token per UTF-8 byte, + 2 per message + 2, + the completion's "
            "max_completion_tokens or max_tokens (64 when neither is given)",
        }
        for name in ("max_tokens", "max_completion_tokens"):
            _nullable(properties, name)["maximum"] = context - 3
    loras = llm.get("details", {}).get("loras", [])
    if loras:
        _only(properties, "lora", loras)
    else:
        properties.pop("lora", None)


def _model_ids(config: AppConfig, stage: str, described: dict[str, Any]) -> list[str]:
    """What `model` may say (Ingress.check_model): the served id, the configured name, the stage's name."""
    configured = getattr(config, stage).model
    return sorted({described.get("model") or stage, stage, *([configured] if configured else [])})


#: The integer bounds past 2**53 the contracts declare, by the double FastAPI's document model made of each (it writes
#: every bound as a float: the seed's maximum 2**64 - 1 became 1.8446744073709552e19, which is 2**64).
EXACT_BOUNDS = {float(bound): bound for bound in (MIN_SEED, MAX_SEED)}


def _exact_integers(node: Any) -> None:
    """Every integer's bounds, anywhere in the document (components, the edit form, the video bodies), as the exact
    integers the server enforces: the seed's range is [-2**63, 2**64 - 1], inclusive, written as JSON integers (a float
    bound past 2**53 is another number: a validator would take 2**64 for a seed). Bounds within 2**53 are exact as
    floats and written as integers too."""
    if isinstance(node, list):
        for item in node:
            _exact_integers(item)
    if not isinstance(node, dict):
        return
    if node.get("type") == "integer":
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
            bound = node.get(key)
            if isinstance(bound, float):
                node[key] = EXACT_BOUNDS[bound] if abs(bound) > 2**53 else int(bound)
    for value in node.values():
        _exact_integers(value)


def _require(schema: dict[str, Any], name: str) -> None:
    """`name` required, and not null."""
    schema["required"] = sorted({*schema.get("required", []), name})
    schema["properties"][name] = _nullable(schema["properties"], name)


def _nullable(properties: dict[str, Any], name: str) -> dict[str, Any]:
    """The non-null branch of an optional field's schema (pydantic writes `anyOf: [{...}, {"type": "null"}]`)."""
    field = properties.get(name, {})
    return next((s for s in field.get("anyOf", []) if s.get("type") != "null"), field)


def _only(properties: dict[str, Any], name: str, values: list[str]) -> None:
    if name in properties:
        branch = _nullable(properties, name)
        branch.pop("pattern", None)
        branch.pop("maxLength", None)
        branch["enum"] = list(values)


def _declare_events(document: dict[str, Any], components: dict[str, Any]) -> None:
    """Each event-stream response as OpenAPI 3.2 declares server-sent events: `itemSchema`, one event (`event`,
    `data`), its `data` a JSON document of the event's model (`contentSchema`); the events' models into the
    components. Image streams send `event: <type>` frames, an `error` frame on a failure; chat streams send data
    lines, `{"error": ...}` on a failure, and `[DONE]` last."""
    models: dict[str, type[BaseModel]] = {
        "ImagePartialEvent": ImagePartialEvent,
        "ImageCompletedEvent": ImageCompletedEvent,
        "ChatCompletionChunk": ChatCompletionChunk,
    }
    for name, model in models.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components.setdefault(name, schema)
    image = [_event(name, {"event": {"type": "string"}}) for name in ("ImagePartialEvent", "ImageCompletedEvent")]
    chat = [_event("ChatCompletionChunk"), {"properties": {"data": {"const": "[DONE]"}}, "required": ["data"]}]
    for path, events in (
        ("/v1/images/generations", image),
        ("/v1/images/edits", image),
        ("/v1/chat/completions", chat),
    ):
        content = document["paths"].get(path, {}).get("post", {}).get("responses", {}).get("200", {}).get("content", {})
        if "text/event-stream" in content:
            failure = _event("ErrorResponse", {"event": {"const": "error"}} if events is image else {})
            content["text/event-stream"] = {"itemSchema": {"type": "object", "oneOf": [*events, failure]}}


def _event(model: str, other: dict[str, Any] | None = None) -> dict[str, Any]:
    data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"$ref": f"#/components/schemas/{model}"},
    }
    return {"properties": {**(other or {}), "data": data}, "required": ["data"]}
