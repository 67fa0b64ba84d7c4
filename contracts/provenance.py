"""Provenance inside the PNG: the text chunks that re-create an image, written and read back in one place.

Every PNG the diffusion stage encodes carries three text chunks, before its pixel data:

    omniserve   iTXt  the ImageRecord as canonical JSON (sorted keys, UTF-8): what `omniserve verify` reads
    parameters  iTXt  the same, in the one-paragraph form the Stable Diffusion web UIs write (for those tools)
    Software    tEXt  "omniserve <version>" (PNG's registered keyword)

An ImageRecord holds what re-creates the image: the prompt as the client sent it, the revised prompt that was
rendered, the image's own seed, every sampling parameter as rendered (the model's defaults filled in), the
rewrite on/off and the LLM's sampling params, each stage's model, switch and kernel backend (`StageRecord`), and
the project's version. Nothing that depends on how the image was batched or which replica rendered it (batch size,
replica id, time) is in it, nor the verified-scope verdict (see `ASSESSMENT`): the same request gives the same
bytes, chunks included, and the sha256 a response reports is of those bytes.

Initial latents and an edit's input image are not copied in (they can be megabytes): their sha256 is.

The file an image is delivered as (`deliver(png, output) -> ImageFile`, the bytes a client gets for `output_format`
and `output_compression`): the diffusion stage always encodes PNG (lossless, its record in the text chunks above);
the ingress transcodes where a request asks for another format, after its result cache, so one kept render serves
every format. The encoders run with fixed settings, every one named here, so the same PNG and the same `output` give
the same bytes: JPEG through libjpeg-turbo (baseline, 4:2:0, standard tables scaled by the quality, no optimisation
pass), WebP through libwebp (lossy, method 4, single-threaded). Measured on the Intel Xeon this was written on,
2026-12-03: libjpeg-turbo's SIMD paths (JSIMD_FORCENONE, SSE2, AVX2) give the same JPEG bytes
(tests/contracts/test_encoding.py). The PNG's three provenance texts travel in the file's XMP packet (JPEG's APP1,
WebP's XMP chunk), each as one element of the `omniserve` namespace (`read_xmp` reads them back), with `output`
("jpeg 90") saying how the file was encoded, so `omniserve verify` can ask for the same file again.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, cast
from xml.etree import ElementTree
from xml.sax.saxutils import escape

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from .results import Provenance, RevisedPrompt
from .sampling import DiffusionSamplingParams, LLMSamplingParams

if TYPE_CHECKING:
    from PIL.PngImagePlugin import PngImageFile

FORMAT: Final = "omniserve.image/1"
#: The XMP namespace of the provenance a transcoded JPEG or WebP carries (`deliver` below writes it).
XMP_NAMESPACE: Final = "urn:omniserve:image:1"
#: The chunks, by keyword.
RECORD_CHUNK = "omniserve"
PARAMETERS_CHUNK = "parameters"
SOFTWARE_CHUNK = "Software"
CHUNKS = (RECORD_CHUNK, PARAMETERS_CHUNK, SOFTWARE_CHUNK)


class ProvenanceError(ValueError):
    """A PNG without a readable, consistent omniserve record (not ours, or altered)."""


@cache
def project_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("omniserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


#: The `Provenance` fields a PNG leaves out: the verified-scope verdict (contracts/scope.py) is an assessment of a
#: replica's configuration against the audit records it finds, which can change (a record added, a replica of another
#: mode or machine) while the pixels do not. In the bytes it made the same request give other bytes: measured, a
#: request-batching and a step-batching replica rendered the same pixels, and 12 of 12 PNGs differed in that field
#: only. Responses and /health carry the verdict.
ASSESSMENT = frozenset({"verified", "verified_by", "scope_differences"})
#: And how many workers rendered it (`parallel`): like the batch it ran in, it does not change the pixels (the parallel
#: group's tests), so in the bytes it would make the same request give other bytes on another replica's grid.
LEFT_OUT = ASSESSMENT | {"parallel"}


class StageRecord(_Record):
    """What a PNG records of a stage: every `Provenance` field but the verdict and the workers (a test keeps the two in
    step)."""

    model: str
    batch_invariant: bool
    kernel_backend: str

    @classmethod
    def of(cls, provenance: Provenance) -> StageRecord:
        return cls.model_validate(provenance.model_dump(exclude=set(LEFT_OUT)))


class ImageOrigin(_Record):
    """What the ingress knows of one image before the diffusion stage renders it: the client's prompt and its rewrite."""

    prompt: str  # as the client sent it
    enhance: bool
    llm: Provenance | None = None  # the LLM stage that rewrote it (None: not rewritten)
    llm_params: LLMSamplingParams | None = None  # what the rewrite ran with (its seed is the image's)

    @classmethod
    def of(cls, prompt: str, rewrite: RevisedPrompt | None) -> ImageOrigin:
        """The origin of an image of `prompt`, rewritten by the LLM stage into `rewrite` (None: not rewritten)."""
        if rewrite is None:
            return cls(prompt=prompt, enhance=False)
        llm = Provenance.model_validate(rewrite.model_dump(include=set(Provenance.model_fields)))
        return cls(prompt=prompt, enhance=True, llm=llm, llm_params=rewrite.params)


