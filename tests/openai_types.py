"""Response bodies read as the official openai Python SDK's own types, strictly (no coercion: `"auto"` is no
quality of an ImagesResponse, `1.0` no `created`): what OpenAI's published schemas say each response is. Extension
fields are kept (the SDK's models allow extras); only OpenAI's own fields are held to OpenAI's types."""

from typing import Any

from openai.types import (
    ImageEditCompletedEvent,
    ImageEditPartialImageEvent,
    ImageGenCompletedEvent,
    ImageGenPartialImageEvent,
    ImagesResponse,
)
from openai.types.chat import ChatCompletion, ChatCompletionChunk

#: Each kind of body this server answers with -> the SDK's type of it (an image stream's events by their `type`).
OFFICIAL = {
    "images": ImagesResponse,
    "chat": ChatCompletion,
    "chunk": ChatCompletionChunk,
    "image_generation.partial_image": ImageGenPartialImageEvent,
    "image_generation.completed": ImageGenCompletedEvent,
    "image_edit.partial_image": ImageEditPartialImageEvent,
    "image_edit.completed": ImageEditCompletedEvent,
}


def read_as_openai(kind: str, body: dict[str, Any]) -> Any:
    """`body` validated strictly by the official type for `kind` (a key of OFFICIAL); fails naming each field."""
    return OFFICIAL[kind].model_validate(body, strict=True)
