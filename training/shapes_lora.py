"""Training a LoRA adapter for the embedded default image model: "twins", which draws every shape asked for twice.

The base model (training/shapes.py) only ever saw one shape per picture, so no prompt makes it draw two.
The adapter learns, from the same captions, to draw the shape as a pair side by side (`Scene.pair`): a style adapter
without a trigger word, the way most published LoRAs work. Only low-rank updates of the UNet's attention and
feed-forward projections are trained (rank `AdapterPlan.rank`, alpha = rank); the base weights, the text encoder and
the VAE stay frozen, so what the adapter can draw is what the base VAE decodes (measured: it decodes pairs of
every shape; a new colour or a plus sign it does not: it pulls those to its palette and to a blob).

The result is one file in the diffusers/PEFT LoRA format (`unet.<module>.lora_A.weight` / `.lora_B.weight`), which
`StableDiffusionPipeline.load_lora_weights` reads as well as this project's per-row adapters
(`stages.diffusion.lora`). `scripts/train_shapes_lora.py` runs it on two threads, seeded: the same plan gives the
same bits on the same CPU kind and library versions (tests/stages/test_shapes_lora.py checks a short run).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler

from stages.diffusion.lora import RowLora, load_adapter
from stages.embedded.diffusion import load_tiny_pipeline
from training.scenes import _TRIPLES, HELD_OUT, Scene, drawn_twice
from training.shapes import SCHEDULE, _target, _update, caption_ids, draw

#: The module paths' endings the adapter adapts: every attention and feed-forward projection of the UNet.
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")


@dataclass(frozen=True)
class AdapterPlan:
    """Everything that decides the adapter's weights (with the base model, the library versions and the CPU kind)."""

    name: str = "twins"
    seed: int = 0
    threads: int = 2
    steps: int = 400
    batch: int = 64
    lr: float = 3e-3
    rank: int = 8


def adapter_scenes() -> list[Scene]:
    """What the adapter trains on: a pair of every (shape, colour, background) the base model trained on; the held-out
    triples stay unseen by both, for the tests to ask for."""
    return [Scene(s, c, b, pair=True) for (s, c, b) in _TRIPLES if (s, c, b) not in HELD_OUT]


class TrainedLora:
    """Low-rank updates on `unet`'s TARGETS while training: `scale * B(A x)` added to each layer's output by a forward
    hook (alpha = rank: scale 1), A initialised as PEFT does (Kaiming-uniform), B at zero so training starts from the
    base model."""

    def __init__(self, unet: torch.nn.Module, rank: int):
        self.weights: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        for path, module in unet.named_modules():
            if isinstance(module, torch.nn.Linear) and path.endswith(TARGETS):
                down = torch.nn.Parameter(torch.empty(rank, module.in_features))
                torch.nn.init.kaiming_uniform_(down, a=5**0.5)
                up = torch.nn.Parameter(torch.zeros(module.out_features, rank))
                self.weights[path] = (down, up)
                module.register_forward_hook(self._hook(down, up))

    @staticmethod
    def _hook(down: torch.nn.Parameter, up: torch.nn.Parameter):
        def add(module, inputs, output):
            return output + F.linear(F.linear(inputs[0], down), up)

        return add

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for pair in self.weights.values() for p in pair]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The PEFT-format keys diffusers' `lora_state_dict` reads."""
        state = {}
        for path, (down, up) in self.weights.items():
            state[f"unet.{path}.lora_A.weight"] = down.detach().clone().contiguous()
            state[f"unet.{path}.lora_B.weight"] = up.detach().clone().contiguous()
        return state


