"""LoRA adapters over HTTP, through the official openai client's `extra_body`: a request with adapter A co-batched with
requests using adapter B, A then B, and none gives the bytes of its solo render with the diffusion switch on; the
control (switch off) differs, or is skipped saying so where stock kernels give solo bits here. `omniserve verify`
reproduces an adapted image from its PNG alone, and an adapted file whose record lost its adapter fails. A chat
completion names an adapter of the LLM stage (tests/stages/test_llm_lora.py checks its bits).

Two apps of their own beside the package's (tests/orchestration/conftest.py), each one diffusion replica with a
four-sample step batch and an adapters directory: "twins" (the committed, trained adapter) and "glow" (random
weights); "/lora" switch on, "/lora-off" off. The image requests skip the rewrite; "/lora"'s LLM stage has one replica
serving a random PEFT adapter, "terse", the other app's is scaled to zero.
"""

import asyncio
import base64
import shutil
import time

import pytest
import torch
from safetensors.torch import save_file

from cli.main import main
from contracts.provenance import read_record
from stages.embedded import embedded_models
from stages.embedded.diffusion import ADAPTERS_PATH

from .conftest import TIMEOUT_S
from .test_stream_and_cli import edited

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LLM = embedded_models("llm")[0]  # embedded:tiny-llama
STEPS = 8  # long enough that four concurrent requests meet in the engine's batch
PROMPT = "a red circle on a blue background"
#: Adapter A (the target), B, A then B, none: (lora, seed).
MIXED = [
    ([{"name": "twins"}], 11),
    ([{"name": "glow", "scale": 0.8}], 12),
    ([{"name": "twins", "scale": 0.7}, {"name": "glow", "scale": -0.5}], 13),
    (None, 14),
]


