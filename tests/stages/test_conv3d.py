"""3-D convolution and the Wan video VAE (diffusers' AutoencoderKLWan) with the CPU kernels: a video's frames do not
depend on the other videos in its batch, nor on whether its latent frames are decoded one at a time with the VAE's
feature cache or many at once.

Each check has a control, the same check with stock kernels, measured here; where stock kernels do not vary on this
CPU the control is skipped saying what was measured. Measured on a 2-core AMD EPYC (AVX-512), every path: stock
float32 conv3d varied for 138-143 of 200 random layers and the tiny VAE's float32 decode everywhere; stock bfloat16
never varied (docs/evidence/conv3d.md).
"""

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan

from stages.kernels import batch_invariant_kernels
from tests.stages.test_kernels import (  # the autouse fixture: stock kernels and the start's threads around each test
    _in_batch,
    _skip_unless_stock_varies,
    _stock_kernels_and_threads_around_each_test,  # noqa: F401
)

DTYPES = [torch.float32, torch.bfloat16]
# (in, out, kernel, stride, padding, groups, (T, H, W)); padding "causal" pads time 2*(k//2) in front only and space on
# both sides, as WanCausalConv3d does (its convolution itself pads nothing).
CONV3D = {
    "k333": (6, 8, (3, 3, 3), 1, 1, 1, (4, 9, 7)),
    "k333_causal": (8, 8, (3, 3, 3), 1, "causal", 1, (3, 8, 8)),
    "k311_causal": (8, 16, (3, 1, 1), 1, "causal", 1, (2, 6, 6)),
    "k311_time_stride": (8, 8, (3, 1, 1), (2, 1, 1), 0, 1, (5, 6, 6)),
    "k111": (12, 5, (1, 1, 1), 1, 0, 1, (3, 7, 5)),
    "k333_grouped_strided": (8, 6, (3, 3, 3), (1, 2, 2), 1, 2, (4, 9, 9)),
}
BATCH_SIZES = (1, 2, 3, 4)


