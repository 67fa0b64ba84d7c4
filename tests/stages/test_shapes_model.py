"""The embedded default image model (`omniserve/tiny-shapes-sd`, trained on `stages.embedded.shapes`): it draws
what the prompt says, for prompts it never saw, and every field a request carries changes the picture.

Images come through the diffusion stage's own loader (`stages.diffusion.load_pipeline`) at the stage's
defaults for an embedded model (64x64, 8 steps, guidance 5). Pixel statistics read colours by their nearest
named colour (`stages.embedded.shapes.nearest_colour`).
"""

import json
import random
from dataclasses import asdict

import numpy as np
import pytest

from stages.diffusion import load_pipeline
from stages.embedded import DEFAULT_MODELS, EMBEDDED_MODELS, embedded_models
from stages.embedded.diffusion import TRAINED_PATH, weights_fingerprint
from stages.embedded.llm import StyleEnhancement
from stages.embedded.shapes import COLOURS, SHAPES
from training.scenes import (
    HELD_OUT,
    WORDS,
    Scene,
    background_phrase,
    centroid,
    colour_share,
    drawn_area,
    drawn_as_said,
    training_scenes,
    with_article,
    word_tokenizer,
)
from training.shapes import TrainingPlan, draw, hit_rate, train

SEEDS = list(range(10))
CENTRE = (slice(24, 40), slice(24, 40))
CORNERS = [(slice(0, 8), slice(0, 8)), (slice(0, 8), slice(56, 64)), (slice(56, 64), slice(0, 8)), (slice(56, 64), slice(56, 64))]


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline(DEFAULT_MODELS["diffusion"], device="cpu", dtype="float32")


def region(shape, index) -> np.ndarray:
    mask = np.zeros(shape, bool)
    mask[index] = True
    return mask


def test_the_trained_model_is_the_default_and_the_random_ones_stay_for_the_audits():
    assert DEFAULT_MODELS["diffusion"] == "omniserve/tiny-shapes-sd" and EMBEDDED_MODELS["omniserve/tiny-shapes-sd"].trained
    assert embedded_models("diffusion") == ("omniserve/tiny-sd-unet", "omniserve/tiny-sd3-dit", "omniserve/tiny-sdxl-unet",
                                              "omniserve/tiny-flux-dit", "omniserve/tiny-qwen-image")


def test_the_held_out_triples_never_appear_in_training_and_every_word_is_one_token():
    seen = {(s.shape, s.colour, s.background) for s in training_scenes()}
    assert ("circle", "red", "blue") in HELD_OUT and not seen & HELD_OUT and len(seen) > 8 * len(HELD_OUT)
    tokenizer = word_tokenizer()
    assert all(len(tokenizer(word, add_special_tokens=False).input_ids) == 1 for word in WORDS)


def test_a_red_circle_on_a_blue_background_is_red_on_blue(pipe):
    images = draw(pipe, ["a red circle on a blue background"] * len(SEEDS), SEEDS)
    corners = np.logical_or.reduce([region((64, 64), c) for c in CORNERS])
    hits = [drawn_as_said(image, Scene("circle", "red", "blue")) and colour_share(image, corners, "blue") > 0.5 for image in images]
    assert sum(hits) >= 8, hits


def test_a_red_circle_on_a_blue_background_is_red_in_the_middle(pipe):
    images = draw(pipe, ["a red circle on a blue background"] * len(SEEDS), SEEDS)
    assert sum(colour_share(image, region((64, 64), CENTRE), "red") > 0.5 for image in images) >= 8


def test_unseen_colour_shape_pairs_are_their_colour_in_the_middle_on_their_background(pipe):
    """The issue's check on other pairs the training never showed: centre mostly the shape's colour, corners mostly
    the background, for 8 of 10 seeds each. Rings are left out: a ring's centre is its hole (the background)."""
    triples = random.Random(6).sample(sorted(t for t in HELD_OUT - {("circle", "red", "blue")} if t[0] != "ring"), 4)
    corners = np.logical_or.reduce([region((64, 64), c) for c in CORNERS])
    hits = {}
    for shape, colour, background in triples:
        prompt = f"{with_article(f'{colour} {shape}')} {background_phrase(background)}"
        images = draw(pipe, [prompt] * len(SEEDS), SEEDS)
        hits[prompt] = sum(colour_share(image, region((64, 64), CENTRE), colour) > 0.5
                           and colour_share(image, corners, background) > 0.5 for image in images)
    assert all(hit >= 8 for hit in hits.values()), hits


