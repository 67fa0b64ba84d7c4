"""What the stages hand back: typed results that cross the actor boundary like the params do.

Plain data only (text, ints, floats, PNG bytes); the ingress builds its HTTP responses from these fields,
never from string keys.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from .config import ParallelDegrees
from .sampling import DiffusionSamplingParams, LLMSamplingParams, LoraChoice, image_fields, required_model

#: One position's top logprobs: (token id, logprob), best first.
TopLogprobs = list[tuple[int, float]]


class Result(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Provenance(Result):
    """Which model produced a result, and with which invariance state."""

    model: str
    batch_invariant: bool
    kernel_backend: str  # "cpu", "vllm-cuda", "none", ...
    # An audit record covers the configuration (and, for an image, its size) that produced this result
    # (contracts/scope.py); when not, why: the nearest record's differences, or "batch invariance is off".
    verified: bool = False
    verified_by: str = ""  # when verified: the audit record, and the self-check where the record's machine was another
    scope_differences: list[str] = []
    # The workers that rendered it (a replica's parallel group; None: one worker, or not a diffusion result).
    parallel: ParallelDegrees | None = None


class Generation(Result):
    """One finished vLLM request, as plain data."""

    text: str
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token
    top_logprobs: list[TopLogprobs]
    finish_reason: str | None
    cached_tokens: int = 0
    # When the engine first scheduled it (set with log stats on); equal values = same step.
    scheduled_ts: float | None = None


class RevisedPrompt(Provenance):
    """The LLM stage's rewrite of one image prompt, with what reproduces it."""

    revised_prompt: str
    prompt: str
    completion: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs] | None  # only when the params asked for logprobs
    finish_reason: str | None
    prompt_tokens: int
    seed: int | None
    params: LLMSamplingParams  # what the rewrite really ran with
    structured_output: bool


class Usage(Result):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(Provenance):
    """One chat completion of the LLM stage."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs] | None
    finish_reason: str | None
    usage: Usage
    seed: int | None
    lora: LoraChoice | None = None  # the LoRA adapter it ran with (name and weights' sha256), None: the base model


class CompletionDelta(Result):
    """What a streamed chat completion adds at one step of its engine: the new text, tokens and their logprobs, and the
    finish reason once it has one. A stream's deltas concatenated are its Completion's text, tokens and logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs] | None
    finish_reason: str | None


class RenderedImage(
    required_model(  # type: ignore[misc]  # a base made by pydantic.create_model
        "_Rendered", image_fields(rendered=True), base=Provenance, doc="the fields marked `rendered`"
    )
):
    """One image of the diffusion stage: PNG bytes, their sha256, and how it was sampled (the sampling fields marked
    `rendered`, as really used: `rendered_params`) and batched."""

    png: bytes
    sha256: str
    batch_size: int  # the most samples that shared one of its denoiser calls
    steps_co_batched: int  # how many of its steps ran with other samples
    steps_computed: int  # how many of its steps ran the denoiser (fewer than its steps with step caching)
    replica: str


class RenderedVideo(
    required_model(  # type: ignore[misc]  # a base made by pydantic.create_model
        "_RenderedClip", image_fields(rendered=True), base=Provenance, doc="the fields marked `rendered`"
    )
):
    """One video of the video stage: MP4 bytes (`stages.diffusion.video_file`), their sha256 and that of the frames they
    encode, how it was sampled and batched."""

    mp4: bytes
    sha256: str
    frames_sha256: str  # of the uint8 frames (frames, height, width, 3), the encoder's input
    num_frames: int
    fps: int
    batch_size: int
    steps_co_batched: int
    steps_computed: int
    replica: str


class RenderProgress(Result):
    """A render's progress: `step` of its `steps` denoising steps done (sent after each, before the result)."""

    step: int
    steps: int


class RenderCheckpoint(Result):
    """A render's whole state after `step` of its `steps` steps (`stages.diffusion.engine.sample`), sent in its
    stream when its job asks (`RenderJob.checkpoint_every`). A replica of the same stage identity (`made_by`: model,
    switch and kernels) resumes it from there with the uninterrupted render's bytes; another starts it anew."""

    step: int
    steps: int
    state: bytes
    made_by: str


class RenderMoved(Result):
    """The render's last item when its replica stops (a scale-down, a redeploy) while it runs: the replica handed it
    off at a step boundary, and its caller sends it again, to another replica, from `checkpoint` (None: it had not
    stepped yet, so it starts there from its first step). What the client was sent (previews) is not sent again."""

    checkpoint: RenderCheckpoint | None = None


class GroupMember(Result):
    """One worker of a diffusion replica's parallel group (`stages.diffusion.group`), as `/health` shows it."""

    pid: int
    node: str
    device: str
    torch_threads: int
    kernels_installed: bool
    rows: int  # denoiser rows it has predicted since it started


class StageDescription(Provenance):
    """A replica's own view of itself, for /health and /v1/models."""

    stage: Literal["llm", "diffusion", "video"]
    replica: str | None = None
    running: bool  # its engine (vLLM's engine core, the diffusion compute thread) is alive and not stuck
    # Every process that runs the model installed the batch-invariant kernels (False when the switch is off).
    kernels_installed: bool
    kernels: Any  # the kernel report(s): one per process that runs the model
    details: dict[str, Any] = {}


class PartialImage(Result):
    """A preview of an image still being denoised (streaming): its current estimate, decoded, as PNG bytes."""

    index: int  # 0-based among the image's partial images
    png: bytes
    height: int
    width: int


def rendered_params(params: DiffusionSamplingParams) -> dict[str, Any]:
    """The fields of resolved `params` a RenderedImage reports."""
    return params.model_dump(include=set(image_fields(rendered=True)))
