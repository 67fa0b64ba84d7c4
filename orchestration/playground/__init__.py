"""The playground: one page at `GET /` for a person to generate, look at and reproduce images.

Plain files in this package (no build step, nothing fetched from elsewhere): `index.html`, `playground.js`,
`playground.css`. The page talks to this server's own routes only: `/v1/images/generations` (streamed when the
route streams, whole otherwise), `/v1/videos` where the app serves videos, and `/health`. `mount(api, videos)` adds the
page and its assets to an app's FastAPI.
"""

from __future__ import annotations

import html
from functools import cache
from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException

#: The page's assets by name -> media type: the only files served from this package.
ASSETS = {"playground.js": "text/javascript; charset=utf-8", "playground.css": "text/css; charset=utf-8"}
#: Where in the page the app's own base path goes (Serve may run the app under a route prefix), and where the video
#: button is hidden from an app that serves no videos.
BASE_MARK, VIDEO_MARK = "{{base}}", "{{video}}"


@cache
def read(name: str) -> str:
    return files(__package__).joinpath(name).read_text(encoding="utf-8")


def page(root_path: str, videos: bool) -> str:
    # Every URL in the page is relative to <base>, so the page works whatever prefix the app is served under.
    base = html.escape(root_path.rstrip("/") + "/", quote=True)
    return read("index.html").replace(BASE_MARK, base).replace(VIDEO_MARK, "" if videos else "hidden")


def mount(api: FastAPI, videos: bool) -> None:
    """`GET /` (the page) and `GET /playground/<asset>`, left out of the API's OpenAPI schema."""

    @api.get("/", include_in_schema=False)
    async def playground(request: Request) -> HTMLResponse:
        return HTMLResponse(page(request.scope.get("root_path", ""), videos))

    @api.get("/playground/{name}", include_in_schema=False)
    async def playground_asset(name: str) -> Response:
        if name not in ASSETS:
            raise HTTPException(404, f"the playground has no asset {name!r}")  # answered in the API's error shape
        return Response(read(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})
