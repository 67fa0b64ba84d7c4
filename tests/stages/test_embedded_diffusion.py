"""The embedded tiny diffusion pipelines: deterministic builds, a build-once cache, seeded generation."""

import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from stages.embedded import EMBEDDED_MODELS, MARKER, diffusion, embedded_models
from stages.embedded.diffusion import (
    KINDS,
    MODEL_IDS,
    RECIPE_VERSION,
    SEED,
    load_tiny_pipeline,
    tiny_pipeline_path,
    weights_fingerprint,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def marker(directory: Path) -> dict:
    return json.loads((directory / MARKER).read_text())


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One cache root for the tests that need the pipelines built, not built fresh."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMNISERVE_CACHE", str(tmp_path_factory.mktemp("omniserve-cache")))
        yield


#: The kinds that render images (the video one, "wan": tests/stages/test_video_engine.py).
IMAGE_KINDS = tuple(kind for kind in KINDS if not EMBEDDED_MODELS[MODEL_IDS[kind]].video)

@pytest.fixture(scope="module")
def pipelines(shared_cache):
    return {kind: load_tiny_pipeline(kind) for kind in KINDS}


def generate(pipe, prompt, seed, size=64, steps=2):
    generator = torch.Generator("cpu").manual_seed(seed)
    # PixArt would otherwise render at its nearest aspect-ratio bin and resize.
    binning = (
        {"use_resolution_binning": False}
        if "use_resolution_binning" in inspect.signature(pipe.__call__).parameters
        else {}
    )
    output = pipe(
        prompt, height=size, width=size, num_inference_steps=steps, generator=generator, output_type="np", **binning
    )
    return output.images


