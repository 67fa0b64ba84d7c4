"""The sha256 of what one running app answers to five fixed requests: a generation (two images, rewritten), an edit, a
stream (its previews and its image), a video and a chat completion. Run against a checkout before and after a change
that must not change a byte (a refactor): the two JSON lines must be equal.

    make serve &                              # or any app on the embedded defaults, at --base
    .venv/bin/python scripts/request_hashes.py --base http://127.0.0.1:8000

Every request is seeded and sent with `Cache-Control: no-cache`, so each is rendered, not read from the result cache.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import time

import httpx

FRESH = {"Cache-Control": "no-cache"}
TIMEOUT_S = 600


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def generation(http: httpx.Client) -> dict[str, object]:
    body = {"prompt": "a red circle", "seed": 11, "n": 2, "size": "64x64", "response_format": "b64_json"}
    answer = http.post("/v1/images/generations", json=body, headers=FRESH)
    answer.raise_for_status()
    data = answer.json()["data"]
    return {
        "images": [sha(base64.b64decode(d["b64_json"])) for d in data],
        "revised": [d["revised_prompt"] for d in data],
    }


def edit(http: httpx.Client, image: bytes) -> str:
    form = {"prompt": "a blue square", "seed": "12", "strength": "0.6", "response_format": "b64_json"}
    answer = http.post("/v1/images/edits", data=form, files={"image": ("in.png", image, "image/png")}, headers=FRESH)
    answer.raise_for_status()
    return sha(base64.b64decode(answer.json()["data"][0]["b64_json"]))


def stream(http: httpx.Client) -> list[str]:
    body = {"prompt": "a green star", "seed": 13, "size": "64x64", "stream": True, "partial_images": 2}
    found = []
    with http.stream("POST", "/v1/images/generations", json=body, headers=FRESH) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                found.append(f"{event['type']}:{sha(base64.b64decode(event['b64_json']))}")
    return found


def video(http: httpx.Client) -> str:
    body = {"prompt": "a red ball bouncing", "seed": 14, "enhance_prompt": False, "size": "64x64"}
    created = http.post("/v1/videos", json=body)
    created.raise_for_status()
    video_id, deadline = created.json()["id"], time.monotonic() + TIMEOUT_S
    while http.get(f"/v1/videos/{video_id}").json()["status"] not in ("completed", "failed"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"video {video_id} did not finish in {TIMEOUT_S} s")
        time.sleep(0.1)
    return sha(http.get(f"/v1/videos/{video_id}/content").content)


def chat(http: httpx.Client, stream: bool) -> str:
    body = {
        "messages": [{"role": "user", "content": "a lighthouse at dusk"}],
        "seed": 15,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": stream,
    }
    if not stream:
        answer = http.post("/v1/chat/completions", json=body, headers=FRESH)
        answer.raise_for_status()
        choice = answer.json()["choices"][0]
        return sha(json.dumps([choice["message"]["content"], choice["logprobs"]], sort_keys=True))
    pieces: list[list[object]] = []
    with http.stream("POST", "/v1/chat/completions", json=body) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[len("data: ") :])["choices"]
                pieces.extend([d["delta"].get("content"), d.get("logprobs")] for d in delta)
    return sha(json.dumps(pieces, sort_keys=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="http://127.0.0.1:8000")
    base = parser.parse_args().base
    with httpx.Client(base_url=base, timeout=TIMEOUT_S) as http:
        generated = generation(http)
        first = base64.b64decode(
            http.post(
                "/v1/images/generations",
                json={"prompt": "a red circle", "seed": 11, "size": "64x64", "response_format": "b64_json"},
            ).json()["data"][0]["b64_json"]
        )
        hashes = {
            "generation": generated,
            "edit": edit(http, first),
            "stream": stream(http),
            "video": video(http),
            "chat": chat(http, stream=False),
            "chat_stream": chat(http, stream=True),
        }
    print(json.dumps(hashes, sort_keys=True))


if __name__ == "__main__":
    main()
