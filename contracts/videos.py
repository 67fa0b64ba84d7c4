"""OpenAI's Videos API as this server serves it: the body of `POST /v1/videos`, the video resource a client polls,
and DELETE's answer.

    VideoCreateRequest   JSON, or the multipart form OpenAI's client sends (`from_form`): OpenAI's `prompt`, `model`,
                         `seconds` and `size`, then this server's extensions, each declared once in
                         DiffusionSamplingParams (`VIDEO_FIELDS`), and `enhance_prompt`
    Video                the job: `status` queued -> in_progress -> completed (or failed), `progress` 0-100, then
                         `completed_at` and `expires_at`; extensions say how it was made (seed, frames, the MP4's
                         sha256 and its frames', batching, verified scope)
    VideoDeleted         the answer to `DELETE /v1/videos/{id}`

A clip's length is `seconds` at the video stage's frame rate plus its first frame (seconds x fps + 1 frames: Wan's VAE
compresses time 4x after the first frame, so a rate that is a multiple of 4 always gives a count it takes), or
`num_frames` itself; given both, they must agree. Neither: the model's own default length.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from .errors import InvalidRequestError
from .http import SIZE_PATTERN, _present, _Request, requested_size
from .sampling import DiffusionSamplingParams, Name, Prompt, optional_model

#: The sampling extensions a video request takes (the rest of an image's, adapters, schedulers, latents, caching,
#: are the image stage's).
VIDEO_FIELDS = ("seed", "num_inference_steps", "guidance_scale", "negative_prompt", "num_frames")
MAX_SECONDS = 60
#: OpenAI's `seconds` is a string ("4"); a JSON client may send the number.
Seconds = Annotated[StrictInt, Field(ge=1, le=MAX_SECONDS)] | Annotated[StrictStr, Field(pattern=r"^[1-9][0-9]?$")]


class _OpenAIVideoRequest(_Request):
    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "input_reference": "this server renders text to video; a reference image or video is not served",
    }

    prompt: Prompt
    model: Name | None = None
    seconds: Seconds | None = None
    size: Annotated[StrictStr, Field(pattern=SIZE_PATTERN)] | None = None


class VideoCreateRequest(
    optional_model(  # type: ignore[misc]  # a base made by pydantic.create_model
        "_VideoExtensions",
        {name: DiffusionSamplingParams.model_fields[name] for name in VIDEO_FIELDS},
        base=_OpenAIVideoRequest,
        doc="the sampling extensions a video takes",
    )
):
    """`POST /v1/videos`: OpenAI's fields, then this server's extensions (the openai client's `extra_body`)."""

    enhance_prompt: StrictBool = True

    def frames(self, fps: int) -> int | None:
        """The frames asked for (None: the model's default): `num_frames`, or `seconds` at `fps`; both must agree."""
        from_seconds = None if self.seconds is None else int(self.seconds) * fps + 1
        if from_seconds is not None and self.num_frames is not None and from_seconds != self.num_frames:
            raise InvalidRequestError(
                f"num_frames {self.num_frames} is not {self.seconds} s at this server's {fps} frames per second "
                f"({from_seconds} frames); give one of them",
                param="num_frames",
            )
        return self.num_frames if self.num_frames is not None else from_seconds

    def diffusion_params(self, seed: int | None, fps: int) -> DiffusionSamplingParams:
        """The sampling params of the video: its extensions, its size as height and width, its frames, `seed`."""
        try:
            width, height = requested_size(self.size)
        except ValueError as err:
            raise InvalidRequestError(str(err), param="size") from None
        given = {name: getattr(self, name) for name in VIDEO_FIELDS}
        return DiffusionSamplingParams.model_validate(
            _present(**{**given, "seed": seed, "height": height, "width": width, "num_frames": self.frames(fps)})
        )


class VideoError(BaseModel):
    """Why a job failed: OpenAI's error fields."""

    code: str
    message: str
    param: str | None = None
    type: str | None = None


class Video(BaseModel):
    """A video job, as OpenAI's `Video` object, then this server's extensions."""

    model_config = ConfigDict(frozen=True)

    id: str
    object: Literal["video"] = "video"
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None  # the job and its file are dropped then (or earlier, for newer files past the bound)
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: Annotated[int, Field(ge=0, le=100)]
    model: str
    prompt: str
    seconds: str  # the clip's length: (frames - 1) / fps
    size: str
    error: VideoError | None = None
    remixed_from_video_id: str | None = None  # remixes are not served: always null
    # Extensions: what reproduces it and how it was made.
    seed: int
    num_frames: int
    fps: int
    num_inference_steps: int
    revised_prompt: str | None = None  # once the LLM stage has rewritten the prompt (the prompt itself when not)
    sha256: str | None = None  # of the MP4, once completed
    frames_sha256: str | None = None  # of its frames as uint8 (frames, height, width, 3): the encoder's input
    batch_size: int | None = None  # the most videos that shared one of its denoiser calls
    steps_co_batched: int | None = None
    replica: str | None = None
    batch_invariant: bool
    verified: bool | None = None
    verified_by: str | None = None
    # The step its render last went on from, on another replica, after its replica was lost (None: it never did).
    resumed_from_step: int | None = None

    def updated(self, **fields: Any) -> Video:
        return self.model_copy(update=fields)


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


def clip_seconds(frames: int, fps: int) -> str:
    """A clip's length as OpenAI writes it ("4"): whole seconds without a fraction, else to the millisecond."""
    seconds = (frames - 1) / fps
    return str(int(seconds)) if seconds.is_integer() else f"{seconds:.3f}".rstrip("0")
