"""The installed stack imports cleanly: make's set-up must leave no broken torch add-ons behind."""

import subprocess
import sys

import pytest


def test_environment_stack_imports_cleanly_in_a_fresh_interpreter():
    # A fresh process: imports cached by other tests must not hide a broken environment.
    code = (
        "from transformers import LlamaConfig, CLIPTextModel\n"
        "from diffusers import StableDiffusionPipeline, StableDiffusion3Pipeline\n"
        "import vllm, ray\n"
        "from ray import serve\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")


@pytest.mark.parametrize("name", ["torchvision", "torchaudio", "torchcodec"])
def test_environment_has_no_cuda_only_torch_addons_beside_cpu_torch(name):
    import importlib.util

    import torch

    if torch.version.cuda is not None:
        pytest.skip("a CUDA torch may carry its matching add-ons")
    if importlib.util.find_spec(name) is None:
        return
    # Present: it must at least import beside this torch.
    done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{name} is installed but broken beside CPU torch: {done.stderr[-2000:]}"


def test_environment_cli_help_works():
    done = subprocess.run([sys.executable, "-m", "cli.main", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "omniserve" in done.stdout
