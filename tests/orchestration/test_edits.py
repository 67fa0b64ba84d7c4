"""`POST /v1/images/edits` end to end: the package's apps (tests/orchestration/conftest.py), real Ray, vLLM, diffusers.

"/" has both switches on, "/off" both off. Through the official openai client and plain multipart forms: an
edit of n images reproduces image i with its seed (bytes and revised prompt), the seed contract holds as for
generations, and every bad input is a 4xx naming its field. 64x64 images, 4 steps.
"""

import base64
import hashlib
import io

import numpy as np
import pytest
from PIL import Image

from contracts.sampling import seeds_for_request

from .conftest import STEPS, TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT = "the same fox, at night"


def picture(seed: int = 0, size: tuple[int, int] = (64, 64), fmt: str = "PNG") -> bytes:
    width, height = size
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


IMAGE = picture()


def edit(http, path="/v1/images/edits", image=IMAGE, files=(), **form):
    """A multipart edit as a form sends it: the image as a file, every other field as text."""
    parts = [("image", ("in.png", image, "image/png"))] if image is not None else []
    parts += [(name, (None, str(value))) for name, value in {"size": "64x64", **form}.items()]
    return http.post(path, files=[*parts, *files])


def png(item) -> bytes:
    data = base64.b64decode(item["b64_json"] if isinstance(item, dict) else item.b64_json)
    sha256 = item["sha256"] if isinstance(item, dict) else item.model_extra["sha256"]
    assert data.startswith(b"\x89PNG") and hashlib.sha256(data).hexdigest() == sha256
    return data


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def test_openai_client_edits_and_image_i_equals_the_n1_edit_with_its_seed(client):
    def openai_edit(seed, n):
        return client.images.edit(image=("fox.png", IMAGE, "image/png"), prompt=PROMPT, n=n, size="64x64",
                                   extra_body={"seed": seed, "num_inference_steps": STEPS}).data

    batch = openai_edit(42, 4)
    assert [item.model_extra["seed"] for item in batch] == seeds_for_request(42, 4)
    assert len({png(item) for item in batch}) == 4
    for item in batch:
        (single,) = openai_edit(item.model_extra["seed"], 1)
        assert png(single) == png(item)
        assert single.revised_prompt == item.revised_prompt  # the LLM stage ran with s_i too
    assert Image.open(io.BytesIO(png(batch[0]))).size == (64, 64)


def test_an_edit_follows_its_image_and_strength_and_image_brackets_name_the_same_field(http, client):
    def edited(**form):
        response = edit(http, **{"prompt": PROMPT, "seed": 7, "enhance_prompt": "false", "num_inference_steps": STEPS, **form})
        assert response.status_code == 200, response.text
        return png(response.json()["data"][0])

    plain = edited()
    assert edited() == plain
    assert edited(image=picture(1)) != plain and edited(strength=1.0) != plain
    generated = http.post("/v1/images/generations", json={"prompt": PROMPT, "seed": 7, "size": "64x64", "enhance_prompt": False})
    assert png(generated.json()["data"][0]) != plain  # an edit is not a generation
    brackets = client.images.edit(image=[("fox.png", IMAGE, "image/png")], prompt=PROMPT, size="64x64",
                                  extra_body={"seed": 7, "enhance_prompt": False, "num_inference_steps": STEPS})
    assert png(brackets.data[0]) == plain


def test_without_a_size_an_edit_renders_at_the_image_size(http):
    response = http.post("/v1/images/edits", files=[("image", ("in.png", picture(2, (96, 64)), "image/png")),
                                                    ("prompt", (None, PROMPT)), ("seed", (None, "3")),
                                                    ("enhance_prompt", (None, "false"))])
    assert response.status_code == 200, response.text
    assert response.json()["size"] == "96x64" and Image.open(io.BytesIO(png(response.json()["data"][0]))).size == (96, 64)


BAD = [
    ({"image": b"not an image"}, "image"),
    ({"image": picture(fmt="GIF")}, "image"),
    ({"size": "128x128"}, "image"),  # not the image's size
    ({"files": [("mask", ("mask.png", IMAGE, "image/png"))]}, "mask"),
    ({"image": None}, "image"),
    ({"files": [("image", ("again.png", IMAGE, "image/png"))]}, "image"),  # two images
    ({"n": "4.5"}, "n"),
    ({"seed": "forty-two"}, "seed"),
    ({"strength": "0"}, "strength"),
    ({"strength": "0.2"}, "strength"),  # int(4 * 0.2) = 0 steps left: refused by the diffusion stage itself
    ({"guidance_scale": "nan"}, "guidance_scale"),
    ({"response_format": "link"}, "response_format"),
    ({"latents": "[[0.0]]"}, "latents"),
    ({"colour": "blue"}, "colour"),
]


@pytest.mark.parametrize("form, param", BAD, ids=[f"{param}-{i}" for i, (_, param) in enumerate(BAD)])
def test_each_bad_edit_is_a_4xx_naming_the_field(http, form, param):
    response = edit(http, **{"prompt": PROMPT, "seed": 1, "num_inference_steps": STEPS, **form})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_an_image_over_16_mib_is_refused_before_it_is_read(http):
    response = edit(http, image=b"\0" * (17 * 2**20), prompt=PROMPT, seed=1)
    assert response.status_code == 413 and response.json()["error"]["param"] == "image", response.text


def test_a_json_edit_is_refused_asking_for_multipart(http):
    response = http.post("/v1/images/edits", json={"prompt": PROMPT, "seed": 1})
    assert response.status_code == 415 and "multipart/form-data" in response.json()["error"]["message"]


def test_a_seedless_edit_is_refused_under_invariance_and_served_without(http):
    refused = edit(http, prompt=PROMPT, num_inference_steps=STEPS)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "seed", refused.text
    served = edit(http, "/off/v1/images/edits", prompt=PROMPT, enhance_prompt="false")
    assert served.status_code == 200, served.text
    item = served.json()["data"][0]
    again = edit(http, "/off/v1/images/edits", prompt=PROMPT, enhance_prompt="false", seed=item["seed"])
    assert png(again.json()["data"][0]) == png(item)


def test_openapi_documents_the_edit_form(http):
    operation = http.get("/openapi.json").json()["paths"]["/v1/images/edits"]["post"]
    form = operation["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["properties"]["image"]["format"] == "binary" and {"image", "prompt"} <= set(form["required"])
    assert {"n", "size", "seed", "strength", "num_inference_steps", "enhance_prompt"} <= set(form["properties"])
    assert "mask" not in form["properties"] and "latents" not in form["properties"]
    assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ImagesResponse")
