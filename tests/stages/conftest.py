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


#: Every engine: each family with the kernels on, the trained default, each family's control (kernels off).
ENGINES = [
    *(pytest.param((model, True), id=f"{name}-on") for name, model in FAMILIES.items()),
    pytest.param((TRAINED, True), id="trained-on"),
    *(pytest.param((model, False), id=f"{name}-control") for name, model in FAMILIES.items()),
]
#: A check that is not of batch invariance (bits against diffusers, scheduling, bookkeeping) runs on these only:
#: `@pytest.mark.parametrize("engine", ENGINES_ON, indirect=True)` (no control engine to skip on).
ENGINES_ON = [p for p in ENGINES if p.values[0][1]]
#: The families that pack sizes into one denoiser call (FLUX, Qwen-Image), on and control.
ENGINES_PACKING = [p for p in ENGINES if p.values[0][0] in (FLUX, QWEN)]


@pytest.fixture(scope="module", params=ENGINES)
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
