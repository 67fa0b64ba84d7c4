"""Video files: float frames (F, H, W, 3) in [0, 1], as the step engine returns a video, to file bytes.

encode_mp4           H.264 in MP4 through the ffmpeg binary imageio-ffmpeg ships, every setting that could vary
                     fixed (one thread everywhere, bit-exact flags, no timestamps): the same frames and provenance
                     give the same bytes. Lossy; needs an even width and height (yuv420p), refuses odd ones.
encode_apng          lossless animated PNG (Pillow): the frames exactly, any size.
read_mp4_provenance  the provenance text an MP4 carries (its `comment` tag); read_apng_provenance, an APNG's.
decode_mp4           MP4 bytes -> uint8 frames (F, H, W, 3), for checks.

Same bytes holds for one ffmpeg build (`encoder_version()`) on x86-64 machines with SSSE3 (any since about 2008):
x264's output depends on the SIMD level it runs (measured: C/SSE2/SSE3 differ from SSSE3..AVX2, and AVX-512 from
AVX2 on some clips; docs/evidence/video-file.md), so x264 is held to its SSSE3 level (`x264_cpu`) rather than left
to detect the CPU. Other architectures run x264's own detection and are not claimed to agree.
"""

from __future__ import annotations

import io
import platform
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from contracts.cpu import cpu_flags
from contracts.errors import InvalidRequestError
from contracts.provenance import RECORD_CHUNK

#: The MP4 tag the provenance text goes in (the `©cmt` atom); APNGs use the images' record chunk (RECORD_CHUNK).
MP4_PROVENANCE_TAG = "comment"
#: swscale's RGB -> YUV conversion: `bitexact` + `accurate_rnd` pick its C-equivalent rounding, so the SIMD level
#: does not change the pixels (measured: -cpuflags 0 gave other bytes without these flags, the same with them).
SCALE_FLAGS = "bicubic+accurate_rnd+bitexact+full_chroma_int"
#: x264: a fixed preset and constant rate factor (no bitrate target, no two-pass state); one thread and no sliced or
#: lookahead threads, so nothing depends on thread timing or the core count.
X264 = ("-preset", "medium", "-crf", "18")
X264_THREADS = "threads=1:sliced-threads=0:lookahead-threads=1"
#: x264's CPU mask (x264.h bits MMX, MMX2, SSE, SSE2, SSE3, SSSE3, CACHELINE_64): its SSSE3 functions on every
#: x86-64 machine, whatever wider units it has (AVX-512 gave other bytes than AVX2). SSSE3 rather than C: the same
#: bytes as AVX2 on every clip measured, at a quarter of C's time.
X264_SSSE3_MASK = sum(1 << bit for bit in (0, 1, 2, 3, 5, 6, 18))
#: BT.709, limited range: the conversion and the tags a player reads agree.
COLOUR = ("-colorspace", "bt709", "-color_primaries", "bt709", "-color_trc", "bt709", "-color_range", "tv")


def encoder_version() -> str:
    """The ffmpeg build the bytes depend on (imageio-ffmpeg's), for a record that names it."""
    import imageio_ffmpeg

    return str(imageio_ffmpeg.get_ffmpeg_version())


def x264_cpu() -> str:
    """The `asm` value x264 runs with: the SSSE3 mask on x86-64 CPUs that have it; elsewhere x264's own detection
    (a mask of x86 bits means other units on ARM; an x86 CPU without SSSE3 cannot run the mask)."""
    if platform.machine().lower() in ("x86_64", "amd64") and "ssse3" in cpu_flags():
        return str(X264_SSSE3_MASK)
    return "auto"


def quantized(pixels) -> np.ndarray:
    """Float pixels in [0, 1] (any shape: an image, a video's frames) -> uint8, the way diffusers quantises:
    round(clip(x) * 255). The one rule for every file the diffusion stage writes (PNG too: `renderer.encode_png`)."""
    return (np.clip(pixels, 0.0, 1.0) * 255).round().astype("uint8")


def to_uint8(frames) -> np.ndarray:
    """Checked float frames -> uint8, by `quantized`;
    InvalidRequestError naming `frames` for anything else than finite floats shaped (F, H, W, 3), F, H, W >= 1."""
    array = np.asarray(frames)
    if array.ndim != 4 or array.shape[-1] != 3 or 0 in array.shape:
        raise InvalidRequestError(f"frames must be shaped (F, H, W, 3), got {array.shape}", param="frames")
    if not np.issubdtype(array.dtype, np.floating) or not np.isfinite(array).all():
        raise InvalidRequestError("frames must be finite floats in [0, 1]", param="frames")
    return quantized(array)


def _check_fps(fps: int) -> None:
    if not isinstance(fps, int) or isinstance(fps, bool) or not 1 <= fps <= 120:
        raise InvalidRequestError(f"fps must be a whole number from 1 to 120, got {fps!r}", param="fps")


def _ffmpeg(arguments: list[str], stdin: bytes) -> None:
    import imageio_ffmpeg

    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-nostdin", "-y", *arguments]
    done = subprocess.run(command, input=stdin, capture_output=True, check=False)
    if done.returncode:
        raise RuntimeError(f"ffmpeg failed ({done.returncode}): {done.stderr.decode(errors='replace')[-2000:]}")


