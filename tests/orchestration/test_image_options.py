"""The image options OpenAI's clients send, over real HTTP against the package's app ("/": both switches on):
`output_format` jpeg/webp with `output_compression` (the same bytes on repeat and co-batched, provenance inside,
`omniserve verify` reproduces them), `quality` as step counts, `size: "auto"`, and `response_format: "url"` served
from the app's image store."""

import base64
import hashlib
import io

import pytest
from PIL import Image

from contracts.provenance import OUTPUT_KEY, ImageOutput, read_chunks, read_record

from .conftest import STEPS, TIMEOUT_S
from .test_app_e2e import concurrently, generate, png

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FAST = {"prompt": "a red circle on a blue background", "enhance_prompt": False}


def file_of(item: dict) -> bytes:
    data = base64.b64decode(item["b64_json"])
    assert hashlib.sha256(data).hexdigest() == item["sha256"]
    return data


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_jpeg_and_webp_are_the_same_bytes_on_repeat_and_co_batched_with_the_record_inside(server, http, fmt):
    ask = {**FAST, "output_format": fmt, "output_compression": 75}
    solo = generate(http, **ask, seed=11)
    assert solo["output_format"] == fmt
    first = file_of(solo["data"][0])
    assert file_of(generate(http, **ask, seed=11)["data"][0]) == first
    with Image.open(io.BytesIO(first)) as picture:
        assert picture.format == fmt.upper() and picture.size == (64, 64)
    as_png = png(generate(http, **FAST, seed=11)["data"][0])
    assert read_record(first) == read_record(as_png)  # the stage's record, carried over
    assert ImageOutput.parse(read_chunks(first)[0][OUTPUT_KEY]) == ImageOutput(fmt, 75)
    responses = concurrently(server, [{**ask, "seed": seed} for seed in (11, 12, 13, 14)])
    together = [r.json()["data"][0] for r in responses]
    assert max(item["batch_size"] for item in together) > 1, "concurrent requests were not co-batched"
    assert file_of(together[0]) == first


def test_verify_reproduces_a_jpeg_from_its_own_provenance(server, http, tmp_path):
    from cli.client import verify

    item = generate(http, **FAST, seed=21, output_format="jpeg", output_compression=60)["data"][0]
    path = tmp_path / "fox.jpg"
    path.write_bytes(file_of(item))
    out = io.StringIO()
    assert verify(server, [path], out=out) == 0, out.getvalue()
    blurred = tmp_path / "other.jpg"
    with Image.open(path) as picture:
        picture.save(blurred, "JPEG", quality=20, xmp=picture.info["xmp"])  # the record kept, the pixels not
    assert verify(server, [blurred], out=out) == 1 and "different pixels" in out.getvalue()


def test_quality_stands_for_a_share_of_the_default_steps_and_auto_size_is_the_default_size(http):
    steps = {}
    for quality in ("low", "medium", "high", "auto"):
        body = generate(http, **FAST, seed=5, quality=quality)
        assert body["quality"] == {"auto": "high"}.get(quality, quality)  # what was rendered, in OpenAI's terms
        steps[quality] = body["data"][0]["steps_computed"]
    assert steps == {"low": 1, "medium": 2, "high": STEPS, "auto": STEPS}  # the app's default is STEPS
    high = png(generate(http, **FAST, seed=5, quality="high")["data"][0])
    by_steps = generate(http, **FAST, seed=5, num_inference_steps=STEPS)
    assert high == png(by_steps["data"][0])
    assert "quality" not in by_steps  # a step count has no OpenAI term: left out
    assert read_record(high).params.quality is None  # recorded as the steps it ran
    auto = generate(http, prompt=FAST["prompt"], enhance_prompt=False, seed=5, size="auto")  # no `size` default here
    assert auto["size"] == "64x64"
    assert png(auto["data"][0]) == png(generate(http, **FAST, seed=5)["data"][0])


def test_url_responses_link_to_the_bytes_the_response_names(server, http):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)
    result = client.images.generate(
        prompt=FAST["prompt"], n=2, size="64x64", response_format="url",
        extra_body={"seed": 31, "enhance_prompt": False, "num_inference_steps": STEPS},
    )
    inline = generate(http, **FAST, seed=31, n=2)["data"]
    for linked, item in zip(result.data, inline, strict=True):
        assert linked.b64_json is None and linked.url.startswith(f"{server}/v1/images/img_")
        fetched = http.get(linked.url)
        assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
        assert hashlib.sha256(fetched.content).hexdigest() == linked.model_extra["sha256"] == item["sha256"]
        assert fetched.content == png(item) and fetched.headers["etag"] == f'"{item["sha256"]}"'
    jpeg = generate(http, **FAST, seed=31, response_format="url", output_format="jpeg")["data"][0]
    fetched = http.get(jpeg["url"])
    assert fetched.headers["content-type"] == "image/jpeg"
    assert hashlib.sha256(fetched.content).hexdigest() == jpeg["sha256"]
    missing = http.get("/v1/images/img_unknown")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "image_id"
    assert http.get("/v1/images/generations").status_code == 405  # the POST routes keep their paths


def test_the_image_store_keeps_files_within_its_bytes_and_time(monkeypatch):
    from contracts.provenance import ImageFile
    from orchestration import image_store

    now = [100.0]
    monkeypatch.setattr(image_store.time, "monotonic", lambda: now[0])
    store = image_store.ImageStore.func_or_class(max_bytes=10, ttl_s=60.0)
    files = [ImageFile("png", bytes([i]) * 4, f"{i}" * 64) for i in range(3)]
    ids = [store.put(file) for file in files]
    assert len(set(ids)) == 3 and all(len(i) > 20 for i in ids)  # unguessable
    assert store.get(ids[0]) is None and store.bytes == 8  # 12 bytes over 10: the oldest dropped
    assert store.get(ids[2]) == (files[2], 60.0)
    now[0] += 30
    late = store.put(files[0])
    assert store.get(ids[1]) is None  # dropped for the newest
    now[0] += 31
    assert store.get(ids[2]) is None and store.get(late)[0] == files[0]  # ids[2] expired, `late` has 29 s left
    huge = store.put(ImageFile("png", b"x" * 50, "f" * 64))
    assert store.get(huge) is not None and store.stats()["files"] == 1  # one file over the bound is kept alone
