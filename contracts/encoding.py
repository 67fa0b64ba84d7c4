"""The file an image is delivered as: the stage's PNG, or that PNG's pixels transcoded to JPEG or WebP.

    deliver(png, output) -> ImageFile    the bytes a client gets for `output_format` and `output_compression`

The diffusion stage always encodes PNG (lossless, its record in text chunks: `contracts.provenance`); the ingress
transcodes where a request asks for another format, after its result cache, so one kept render serves every format.
The encoders run with fixed settings, every one named here, so the same PNG and the same `output` give the same
bytes: JPEG through libjpeg-turbo (baseline, 4:2:0, standard tables scaled by the quality, no optimisation pass),
WebP through libwebp (lossy, method 4, single-threaded). Measured on the Intel Xeon this was written on, 2026-12-03:
libjpeg-turbo's SIMD paths (JSIMD_FORCENONE, SSE2, AVX2) give the same JPEG bytes (tests/contracts/test_encoding.py).

The PNG's three provenance texts travel in the file's XMP packet (JPEG's APP1, WebP's XMP chunk), each as one element
of the `omniserve` namespace (`contracts.provenance.read_xmp` reads them back), with `output` ("jpeg 90") saying how the file was encoded, so `omniserve verify` can
ask for the same file again.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Annotated, Final, Literal
from xml.sax.saxutils import escape

from pydantic import Field, StrictInt

from .provenance import XMP_NAMESPACE, read_chunks

OutputFormat = Literal["png", "jpeg", "webp"]
#: OpenAI's `output_compression`, 0-100, for JPEG and WebP: passed to the encoder as its quality (100, OpenAI's
#: default: the least loss).
Compression = Annotated[StrictInt, Field(ge=0, le=100)]
DEFAULT_COMPRESSION: Final = 100
MEDIA_TYPES: Final = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}

OUTPUT_KEY: Final = "output"
_PIL_FORMATS: Final = {"jpeg": "JPEG", "webp": "WEBP"}


@dataclass(frozen=True)
class ImageOutput:
    """How a request's images are delivered: the format and, for JPEG and WebP, the encoder's quality."""

    format: OutputFormat = "png"
    compression: int | None = None  # None for PNG (lossless)

    def __str__(self) -> str:
        return self.format if self.compression is None else f"{self.format} {self.compression}"

    def request_fields(self) -> dict[str, str | int]:
        """The request fields that ask for this output."""
        return (
            {} if self.format == "png" else {"output_format": self.format, "output_compression": self.compression or 0}
        )

    @classmethod
    def parse(cls, text: str) -> ImageOutput:
        """The inverse of str(): "png", "jpeg 90"."""
        name, _, quality = text.partition(" ")
        if name not in MEDIA_TYPES or (name == "png") != (not quality) or (quality and not quality.isdigit()):
            raise ValueError(f"not an output: {text!r}")
        return cls(format=name, compression=int(quality) if quality else None)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ImageFile:
    """Delivered bytes, their format and sha256 (what a response reports and a URL serves)."""

    format: OutputFormat
    data: bytes
    sha256: str

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.format]


def deliver(png: bytes, output: ImageOutput, sha256: str | None = None) -> ImageFile:
    """`png` as `output` asks: itself, or its pixels as JPEG or WebP with its provenance in XMP."""
    if output.format == "png":
        return ImageFile("png", png, sha256 or hashlib.sha256(png).hexdigest())
    from PIL import Image

    chunks, _ = read_chunks(png)
    quality = DEFAULT_COMPRESSION if output.compression is None else output.compression
    xmp = _xmp({**chunks, OUTPUT_KEY: str(output)})
    buffer = io.BytesIO()
    with Image.open(io.BytesIO(png)) as picture:
        pixels = picture.convert("RGB")
    if output.format == "jpeg":
        pixels.save(buffer, "JPEG", quality=quality, subsampling="4:2:0", optimize=False, progressive=False, xmp=xmp)
    else:
        pixels.save(buffer, "WEBP", quality=quality, method=4, lossless=False, exact=False, xmp=xmp)
    data = buffer.getvalue()
    return ImageFile(output.format, data, hashlib.sha256(data).hexdigest())


def _xmp(texts: dict[str, str]) -> bytes:
    elements = "".join(f"<omniserve:{key}>{escape(text)}</omniserve:{key}>" for key, text in texts.items())
    return (
        '<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>'
        '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
        f'<rdf:Description rdf:about="" xmlns:omniserve="{XMP_NAMESPACE}">{elements}</rdf:Description>'
        '</rdf:RDF></x:xmpmeta><?xpacket end="r"?>'
    ).encode()