def train_adapter(pipe, plan: AdapterPlan, out: Path, log=print) -> dict[str, Any]:
    """Train `plan`'s adapter on the (frozen) base pipeline `pipe` and save it as `out`; returns what it measured."""
    from safetensors.torch import save_file

    started, cpu_started = time.perf_counter(), time.process_time()
    threads = torch.get_num_threads()
    torch.set_num_threads(plan.threads)
    scenes = adapter_scenes()
    for module in (pipe.unet, pipe.text_encoder, pipe.vae):
        module.requires_grad_(False)
        module.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(plan.seed)
        latents = _encode(pipe.vae, scenes)
        lora = TrainedLora(pipe.unet, plan.rank)
        loss = _train(pipe, lora, scenes, latents, plan, log)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(lora.state_dict(), str(out))
    out.chmod(0o644)  # readable by replicas running as another user
    torch.set_num_threads(threads)
    return {
        "plan": asdict(plan),
        "loss": loss,
        "layers": len(lora.weights),
        "parameters": sum(p.numel() for p in lora.parameters()),
        "wall_s": round(time.perf_counter() - started, 1),
        "cpu_s": round(time.process_time() - cpu_started, 1),
    }


@torch.no_grad()
def _encode(vae, scenes: list[Scene]) -> torch.Tensor:
    images = torch.from_numpy(np.stack([s.render() for s in scenes])).permute(0, 3, 1, 2).float() / 127.5 - 1
    latents = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in images.split(256)])
    return latents * vae.config.scaling_factor


def _train(pipe, lora: TrainedLora, scenes: list[Scene], latents: torch.Tensor, plan: AdapterPlan, log) -> float:
    """The base model's own objective (v on SD 1.x's schedule, one caption in ten unconditional), on pairs."""
    noise_schedule = DDPMScheduler(**SCHEDULE, prediction_type=pipe.scheduler.config.prediction_type)
    parameters = lora.parameters()
    optimiser = torch.optim.AdamW(parameters, lr=plan.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, plan.lr, total_steps=plan.steps, pct_start=0.05)
    captions = random.Random(plan.seed)
    tokenizer, text_encoder, unet = pipe.tokenizer, pipe.text_encoder, pipe.unet
    running = 0.0
    for step in range(plan.steps):
        picked = torch.randint(len(scenes), (plan.batch,))
        ids = caption_ids(tokenizer, [scenes[i] for i in picked.tolist()], captions)
        with torch.no_grad():
            text = text_encoder(ids)[0]
        noise = torch.randn_like(latents[picked])
        timesteps = torch.randint(noise_schedule.config.num_train_timesteps, (plan.batch,))
        noisy = noise_schedule.add_noise(latents[picked], noise, timesteps)
        prediction = unet(noisy, timesteps, encoder_hidden_states=text).sample
        loss = F.mse_loss(prediction, _target(noise_schedule, latents[picked], noise, timesteps))
        _update(loss, optimiser, schedule, clip=parameters)
        running = 0.98 * running + 0.02 * loss.item() if step else loss.item()
        if step % 100 == 0 or step == plan.steps - 1:
            log(f"adapter step {step}: loss {running:.4f}")
    return round(running, 5)


def held_out_pairs(count: int = 8) -> list[Scene]:
    """`count` held-out triples (seen by neither the base model nor the adapter) as pairs; rings left out (a small
    ring's hole is below what the VAE draws)."""
    triples = sorted(t for t in HELD_OUT if t[0] != "ring")
    return [Scene(*t, pair=True) for t in random.Random(0).sample(triples, count)]


def pair_rate(weights: Path, scale: float, seeds: range = range(10)) -> float:
    """The share of held-out prompts x seeds the base model draws as a pair with the adapter in `weights` at `scale`
    (every row of every call: `stages.diffusion.lora.RowLora`), at the embedded defaults."""
    pipe = load_tiny_pipeline("shapes")
    pipe.set_progress_bar_config(disable=True)
    lora = RowLora(pipe.unet, "unet")
    adapter = load_adapter(weights, "adapter", type(pipe), ("unet",))
    lora.attach(adapter)
    rng = random.Random(0)
    pairs = [(scene, seed) for scene in held_out_pairs() for seed in seeds]
    prompts = [scene.caption(rng) for scene, _ in pairs]
    with lora.rows([((adapter, scale),)] * 2 * len(pairs)):  # classifier-free guidance: two rows per prompt
        images = draw(pipe, prompts, [seed for _, seed in pairs])
    return round(
        sum(drawn_twice(image, scene) for image, (scene, _) in zip(images, pairs, strict=True)) / len(pairs), 3
    )