def test_held_out_triples_get_their_background_and_large_shapes_their_colour(pipe):
    triples = random.Random(1).sample(sorted(HELD_OUT - {("circle", "red", "blue")}), 8)
    background = hit_rate(pipe, [Scene("circle", "white", b) for _, _, b in triples], SEEDS[:4], background_only=True)
    large = hit_rate(pipe, [Scene(*triple, size="large") for triple in triples], SEEDS[:5], random.Random(2))
    assert background >= 0.9 and large >= 0.7, (background, large)


def test_size_words_change_the_size_and_the_prompt_without_them_is_large(pipe):
    prompts = [f"a {size} orange square on a cyan background" for size in ("small", "large")] + ["an orange square on a cyan background"]
    small, large, unsaid = (draw(pipe, [p] * 4, SEEDS[:4]) for p in prompts)
    area = [np.mean([drawn_area(image, "cyan") for image in images]) for images in (small, large, unsaid)]
    assert area[0] * 2 < area[1] and area[0] * 2 < area[2], area


def test_position_words_move_the_shape(pipe):
    words = ("left", "right", "top", "bottom")
    prompts = [f"a small yellow star on a purple background, {word}" for word in words for _ in range(3)]
    images = draw(pipe, prompts, [0, 1, 2] * len(words))
    x, y = np.array([centroid(image, "purple") for image in images]).reshape(len(words), 3, 2).mean(1).T
    assert x[0] < 26 < 38 < x[1] and y[2] < 26 < 38 < y[3], (x, y)


def test_the_negative_prompt_and_the_guidance_scale_change_the_image(pipe):
    prompt = ["a green square on a pink background"]
    plain = draw(pipe, prompt, [3]).astype(int)
    negative = draw(pipe, prompt, [3], negative_prompt=["a green square"]).astype(int)
    weaker = draw(pipe, prompt, [3], guidance_scale=1.5).astype(int)
    assert np.abs(plain - negative).mean() > 4 and np.abs(plain - weaker).mean() > 4


def test_the_embedded_rewrite_reaches_the_picture(pipe):
    prompt = "a red circle on a blue background"
    revised = StyleEnhancement().compose(prompt, "small, left")
    assert revised == "a red circle on a blue background, small, left"
    before, after = draw(pipe, [prompt] * 4, SEEDS[:4]), draw(pipe, [revised] * 4, SEEDS[:4])
    assert sum(drawn_area(b, "blue") > 2 * drawn_area(a, "blue") for b, a in zip(before, after)) >= 3
    assert all(drawn_as_said(image, Scene("circle", "red", "blue")) for image in after[:1])
    # Where the shape is: the prompt alone centres it, the rewrite's "left" moves it left.
    assert all(centroid(b, "blue")[0] > 26 > centroid(a, "blue")[0] for b, a in zip(before, after)), \
        [(centroid(b, "blue"), centroid(a, "blue")) for b, a in zip(before, after)]


def test_the_committed_model_is_the_one_its_record_describes():
    record = json.loads((TRAINED_PATH / "training.json").read_text())
    assert record["weights_sha256"] == weights_fingerprint(TRAINED_PATH)
    assert record["plan"] == json.loads(json.dumps(asdict(TrainingPlan())))
    assert record["held_out_hit_rate"]["background"] >= 0.9 and record["held_out_hit_rate"]["large"] >= 0.7


def test_a_short_training_run_is_deterministic(tmp_path):
    plan = TrainingPlan(vae_steps=2, vae_batch=4, unet_steps=2, unet_batch=4, scenes=40)
    first, second = tmp_path / "first", tmp_path / "second"
    train(plan, first, log=lambda _: None)
    train(plan, second, log=lambda _: None)
    assert weights_fingerprint(first) == weights_fingerprint(second)
    assert weights_fingerprint(first) != weights_fingerprint(TRAINED_PATH)


def test_captions_say_what_the_scene_shows_in_the_rewrites_word_order():
    rng = random.Random(0)
    scene = Scene("ring", "cyan", "red", "small", "top")
    said = {scene.caption(rng) for _ in range(200)}
    assert "a small cyan ring on a red background, top" in said and "a cyan ring, small, top, on a red background" in said
    assert all(w in c for c in said for w in ("cyan", "ring", "red", "small", "top"))
    assert set(COLOURS) >= {"red", "blue", "green", "yellow", "purple", "orange", "white", "black"} and len(SHAPES) == 5
