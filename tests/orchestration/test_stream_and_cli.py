"""Streaming (server-sent events, as OpenAI's Images API streams) and the CLI's generate / verify / health, end to end.

The package's apps (tests/orchestration/conftest.py): "/" both switches on, "/off" both off. Through the official
openai client: partial images then the completed image, whose bytes equal the non-streamed request's; `omniserve
generate` then `omniserve verify` exits 0; verify fails for an edited file and against the "/off" app. 64x64, 4 steps.
"""

import base64
import hashlib
import io
import json

import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from cli.main import main
from contracts.provenance import RECORD_CHUNK, ImageRecord, read_chunks, read_record
from contracts.sampling import seeds_for_request
from tests.openai_types import read_as_openai

from .conftest import STEPS, TIMEOUT_S
from .test_edits import IMAGE, edit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


def decoded(event) -> bytes:
    return base64.b64decode(event.b64_json)


def test_openai_client_streams_partial_images_then_the_non_streamed_bytes(client, http):
    events = list(client.images.generate(prompt=PROMPT, size="64x64", stream=True, partial_images=2, extra_body={"seed": 7}))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(e.size == "64x64" and e.output_format == "png" and decoded(e).startswith(b"\x89PNG") for e in events)
    assert all(e.quality == "high" for e in events)  # the default steps, in OpenAI's terms
    completed = events[-1]
    whole = http.post("/v1/images/generations", json={"prompt": PROMPT, "size": "64x64", "seed": 7}).json()["data"][0]
    assert decoded(completed) == base64.b64decode(whole["b64_json"])
    extra = completed.model_extra
    assert (extra["seed"], extra["sha256"], extra["revised_prompt"]) == (7, whole["sha256"], whole["revised_prompt"])
    assert completed.usage.input_tokens > 0  # the rewrite's tokens
    record = read_record(decoded(completed))  # the provenance inside: the client's prompt, its rewrite, both stages
    assert (record.prompt, record.revised_prompt, record.seed, record.enhance) == (PROMPT, whole["revised_prompt"], 7, True)
    assert record.llm_params.seed == 7 and set(record.stages) == {"llm", "diffusion"}


def test_each_raw_stream_event_is_what_the_official_types_read_strictly(http):
    body = {"prompt": PROMPT, "size": "64x64", "seed": 7, "stream": True, "partial_images": 1,
            "num_inference_steps": STEPS, "enhance_prompt": False}
    with http.stream("POST", "/v1/images/generations", json=body) as response:
        data = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line.startswith("data: ")]
    assert [event["type"] for event in data] == ["image_generation.partial_image", "image_generation.completed"]
    for event in data:  # steps given: no OpenAI quality names them, and the events' schemas require one: "auto"
        assert read_as_openai(event["type"], event).quality == "auto"


def test_openai_client_streams_an_edit_with_image_edit_events(client):
    def streamed(partial_images):
        return list(client.images.edit(image=("fox.png", IMAGE, "image/png"), prompt=PROMPT, size="64x64", stream=True,
                                       partial_images=partial_images, extra_body={"seed": 3, "enhance_prompt": False}))

    events = streamed(1)
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    whole = client.images.edit(image=("fox.png", IMAGE, "image/png"), prompt=PROMPT, size="64x64",
                               extra_body={"seed": 3, "enhance_prompt": False}).data[0]
    assert decoded(events[-1]) == base64.b64decode(whole.b64_json)
    assert read_record(decoded(events[-1])).image_sha256 == hashlib.sha256(IMAGE).hexdigest()


@pytest.mark.parametrize("body,param", [
    ({"stream": True, "partial_images": 5}, "partial_images"),
    ({"partial_images": 2}, "partial_images"),
    ({"stream": True, "size": "65x64"}, "size"),
    ({"stream": True, "n": 9}, "n"),
])
def test_a_bad_streamed_request_is_a_json_400_naming_the_field(http, body, param):
    response = http.post("/v1/images/generations", json={"prompt": PROMPT, "seed": 1, **body})
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["param"] == param


def test_a_bad_streamed_edit_is_a_json_400_naming_the_field(http):
    response = edit(http, prompt=PROMPT, seed=1, stream="true", partial_images=4)
    assert response.status_code == 400 and response.json()["error"]["param"] == "partial_images"


@pytest.fixture(scope="module")
def generated(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("generated")
    assert main(["generate", PROMPT, "--n", "2", "--seed", "42", "--size", "64x64", "--no-enhance", "--out", str(out),
                 "--url", server]) == 0
    return sorted(out.glob("*.png"))


def test_cli_generate_writes_each_image_with_its_seed_and_provenance(generated, capsys):
    assert [read_record(p.read_bytes()).seed for p in generated] == seeds_for_request(42, 2)
    assert all(read_record(p.read_bytes()).params.num_inference_steps == STEPS for p in generated)


def test_cli_verify_exits_0_when_the_server_renders_every_file_again(server, generated, capsys):
    assert main(["verify", *map(str, generated), "--url", server]) == 0
    assert capsys.readouterr().out.count("OK ") == 2


def edited(path, tmp_path, **changes) -> str:
    """The file with its record changed consistently (every chunk rewritten), pixels untouched."""
    record = read_record(path.read_bytes()).model_copy(update=changes)
    info = PngInfo()
    for keyword, text in ImageRecord.model_validate_json(record.canonical()).chunks().items():
        info.add_itxt(keyword, text)
    target = tmp_path / "edited.png"
    Image.open(io.BytesIO(path.read_bytes())).save(target, format="PNG", pnginfo=info)
    assert RECORD_CHUNK in read_chunks(target.read_bytes())[0]
    return str(target)


def test_cli_verify_fails_for_a_file_whose_provenance_was_edited(server, generated, tmp_path, capsys):
    assert main(["verify", edited(generated[0], tmp_path, seed=1234), "--url", server]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_cli_verify_fails_for_a_file_whose_pixels_were_edited(server, generated, tmp_path, capsys):
    picture = Image.open(generated[0])
    picture.putpixel((0, 0), tuple(255 - v for v in picture.getpixel((0, 0))))
    info = PngInfo()
    for keyword, text in read_chunks(generated[0].read_bytes())[0].items():
        info.add_itxt(keyword, text)
    picture.save(tmp_path / "pixel.png", format="PNG", pnginfo=info)
    assert main(["verify", str(tmp_path / "pixel.png"), "--url", server]) == 1
    assert "same provenance, different pixels" in capsys.readouterr().out


def test_cli_verify_fails_against_a_server_whose_diffusion_switch_differs(server, generated, capsys):
    assert main(["verify", str(generated[0]), "--url", f"{server}/off"]) == 1
    out = capsys.readouterr().out
    assert "diffusion.batch_invariant: the file says True, the server has False" in out and "nothing rendered" in out


def test_cli_health_prints_each_stage_as_a_row(server, http, capsys):
    model = http.get("/health").json()["stages"]["diffusion"]["model"]
    assert main(["health", "--url", server]) == 0
    out = capsys.readouterr().out
    assert "kernel_backend" in out.splitlines()[1]
    assert any(line.split()[:3] == ["diffusion", "running", model] for line in out.splitlines())