def app_config(invariant: bool, lora_dir: str, llm_lora_dir: str | None = None) -> dict:
    """An app of one diffusion replica with the adapters of `lora_dir`; its LLM scaled to zero, or with
    `llm_lora_dir` one LLM replica serving those adapters."""
    # The random-weight Llama (by name): a random adapter moves its tokens; the trained default's are too sure to.
    llm = ({"num_replicas": 1, "lora_dir": llm_lora_dir, "torch_threads": 1, "model": LLM} if llm_lora_dir else
           {"autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}})
    return {
        "llm": {"batch_invariant": invariant, "ray_actor_options": {"num_cpus": 0.1}, **llm},
        "diffusion": {"batch_invariant": invariant, "ray_actor_options": {"num_cpus": 0.2}, "max_batch_size": 4,
                      "lora_dir": lora_dir, "defaults": {"num_inference_steps": STEPS}},
        "ingress": {"ray_actor_options": {"num_cpus": 0.02}},
    }


@pytest.fixture(scope="module")
def lora_server(server, tmp_path_factory):
    from ray import serve

    from orchestration import build_app
    from stages.embedded.diffusion import load_tiny_pipeline
    from stages.embedded.llm import ensure_tiny_llama
    from tests.stages.test_llm_lora import peft_adapter

    directory = tmp_path_factory.mktemp("loras")
    shutil.copytree(ADAPTERS_PATH / "twins", directory / "twins")
    unet, gen, glow = load_tiny_pipeline("shapes").unet, torch.Generator().manual_seed(5), {}
    for path, module in unet.named_modules():
        if isinstance(module, torch.nn.Linear) and path.endswith(("to_q", "to_v")):
            glow[f"unet.{path}.lora_A.weight"] = torch.randn(4, module.in_features, generator=gen) * 0.3
            glow[f"unet.{path}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=gen) * 0.3
    save_file(glow, str(directory / "glow.safetensors"))
    llm_directory = tmp_path_factory.mktemp("llm-loras")
    peft_adapter(ensure_tiny_llama(), llm_directory / "terse", 1)
    started = time.monotonic()
    serve.run(build_app(app_config(True, str(directory), str(llm_directory))), name="lora", route_prefix="/lora")
    serve.run(build_app(app_config(False, str(directory))), name="lora-off", route_prefix="/lora-off")
    print(f"adapter apps running after {time.monotonic() - started:.1f} s")
    try:
        yield server
    finally:
        serve.delete("lora")
        serve.delete("lora-off")


def openai_client(base_url: str):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)


async def generate(client, lora, seed):
    extra = {"seed": seed, "enhance_prompt": False, **({"lora": lora} if lora else {})}
    result = await client.images.generate(prompt=PROMPT, size="64x64", response_format="b64_json", extra_body=extra)
    return result.data[0]


def mixed_and_solo(base_url: str):
    """Each MIXED request alone, then all four at once (until they share the engine's batch, at most 3 tries)."""

    async def run():
        client = openai_client(base_url)
        solo = [await generate(client, lora, seed) for lora, seed in MIXED]
        for _ in range(3):
            together = await asyncio.gather(*(generate(client, lora, seed) for lora, seed in MIXED))
            if min(d.model_extra["batch_size"] for d in together) == len(MIXED):
                return solo, together
        pytest.fail(f"four concurrent requests never shared a step: batch sizes {[d.model_extra for d in together]}")

    return asyncio.run(run())


def test_adapter_a_cobatched_with_b_a_and_b_and_none_gives_its_solo_bytes_switch_on(lora_server):
    solo, together = mixed_and_solo(f"{lora_server}/lora")
    assert all(d.model_extra["batch_size"] == 1 for d in solo)
    for alone, batched in zip(solo, together, strict=True):
        assert base64.b64decode(batched.b64_json) == base64.b64decode(alone.b64_json)
    recorded = read_record(base64.b64decode(together[2].b64_json)).params.lora
    assert [(c.name, c.scale) for c in recorded] == [("twins", 0.7), ("glow", -0.5)]
    assert all(len(c.sha256) == 64 for c in recorded)  # provenance names each adapter's weights file
    assert len({d.b64_json for d in solo}) == len(MIXED)  # every adapter choice draws something else


def test_control_switch_off_cobatched_adapters_differ_from_their_solo_bytes(lora_server):
    solo, together = mixed_and_solo(f"{lora_server}/lora-off")
    differ = [i for i, (a, b) in enumerate(zip(solo, together, strict=True)) if a.b64_json != b.b64_json]
    if not differ:
        pytest.skip("measured: with stock kernels these four co-batched requests each gave their solo bytes on this CPU")
    assert differ


def test_omniserve_verify_reproduces_an_adapted_image_from_its_png_alone(lora_server, tmp_path, capsys):
    async def one():
        return await generate(openai_client(f"{lora_server}/lora"), MIXED[2][0], 21)

    path = tmp_path / "adapted.png"
    path.write_bytes(base64.b64decode(asyncio.run(one()).b64_json))
    assert main(["verify", str(path), "--url", f"{lora_server}/lora"]) == 0
    assert "OK " in capsys.readouterr().out
    # The same pixels with a record that lost the adapters: re-rendered without them, the bytes differ.
    assert main(["verify", edited(path, tmp_path, params=read_record(path.read_bytes()).params.model_copy(
        update={"lora": None})), "--url", f"{lora_server}/lora"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_an_unknown_adapter_is_a_404_naming_it_and_a_bad_scale_or_too_many_a_400(lora_server):
    import httpx

    with httpx.Client(base_url=f"{lora_server}/lora", timeout=TIMEOUT_S) as http:
        assert [c["id"] for c in http.get("/v1/loras").json()["data"]] == ["glow", "twins"]
        body = {"prompt": PROMPT, "size": "64x64", "seed": 1, "enhance_prompt": False}
        for lora, status, says in [([{"name": "nowhere"}], 404, "nowhere"), ([{"name": "twins", "scale": 9}], 400, "4"),
                                   ([{"name": f"a{i}"} for i in range(5)], 400, "at most 4")]:
            response = http.post("/v1/images/generations", json={**body, "lora": lora})
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["param"].startswith("lora") and says in error["message"], error


def test_a_chat_completion_with_an_llm_adapter_differs_names_it_and_an_unknown_one_is_a_404(lora_server):
    """The LLM stage's adapters over HTTP, through the openai client's `extra_body`."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{lora_server}/lora/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)
    messages = [{"role": "user", "content": "a cat, watercolor"}]

    def chat(**extra):
        return client.chat.completions.create(model=LLM, messages=messages, max_tokens=12,
                                              temperature=0.0, extra_body=extra)

    plain, adapted = chat(), chat(lora="terse")
    assert plain.model_extra["token_ids"] != adapted.model_extra["token_ids"]
    assert plain.model_extra["lora"] is None and adapted.model_extra["lora"]["name"] == "terse"
    assert adapted.model_extra["token_ids"] == chat(lora="terse").model_extra["token_ids"]
    with pytest.raises(openai.NotFoundError) as refused:
        chat(lora="nowhere")
    body = refused.value.body if isinstance(refused.value.body, dict) else {}
    assert body.get("error", body)["param"] == "lora" and "nowhere" in str(refused.value)
