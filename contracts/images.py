"""An edit's input image: its bounds, its decoding and its size rule, in one place (the ingress and the stage use it).

    admit_image(data) -> PIL image    PNG, JPEG or WebP bytes, at most MAX_IMAGE_BYTES and MAX_SIDE x MAX_SIDE,
                                      decoded whole, turned upright (EXIF orientation) and converted to RGB
    edit_size(image, width, height)   the size an edit renders at: the requested one, which must be the image's
                                      own; none requested, the image's own

Every refusal is an InvalidRequestError naming `image` (a PayloadTooLargeError, 413, for too many bytes). PIL is
imported when an image is admitted, not before.
"""

from __future__ import annotations

import io
from typing import Any

from .errors import InvalidRequestError, PayloadTooLargeError
from .sampling import MAX_SIDE, MIN_SIDE, SIDE_MULTIPLE

MAX_IMAGE_BYTES = 16 * 2**20
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


def _refused(message: str, code: str = "invalid_image") -> InvalidRequestError:
    return InvalidRequestError(message, param="image", code=code)


def check_image_bytes(size: int) -> None:
    """Refuse an image of `size` bytes before reading it, if it is too large (413, as a body over its limit)."""
    if size > MAX_IMAGE_BYTES:
        raise PayloadTooLargeError(
            f"image is {size} bytes; at most {MAX_IMAGE_BYTES} (16 MiB) are accepted",
            param="image",
            code="image_too_large",
        )


def admit_image(data: Any):
    """The image in `data` (PNG, JPEG or WebP bytes), upright and in RGB, or InvalidRequestError(param="image")."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not isinstance(data, bytes):
        raise _refused(
            f"image must be the bytes of a PNG, JPEG or WebP file, not {type(data).__name__}", "invalid_type"
        )
    if not data:
        raise _refused("image is empty: send a PNG, JPEG or WebP file")
    check_image_bytes(len(data))
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        width, height = image.size
        if width > MAX_SIDE or height > MAX_SIDE:  # checked before the pixels are decoded
            raise _refused(f"image is {width}x{height}; at most {MAX_SIDE}x{MAX_SIDE} is accepted", "image_too_large")
        image.load()
        return ImageOps.exif_transpose(image).convert("RGB")
    except InvalidRequestError:
        raise
    except UnidentifiedImageError:
        raise _refused("image is not a PNG, JPEG or WebP image") from None
    except Exception as err:  # PIL raises many kinds on a damaged file (truncated, bad chunks, ...)
        raise _refused(f"image could not be decoded: {err}") from None


def edit_size(image, width: int | None, height: int | None) -> tuple[int, int]:
    """(width, height) of an edit of `image`: the requested side where given (it must be the image's), else the image's."""
    own_width, own_height = image.size
    size = (width or own_width, height or own_height)
    if size != (own_width, own_height):
        raise _refused(
            f"image is {own_width}x{own_height} but the requested size is {size[0]}x{size[1]}: "
            "send an image of the requested size, or leave size out",
            "invalid_size",
        )
    for side in size:
        if not MIN_SIDE <= side <= MAX_SIDE or side % SIDE_MULTIPLE:
            raise _refused(
                f"image is {own_width}x{own_height}: its width and height must be multiples of {SIDE_MULTIPLE} "
                f"in [{MIN_SIDE}, {MAX_SIDE}]",
                "invalid_size",
            )
    return size
