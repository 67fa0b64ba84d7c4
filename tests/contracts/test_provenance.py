"""The provenance a PNG carries (`contracts.provenance`): written into its text chunks, read back, checked."""

import io

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from contracts.provenance import (
    LEFT_OUT,
    CHUNKS,
    RECORD_CHUNK,
    ImageOrigin,
    ImageRecord,
    ProvenanceError,
    StageRecord,
    differences,
    project_version,
    read_chunks,
    read_record,
)
from contracts.results import Provenance, RevisedPrompt
from contracts.sampling import DiffusionSamplingParams, LLMSamplingParams

PARAMS = DiffusionSamplingParams(seed=7, num_inference_steps=4, guidance_scale=5.0, height=32, width=48,
                                 negative_prompt="blurry", scheduler="euler")
DIFFUSION = Provenance(model="omniserve/tiny-sd-unet", batch_invariant=True, kernel_backend="cpu")
REWRITE = RevisedPrompt(model="omniserve/tiny-llm", batch_invariant=True, kernel_backend="cpu", revised_prompt="a fox, snow",
                        prompt="a fox", completion=", snow", token_ids=[1, 2], logprobs=[-0.1, -0.2], top_logprobs=None,
                        finish_reason="stop", prompt_tokens=5, seed=7, params=LLMSamplingParams(seed=7, temperature=0.8),
                        structured_output=False)


def png(record, pixels=None) -> bytes:
    """Encoded as the diffusion stage encodes (`stages.diffusion.encode_png`), without importing torch."""
    pixels = np.full((32, 48, 3), 128, "uint8") if pixels is None else pixels
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=6, pnginfo=record.png_info() if record else None)
    return buffer.getvalue()


def rewritten(data: bytes, chunks: dict[str, str]) -> bytes:
    """The same pixels with other text chunks (what someone editing a file's metadata does)."""
    info = PngInfo()
    for keyword, text in chunks.items():
        info.add_itxt(keyword, text)
    buffer = io.BytesIO()
    Image.open(io.BytesIO(data)).save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def test_a_record_round_trips_through_the_png_chunks():
    record = ImageRecord.of("a fox, snow", PARAMS, DIFFUSION, ImageOrigin.of("a fox", REWRITE))
    data = png(record)
    assert set(read_chunks(data)[0]) == set(CHUNKS)
    back = read_record(data)
    assert back == record
    assert (back.prompt, back.revised_prompt, back.seed, back.enhance) == ("a fox", "a fox, snow", 7, True)
    assert back.params == PARAMS and back.llm_params == REWRITE.params and back.version == project_version()
    assert back.stages["llm"].model == "omniserve/tiny-llm" and back.stages["diffusion"] == StageRecord.of(DIFFUSION)


def test_the_same_record_gives_the_same_bytes_and_another_seed_other_bytes():
    record = ImageRecord.of("a fox", PARAMS, DIFFUSION, None)
    assert png(record) == png(record)
    assert png(record) != png(record.model_copy(update={"seed": 8}))


def test_every_provenance_field_but_the_scope_verdict_is_written():
    # A field added to Provenance must be decided on here: written (StageRecord) or left out (LEFT_OUT).
    assert set(StageRecord.model_fields) == set(Provenance.model_fields) - LEFT_OUT
    record = ImageRecord.of("a fox", PARAMS, DIFFUSION, None)
    written = read_record(png(record)).stages["diffusion"]
    assert written.model_dump() == DIFFUSION.model_dump(exclude=LEFT_OUT)


def test_the_scope_verdict_never_changes_the_bytes():
    # Verified here, unverified on a replica that found no record: the same pixels must give the same PNG.
    unverified = DIFFUSION.model_copy(update={"verified": False, "scope_differences": ["thread count 4 not audited"]})
    verified = DIFFUSION.model_copy(update={"verified": True, "scope_differences": []})
    assert png(ImageRecord.of("a fox", PARAMS, verified, None)) == png(ImageRecord.of("a fox", PARAMS, unverified, None))


def test_a_stage_called_directly_records_its_prompt_as_the_origin():
    record = read_record(png(ImageRecord.of("a fox", PARAMS, DIFFUSION, None)))
    assert (record.prompt, record.revised_prompt, record.enhance, record.llm_params) == ("a fox", "a fox", False, None)
    assert list(record.stages) == ["diffusion"]


def test_latents_and_an_edit_image_are_recorded_by_their_sha256_only():
    latents = PARAMS.model_copy(update={"latents": [[[0.5] * 6] * 4] * 4})
    record = ImageRecord.of("a fox", latents, DIFFUSION, None, image=b"input image bytes")
    assert record.params.latents is None and len(record.latents_sha256) == 64 and len(record.image_sha256) == 64


def test_a_png_without_a_record_or_with_an_edited_one_is_refused_saying_why():
    data = png(ImageRecord.of("a fox", PARAMS, DIFFUSION, None))
    with pytest.raises(ProvenanceError, match="no 'omniserve' chunk"):
        read_record(png(None))
    chunks, _ = read_chunks(data)
    edited = chunks[RECORD_CHUNK].replace('"seed":7', '"seed":8')
    with pytest.raises(ProvenanceError, match="'parameters' chunk differs"):
        read_record(rewritten(data, {**chunks, RECORD_CHUNK: edited}))
    with pytest.raises(ProvenanceError, match="not a valid record"):
        read_record(rewritten(data, {**chunks, RECORD_CHUNK: "{"}))
    with pytest.raises(ProvenanceError, match="not a readable image"):
        read_record(b"not a png" + data)


def test_differences_name_each_field_that_differs():
    record = ImageRecord.of("a fox", PARAMS, DIFFUSION, None)
    other = record.model_copy(update={"stages": {"diffusion": DIFFUSION.model_copy(update={"batch_invariant": False})}})
    assert differences(record, other) == ["stages.diffusion.batch_invariant: True != False"]
    assert differences(record, record) == []
