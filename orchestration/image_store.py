"""The image store behind `response_format: "url"`: delivered files kept for a while, served at `GET /v1/images/{id}`.

    ImageStore.put(file) -> id        keep a file (`contracts.provenance.ImageFile`); its id is 128 random bits
    ImageStore.get(id) -> ImageFile   the file, or None once it expired, was dropped, or never was

One deployment of one replica, not a cache in each ingress replica: Serve's proxy sends a URL's GET to any ingress
replica, so the file must be where every one of them can find it. Bounded twice: each file expires `ttl_s` after it
was kept (OpenAI's URLs last 60 minutes, the default here), and past `max_bytes` the oldest files are dropped first (a
single file over the bound is kept alone). The id is the only key: a URL is a capability, unguessable, and nothing
lists the store. A lost replica loses its files (Serve starts a new, empty one): a URL is a convenience, the bytes'
sha256 and the request that reproduces them are the record.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict

from ray import serve
from ray.serve.handle import DeploymentHandle

from contracts.errors import NotFoundError
from contracts.provenance import ImageFile


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class ImageStore:
    def __init__(self, max_bytes: int, ttl_s: float):
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._files: OrderedDict[str, tuple[float, ImageFile]] = OrderedDict()  # id -> (expiry, file), oldest first
        self.bytes = 0

    def put(self, file: ImageFile) -> str:
        self._expire()
        while self._files and self.bytes + len(file.data) > self.max_bytes:
            self._drop(next(iter(self._files)))
        image_id = f"img_{secrets.token_urlsafe(16)}"
        self._files[image_id] = (time.monotonic() + self.ttl_s, file)
        self.bytes += len(file.data)
        return image_id

    def get(self, image_id: str) -> tuple[ImageFile, float] | None:
        """The file and the seconds it has left, or None."""
        self._expire()
        kept = self._files.get(image_id)
        return None if kept is None else (kept[1], kept[0] - time.monotonic())

    def stats(self) -> dict[str, float]:
        self._expire()
        return {"files": len(self._files), "bytes": self.bytes, "max_bytes": self.max_bytes, "ttl_s": self.ttl_s}

    def _expire(self) -> None:
        now = time.monotonic()
        while self._files and next(iter(self._files.values()))[0] <= now:  # every file lives ttl_s: oldest first
            self._drop(next(iter(self._files)))

    def _drop(self, image_id: str) -> None:
        self.bytes -= len(self._files.pop(image_id)[1].data)


class ImageLinks:
    """The ingress's side of the store: a response's files in, a link's file out (404 naming `image_id` when gone)."""

    def __init__(self, store: DeploymentHandle, ttl_s: float):
        self.store, self.ttl_s = store, ttl_s

    async def keep(self, files: list[ImageFile]) -> list[str]:
        """Each file into the store: their ids, in order."""
        return list(await asyncio.gather(*(self.store.put.remote(file) for file in files)))

    async def get(self, image_id: str) -> tuple[ImageFile, float]:
        """A stored file and the seconds it has left."""
        kept = await self.store.get.remote(image_id)
        if kept is None:
            raise NotFoundError(
                f"no image {image_id!r}: its link expired (links last {self.ttl_s:g} s), was dropped for newer ones, "
                "or never existed",
                param="image_id",
                code="image_not_found",
            )
        return kept
