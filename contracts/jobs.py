"""The one typed job the image routes hand the diffusion stage: a generation or an edit, streamed or not.

Generations, edits and streams differ only in data: an edit carries its input `image`, a stream asks for
`partial_images` previews. The ingress builds one `RenderJob` per image and the stage has one entry point for it
(`DiffusionStage.render`), which yields the previews, then the image; a caller that wants the image alone takes the
last item (`final_image`).
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Any, TypeVar

from pydantic import NonNegativeInt, StrictBytes, StrictStr

from .provenance import ImageOrigin
from .results import RenderCheckpoint, RenderedImage
from .sampling import Contract, DiffusionSamplingParams, PartialImages

T = TypeVar("T")


class RenderJob(Contract):
    """One image to render. The stage admits every field again with the ingress's functions (contracts.admission)."""

    prompt: StrictStr  # what the model renders: the revised prompt, or the client's when it was not rewritten
    params: DiffusionSamplingParams
    origin: ImageOrigin | None = None  # the client's prompt and its rewrite, for the PNG's record
    image: StrictBytes | None = None  # an edit's input image, as the client sent it (None: a generation)
    partial_images: PartialImages = 0  # previews to send before the image (streaming)
    # A RenderCheckpoint in the stream every this many steps (0: none), and one to resume from (None: from the start):
    # a render moved to another replica goes on from its last checkpoint (a video job's, `orchestration.video_jobs`).
    checkpoint_every: NonNegativeInt = 0
    resume: RenderCheckpoint | None = None

    @property
    def kind(self) -> str:
        return "generation" if self.image is None else "edit"


async def final(items: AsyncIterable[Any], kind: type[T]) -> T:
    """The `kind` at the end of a stage's stream, the pieces before it skipped: a render's RenderedImage (previews
    skipped), a chat's Completion (its pieces skipped)."""
    last = None
    async for item in items:
        last = item
    if not isinstance(last, kind):
        raise RuntimeError(f"a stream ended without its {kind.__name__} (last item: {type(last).__name__})")
    return last


async def final_image(items: AsyncIterable[Any]) -> RenderedImage:
    """The RenderedImage at the end of a `render` stream (a stage handle's or the stage's own)."""
    return await final(items, RenderedImage)
