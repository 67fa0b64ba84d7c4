"""Fixtures shared by the stage tests."""

import pytest

from contracts.config import DiffusionStageConfig
from stages.diffusion import DiffusionRenderer
from stages.diffusion.engine import StepEngine
from stages.embedded import DEFAULT_MODELS, embedded_models
from stages.kernels import disable_batch_invariant_kernels

UNET, DIT, SDXL, FLUX, QWEN = embedded_models("diffusion")
TRAINED = DEFAULT_MODELS["diffusion"]


FAMILIES = {"unet": UNET, "sdxl": SDXL, "dit": DIT, "flux": FLUX, "qwen": QWEN}


@pytest.fixture(scope="module", params=[*((model, True) for model in FAMILIES.values()), (TRAINED, True),
                                        *((model, False) for model in FAMILIES.values())],
                ids=[*(f"{name}-on" for name in FAMILIES), "trained-on", *(f"{name}-control" for name in FAMILIES)])
def engine(request):
    """A step engine on each tiny pipeline (random weights: SD, SDXL, SD3, FLUX, Qwen-Image; and the trained default), kernels on and
    off (the control); `engine.invariant` says which."""
    model, invariant = request.param
    disable_batch_invariant_kernels()
    renderer = DiffusionRenderer(DiffusionStageConfig(model=model, batch_invariant=invariant, torch_threads=1))
    engine = StepEngine(renderer.family, max_batch_size=8, torch_threads=1)
    engine.renderer, engine.invariant = renderer, invariant
    yield engine
    engine.stop()
    disable_batch_invariant_kernels()