def conv3d_case(case, dtype):
    cin, cout, kernel, stride, padding, groups, frames = CONV3D[case]
    gen = torch.Generator().manual_seed(21)
    weight = torch.randn(cout, cin // groups, *kernel, generator=gen).to(dtype)
    bias = torch.randn(cout, generator=gen).to(dtype)

    def fn(x):
        if padding == "causal":
            t, h, w = (k // 2 for k in kernel)
            return F.conv3d(F.pad(x, (w, w, h, h, 2 * t, 0)), weight, bias, stride, groups=groups)
        return F.conv3d(x, weight, bias, stride, padding, groups=groups)

    return fn, lambda count, gen: torch.randn(count, cin, *frames, generator=gen).to(dtype)


def _conv3d_varies(case, dtype) -> bool:
    """Whether any sample of a batch of 1-4 differs from the same sample alone, at any position."""
    fn, make = conv3d_case(case, dtype)
    videos = make(max(BATCH_SIZES), torch.Generator().manual_seed(22))
    alone = [fn(videos[i : i + 1].clone()) for i in range(len(videos))]
    return any(not torch.equal(_in_batch(fn, videos[i : i + 1], torch.cat([videos[:i], videos[i + 1 : size]]), i), alone[i])
               for size in BATCH_SIZES for i in range(size))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CONV3D)
def test_conv3d_every_sample_at_every_position_gives_its_solo_bits(case, dtype):
    with batch_invariant_kernels():
        assert not _conv3d_varies(case, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv3d_off_control_varies_for_some_layer(dtype):
    varied = [case for case in CONV3D if _conv3d_varies(case, dtype)]
    _skip_unless_stock_varies(bool(varied), f"conv3d ({dtype}) layers {list(CONV3D)} at batch sizes 1-4, every position")


def _lone_sample_layouts(dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A lone sample as the Wan VAE's attention hands it on (reshaped out of a permute: its size-1 batch dimension has
    stride C, not C*H*W), and the same values freshly laid out, each through a 1x1 conv2d and a conv3d."""
    gen = torch.Generator().manual_seed(23)
    weight, bias = torch.randn(16, 16, 1, 1, generator=gen).to(dtype), torch.randn(16, generator=gen).to(dtype)
    tokens = torch.randn(1, 36, 16, generator=gen).to(dtype)
    reshaped = tokens.permute(0, 2, 1).reshape(1, 16, 6, 6)
    weight3 = torch.randn(8, 16, 1, 3, 3, generator=gen).to(dtype)
    return [(F.conv2d(reshaped, weight, bias), F.conv2d(reshaped.clone(memory_format=torch.contiguous_format), weight, bias)),
            (F.conv3d(reshaped[:, :, None], weight3, padding=(0, 1, 1)),
             F.conv3d(reshaped[:, :, None].contiguous(), weight3, padding=(0, 1, 1)))]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_strides_of_size_one_dimensions_do_not_change_the_bits(dtype):
    with batch_invariant_kernels():
        assert all(torch.equal(odd, fresh) for odd, fresh in _lone_sample_layouts(dtype))


# --- the Wan VAE ----------------------------------------------------------------------------------------------------

LATENTS = (3, 4, 4, 6, 6)  # three videos, 4 latent channels, 4 latent frames of 6x6


def tiny_wan_vae(dtype, temporal: bool) -> AutoencoderKLWan:
    """A tiny random AutoencoderKLWan: 3 resolutions of 8-16 channels, the mid block's attention, one temporal 2x
    upsampling when `temporal` (none otherwise). Every weight random (the RMS gains start at 1), so every term counts."""
    torch.manual_seed(24)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, temporal],
                           latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()
    with torch.no_grad():
        for parameter in vae.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
    return vae.to(dtype)


@torch.no_grad()
def chunked(vae, z):
    """The VAE's own decode: one latent frame at a time, each causal convolution fed the cached last frames."""
    return vae.decode(z).sample


@torch.no_grad()
def first_then_rest(vae, z):
    """The same cache protocol, but every latent frame after the first in one call (the first is always alone: the
    temporal upsampler treats it apart)."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for part, first in ((x[:, :, :1], True), (x[:, :, 1:], False)):
        vae._conv_idx = [0]
        frames.append(vae.decoder(part, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=first))
    vae.clear_cache()
    return torch.clamp(torch.cat(frames, 2), -1.0, 1.0)


@torch.no_grad()
def whole(vae, z):
    """No cache at all: every causal convolution over the whole time axis at once. The same function as `chunked` only
    without temporal upsampling (without a cache the upsampler skips its time convolution)."""
    return torch.clamp(vae.decoder(vae.post_quant_conv(z)), -1.0, 1.0)


def _vae_differences(dtype) -> dict[str, int]:
    """Elements differing, video by video: batched vs alone (batches of 3 and 2), and between decode schedules."""
    z = torch.randn(*LATENTS, generator=torch.Generator().manual_seed(25)).to(dtype)
    vae, flat = tiny_wan_vae(dtype, temporal=True), tiny_wan_vae(dtype, temporal=False)
    alone = [chunked(vae, z[i : i + 1]) for i in range(len(z))]
    batched = [chunked(vae, z), chunked(vae, z[:2])]
    return {
        "batched_vs_alone": sum(int((out[i : i + 1] != alone[i]).sum()) for out in batched for i in range(len(out))),
        "frame_by_frame_vs_first_then_rest": int((first_then_rest(vae, z[:1]) != alone[0]).sum()),
        "frame_by_frame_vs_whole_no_cache": int((whole(flat, z[:1]) != chunked(flat, z[:1])).sum()),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_wan_vae_decode_same_bits_batched_or_alone_chunked_or_whole(dtype):
    with batch_invariant_kernels():
        assert _vae_differences(dtype) == {
            "batched_vs_alone": 0, "frame_by_frame_vs_first_then_rest": 0, "frame_by_frame_vs_whole_no_cache": 0}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_wan_vae_off_control_varies(dtype):
    differences = _vae_differences(dtype)
    _skip_unless_stock_varies(any(differences.values()), f"the tiny Wan VAE's decode ({dtype}): {differences}")
