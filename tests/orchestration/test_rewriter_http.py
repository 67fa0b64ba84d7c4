"""The default LLM, the embedded rewriter, through the app ("/small": both switches on, vLLM serving the committed
model): free prompts it never saw come back rewritten into the image model's words, keeping their colour and shape
words, and the picture shows them (issue 15's pixel statistics: the border's colour is the background's, most of what
is drawn is the shape's colour); chat answers in readable words."""

import base64
import io
import re

import httpx
import numpy as np
import pytest
from PIL import Image

from training.rewriter import HELD_OUT_PROMPTS, chat_examples, keeps_words, rewrite_examples, words_of
from training.scenes import Scene, background_as_said, drawn_as_said

from .conftest import TIMEOUT_S
from .test_app_e2e import concurrently

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [prompt for prompt, _ in HELD_OUT_PROMPTS[:20]]
CAPTION = re.compile(r"an? (?P<size>small|large) (?P<colour>\w+) (?P<shape>\w+) on an? (?P<background>\w+) "
                     r"background, (?P<position>\w+)")


def test_held_out_prompts_are_rewritten_keeping_their_words_and_the_picture_shows_them(small_server):
    bodies = [{"prompt": p, "seed": 100 + i, "num_inference_steps": 8} for i, p in enumerate(PROMPTS)]
    responses = concurrently(small_server, bodies)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    items = [r.json()["data"][0] for r in responses]
    lost = {p: item["revised_prompt"] for p, item in zip(PROMPTS, items) if not keeps_words(p, item["revised_prompt"])}
    assert not lost, lost
    scenes = [Scene(**CAPTION.fullmatch(item["revised_prompt"]).groupdict()) for item in items]
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))).convert("RGB")) for item in items]
    backgrounds = sum(background_as_said(image, scene.background) for image, scene in zip(images, scenes))
    large = [(image, scene) for image, scene in zip(images, scenes) if scene.size == "large" and scene.shape != "ring"]
    drawn = sum(drawn_as_said(image, scene) for image, scene in large)
    assert backgrounds >= 18 and drawn >= 0.8 * len(large), (backgrounds, drawn, len(large))


def test_chat_answers_in_readable_words(small_server):
    # Readable: every word one of its training language's (what it was taught to answer, chats and rewrites alike).
    answers = [m["content"] for chat in chat_examples() for m in chat if m["role"] == "assistant"]
    known = {w for text in answers + [caption for _, caption in rewrite_examples()] for w in words_of(text)}
    for question in ("hello", "what can you draw?", "which colours do you know?"):
        body = {"messages": [{"role": "user", "content": question}], "seed": 1, "max_tokens": 48}
        response = httpx.post(f"{small_server}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["message"]["content"]
        assert len(words_of(text)) >= 3 and set(words_of(text)) <= known, (question, text)