def encode_mp4(frames, *, fps: int, provenance: str | None) -> bytes:
    """Float frames -> MP4 bytes (H.264 yuv420p), the provenance in its `comment` tag. Odd sizes are refused, not
    padded: padding would serve a picture of another size than the one requested (and yuv420p halves chroma)."""
    pixels, (count, height, width) = to_uint8(frames), np.shape(frames)[:3]
    _check_fps(fps)
    if height % 2 or width % 2:
        raise InvalidRequestError(f"an MP4 needs an even width and height, got {width}x{height}", param="size")
    tags = ["-metadata", f"{MP4_PROVENANCE_TAG}={provenance}"] if provenance is not None else []
    with tempfile.TemporaryDirectory() as folder:
        # A file, not stdout: the MP4 muxer seeks back to write its index (and faststart moves it to the front).
        out = Path(folder) / "video.mp4"
        _ffmpeg(
            [
                *("-threads", "1", "-filter_threads", "1"),
                *("-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", str(fps), "-i", "-"),
                *("-map_metadata", "-1", "-map_chapters", "-1", "-frames:v", str(count)),
                *("-vf", f"scale=out_color_matrix=bt709:out_range=tv:flags={SCALE_FLAGS}", "-pix_fmt", "yuv420p"),
                *("-c:v", "libx264", *X264, "-x264-params", f"{X264_THREADS}:asm={x264_cpu()}", *COLOUR),
                # No encoder-version tag, no creation time: bit-exact muxing and coding.
                *("-fflags", "+bitexact", "-flags:v", "+bitexact", *tags, "-movflags", "+faststart"),
                *("-f", "mp4", str(out)),
            ],
            pixels.tobytes(),
        )
        return out.read_bytes()


def _ffmetadata_values(text: str) -> dict[str, str]:
    """The global `key=value` entries of ffmpeg's ffmetadata text, unescaped (`\\` escapes `=;#\\` and newline)."""
    values: dict[str, str] = {}
    entry, key, escaped = "", None, False
    for char in text.split("\n", 1)[1] if "\n" in text else "":  # after the ";FFMETADATA1" header
        if escaped:
            entry, escaped = entry + char, False
        elif char == "\\":
            escaped = True
        elif char == "=" and key is None:
            key, entry = entry, ""
        elif char == "\n":
            if entry.startswith("["):  # a stream or chapter section: the global entries are over
                break
            if key is not None:
                values[key] = entry
            entry, key = "", None
        else:
            entry += char
    return values


def read_mp4_provenance(data: bytes) -> str | None:
    """The provenance an MP4 of ours carries; None when it has none."""
    with tempfile.TemporaryDirectory() as folder:
        video, out = Path(folder) / "video.mp4", Path(folder) / "tags.txt"
        video.write_bytes(data)
        _ffmpeg(["-i", str(video), "-f", "ffmetadata", str(out)], b"")
        return _ffmetadata_values(out.read_text(encoding="utf-8")).get(MP4_PROVENANCE_TAG)


def decode_mp4(data: bytes) -> np.ndarray:
    """MP4 bytes -> uint8 frames (F, H, W, 3), through the same ffmpeg (for checks; the decoder's rounding)."""
    import imageio_ffmpeg

    with tempfile.TemporaryDirectory() as folder:
        video = Path(folder) / "video.mp4"
        video.write_bytes(data)
        reader = imageio_ffmpeg.read_frames(str(video))
        width, height = next(reader)["size"]
        frames = [np.frombuffer(frame, np.uint8).reshape(height, width, 3) for frame in reader]
    return np.stack(frames)


def encode_apng(frames, *, fps: int, provenance: str | None) -> bytes:
    """Float frames -> lossless animated PNG bytes, the provenance in the images' record chunk (iTXt)."""
    from PIL import Image
    from PIL.PngImagePlugin import Blend, PngInfo

    pixels = to_uint8(frames)
    _check_fps(fps)
    info = PngInfo()
    if provenance is not None:
        info.add_itxt(RECORD_CHUNK, provenance)
    images = [Image.fromarray(frame) for frame in pixels]
    # Pillow merges a frame equal to the one before into its duration; alternating the blend mode (the same picture
    # for opaque frames) keeps one frame per frame, so a decoder gets F frames back.
    blends = [Blend.OP_SOURCE if index % 2 == 0 else Blend.OP_OVER for index in range(len(images))]
    buffer = io.BytesIO()
    # duration in ms: Pillow writes it as a fraction (1000 / fps ms -> 1/fps s exactly).
    images[0].save(
        buffer, format="PNG", save_all=True, append_images=images[1:], duration=1000 / fps, loop=0,
        blend=blends, compress_level=6, pnginfo=info,
    )  # fmt: skip
    return buffer.getvalue()


def read_apng_provenance(data: bytes) -> str | None:
    """The provenance an APNG (or PNG) of ours carries; None when it has none."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as picture:
        value = picture.text.get(RECORD_CHUNK)  # type: ignore[attr-defined]
    return None if value is None else str(value)


def decode_apng(data: bytes) -> np.ndarray:
    """APNG bytes -> uint8 frames (F, H, W, 3), exactly as encoded."""
    from PIL import Image, ImageSequence

    with Image.open(io.BytesIO(data)) as picture:
        return np.stack([np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(picture)])
