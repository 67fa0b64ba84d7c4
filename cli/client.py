"""The command line's side of the HTTP API: `omniserve generate`, `verify` and `health` (standard library only).

generate  one streamed request (`stream: true`): a progress bar on stderr fed by its events, the PNGs written
verify    per file: its record (`contracts.provenance`) checked, the server's stages compared with it (/health)
          before anything is rendered, then the image rendered again (n=1, its seed and params) and the
          sha256 compared; exit 0 only if every file matches
health    /health as a table: each stage's state, model, switch, kernels, replicas (and `verified`)
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from contracts.provenance import (
    OUTPUT_KEY,
    ImageOutput,
    ImageRecord,
    ProvenanceError,
    StageRecord,
    differences,
    read_chunks,
    read_record,
)
from contracts.sampling import image_fields

#: Seconds a request may take (a cold app builds its models on the first request).
TIMEOUT_S = 600.0
#: The stage fields /health and a record share, compared before re-rendering (model, switch, kernel backend).
COMPARED = tuple(StageRecord.model_fields)


class ServerError(Exception):
    """The server answered with an error (its message), or could not be reached."""


def _request(url: str, path: str, body: dict | None = None) -> urllib.request.Request:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
    return urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers)


def _open(request: urllib.request.Request, *, ok: tuple[int, ...] = ()):
    """The response; an error status becomes ServerError with the server's message (statuses in `ok` are answers)."""
    try:
        return urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as err:
        if err.code in ok:
            return err
        try:
            message = json.loads(err.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = err.reason
        raise ServerError(f"{request.full_url}: HTTP {err.code}: {message}") from None
    except (urllib.error.URLError, OSError) as err:
        raise ServerError(f"{request.full_url}: cannot reach the server ({getattr(err, 'reason', err)})") from None


def get_json(url: str, path: str, *, ok: tuple[int, ...] = ()) -> dict:
    with _open(_request(url, path), ok=ok) as response:
        return json.loads(response.read())


def post_json(url: str, path: str, body: dict) -> dict:
    with _open(_request(url, path, body)) as response:
        return json.loads(response.read())


def events(url: str, path: str, body: dict) -> Iterator[dict]:
    """The server-sent events of a streamed request, each event's data; an `error` event raises ServerError."""
    with _open(_request(url, path, {**body, "stream": True})) as response:
        name, data = None, []
        for raw in response:
            line = raw.decode("utf-8").rstrip("\r\n")
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
            elif not line and data:
                event = json.loads("\n".join(data))
                if name == "error" or "error" in event:
                    raise ServerError(f"the stream ended with an error: {event['error']['message']}")
                yield event
                name, data = None, []


class Progress:
    """A text progress bar on a stream: one unit per preview and per image (an image done fills its previews)."""

    def __init__(self, images: int, previews: int, out: TextIO, width: int = 30):
        self.per_image, self.images, self.out, self.width = previews + 1, images, out, width
        self.done = [0] * images

    def update(self, event: dict) -> None:
        index = event.get("image_index", 0)
        completed = event["type"].endswith(".completed")
        self.done[index] = self.per_image if completed else min(self.done[index] + 1, self.per_image - 1)
        total, done = self.images * self.per_image, sum(self.done)
        bar = "#" * (self.width * done // total)
        images = sum(d == self.per_image for d in self.done)
        self.out.write(f"\r[{bar:<{self.width}}] {images}/{self.images} images")
        if images == self.images:
            self.out.write("\n")
        self.out.flush()


def generate(url: str, body: dict, out_dir: Path, *, log: TextIO | None = None) -> list[Path]:
    """Stream one generation request, show its progress, write each image as `<out_dir>/image-<i>-<seed>.png`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress(body.get("n") or 1, body.get("partial_images") or 0, log or sys.stderr)
    written: dict[int, tuple[Path, dict]] = {}
    for event in events(url, "/v1/images/generations", body):
        progress.update(event)
        if event["type"].endswith(".completed"):
            png = base64.b64decode(event["b64_json"])
            if hashlib.sha256(png).hexdigest() != event["sha256"]:
                raise ServerError(f"image {event['image_index']}: its bytes do not match the sha256 the server sent")
            path = out_dir / f"image-{event['image_index']}-{event['seed']}.png"
            path.write_bytes(png)
            written[event["image_index"]] = path, event
    for path, event in (written[i] for i in sorted(written)):  # after the bar: stdout and stderr may share a terminal
        print(f"{path}\tseed={event['seed']}\tsha256={event['sha256']}")
    return [path for path, _ in (written[i] for i in sorted(written))]


def video(url: str, body: dict, out_dir: Path, *, log: TextIO | None = None, poll_s: float = 0.2) -> Path:
    """Create one video job (`POST /v1/videos`), show its progress until it finishes, write its MP4 as
    `<out_dir>/video-<seed>.mp4` (its sha256 checked against the job's) and print it with its seed and sha256."""
    out = log or sys.stderr
    job = post_json(url, "/v1/videos", body)
    while job["status"] not in ("completed", "failed"):
        time.sleep(poll_s)
        job = get_json(url, f"/v1/videos/{job['id']}")
        bar = "#" * (30 * job["progress"] // 100)
        out.write(f"\r[{bar:<30}] {job['progress']:3d}% {job['status'].replace('_', ' ')}")
        out.flush()
    out.write("\n")
    if job["status"] == "failed":
        raise ServerError(f"video {job['id']} failed: {job['error']['message']}")
    with _open(_request(url, f"/v1/videos/{job['id']}/content")) as response:
        mp4 = response.read()
    if hashlib.sha256(mp4).hexdigest() != job["sha256"]:
        raise ServerError(f"video {job['id']}: its bytes do not match the sha256 the server sent")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"video-{job['seed']}.mp4"
    path.write_bytes(mp4)
    print(f"{path}\tseed={job['seed']}\tframes={job['num_frames']}\tsha256={job['sha256']}")
    return path


def reproduction(record: ImageRecord) -> dict:
    """The request that renders a record's image again: n=1, its seed, prompt, rewrite switch and every parameter."""
    p = record.params
    body = {
        "prompt": record.prompt,
        "n": 1,
        "seed": record.seed,
        "size": f"{p.width}x{p.height}",
        "enhance_prompt": record.enhance,
        "num_inference_steps": p.num_inference_steps,
        "guidance_scale": p.guidance_scale,
    }
    # Every other sampling field a request may send, as it ran (the Served markers say which): adapters with the
    # sha256 of the weights that rendered them (a replica whose file differs refuses, 400), step caching, ...
    fields = set(image_fields(request="all")) - set(body)
    return body | p.model_dump(mode="json", include=fields, exclude_none=True)


def server_differences(record: ImageRecord, health: dict) -> list[str]:
    """Where the server's stages (as /health reports them) differ from what rendered the file, field by field."""
    found = []
    for stage, provenance in record.stages.items():
        served = health.get("stages", {}).get(stage) or {}
        for name in COMPARED:
            mine, theirs = getattr(provenance, name, None), served.get(name)
            if mine is not None and theirs is not None and mine != theirs:
                found.append(f"{stage}.{name}: the file says {mine!r}, the server has {theirs!r}")
    return found


def verify_one(url: str, path: Path, health: dict) -> str | None:
    """None when the server renders `path` again to the same sha256; else why not, in a sentence."""
    png = path.read_bytes()  # or the JPEG or WebP it was delivered as: asked for again in its format
    try:
        record = read_record(png)
        output = ImageOutput.parse(read_chunks(png)[0].get(OUTPUT_KEY, "png"))
    except (ProvenanceError, ValueError) as err:
        return str(err)
    if record.latents_sha256 or record.image_sha256:
        what = "initial latents" if record.latents_sha256 else "input image (an edit)"
        return f"it was rendered from an {what} the file does not hold; it cannot be rendered again from the file alone"
    mismatch = server_differences(record, health)
    if mismatch:
        return "the server is not configured as the one that rendered it (nothing rendered): " + "; ".join(mismatch)
    item = post_json(url, "/v1/images/generations", reproduction(record) | output.request_fields())["data"][0]
    if item["sha256"] == hashlib.sha256(png).hexdigest():
        return None
    again = read_record(base64.b64decode(item["b64_json"]))
    changed = differences(record, again)
    if changed:
        return "the re-render's provenance differs from the file's: " + "; ".join(changed)
    return "same provenance, different pixels: the file's pixels were altered (or the server does not reproduce them)"


def verify(url: str, paths: list[Path], *, out: TextIO | None = None) -> int:
    """Verify each file against the server; 0 only when every one matches."""
    health = get_json(url, "/health", ok=(503,))
    failed = 0
    for path in paths:
        try:
            problem = verify_one(url, path, health)
        except (OSError, ServerError) as err:
            problem = str(err)
        failed += problem is not None
        print(
            f"OK    {path}: the server renders it again bit for bit" if problem is None else f"FAIL  {path}: {problem}",
            file=out or sys.stdout,
        )
    return 1 if failed else 0


def health_table(report: dict) -> str:
    """/health as a table: one row per stage."""
    columns = (
        "stage",
        "state",
        "model",
        "batch_invariant",
        "kernel_backend",
        "kernels_installed",
        "replicas",
        "verified",
    )
    rows: list[tuple[str, ...]] = [columns]
    for stage, info in report.get("stages", {}).items():
        replicas = info.get("replicas") or {}
        counts = f"{replicas.get('running', '?')}/{replicas.get('configured', '?')}" if replicas else "-"
        cells = {**info, "stage": stage, "replicas": counts}
        rows.append(tuple("-" if cells.get(c) is None else str(cells[c]) for c in columns))
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    reasons = [f"{stage}: {why}" for stage, info in report.get("stages", {}).items() for why in info.get("reasons", [])]
    return "\n".join([f"status: {report.get('status')}", *lines, *reasons])
