"""The delivered file (`contracts.provenance`): the stage's PNG, or its pixels as JPEG or WebP with fixed encoder
settings, the same bytes every time, the provenance carried in XMP and read back."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from contracts.provenance import (
    CHUNKS,
    ImageOrigin,
    ImageOutput,
    ImageRecord,
    ProvenanceError,
    deliver,
    read_chunks,
    read_record,
    read_xmp,
)
from tests.contracts.test_provenance import DIFFUSION, PARAMS, REWRITE, png

RECORD = ImageRecord.of("a fox, snow", PARAMS, DIFFUSION, ImageOrigin.of('a fox <&> "quoted" ü', REWRITE))
# Noise over a gradient: every 8x8 block differs, so an encoder's every stage has work.
PIXELS = (np.random.default_rng(0).random((32, 48, 3)) * 64 + np.linspace(0, 191, 48)[None, :, None]).astype("uint8")


@pytest.fixture(scope="module")
def source() -> bytes:
    return png(RECORD, PIXELS)


def test_png_is_delivered_as_the_stage_encoded_it(source):
    file = deliver(source, ImageOutput())
    assert (file.format, file.data, file.media_type) == ("png", source, "image/png")


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_jpeg_and_webp_are_the_same_bytes_every_time_and_carry_the_record(source, fmt):
    output = ImageOutput(fmt, 80)
    first, again = deliver(source, output), deliver(source, output)
    assert first.data == again.data and first.sha256 == again.sha256
    with Image.open(io.BytesIO(first.data)) as picture:
        assert picture.format == fmt.upper() and picture.size == (48, 32)
        decoded = np.asarray(picture.convert("RGB"), dtype=float)
    assert np.corrcoef(decoded.ravel(), PIXELS.ravel())[0, 1] > 0.9  # lossy, but the picture
    assert read_record(first.data) == RECORD  # prompt with XML's special characters and non-ASCII intact
    chunks, _ = read_chunks(first.data)
    assert set(CHUNKS) <= set(chunks) and ImageOutput.parse(chunks["output"]) == output
    assert deliver(source, ImageOutput(fmt, 30)).data != first.data  # the compression is used


def test_an_output_round_trips_through_its_text():
    for output in (ImageOutput(), ImageOutput("jpeg", 0), ImageOutput("webp", 100)):
        assert ImageOutput.parse(str(output)) == output
    for bad in ("gif", "png 3", "jpeg", "jpeg x"):
        with pytest.raises(ValueError):
            ImageOutput.parse(bad)


def test_xmp_that_is_not_ours_or_not_xml_reads_as_nothing():
    assert read_xmp(b"") == {} and read_xmp("<x:xmpmeta><unclosed") == {}
    assert read_xmp('<x:xmpmeta xmlns:x="adobe:ns:meta/"><a>1</a></x:xmpmeta>') == {}


def test_an_altered_transcoded_file_is_refused(source):
    data = deliver(source, ImageOutput("jpeg", 90)).data
    with pytest.raises(ProvenanceError, match="inconsistent"):
        read_record(data.replace(b'"seed":7', b'"seed":8'))  # every seed of the record, not the parameters' text


_ENCODE = """
import sys
from contracts.provenance import ImageOutput, deliver
sys.stdout.write(deliver(sys.stdin.buffer.read(), ImageOutput("jpeg", 75)).sha256)
"""


def test_libjpeg_turbo_gives_the_same_jpeg_on_each_of_its_simd_paths(source):
    """libjpeg-turbo picks SSE2 or AVX2 code by the CPU (JSIMD_FORCE* overrides it): every path this machine can run
    gives the same file (measured equal here: the integer DCT and colour conversion are exact in each)."""
    paths = {}
    for force in ("", "JSIMD_FORCENONE", "JSIMD_FORCESSE2", "JSIMD_FORCEAVX2"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("JSIMD_")} | ({force: "1"} if force else {})
        run = subprocess.run([sys.executable, "-c", _ENCODE], input=source, capture_output=True, env=env, check=True)
        paths[force or "default"] = run.stdout
    assert len(set(paths.values())) == 1, paths
