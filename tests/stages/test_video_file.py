"""Video files (issue 28, item 3): MP4 through a fixed ffmpeg/x264 configuration gives the same bytes for the same
frames and provenance (again, in another process with another environment, whatever SIMD units ffmpeg and x264
would pick); an APNG gives the frames back exactly; both carry the provenance; bad input is refused by field.
Figures and the SIMD facts: docs/evidence/video-file.md."""

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from contracts.cpu import cpu_flags
from contracts.errors import InvalidRequestError
from stages.diffusion import encode_png, video_file
from stages.diffusion.video_file import (
    decode_apng,
    decode_mp4,
    encode_apng,
    encode_mp4,
    read_apng_provenance,
    read_mp4_provenance,
    to_uint8,
)

ROOT = Path(__file__).resolve().parents[2]
# Characters ffmpeg's metadata text escapes, a newline and non-ASCII: the text must come back as it went in.
PROVENANCE = json.dumps({"prompt": "a fox; #1 = \\ red\nsecond line", "seed": 42, "note": "renard roux é"})
#: x264's AVX2 level (x264.h bits: MMX .. AVX, FMA3, BMI1, BMI2, AVX2, CACHELINE_64).
AVX2_MASK = sum(1 << bit for bit in (*range(10), 12, 13, 14, 15, 18))


def clip(count: int = 9, size: int = 64, *, noise: float = 0.01, shift: int = 4) -> np.ndarray:
    """A moving gradient with a little noise: float frames (count, size, size, 3) in [0, 1], like a video's."""
    ramp = np.linspace(0.0, 1.0, size)
    base = np.stack(np.meshgrid(ramp, ramp), -1).sum(-1)[..., None] / 2 * np.array([1.0, 0.6, 0.3])
    grain = np.random.default_rng(0).standard_normal((count, size, size, 3)) * noise
    return np.clip(np.stack([np.roll(base, shift * k, axis=1) for k in range(count)]) + grain, 0.0, 1.0)


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return encode_mp4(clip(), fps=8, provenance=PROVENANCE)


def test_the_same_frames_give_the_same_mp4_bytes(mp4):
    started = time.perf_counter()
    again = encode_mp4(clip(), fps=8, provenance=PROVENANCE)
    print(f"9 frames 64x64: {len(mp4)} bytes, encoded in {time.perf_counter() - started:.3f} s")
    assert again == mp4
    assert encode_mp4(clip(), fps=8, provenance="other") != mp4  # the provenance is in the bytes


def test_another_process_with_another_environment_gives_the_same_bytes(mp4, tmp_path):
    # The module loaded from its file, not through stages.diffusion (whose __init__ loads torch): a fast process.
    np.save(tmp_path / "frames.npy", clip())
    (tmp_path / "provenance.txt").write_text(PROVENANCE, encoding="utf-8")
    script = (
        "import importlib.util, sys, numpy; root = sys.argv[1]; sys.path.insert(0, root);"
        "spec = importlib.util.spec_from_file_location('video_file', root + '/stages/diffusion/video_file.py');"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module);"
        "provenance = open('provenance.txt', encoding='utf-8').read();"
        "sys.stdout.buffer.write(module.encode_mp4(numpy.load('frames.npy'), fps=8, provenance=provenance))"
    )
    threads = {name: "3" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "LC_ALL": "C", **threads}
    done = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == mp4


def test_ffmpegs_own_simd_level_does_not_change_the_bytes(mp4, monkeypatch):
    # -cpuflags 0: swscale's RGB -> YUV in C. Without its bitexact flags this gave other bytes (the evidence file).
    run = video_file._ffmpeg
    monkeypatch.setattr(video_file, "_ffmpeg", lambda arguments, stdin: run(["-cpuflags", "0", *arguments], stdin))
    assert encode_mp4(clip(), fps=8, provenance=PROVENANCE) == mp4


