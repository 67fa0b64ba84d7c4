"""The real-width audit (issue 44): denoisers and VAE decoders at the widths of public configurations.

Each family's denoiser (SD1.5 UNet, SDXL UNet, SD3.5-medium MMDiT, FLUX.1 transformer, Qwen-Image MMDiT, Wan 2.1
1.3B transformer) and its VAE decoder are built from the public config's widths (hidden size, heads, channels,
cross-attention width, text length) with random weights from a fixed seed, float32; where the full depth does not
fit this machine, a few blocks, and the record says how many. One forward of a target sample alone is compared bit
for bit with the same sample co-batched with 1-3 different neighbours (first, middle, last; each neighbour its own
latents, text and timestep), with stock kernels (the control) and with the project's kernels; each forward is timed,
stock and kernels alternating. These records verify the kernels at those shapes, not a checkpoint: no weights are
loaded, and what a trained model computes is not what these compute. `omniserve audit --real-width`.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    UNet2DConditionModel,
    WanTransformer3DModel,
)

from evidence.report import environment, markdown_table, summarize
from stages.kernels import disable_batch_invariant_kernels, enable_batch_invariant_kernels

NOTE = (
    "These records verify the project's kernels at these shapes (random weights from a fixed seed, float32), "
    "not a checkpoint: no weights were loaded."
)
TARGET_SEED, NEIGHBOUR_SEEDS = 42, (7, 99, 1234)
#: Where each sample is in its denoising (a fraction of the schedule): neighbours at other steps, as on the engine.
TARGET_T, NEIGHBOUR_T = 0.5, (0.9, 0.3, 0.7)
#: (ordering, batch size): the target with 1, 2 and 3 neighbours.
ARRANGEMENTS: tuple[tuple[str, int], ...] = (("first", 2), ("middle", 3), ("last", 4))

FLUX_TEXT = 256
Inputs = dict[str, Any]


@dataclass(frozen=True)
class Component:
    """One module to audit: how to build it, one sample's inputs, the call's extras and the call."""

    family: str
    role: str  # "denoiser" or "vae decoder"
    cls: str
    source: str  # the public configuration whose widths these are
    widths: dict
    build: Callable[[], torch.nn.Module]
    sample: Callable[[int, float], Inputs]  # (seed, t) -> one sample's tensors (batch 1; nested dicts allowed)
    call: Callable[[torch.nn.Module, Inputs, int], torch.Tensor]  # (module, batched tensors, batch) -> output
    size: int
    native: int
    depth: str  # "full" or "N of M ..."
    shared_with: list[str] = field(default_factory=list)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def _seeded(build: Callable[[], torch.nn.Module], seed: int) -> Callable[[], torch.nn.Module]:
    def built() -> torch.nn.Module:
        torch.manual_seed(seed)
        return build().eval()

    return built


# --- the denoisers ------------------------------------------------------------------------------------------------


def sd15(size: int, blocks: int | None) -> Component:
    """runwayml/stable-diffusion-v1-5 unet/config.json: the full UNet (860M parameters), CLIP-L text (77 x 768)."""
    widths = {"block_out_channels": (320, 640, 1280, 1280), "cross_attention_dim": 768, "heads": 8, "text": (77, 768)}

    def build() -> torch.nn.Module:
        return UNet2DConditionModel(
            sample_size=64,
            layers_per_block=2,
            block_out_channels=widths["block_out_channels"],
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=768,
            attention_head_dim=8,
        )

    def sample(seed: int, t: float) -> Inputs:
        g = _gen(seed)
        return {
            "sample": _randn(g, 1, 4, size // 8, size // 8),
            "encoder_hidden_states": _randn(g, 1, 77, 768),
            "timestep": torch.tensor([round(1000 * t)]),
        }

    return Component(
        "sd15", "denoiser", "UNet2DConditionModel", "runwayml/stable-diffusion-v1-5 unet", widths,
        _seeded(build, 15), sample, _module_call, size, 512, "full",
    )  # fmt: skip


def sdxl(size: int, blocks: int | None) -> Component:
    """stabilityai/stable-diffusion-xl-base-1.0 unet/config.json; its 1280-wide level's 10 transformer blocks per
    attention layer cut to `blocks` (the full UNet is 2.6B parameters, 10 GiB in float32)."""
    depth = blocks or 2
    widths = {
        "block_out_channels": (320, 640, 1280),
        "transformer_layers_per_block": (1, 2, depth),
        "cross_attention_dim": 2048,
        "heads": (5, 10, 20),
        "text": (77, 2048),
        "added": "text_time 2816 (pooled 1280 + 6 x 256)",
    }

    def build() -> torch.nn.Module:
        return UNet2DConditionModel(
            sample_size=128,
            layers_per_block=2,
            block_out_channels=widths["block_out_channels"],
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=widths["transformer_layers_per_block"],
            attention_head_dim=(5, 10, 20),
            cross_attention_dim=2048,
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,
        )

    def sample(seed: int, t: float) -> Inputs:
        g = _gen(seed)
        return {
            "sample": _randn(g, 1, 4, size // 8, size // 8),
            "encoder_hidden_states": _randn(g, 1, 77, 2048),
            "timestep": torch.tensor([round(1000 * t)]),
            "added_cond_kwargs": {
                "text_embeds": _randn(g, 1, 1280),
                "time_ids": torch.tensor([[size, size, 0, 0, size, size]], dtype=torch.float32),
            },
        }

    return Component(
        "sdxl", "denoiser", "UNet2DConditionModel", "stabilityai/stable-diffusion-xl-base-1.0 unet", widths,
        _seeded(build, 16), sample, _module_call, size, 1024,
        "full" if depth == 10 else f"{depth} of 10 transformer blocks per attention layer at the 1280-wide level",
    )  # fmt: skip


def sd35m(size: int, blocks: int | None) -> Component:
    """stabilityai/stable-diffusion-3.5-medium transformer/config.json (24 joint blocks, 1536 wide, 24 heads of 64,
    dual attention in blocks 0-12, RMSNorm'd q/k); text: 77 CLIP + 256 T5 tokens of 4096, pooled 2048."""
    depth = blocks or 2
    widths = {"hidden": 1536, "heads": 24, "head_dim": 64, "joint_attention_dim": 4096, "text": (333, 4096)}

    def build() -> torch.nn.Module:
        return SD3Transformer2DModel(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=depth,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            pos_embed_max_size=384,
            qk_norm="rms_norm",
            dual_attention_layers=tuple(range(min(depth, 13))),
        )

    def sample(seed: int, t: float) -> Inputs:
        g = _gen(seed)
        return {
            "hidden_states": _randn(g, 1, 16, size // 8, size // 8),
            "encoder_hidden_states": _randn(g, 1, 333, 4096),
            "pooled_projections": _randn(g, 1, 2048),
            "timestep": torch.tensor([1000.0 * t]),
        }

    return Component(
        "sd35m", "denoiser", "SD3Transformer2DModel", "stabilityai/stable-diffusion-3.5-medium transformer", widths,
        _seeded(build, 35), sample, _module_call, size, 1024, _cut(depth, 24, "joint blocks"),
    )  # fmt: skip


def flux1(size: int, blocks: int | None) -> Component:
    """black-forest-labs/FLUX.1-dev transformer/config.json (19 double + 38 single blocks, 3072 wide, 24 heads of
    128, RoPE axes 16+56+56, guidance embedding); text: 256 T5 tokens of 4096 (FLUX.1-schnell's max_sequence_length;
    dev's default is 512: the text stream is most of this forward's time here), CLIP pooled 768; latents packed 2x2."""
    depth = blocks or 1
    widths = {"hidden": 3072, "heads": 24, "head_dim": 128, "joint_attention_dim": 4096, "text": (FLUX_TEXT, 4096)}
    side = size // 16  # 8x VAE, then 2x2 packing

    def build() -> torch.nn.Module:
        return FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=depth,
            num_single_layers=depth,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        )

    def sample(seed: int, t: float) -> Inputs:
        g = _gen(seed)
        return {
            "hidden_states": _randn(g, 1, side * side, 64),
            "encoder_hidden_states": _randn(g, 1, FLUX_TEXT, 4096),
            "pooled_projections": _randn(g, 1, 768),
            "timestep": torch.tensor([t]),
            "guidance": torch.tensor([3.5]),
        }

    def call(module: torch.nn.Module, inputs: Inputs, batch: int) -> torch.Tensor:
        rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
        return _module_call(module, {**inputs, "img_ids": img_ids, "txt_ids": torch.zeros(FLUX_TEXT, 3)}, batch)

    return Component(
        "flux1", "denoiser", "FluxTransformer2DModel", "black-forest-labs/FLUX.1-dev transformer", widths,
        _seeded(build, 11), sample, call, size, 1024, f"{depth} of 19 double-stream and {depth} of 38 single-stream blocks",
    )  # fmt: skip


def qwen_image(size: int, blocks: int | None) -> Component:
    """Qwen/Qwen-Image transformer/config.json (60 MMDiT blocks, 3072 wide, 24 heads of 128, RoPE 16+56+56 over text
    and image); text: Qwen2.5-VL-7B hidden states of 3584, 64 tokens here (a prompt's length: nothing is padded)."""
    depth = blocks or 1
    widths = {"hidden": 3072, "heads": 24, "head_dim": 128, "joint_attention_dim": 3584, "text": (64, 3584)}
    side = size // 16

    def build() -> torch.nn.Module:
        return QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=depth,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=3584,
            axes_dims_rope=(16, 56, 56),
        )

    def sample(seed: int, t: float) -> Inputs:
        g = _gen(seed)
        return {
            "hidden_states": _randn(g, 1, side * side, 64),
            "encoder_hidden_states": _randn(g, 1, 64, 3584),
            "encoder_hidden_states_mask": torch.ones(1, 64, dtype=torch.long),
            "timestep": torch.tensor([t]),
        }

    def call(module: torch.nn.Module, inputs: Inputs, batch: int) -> torch.Tensor:
        return _module_call(module, {**inputs, "img_shapes": [[(1, side, side)]] * batch}, batch)

    return Component(
        "qwen-image", "denoiser", "QwenImageTransformer2DModel", "Qwen/Qwen-Image transformer", widths,
        _seeded(build, 20), sample, call, size, 1328, _cut(depth, 60, "MMDiT blocks"),
    )  # fmt: skip


