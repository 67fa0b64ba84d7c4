"""Training the embedded default image model on the procedural shapes (`stages.embedded.shapes`).

Three stages, all seeded, on two CPU threads (TrainingPlan.threads), in under 10 minutes on this project's 2-core
machine (training.json records the time):
  1. the VAE (AutoencoderKL, 8x downsampling, 4 latent channels) learns to reconstruct every training scene;
  2. the scenes are encoded once; the latents' spread sets the VAE's `scaling_factor`;
  3. the UNet (UNet2DConditionModel on 8x8 latents, three levels) and the CLIP text encoder learn together to
     predict v (`_target`) on Stable Diffusion 1.x's own noise schedule, with one caption in ten dropped to the
     empty prompt so classifier-free guidance has its unconditional branch.
The result is a plain StableDiffusionPipeline directory (`save_pretrained`), loaded like any checkpoint.
`scripts/train_shapes.py` runs it and writes the committed model; the same plan (seed and thread count included)
gives the same weights, bit for bit (tests/stages/test_shapes_model.py checks a short run).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel

# From their modules, not the package: to a type checker the package's names are torch-less placeholders.
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from transformers import CLIPTextConfig, CLIPTextModel

from training.scenes import Scene, background_as_said, drawn_as_said, training_scenes, word_tokenizer

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

#: Stable Diffusion 1.x's noise schedule: training adds noise with it, the saved Euler scheduler removes it.
SCHEDULE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000}
#: One caption in this many trains the unconditional branch (the empty prompt).
UNCONDITIONAL_EVERY = 10


@dataclass(frozen=True)
class TrainingPlan:
    """Everything that decides the trained weights (with the library versions and the CPU kind)."""

    seed: int = 0
    #: Threads for every step: a thread count splits work differently, so it is part of what decides the bits.
    threads: int = 2
    vae_steps: int = 1200
    vae_batch: int = 16
    vae_lr: float = 1e-3
    kl_weight: float = 1e-6
    unet_steps: int = 2500
    unet_batch: int = 64
    unet_lr: float = 1.5e-3
    #: The UNet's width per level (8x8, 4x4, 2x2 latents).
    unet_channels: tuple[int, ...] = (32, 64, 64)
    #: What the UNet predicts: "v_prediction" or "epsilon" (diffusers' scheduler names).
    prediction: str = "v_prediction"
    scenes: int | None = None  # train on the first this many scenes only (a quick check), None: all of them


def autoencoder() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        # Few, wide norm groups: a group normalised on its own per image loses its absolute level, and with
        # one channel per group a flat-coloured image would lose its colour.
        block_out_channels=(16, 32, 32, 32),
        layers_per_block=1,
        norm_num_groups=2,
    )


def denoiser(tokenizer, plan: TrainingPlan) -> tuple[CLIPTextModel, UNet2DConditionModel]:
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=tokenizer.model_max_length,
            hidden_act="gelu",
            layer_norm_eps=1e-5,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    levels = len(plan.unet_channels)
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        # Three levels (8x8, 4x4, 2x2). Two, trained the same way, also learn colours and positions, but the
        # guidance scale then moved the picture too little (5 -> 1.5: 3.9 levels of 255 on average, 6.5 with three).
        down_block_types=("CrossAttnDownBlock2D",) * levels,
        up_block_types=("CrossAttnUpBlock2D",) * levels,
        block_out_channels=plan.unet_channels,
        layers_per_block=1,
        cross_attention_dim=64,
        attention_head_dim=2,
        norm_num_groups=4,  # diffusers' legacy name: 2 heads
    )
    return text_encoder, unet


def train(plan: TrainingPlan, out: Path, log=print) -> dict[str, Any]:
    """Train every component after `plan` and save the pipeline into `out`; returns what it measured."""
    started, cpu_started = time.perf_counter(), time.process_time()
    threads = torch.get_num_threads()
    torch.set_num_threads(plan.threads)
    with torch.random.fork_rng(devices=[]):
        tokenizer = word_tokenizer()
        scenes = training_scenes()[: plan.scenes]
        images = torch.from_numpy(np.stack([s.render() for s in scenes])).permute(0, 3, 1, 2).float() / 127.5 - 1
        torch.manual_seed(plan.seed)
        vae = autoencoder()
        vae_loss = _train_vae(vae, images, plan, log)
        latents = _encode(vae, images)
        # Seeded again: the denoiser's draws do not depend on the autoencoder's, nor the autoencoder on the UNet's shape.
        torch.manual_seed(plan.seed + 1)
        text_encoder, unet = denoiser(tokenizer, plan)
        unet_loss = _train_denoiser(unet, text_encoder, tokenizer, scenes, latents, plan, log)
    scheduler = EulerDiscreteScheduler(
        **SCHEDULE, steps_offset=1, timestep_spacing="leading", prediction_type=plan.prediction
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    cast("DiffusionPipeline", pipe).save_pretrained(out)  # the placeholder's type again: a DiffusionPipeline
    torch.set_num_threads(threads)
    return {
        "plan": asdict(plan),
        "vae_loss": vae_loss,
        "denoiser_loss": unet_loss,
        "wall_s": round(time.perf_counter() - started, 1),
        "cpu_s": round(time.process_time() - cpu_started, 1),
    }


def _train_vae(vae: AutoencoderKL, images: torch.Tensor, plan: TrainingPlan, log) -> float:
    optimiser = torch.optim.Adam(vae.parameters(), lr=plan.vae_lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, plan.vae_lr, total_steps=plan.vae_steps, pct_start=0.1)
    vae.train()
    running = 0.0
    for step in range(plan.vae_steps):
        batch = images[torch.randint(len(images), (plan.vae_batch,))]
        posterior = vae.encode(batch).latent_dist
        # The mean, not a sample: an autoencoder learns these flat-coloured scenes in a few hundred steps,
        # where the sampling noise of a fresh encoder would drown its latents.
        reconstruction = vae.decode(posterior.mean).sample
        loss = F.mse_loss(reconstruction, batch) + plan.kl_weight * posterior.kl().mean()
        # Clipped (and at most 1e-3): the autoencoder caps what the model can draw, and unclipped at 2e-3 it
        # stalled on some seeds (its reconstructions kept large shapes' colour for 38% of scenes; now 97%).
        _update(loss, optimiser, schedule, clip=list(vae.parameters()))
        running = 0.9 * running + 0.1 * loss.item() if step else loss.item()
        if step % 200 == 0 or step == plan.vae_steps - 1:
            log(f"vae step {step}: loss {running:.4f}")
    vae.eval()
    return round(running, 5)


def _update(loss: torch.Tensor, optimiser, schedule, clip: list | None = None) -> None:
    """One optimiser step on `loss`; with `clip`, those parameters' gradient norm is held to 1 first."""
    optimiser.zero_grad()
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(clip, 1.0)
    optimiser.step()
    schedule.step()