def test_x264_is_held_to_one_simd_level(monkeypatch):
    # A clip on which x264 at its own detection (AVX-512 here) gives other bytes than at AVX2: the pinned level
    # gives AVX2's bytes on such a machine too. C, SSE2 and SSE3 give other bytes again (the evidence file).
    if not {"ssse3", "avx2", "fma", "bmi1", "bmi2", "abm"} <= cpu_flags():
        pytest.skip("needs an x86-64 CPU with AVX2 (the levels compared)")
    sensitive = clip(noise=0.0, shift=3)
    pinned = encode_mp4(sensitive, fps=8, provenance=None)
    monkeypatch.setattr(video_file, "x264_cpu", lambda: str(AVX2_MASK))
    assert encode_mp4(sensitive, fps=8, provenance=None) == pinned
    monkeypatch.setattr(video_file, "x264_cpu", lambda: "auto")
    if encode_mp4(sensitive, fps=8, provenance=None) == pinned:
        pytest.skip("x264's own detection gave the pinned bytes here (no AVX-512?): the pin was not exercised")


def test_the_mp4_decodes_to_the_frames_within_a_psnr_floor(mp4):
    decoded, expected = decode_mp4(mp4), to_uint8(clip())
    assert decoded.shape == (9, 64, 64, 3)
    error = ((decoded.astype(np.float64) - expected) ** 2).mean()
    assert 10 * np.log10(255**2 / error) > 35  # lossy (crf 18): measured 38.2 dB on this clip


def test_the_apng_decodes_to_exactly_the_frames_and_its_bytes_repeat():
    frames = clip()
    apng = encode_apng(frames, fps=8, provenance=PROVENANCE)
    assert apng == encode_apng(frames, fps=8, provenance=PROVENANCE)
    np.testing.assert_array_equal(decode_apng(apng), to_uint8(frames))
    repeated = np.repeat(frames[:1], 3, axis=0)  # Pillow would merge equal frames into one: they stay three
    assert decode_apng(encode_apng(repeated, fps=24, provenance=None)).shape == (3, 64, 64, 3)


def test_the_provenance_round_trips_in_both_containers(mp4):
    assert read_mp4_provenance(mp4) == PROVENANCE
    assert read_apng_provenance(encode_apng(clip(2), fps=8, provenance=PROVENANCE)) == PROVENANCE
    assert read_mp4_provenance(encode_mp4(clip(2), fps=8, provenance=None)) is None
    assert read_apng_provenance(encode_apng(clip(2), fps=8, provenance=None)) is None


def test_one_frame_is_a_video():
    one = clip(1)
    assert decode_mp4(encode_mp4(one, fps=8, provenance="x")).shape == (1, 64, 64, 3)
    np.testing.assert_array_equal(decode_apng(encode_apng(one, fps=8, provenance="x")), to_uint8(one))


def test_frames_are_quantised_as_the_png_path_quantises():
    values = np.array([-0.5, 0.0, 0.5 / 255, 1.5 / 255, 0.5, 254.5 / 255, 1.0, 2.0])
    image = np.broadcast_to(values[:, None, None], (8, 2, 3)).astype(np.float32)
    png = np.asarray(Image.open(io.BytesIO(encode_png(image))))
    np.testing.assert_array_equal(to_uint8(image[None])[0], png)


@pytest.mark.parametrize(
    ("frames", "fps", "param"),
    [
        (np.zeros((64, 64, 3)), 8, "frames"),  # no frame axis
        (np.zeros((2, 64, 64, 4)), 8, "frames"),  # RGBA
        (np.zeros((0, 64, 64, 3)), 8, "frames"),
        (np.full((2, 64, 64, 3), np.nan), 8, "frames"),
        (np.zeros((2, 64, 64, 3), np.uint8), 8, "frames"),  # already quantised: the caller's rule, not ours
        (np.zeros((2, 64, 64, 3)), 0, "fps"),
        (np.zeros((2, 63, 64, 3)), 8, "size"),  # yuv420p: MP4 only
    ],
)
def test_bad_input_is_refused_naming_the_field(frames, fps, param):
    with pytest.raises(InvalidRequestError) as refused:
        encode_mp4(frames, fps=fps, provenance=None)
    assert refused.value.param == param
    if param != "size":
        with pytest.raises(InvalidRequestError) as refused:
            encode_apng(frames, fps=fps, provenance=None)
        assert refused.value.param == param
    else:  # an APNG has no parity rule
        assert decode_apng(encode_apng(frames, fps=fps, provenance=None)).shape == frames.shape