def wan21(size: int, blocks: int | None) -> Component:
    """Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json (30 blocks, 1536 wide, 12 heads of 128, FFN 8960,
    3-D RoPE, cross-attention to 512 UMT5 tokens of 4096); one latent frame (a still: the first frame of a video)."""
    depth = blocks or 2
    widths = {"hidden": 1536, "heads": 12, "head_dim": 128, "ffn_dim": 8960, "text": (512, 4096), "frames": 1}

    def build() -> torch.nn.Module:
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=12,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=8960,
            num_layers=depth,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
        )

    def sample(seed: int, t: float) -> Inputs:
        g = _gen(seed)
        return {
            "hidden_states": _randn(g, 1, 16, 1, size // 8, size // 8),
            "encoder_hidden_states": _randn(g, 1, 512, 4096),
            "timestep": torch.tensor([round(1000 * t)]),
        }

    return Component(
        "wan21", "denoiser", "WanTransformer3DModel", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer", widths,
        _seeded(build, 21), sample, _module_call, size, 832, _cut(depth, 30, "blocks"),
    )  # fmt: skip


def _cut(depth: int, full: int, what: str) -> str:
    return "full" if depth >= full else f"{depth} of {full} {what}"


def _module_call(module: torch.nn.Module, inputs: Inputs, batch: int) -> torch.Tensor:
    return module(**inputs, return_dict=False)[0]


# --- the VAE decoders ---------------------------------------------------------------------------------------------


def kl_decoder(family: str, latent_channels: int, size: int) -> Component:
    """AutoencoderKL's decoder (channels 512, 512, 256, 128; 3 resnets per level, layers_per_block 2; 32 groups):
    SD1.5's and SDXL's with 4 latent channels and post-quant conv, SD3's and FLUX.1's with 16 and none."""
    sixteen = latent_channels == 16
    widths = {"block_out_channels": (128, 256, 512, 512), "latent_channels": latent_channels, "groups": 32}

    def build() -> torch.nn.Module:
        return AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            latent_channels=latent_channels,
            use_quant_conv=not sixteen,
            use_post_quant_conv=not sixteen,
        )

    def sample(seed: int, t: float) -> Inputs:
        return {"z": _randn(_gen(seed), 1, latent_channels, size // 8, size // 8)}

    source = "stabilityai/stable-diffusion-3.5-medium vae" if sixteen else "runwayml/stable-diffusion-v1-5 vae"
    return Component(
        family, "vae decoder", "AutoencoderKL", source, widths, _seeded(build, 100 + latent_channels), sample,
        _decode, size, 0, "full",
    )  # fmt: skip


def wan_decoder(family: str, size: int) -> Component:
    """Wan 2.1's causal 3-D VAE decoder (base 96, multipliers 1, 2, 4, 4, 2 resnets per level, 16 latent channels),
    one latent frame; Qwen-Image's VAE (its own class, AutoencoderKLQwenImage) has the same widths."""
    cls = AutoencoderKLQwenImage if family == "qwen-image" else AutoencoderKLWan
    widths = {"base_dim": 96, "dim_mult": (1, 2, 4, 4), "z_dim": 16, "num_res_blocks": 2, "frames": 1}

    def build() -> torch.nn.Module:
        return cls(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2)

    def sample(seed: int, t: float) -> Inputs:
        return {"z": _randn(_gen(seed), 1, 16, 1, size // 8, size // 8)}

    source = "Qwen/Qwen-Image vae" if family == "qwen-image" else "Wan-AI/Wan2.1-T2V-1.3B-Diffusers vae"
    return Component(
        family, "vae decoder", cls.__name__, source, widths, _seeded(build, 196), sample, _decode, size, 0, "full"
    )


def _decode(module: torch.nn.Module, inputs: Inputs, batch: int) -> torch.Tensor:
    return module.decode(inputs["z"], return_dict=False)[0]  # type: ignore[operator]


#: family -> (the denoiser, the side audited here unless told, the VAE decoder). 128 px: what fits ~50 minutes of one
#: shared core for all six with their decoders (the decoders cost most: ~0.45 TFLOP a sample at 256 px).
FAMILIES: dict[str, tuple[Callable[[int, int | None], Component], int, Callable[[str, int], Component]]] = {
    "sd15": (sd15, 128, lambda family, size: kl_decoder(family, 4, size)),
    "sdxl": (sdxl, 128, lambda family, size: kl_decoder(family, 4, size)),
    "sd35m": (sd35m, 128, lambda family, size: kl_decoder(family, 16, size)),
    "flux1": (flux1, 128, lambda family, size: kl_decoder(family, 16, size)),
    "qwen-image": (qwen_image, 128, wan_decoder),
    "wan21": (wan21, 128, wan_decoder),
}


def components(families: Sequence[str], size: int | None, blocks: int | None) -> list[Component]:
    """Each family's denoiser and VAE decoder; a decoder of the same class and widths at the same size as one
    already listed is audited once (its record names every family it stands for)."""
    if size is not None and (size < 16 or size % 16):
        raise ValueError(f"size {size}: a multiple of 16 (8x VAE, 2x2 patches)")
    listed: list[Component] = []
    decoders: dict[tuple, Component] = {}
    for family in families:
        denoiser, default_size, decoder = FAMILIES[family]
        side = size or default_size
        listed.append(denoiser(side, blocks))
        vae = decoder(family, side)
        key = (vae.cls, repr(vae.widths), side)
        if key in decoders:
            decoders[key].shared_with.append(family)
        else:
            decoders[key] = vae
            listed.append(vae)
    return listed


# --- the audit ----------------------------------------------------------------------------------------------------


def _collate(samples: list[Inputs]) -> Inputs:
    first = samples[0]
    return {
        key: _collate([s[key] for s in samples])
        if isinstance(first[key], dict)
        else torch.cat([s[key] for s in samples])
        for key in first
    }


def _set_kernels(setting: str) -> None:
    disable_batch_invariant_kernels()
    if setting == "on" and not enable_batch_invariant_kernels("cpu").installed:
        raise RuntimeError("the CPU kernels could not be installed")


def _forward(component: Component, module: torch.nn.Module, order: list[tuple[int, float]], setting: str):
    """One timed forward of `order`'s samples under `setting`: (output, wall seconds, CPU seconds of this process).
    With one torch thread the CPU time is the forward's own work, whatever else the machine runs: ratios use it."""
    inputs = _collate([component.sample(seed, t) for seed, t in order])
    _set_kernels(setting)
    try:
        with torch.inference_mode():
            wall, cpu = time.perf_counter(), time.process_time()
            output = component.call(module, inputs, len(order))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        disable_batch_invariant_kernels()
    return output.detach().clone(), wall, cpu


def _order(ordering: str, size: int) -> list[tuple[int, float]]:
    target, others = (TARGET_SEED, TARGET_T), list(zip(NEIGHBOUR_SEEDS, NEIGHBOUR_T, strict=True))[: size - 1]
    if ordering == "first":
        return [target, *others]
    if ordering == "last":
        return [*others, target]
    if ordering == "middle":
        return [*others[: (size - 1) // 2], target, *others[(size - 1) // 2 :]]
    raise ValueError(f"unknown ordering {ordering!r} (first, middle, last)")


def first_divergent_module(
    component: Component, module: torch.nn.Module, order: list[tuple[int, float]], setting: str
) -> str | None:
    """The first module (in execution order) whose output row for the target differs solo vs in `order` under
    `setting`: each module's output compared by a digest of the target's row, so nothing large is kept."""
    solo = dict(_trace(component, module, [(TARGET_SEED, TARGET_T)], setting))
    for key, digest in _trace(component, module, order, setting):
        if key in solo and solo[key] != digest:
            return key.split("#")[0]
    return None


def _trace(component: Component, module: torch.nn.Module, order: list, setting: str) -> list[tuple[str, str]]:
    """(module name#call, sha256 of the target's row of its output) for every module whose output has one row per
    sample, in execution order."""
    size, position = len(order), order.index((TARGET_SEED, TARGET_T))
    digests: list[tuple[str, str]] = []
    calls: dict[str, int] = {}

    def hook_for(name: str):
        def hook(_module, _inputs, output) -> None:
            tensor = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
            if torch.is_tensor(tensor) and tensor.dim() > 1 and tensor.shape[0] == size:
                index = calls[name] = calls.get(name, -1) + 1
                row = tensor[position].detach().contiguous().cpu()
                digests.append((f"{name}#{index}", hashlib.sha256(row.view(torch.uint8).numpy().tobytes()).hexdigest()))

        return hook

    handles = [child.register_forward_hook(hook_for(name or "(root)")) for name, child in module.named_modules()]
    try:
        _forward(component, module, order, setting)
    finally:
        for handle in handles:
            handle.remove()
    return digests


def differing(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """(elements whose bits differ, max |a - b|): bit for bit, so a NaN equals itself and -0.0 differs from 0.0."""
    bits = (a.contiguous().view(torch.int32) != b.contiguous().view(torch.int32)).sum()
    return int(bits), float((a.double() - b.double()).abs().max())


def _run(component: Component, setting: str, ordering: str, order: list, seconds: list, counts: tuple) -> dict:
    """One run's row, in the shape every audit report shares (`evidence.report.summarize`, `markdown_table`)."""
    return {
        "stage": component.role,
        "model": f"{component.family} {component.cls}",
        "kernels": setting,
        "ordering": ordering,
        "batch_size": len(order),
        "target_position": order.index((TARGET_SEED, TARGET_T)),
        "dtype": "float32",
        "detail": f"{component.size}x{component.size}, {component.depth}",
        "differing_elements": counts[0],
        "total_elements": counts[2],
        "max_abs_diff": counts[1],
        "seconds": round(seconds[0], 4),
        "cpu_seconds": round(seconds[1], 4),
    }


def audit_component(
    component: Component,
    *,
    arrangements: Sequence[tuple[str, int]] = ARRANGEMENTS,
    kernels: Sequence[str] = ("off", "on"),
    log: Callable[[str], None] = print,
) -> dict:
    """Solo against each arrangement, per kernel setting; the settings alternate (off, on; on, off; ...) forward by
    forward, after one untimed warm-up forward each (whose output must equal the timed solo one)."""
    started = time.perf_counter()
    module = component.build()
    built_s = time.perf_counter() - started
    target = [(TARGET_SEED, TARGET_T)]
    warm = {setting: _forward(component, module, target, setting)[0] for setting in kernels}
    solo: dict[str, torch.Tensor] = {}
    runs: list[dict] = []
    plans = [("solo", 1), *arrangements]
    for index, (ordering, size) in enumerate(plans):
        order = target if ordering == "solo" else _order(ordering, size)
        for setting in kernels if index % 2 == 0 else tuple(reversed(kernels)):
            output, *seconds = _forward(component, module, order, setting)
            row = output[order.index(target[0])]
            reference = solo.setdefault(setting, row)
            counts = (*differing(reference, row), row.numel())
            runs.append(_run(component, setting, ordering, order, seconds, counts))
            if counts[0] and setting == "on":  # where the kernels let a batch in: named, at two traced forwards
                runs[-1]["first_divergent_module"] = first_divergent_module(component, module, order, setting)
            log(
                f"[real width] {component.family} {component.role} {component.size}px kernels={setting} "
                f"batch={len(order)} {ordering}: {counts[0]}/{counts[2]} differ, {seconds[0]:.2f} s ({seconds[1]:.2f} s CPU)"
                + (f", first at {runs[-1]['first_divergent_module']}" if "first_divergent_module" in runs[-1] else "")
            )
    record = _record(component, module, runs, built_s, time.perf_counter() - started)
    record["warm_up_equal"] = {s: differing(warm[s][0], solo[s])[0] == 0 for s in kernels}
    record["output_std"] = float(solo[kernels[0]].double().std())
    record["runs"] = runs
    return record


def _record(component: Component, module: torch.nn.Module, runs: list[dict], built_s: float, total_s: float) -> dict:
    """What the report says of one component: its shape, its verdicts and its times."""
    on = [r for r in runs if r["kernels"] == "on"]
    off = [r for r in runs if r["kernels"] == "off"]
    record: dict[str, Any] = {
        "family": component.family,
        "role": component.role,
        "class": component.cls,
        "config_source": component.source,
        "widths": component.widths,
        "depth": component.depth,
        "parameters": sum(p.numel() for p in module.parameters()),
        "size": component.size,
        "native_size": component.native or None,
        "shared_with": component.shared_with,
        "differing_with_kernels_on": sum(r["differing_elements"] for r in on) if on else None,
        "control_differing": max((r["differing_elements"] for r in off if r["ordering"] != "solo"), default=None),
        "control_runs_that_differ": sum(r["differing_elements"] > 0 for r in off) if off else None,
        "elements_per_sample": runs[0]["total_elements"],
        "build_s": round(built_s, 2),
        "audit_s": round(total_s, 2),
    }
    record["timing"] = _timing(runs)
    return record


def _timing(runs: list[dict]) -> dict | None:
    """Kernels on / stock CPU time per forward of one shape (paired, alternating): min, median, max over the shapes;
    and the solo forward's wall and CPU seconds per setting."""
    pairs: dict[tuple, dict] = {}
    for row in runs:
        pairs.setdefault((row["ordering"], row["batch_size"]), {})[row["kernels"]] = row["cpu_seconds"]
    ratios = {f"{o}:{b}": p["on"] / p["off"] for (o, b), p in pairs.items() if {"on", "off"} <= set(p)}
    if not ratios:
        return None
    values = list(ratios.values())
    solo = pairs[("solo", 1)]
    return {
        "ratio_on_over_off": {key: round(value, 3) for key, value in ratios.items()},
        "min": round(min(values), 3),
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
        "solo_cpu_s": {setting: round(seconds, 3) for setting, seconds in solo.items()},
        "solo_wall_s": {r["kernels"]: r["seconds"] for r in runs if r["ordering"] == "solo"},
    }


def run_real_width_audit(
    families: Sequence[str] = tuple(FAMILIES),
    *,
    size: int | None = None,
    blocks: int | None = None,
    arrangements: Sequence[tuple[str, int]] = ARRANGEMENTS,
    kernels: Sequence[str] = ("off", "on"),
    torch_threads: int = 1,
    command: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Every family's denoiser and decoder; `progress` gets the report so far after each component."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown families {unknown} (of {', '.join(FAMILIES)})")
    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    disable_batch_invariant_kernels()
    report: dict[str, Any] = {"note": NOTE, "components": [], "runs": [], "failures": []}
    report["arrangements"] = [list(pair) for pair in arrangements]
    try:
        for component in components(families, size, blocks):
            _audit_into(report, component, arrangements, kernels, log)
            if progress:
                progress(_finish(report, command))
        return _finish(report, command)  # with the audit's thread count, before the caller's is restored
    finally:
        torch.set_num_threads(threads)  # the caller's (a test's process) again


def _audit_into(report: dict, component: Component, arrangements, kernels, log) -> None:
    """Audit one component into the report; a component that cannot be built or run is recorded, and the audit
    goes on."""
    try:
        record = audit_component(component, arrangements=arrangements, kernels=kernels, log=log)
    except (RuntimeError, MemoryError, ValueError) as error:
        log(f"[real width] {component.family} {component.role}: FAILED {error}")
        report["failures"].append({"family": component.family, "role": component.role, "error": str(error)})
        return
    report["runs"] += record.pop("runs")
    report["components"].append(record)


def _finish(report: dict, command: Sequence[str] | None) -> dict:
    report["summary"] = summarize(report["runs"])
    report["environment"] = environment(command)
    report["environment"]["load_average"] = [round(x, 2) for x in _load_average()]
    return report


def _widths(widths: dict) -> str:
    return "; ".join(f"{key} {value}" for key, value in widths.items()).replace("'", "")


def _load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def markdown(report: dict) -> str:
    """The components' table (shape, verdicts, time ratios), then the runs' evidence table."""
    env = report["environment"]
    lines = [
        "# Real-width audit",
        "",
        report["note"],
        "",
        f"Co-batched arrangements (ordering:batch size): {', '.join(f'{o}:{b}' for o, b in report['arrangements'])}; "
        f"load average at the end {env.get('load_average')}.",
        "",
        "| family | component | class | depth | parameters | size (native) | widths | elements | differing, kernels on | "
        "control: max differing (runs that differ) | on/off CPU time min / median / max | solo CPU s off / on |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["components"]:
        timing = c.get("timing") or {}
        solo = timing.get("solo_cpu_s", {})
        family = ", ".join([c["family"], *c["shared_with"]])
        native = f" ({c['native_size']})" if c.get("native_size") else ""
        lines.append(
            f"| {family} | {c['role']} | {c['class']} | {c['depth']} | {c['parameters'] / 1e6:.0f}M | "
            f"{c['size']}x{c['size']}{native} | {_widths(c['widths'])} | {c['elements_per_sample']:,} | {c['differing_with_kernels_on']} | "
            f"{c['control_differing']} ({c['control_runs_that_differ']}) | "
            f"{timing.get('min', '-')} / {timing.get('median', '-')} / {timing.get('max', '-')} | "
            f"{solo.get('off', '-')} / {solo.get('on', '-')} |"
        )
    for failure in report["failures"]:
        lines.append(f"\nNot audited: {failure['family']} {failure['role']}: {failure['error']}")
    for c in report["components"]:  # notes added to a record after its run (where a difference was located)
        lines += [f"\n{c['family']} {c['role']}: {note}" for note in c.get("notes", [])]
    lines += [f"\nCorrected after the run: {note}" for note in report.get("corrections", [])]
    return "\n".join(lines) + "\n\n" + markdown_table(report)
