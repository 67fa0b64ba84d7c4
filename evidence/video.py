"""What the diffusion audit adds for a video family (Wan): the encoded file, and the VAE's decode schedules.

file       each run's frames encoded as the video stage encodes them (`stages.diffusion.video_file.encode_mp4`, no
           provenance) and the bytes compared with the solo run's: the same-bytes promise is about the file a client
           downloads, not only the tensor
schedules  the target's final latents decoded frame by frame with the VAE's feature cache (what the stage does,
           diffusers' own decode) and as the first latent frame alone, then all the rest in one call with the same
           cache: the causal convolutions then see several frames at once, a larger time axis for the same outputs
           (the chunked-versus-whole question of 3-D convolution)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stages.diffusion.video_file import encode_mp4

#: The video stage's default frame rate (contracts.config.VideoStageConfig): the rate changes the container's timing
#: fields only, the same for solo and co-batched runs.
AUDIT_FPS = 8


def is_video(pixels: torch.Tensor) -> bool:
    return pixels.dim() == 4  # (frames, height, width, 3); an image is (height, width, 3)


def file_bytes(pixels: torch.Tensor) -> bytes:
    return encode_mp4(pixels.numpy(), fps=AUDIT_FPS, provenance=None)


@torch.inference_mode()
def first_then_rest(family: Any, latents: torch.Tensor) -> np.ndarray:
    """One video's frames (frames, H, W, 3) decoded as its first latent frame, then every other one in one call, through
    the VAE's own feature cache (diffusers' AutoencoderKLWan decoder, called as its `_decode` calls it per frame)."""
    vae = family.pipe.vae
    vae.clear_cache()
    x = vae.post_quant_conv(family.to_vae(latents[None]))
    parts = []
    for part, first in ((x[:, :, :1], True), (x[:, :, 1:], False)):
        vae._conv_idx = [0]
        parts.append(vae.decoder(part, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=first))
    vae.clear_cache()
    video = torch.clamp(torch.cat(parts, 2), -1.0, 1.0)
    return family.pipe.video_processor.postprocess_video(video, output_type="np")[0]


def schedules_run(family: Any, solo: Any, row: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """`row` with the counts of the decode-schedule comparison on the solo sample: elements of its frames differing."""
    frame_by_frame = solo.pixels
    other = torch.from_numpy(first_then_rest(family, solo.final_latents))
    differing = int((other != frame_by_frame).sum())
    log(f"[diffusion audit] {row['model']} kernels={row['kernels']} decode schedules: {differing} differ")
    return {
        **row,
        "ordering": "decode: first latent frame, then the rest",
        "batch_size": 1,
        "target_position": 0,
        "pixels_differing": differing,
        "pixels_total": frame_by_frame.numel(),
        "max_abs_diff": float((other.double() - frame_by_frame.double()).abs().max()),
        "differing_elements": differing,
        "total_elements": frame_by_frame.numel(),
    }
