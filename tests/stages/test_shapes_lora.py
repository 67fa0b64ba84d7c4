"""The trained adapter "twins" (training/shapes_lora.py) on the embedded default model, served per request by
the step engine: it draws held-out prompts as a pair of shapes (the base model never does), at scale 0 or left out the
image is the base model's bit for bit, and a replica that never loaded it renders the same base bits. Its training is
reproducible: a short run twice gives the same bits."""

import json
import random

import numpy as np
import pytest

from contracts.sampling import DiffusionSamplingParams, LoraChoice
from stages.embedded import DEFAULT_MODELS, embedded_adapters
from stages.embedded.diffusion import ADAPTERS_PATH
from stages.kernels import disable_batch_invariant_kernels
from training.scenes import drawn_as_said, drawn_twice
from training.shapes_lora import AdapterPlan, held_out_pairs, train_adapter

SEEDS = (0, 1, 2)


def served(lora_dir: str | None):
    """A renderer of the embedded default with its step engine, kernels on; `lora_dir` "": no adapters at all."""
    from contracts.config import DiffusionStageConfig
    from stages.diffusion import DiffusionRenderer
    from stages.diffusion.engine import StepEngine

    disable_batch_invariant_kernels()
    config = DiffusionStageConfig(model=DEFAULT_MODELS["diffusion"], batch_invariant=True, torch_threads=1,
                                  lora_dir=lora_dir)
    renderer = DiffusionRenderer(config)
    return renderer, StepEngine(renderer.family, max_batch_size=8, torch_threads=1)


def render(renderer, engine, scale: float | None) -> list[np.ndarray]:
    """Every held-out pair prompt x SEEDS, in one step batch, with "twins" at `scale` (None: no `lora`)."""
    from stages.diffusion.engine import Sample

    rng = random.Random(0)
    lora = None if scale is None else [LoraChoice(name="twins", scale=scale)]
    samples = [
        Sample(scene.caption(rng), renderer.resolve(DiffusionSamplingParams(seed=seed, lora=lora), step_engine=True),
               on_done=None)
        for scene in held_out_pairs(4) for seed in SEEDS
    ]
    return [(np.clip(image, 0, 1) * 255).round().astype(np.uint8) for image in engine.render(samples)]


@pytest.fixture(scope="module")
def images():
    """The same prompts at scale 1, 0 and without the adapter, on a replica with the embedded adapters; and without
    the adapter on a replica with no adapters directory."""
    renderer, engine = served(None)
    try:
        assert renderer.loras.names() == ["twins"]  # the default model's own adapters, with no lora_dir configured
        drawn = {scale: render(renderer, engine, scale) for scale in (1.0, 0.0, None)}
    finally:
        engine.stop()
    bare, engine = served("")
    try:
        assert bare.loras.names() == []
        drawn["bare"] = render(bare, engine, None)
    finally:
        engine.stop()
        disable_batch_invariant_kernels()
    return drawn


def test_twins_draws_held_out_prompts_as_a_pair_which_the_base_model_never_does(images):
    scenes = [scene for scene in held_out_pairs(4) for _ in SEEDS]
    twice = [drawn_twice(image, scene) for image, scene in zip(images[1.0], scenes, strict=True)]
    base = [drawn_twice(image, scene) for image, scene in zip(images[None], scenes, strict=True)]
    # `drawn_twice` reads the colours said too: two parts in the shape's colour on the background's.
    assert sum(twice) >= 0.75 * len(scenes), twice
    assert sum(base) <= 0.1 * len(scenes), base
    # The base model draws those prompts' one shape as said: what the adapter changes is how many.
    assert sum(drawn_as_said(image, scene) for image, scene in zip(images[None], scenes, strict=True)) >= 0.75 * len(scenes)


def test_scale_0_and_no_adapter_give_the_base_models_bits_on_a_replica_with_or_without_adapters(images):
    for at_zero, plain, bare in zip(images[0.0], images[None], images["bare"], strict=True):
        assert np.array_equal(at_zero, plain) and np.array_equal(plain, bare)
    assert not any(np.array_equal(a, b) for a, b in zip(images[1.0], images[None], strict=True))


def test_the_committed_adapter_carries_its_training_record():
    record = json.loads((ADAPTERS_PATH / "twins" / "training.json").read_text())
    assert record["plan"] == {**AdapterPlan().__dict__}
    assert record["held_out_pair_rate"]["scale 1"] >= 0.8 and record["held_out_pair_rate"]["scale 0"] <= 0.1
    assert embedded_adapters(DEFAULT_MODELS["diffusion"]) == str(ADAPTERS_PATH)


def test_a_short_training_run_gives_the_same_adapter_bits_twice(tmp_path):
    import hashlib

    from stages.embedded.diffusion import load_tiny_pipeline

    plan = AdapterPlan(steps=3, batch=8)
    digests = []
    for run in range(2):
        out = tmp_path / f"run{run}.safetensors"
        train_adapter(load_tiny_pipeline("shapes"), plan, out, log=lambda line: None)
        digests.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert digests[0] == digests[1]