@torch.no_grad()
def _encode(vae: AutoencoderKL, images: torch.Tensor) -> torch.Tensor:
    """Every scene's latent mean, scaled to unit spread; the scale is saved in the VAE's config."""
    latents = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in images.split(256)])
    scaling = float(1.0 / latents.std())
    vae.register_to_config(scaling_factor=scaling)
    return latents * scaling


def _train_denoiser(unet, text_encoder, tokenizer, scenes, latents: torch.Tensor, plan: TrainingPlan, log) -> float:
    noise_schedule = DDPMScheduler(**SCHEDULE, prediction_type=plan.prediction)
    parameters = [*unet.parameters(), *text_encoder.parameters()]
    optimiser = torch.optim.AdamW(parameters, lr=plan.unet_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, plan.unet_lr, total_steps=plan.unet_steps, pct_start=0.05)
    captions = random.Random(plan.seed)
    unet.train()
    text_encoder.train()
    running = 0.0
    for step in range(plan.unet_steps):
        picked = torch.randint(len(scenes), (plan.unet_batch,))
        ids = caption_ids(tokenizer, [scenes[i] for i in picked.tolist()], captions)
        noise = torch.randn_like(latents[picked])
        timesteps = torch.randint(noise_schedule.config.num_train_timesteps, (plan.unet_batch,))
        noisy = noise_schedule.add_noise(latents[picked], noise, timesteps)
        prediction = unet(noisy, timesteps, encoder_hidden_states=text_encoder(ids)[0]).sample
        loss = F.mse_loss(prediction, _target(noise_schedule, latents[picked], noise, timesteps))
        _update(loss, optimiser, schedule, clip=parameters)
        running = 0.98 * running + 0.02 * loss.item() if step else loss.item()
        if step % 250 == 0 or step == plan.unet_steps - 1:
            log(f"denoiser step {step}: loss {running:.4f}")
    unet.eval()
    text_encoder.eval()
    return round(running, 5)


def caption_ids(tokenizer, scenes: list[Scene], captions: random.Random) -> torch.Tensor:
    """A training batch's captions as token ids: one caption of each scene drawn from `captions`, one in
    UNCONDITIONAL_EVERY the empty prompt (the unconditional branch classifier-free guidance needs)."""
    texts = ["" if captions.randrange(UNCONDITIONAL_EVERY) == 0 else scene.caption(captions) for scene in scenes]
    return tokenizer(
        texts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids


def _target(noise_schedule: DDPMScheduler, latents, noise, timesteps) -> torch.Tensor:
    """What the UNet learns to predict. At high noise x_t is nearly all noise, so predicting the noise (epsilon) is
    easy whatever the picture: an epsilon UNet never learned where a position word puts the shape (its prediction
    moved by 0.0005 from "left" to "right" at t=999; the shape went where the seed's noise put it). There
    v = alpha * noise - sigma * x0 is mostly the clean latent, so the first sampling steps' layout is what it
    learns (the same words move v's prediction by 0.97, and the shape lands where it is said)."""
    # diffusers annotates `config` as a dict; it is a FrozenDict, whose keys are attributes too.
    if noise_schedule.config.prediction_type == "v_prediction":
        return noise_schedule.get_velocity(latents, noise, timesteps)
    return noise


def draw(pipe, prompts: list[str], seeds: list[int], **options: Any) -> np.ndarray:
    """uint8 (N, 64, 64, 3): prompt i with seed i, at the embedded defaults (8 steps, guidance 5) unless given."""
    options = {"num_inference_steps": 8, "guidance_scale": 5.0, "height": 64, "width": 64, **options}
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    images = pipe(prompt=prompts, generator=generators, output_type="np", **options).images
    return (np.clip(images, 0, 1) * 255).round().astype(np.uint8)


def hit_rate(pipe, scenes, seeds: list[int], rng: random.Random | None = None, background_only: bool = False) -> float:
    """The share of (scene, seed) drawings in the scene's colours (`drawn_as_said`), or with its background only."""
    rng = rng or random.Random(0)
    pairs = [(scene, seed) for scene in scenes for seed in seeds]
    images = draw(pipe, [scene.caption(rng) for scene, _ in pairs], [seed for _, seed in pairs])
    said = [
        background_as_said(image, scene.background) if background_only else drawn_as_said(image, scene)
        for image, (scene, _) in zip(images, pairs, strict=False)
    ]
    return sum(said) / len(said)