def test_tiny_pipeline_kinds_are_the_registrys_diffusion_models():
    entries = {kind: EMBEDDED_MODELS[MODEL_IDS[kind]] for kind in KINDS}
    audited = {entry.id for entry in entries.values() if not (entry.fallback or entry.video)}
    assert audited == set(embedded_models("diffusion"))
    assert MODEL_IDS["pixart"] not in embedded_models("diffusion")  # the fallback's model: no family, no audit
    assert MODEL_IDS["wan"] not in embedded_models("diffusion")  # video: not in the image audits and benchmarks
    assert all(EMBEDDED_MODELS[MODEL_IDS[kind]].recipe == kind for kind in KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_pipeline_build_is_deterministic_across_fresh_cache_roots(kind, tmp_path, monkeypatch):
    built = []
    for root in ("first", "second"):
        monkeypatch.setenv("OMNISERVE_CACHE", str(tmp_path / root))
        built.append(tiny_pipeline_path(kind))
    first, second = built
    assert first != second
    assert marker(first)["weights_sha256"] == marker(second)["weights_sha256"]
    # The marker states what is on disk.
    assert weights_fingerprint(first) == marker(first)["weights_sha256"]
    record = marker(first)
    assert (record["kind"], record["model_id"], record["seed"], record["recipe_version"]) == (
        kind,
        MODEL_IDS[kind],
        SEED,
        RECIPE_VERSION,
    )
    assert {"torch", "diffusers", "transformers"} <= set(record["versions"])


def test_tiny_pipeline_build_leaves_the_callers_global_rng_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNISERVE_CACHE", str(tmp_path))
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    tiny_pipeline_path("unet")
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_pipeline_cache_is_reused_not_rebuilt(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNISERVE_CACHE", str(tmp_path))
    path = tiny_pipeline_path(kind)
    written = (path / MARKER).stat().st_mtime_ns

    def refuse_to_build(kind):
        raise AssertionError("a complete build is present: nothing should be built")

    monkeypatch.setattr(diffusion, "_build", refuse_to_build)
    assert tiny_pipeline_path(kind) == path
    assert (path / MARKER).stat().st_mtime_ns == written
    load_tiny_pipeline(kind)


def test_tiny_pipeline_build_that_loses_the_race_is_discarded(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNISERVE_CACHE", str(tmp_path))
    build = diffusion._build
    winner = {}

    def build_while_another_replica_finishes_first(kind):
        monkeypatch.setattr(diffusion, "_build", build)
        # The other replica: its rename lands while we are still building.
        winner["path"] = tiny_pipeline_path(kind)
        winner["marker_mtime"] = (winner["path"] / MARKER).stat().st_mtime_ns
        return build(kind)

    monkeypatch.setattr(diffusion, "_build", build_while_another_replica_finishes_first)
    path = tiny_pipeline_path("dit")
    assert path == winner["path"]
    assert (path / MARKER).stat().st_mtime_ns == winner["marker_mtime"]  # the winner's build, untouched
    assert weights_fingerprint(path) == marker(path)["weights_sha256"]
    assert [entry.name for entry in tmp_path.iterdir()] == [path.name]  # no staging directory left behind


def test_tiny_pipeline_built_in_a_distributed_rank_other_than_0_is_refused_not_cached(tmp_path, monkeypatch):
    # transformers writes a model on rank 0 of an initialized torch.distributed group only: a parallel render's
    # worker building the cache saved empty text encoder directories, and that build was cached (measured
    # 2026-12-06: every later load of tiny-sd3-dit failed). Here rank 1 of a group, as transformers reads it.
    import transformers.distributed.mixin as mixin

    monkeypatch.setenv("OMNISERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    with pytest.raises(RuntimeError, match="saved nothing for text_encoder, text_encoder_2"):
        tiny_pipeline_path("dit")
    assert list(tmp_path.iterdir()) == []  # nothing cached, no staging directory left


def test_tiny_pipeline_leftover_of_a_crashed_build_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNISERVE_CACHE", str(tmp_path))
    target = tmp_path / f"{MODEL_IDS['unet'].replace('/', '--')}-v{RECIPE_VERSION}"
    target.mkdir()
    (target / "half-written.safetensors").write_bytes(b"")  # no marker: a build that died midway
    assert tiny_pipeline_path("unet") == target
    assert not (target / "half-written.safetensors").exists()
    assert weights_fingerprint(target) == marker(target)["weights_sha256"]
    assert [entry.name for entry in tmp_path.iterdir()] == [target.name]


@pytest.mark.slow
def test_tiny_pipeline_two_processes_building_at_once_share_one_complete_build(tmp_path):
    go = tmp_path / "go"
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from stages.embedded.diffusion import tiny_pipeline_path\n"
        "Path(sys.argv[1]).touch()\n"
        "while not Path(sys.argv[2]).exists(): time.sleep(0.01)\n"
        "print(tiny_pipeline_path('unet'))\n"
    )
    env = {**os.environ, "OMNISERVE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    replicas = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(flag), str(go)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for flag in ready
    ]
    deadline = time.monotonic() + 120
    while not all(flag.exists() for flag in ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()  # both imported: release them together
    outputs = [replica.communicate(timeout=120) for replica in replicas]
    assert all(replica.returncode == 0 for replica in replicas), [err[-2000:] for _, err in outputs]

    paths = {Path(out.strip().splitlines()[-1]) for out, _ in outputs}
    assert len(paths) == 1
    (path,) = paths
    assert weights_fingerprint(path) == marker(path)["weights_sha256"]
    assert [entry.name for entry in (tmp_path / "cache").iterdir()] == [path.name]


def test_tiny_pipeline_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown tiny pipeline kind"):
        tiny_pipeline_path("vqgan")


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind not in ("pixart", "qwen", "wan")])  # CLIP's tokenizer
def test_tiny_pipeline_tokenizer_takes_any_text_and_truncates_to_77(kind, pipelines):
    tokenizer = pipelines[kind].tokenizer
    long_prompt = "Ünïcode, emoji 🦊 and\ttabs! " * 10
    ids = tokenizer(long_prompt, padding="max_length", max_length=77, truncation=True).input_ids
    assert len(ids) == 77
    assert (ids[0], ids[-1]) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert tokenizer.unk_token_id not in ids[1:-1]


def test_tiny_qwen_tokenizer_takes_any_text_and_its_template_prefix_is_the_34_tokens_the_pipeline_drops(pipelines):
    pipe = pipelines["qwen"]
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    text = "Ünïcode, emoji 🦊 and\ttabs!"
    ids = pipe.tokenizer(text).input_ids
    assert pipe.tokenizer.decode(ids) == text  # byte-level: nothing unknown, nothing lost
    template = pipe.tokenizer(pipe.prompt_template_encode.format(text)).input_ids
    assert template[34 : 34 + len(ids)] == ids  # what the encoder keeps is the prompt's own tokens, then the suffix


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_pipeline_loads_every_component_in_the_requested_dtype(kind, shared_cache):
    pipe = load_tiny_pipeline(kind, dtype=torch.bfloat16)
    modules = [component for component in pipe.components.values() if isinstance(component, torch.nn.Module)]
    assert {parameter.dtype for module in modules for parameter in module.parameters()} == {torch.bfloat16}


@pytest.mark.slow
@pytest.mark.parametrize("kind", IMAGE_KINDS)
def test_tiny_pipeline_generates_the_same_64x64_image_twice_for_one_seed(kind, pipelines):
    first = generate(pipelines[kind], "a red fox in the snow", seed=42)
    second = generate(pipelines[kind], "a red fox in the snow", seed=42)
    assert first.shape == (1, 64, 64, 3)
    assert np.isfinite(first).all() and first.std() > 0
    assert np.array_equal(first, second)
    assert not np.array_equal(first, generate(pipelines[kind], "a red fox in the snow", seed=43))


@pytest.mark.slow
@pytest.mark.parametrize("size", [128, 256])
@pytest.mark.parametrize("kind", IMAGE_KINDS)
def test_tiny_pipeline_serves_larger_square_sizes(kind, size, pipelines):
    assert generate(pipelines[kind], "a lighthouse at dusk", seed=7, size=size, steps=1).shape == (1, size, size, 3)
