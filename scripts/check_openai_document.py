"""Checked from outside: this server's responses against OpenAI's own published OpenAPI document.

The document is not part of the project (it is OpenAI's, and it is large): give the path of a copy of its
`openapi.json` (OpenAI's openai-openapi repository). Against a running server (`make serve`), this makes the calls a
client makes and validates every JSON body it gets, including each event of an image stream and each chunk of a chat
stream, against the document's schema for it (JSON Schema 2020-12, as OpenAPI 3.1 defines), and prints one line per
body and a summary. Exit status: 0 when every body validated (the known difference aside), 1 otherwise.

Known difference, kept and documented (docs/api.md): `size` echoes the size rendered ("64x64"), outside the document's
enum of OpenAI's own sizes; the one validation error allowed is at that path.

    .venv/bin/python scripts/check_openai_document.py --document /path/to/openapi.json [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from typing import Any

import httpx

#: What each body is, in the document's terms.
SCHEMAS = {
    "models": "ListModelsResponse",
    "model": "Model",
    "images": "ImagesResponse",
    "image_generation.partial_image": "ImageGenPartialImageEvent",
    "image_generation.completed": "ImageGenCompletedEvent",
    "image_edit.partial_image": "ImageEditPartialImageEvent",
    "image_edit.completed": "ImageEditCompletedEvent",
    "chat": "CreateChatCompletionResponse",
    "chunk": "CreateChatCompletionStreamResponse",
    "video": "VideoResource",
    "error": "ErrorResponse",
}
#: The one documented difference: a rendered size outside OpenAI's enum of sizes.
ALLOWED = {("size",)}


def nullable_as_null(schema: Any) -> Any:
    """OpenAPI 3.0's `nullable: true`, which the document still uses beside 3.1's `type: null` (111 times in 2.3.0),
    read as OpenAPI tools read it: null is also allowed there. JSON Schema itself ignores the keyword."""
    if isinstance(schema, list):
        return [nullable_as_null(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = {key: nullable_as_null(value) for key, value in schema.items() if key != "nullable"}
    return {"anyOf": [converted, {"type": "null"}]} if schema.get("nullable") is True else converted


class Document:
    def __init__(self, path: str):
        from jsonschema import Draft202012Validator
        from referencing import Registry, Resource
        from referencing.jsonschema import DRAFT202012

        with open(path) as file:
            document = nullable_as_null(json.load(file))
        self.version = document["info"]["version"]
        resource = Resource.from_contents(document, default_specification=DRAFT202012)
        registry = Registry().with_resource("urn:openai", resource)
        self.validators = {
            kind: Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{name}"}, registry=registry)
            for kind, name in SCHEMAS.items()
        }

    def errors(self, kind: str, body: Any) -> tuple[list[str], list[str]]:
        """(the validation errors outside the allowed difference, the allowed ones), each with its path."""
        found: tuple[list[str], list[str]] = ([], [])
        for error in self.validators[kind].iter_errors(body):
            path = tuple(str(part) for part in error.absolute_path)
            found[path in ALLOWED].append(f"{'/'.join(path) or '(body)'}: {error.message[:200]}")
        return found


def events(response: httpx.Response) -> list[dict]:
    """The JSON of each server-sent event's data line (the `[DONE]` sentinel left out)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            out.append(json.loads(line[6:]))
    return out


def png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def bodies(client: httpx.Client) -> list[tuple[str, str, Any]]:
    """(call, kind, body) for every body a client's calls get."""
    seen: list[tuple[str, str, Any]] = []
    fresh = {"Cache-Control": "no-cache"}
    models = client.get("/v1/models").json()
    seen.append(("GET /v1/models", "models", models))
    seen.append(("GET /v1/models/{id}", "model", client.get(f"/v1/models/{models['data'][0]['id']}").json()))
    image = {"prompt": "a red circle on a blue background", "seed": 7, "size": "64x64"}
    seen.append(("POST /v1/images/generations", "images", client.post("/v1/images/generations", json=image).json()))
    two = {**image, "n": 2, "response_format": "b64_json"}
    seen.append(("POST /v1/images/generations n=2", "images", client.post("/v1/images/generations", json=two).json()))
    stream = {**image, "stream": True, "partial_images": 2, "enhance_prompt": False}
    with client.stream("POST", "/v1/images/generations", json=stream, headers=fresh) as response:
        seen += [("POST /v1/images/generations stream", event["type"], event) for event in events(response)]
    files = {"image": ("in.png", png(), "image/png")}
    edit = client.post("/v1/images/edits", files=files, data={"prompt": "a blue square", "seed": "5", "size": "64x64"})
    seen.append(("POST /v1/images/edits", "images", edit.json()))
    data = {"prompt": "a blue square", "seed": "5", "size": "64x64", "stream": "true", "partial_images": "1"}
    with client.stream("POST", "/v1/images/edits", files=files, data=data, headers=fresh) as response:
        seen += [("POST /v1/images/edits stream", event["type"], event) for event in events(response)]
    bad = client.post("/v1/images/generations", json={**image, "size": "65x64"})
    seen.append(("POST /v1/images/generations (bad size: 400)", "error", bad.json()))
    chat = {"messages": [{"role": "user", "content": "a fox in the snow"}], "seed": 3, "max_tokens": 16}
    seen.append(("POST /v1/chat/completions", "chat", client.post("/v1/chat/completions", json=chat).json()))
    streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=streamed) as response:
        seen += [("POST /v1/chat/completions stream", "chunk", chunk) for chunk in events(response)]
    video = client.post("/v1/videos", json={"prompt": "a red ball rolling", "seed": 4, "size": "64x64"})
    if video.status_code == 404:  # an app without the video stage
        return seen
    seen.append(("POST /v1/videos", "video", video.json()))
    job = video.json()["id"]
    for _ in range(600):
        current = client.get(f"/v1/videos/{job}").json()
        if current["status"] in ("completed", "failed"):
            break
        time.sleep(0.5)
    seen.append(("GET /v1/videos/{id}", "video", current))
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--document", required=True, help="OpenAI's openapi.json")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    args = parser.parse_args(argv)
    document = Document(args.document)
    with httpx.Client(base_url=args.url, timeout=300) as client:
        seen = bodies(client)
    failed = allowed = 0
    for call, kind, body in seen:
        errors, known = document.errors(kind, body)
        failed, allowed = failed + bool(errors), allowed + bool(known)
        note = " (the documented size difference)" if known else ""
        print(
            f"{'FAIL' if errors else 'ok  '}  {call}: {SCHEMAS[kind]}{note}" + "".join(f"\n      {e}" for e in errors)
        )
    print(
        f"{len(seen) - failed} of {len(seen)} bodies valid against OpenAI's document {document.version}; "
        f"{allowed} of them only through the documented size difference"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