class ImageRecord(_Record):
    """Everything that re-creates one PNG; written into it (`ImageRecord.png_info`) and read back (`read_record`)."""

    format: Literal["omniserve.image/1"] = FORMAT
    version: str
    prompt: str  # the client's prompt (what `prompt` of a request that reproduces it must be)
    revised_prompt: str  # what the diffusion stage rendered (the prompt itself when not rewritten)
    enhance: bool
    seed: int
    params: DiffusionSamplingParams  # as rendered; `latents` left out (see latents_sha256)
    latents_sha256: str | None = None  # the initial latents a request gave, if any
    image_sha256: str | None = None  # an edit's input image (None: text-to-image)
    llm_params: LLMSamplingParams | None = None
    stages: dict[str, StageRecord]  # "diffusion" always; "llm" when it rewrote the prompt

    @classmethod
    def of(
        cls,
        prompt: str,
        params: DiffusionSamplingParams,
        diffusion: Provenance,
        origin: ImageOrigin | None,
        image: bytes | None = None,
    ) -> ImageRecord:
        """The record of an image the diffusion stage rendered from `prompt` with resolved `params`.

        Without an origin (the stage called directly, not through the ingress) the prompt is its own origin."""
        origin = origin or ImageOrigin(prompt=prompt, enhance=False)
        stages = {"diffusion": StageRecord.of(diffusion), **({"llm": StageRecord.of(origin.llm)} if origin.llm else {})}
        latents = None if params.latents is None else _sha256(json.dumps(params.latents).encode())
        return cls(
            version=project_version(),
            prompt=origin.prompt,
            revised_prompt=prompt,
            enhance=origin.enhance,
            seed=params.seed,
            params=params.model_copy(update={"latents": None}),
            latents_sha256=latents,
            image_sha256=None if image is None else _sha256(image),
            llm_params=origin.llm_params,
            stages=stages,
        )

    def canonical(self) -> str:
        """The record as written: JSON with sorted keys, no spaces, UTF-8 as it is."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def parameters(self) -> str:
        """The Stable Diffusion web UIs' form: prompt, negative prompt, then `Key: value` pairs."""
        p = self.params
        pairs = {
            "Steps": p.num_inference_steps,
            "Sampler": p.scheduler or "default",
            "CFG scale": p.guidance_scale,
            "Seed": self.seed,
            "Size": f"{p.width}x{p.height}",
            "Model": self.stages["diffusion"].model,
            "Denoising strength": p.strength,
            "Version": f"omniserve {self.version}",
        }
        lines = [self.revised_prompt] + ([f"Negative prompt: {p.negative_prompt}"] if p.negative_prompt else [])
        return "\n".join(lines + [", ".join(f"{k}: {v}" for k, v in pairs.items() if v is not None)])

    def chunks(self) -> dict[str, str]:
        """Each chunk's text, by keyword."""
        return {
            RECORD_CHUNK: self.canonical(),
            PARAMETERS_CHUNK: self.parameters(),
            SOFTWARE_CHUNK: f"omniserve {self.version}",
        }

    def png_info(self):
        """PIL's PngInfo holding the chunks (uncompressed, in CHUNKS order: the same record, the same bytes)."""
        from PIL.PngImagePlugin import PngInfo

        info = PngInfo()
        for keyword, text in self.chunks().items():
            if keyword == SOFTWARE_CHUNK:
                info.add_text(keyword, text)
            else:
                info.add_itxt(keyword, text)
        return info

    def problems(self, chunks: dict[str, str], size: tuple[int, int]) -> list[str]:
        """What in a file disagrees with this record: the derived chunks, the image's size, the record's own form
        (each as this version writes it: a file of another version, or edited by hand, shows here)."""
        problems = [
            f"the {keyword!r} chunk differs from what the record implies"
            for keyword, text in self.chunks().items()
            if keyword != RECORD_CHUNK and chunks.get(keyword) != text
        ]
        if self.canonical() != chunks.get(RECORD_CHUNK):
            problems.append(f"the {RECORD_CHUNK!r} chunk is not written as omniserve {project_version()} writes it")
        if size != (self.params.width, self.params.height):
            problems.append(
                f"the image is {size[0]}x{size[1]} but its record says {self.params.width}x{self.params.height}"
            )
        return problems


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def read_chunks(file: bytes) -> tuple[dict[str, str], tuple[int, int]]:
    """The provenance texts of an image file and its (width, height): a PNG's text chunks, or the XMP elements of a
    JPEG or WebP the ingress transcoded (`deliver`); ProvenanceError when it is none of those."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(file)) as picture:
            if picture.format == "PNG":
                chunks = cast("PngImageFile", picture).text  # only PIL's PNG plugin opens a PNG
                return {key: str(value) for key, value in chunks.items()}, picture.size
            if picture.format in ("JPEG", "WEBP"):
                return read_xmp(picture.info.get("xmp", b"")), picture.size
            raise ProvenanceError(f"not a PNG, JPEG or WebP but {picture.format}")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError) as err:
        raise ProvenanceError(f"not a readable image: {err}") from None


def read_xmp(xmp: bytes | str) -> dict[str, str]:
    """Our elements of an XMP packet, by keyword ({} when it has none or is no XML)."""
    text = xmp.decode("utf-8", "replace") if isinstance(xmp, bytes) else xmp
    start, end = text.find("<x:xmpmeta"), text.rfind("</x:xmpmeta>")
    if start < 0 or end < 0:
        return {}
    try:
        root = ElementTree.fromstring(text[start : end + len("</x:xmpmeta>")])
    except ElementTree.ParseError:
        return {}
    prefix = "{" + XMP_NAMESPACE + "}"
    return {node.tag[len(prefix) :]: node.text or "" for node in root.iter() if node.tag.startswith(prefix)}


def read_record(png: bytes) -> ImageRecord:
    """The record in an image file (a PNG, or a JPEG or WebP of ours), checked against the file's other chunks and its size; ProvenanceError says what is wrong."""
    chunks, (width, height) = read_chunks(png)
    if RECORD_CHUNK not in chunks:
        raise ProvenanceError(f"no {RECORD_CHUNK!r} chunk: not an omniserve image, or its provenance was removed")
    try:
        record = ImageRecord.model_validate_json(chunks[RECORD_CHUNK])
    except ValidationError as err:
        raise ProvenanceError(
            f"the {RECORD_CHUNK!r} chunk is not a valid record (altered?): {err.errors()[0]['msg']}"
        ) from None
    problems = record.problems(chunks, (width, height))
    if problems:
        raise ProvenanceError(
            "the file's provenance is inconsistent (altered, or from another version?): " + "; ".join(problems)
        )
    return record


def differences(expected: Any, found: Any, path: str = "") -> list[str]:
    """Where two records (or their parts, as plain data) differ: ["stages.diffusion.batch_invariant: True != False"]."""
    if isinstance(expected, BaseModel):
        expected = expected.model_dump(mode="json")
    if isinstance(found, BaseModel):
        found = found.model_dump(mode="json")
    if isinstance(expected, dict) and isinstance(found, dict):
        return [
            line
            for key in sorted(set(expected) | set(found), key=str)
            for line in differences(expected.get(key), found.get(key), f"{path}.{key}" if path else str(key))
        ]
    return [] if expected == found else [f"{path or 'value'}: {expected!r} != {found!r}"]


# The file an image is delivered as: the stage's PNG, or its pixels transcoded to JPEG or WebP.

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
