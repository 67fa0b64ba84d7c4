"""The batch-invariance switch and the seed contract: the one place these rules live.

Nothing here imports torch: these rules run at admission, before any replica
(or any accelerator) is involved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from . import envs
from .errors import InvalidRequestError
from .sampling import GENERATOR_HINT, MAX_SEED, MIN_SEED, is_valid_seed, seed_range_message

__all__ = ["MAX_SEED", "MIN_SEED", "STAGES", "SeedContractError", "resolve_batch_invariant", "validate_seed_contract"]

Stage = Literal["llm", "diffusion"]
STAGES: tuple[Stage, ...] = ("llm", "diffusion")


@dataclass(frozen=True)
class Switches:
    """Each stage's batch-invariance switch, resolved (`resolve_batch_invariant`): what an app runs with."""

    llm: bool
    diffusion: bool

    def of(self, stage: Stage) -> bool:
        return self.llm if stage == "llm" else self.diffusion


#: vLLM's global switch; each stage follows it unless its own variable is set.
GLOBAL_SWITCH = "VLLM_BATCH_INVARIANT"
#: Each stage's own switch, overriding the global one in either direction.
STAGE_SWITCHES: dict[str, str] = {
    "llm": "OMNI_LLM_BATCH_INVARIANT",
    "diffusion": "OMNI_DIFFUSION_BATCH_INVARIANT",
}


class SeedContractError(InvalidRequestError):
    """A request breaks the seed contract that batch invariance relies on (a 400 naming the first field)."""

    def __init__(self, violations: list[str], param: str | None = None):
        self.violations = list(violations)
        super().__init__("batch invariance is on: " + "; ".join(self.violations), param=param, code="seed_contract")

    def __reduce__(self):
        # Crossing a Ray boundary pickles the error: rebuild it from its fields, not from args.
        return (type(self), (self.violations, self.param))


def resolve_batch_invariant(
    stage: str,
    environ: Mapping[str, str] | None = None,
    override: bool | None = None,
) -> bool:
    """Decide whether `stage` runs batch-invariant.

    Precedence: an explicit `override` (the app config) wins; else the stage's own
    variable; else vLLM's global `VLLM_BATCH_INVARIANT`; else off.
    """
    if stage not in STAGE_SWITCHES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {sorted(STAGE_SWITCHES)}")
    if override is not None:
        if not isinstance(override, bool):
            raise TypeError(f"override must be True, False or None, not {override!r}")
        return override
    for name in (STAGE_SWITCHES[stage], GLOBAL_SWITCH):
        if envs.is_set(name, environ):
            return envs.read(name, environ)
    return False


def _field(params: Any, name: str) -> Any:
    if isinstance(params, Mapping):
        return params.get(name)
    return getattr(params, name, None)


# Inputs that take the initial noise or the trajectory out of the seed's hands.
_SEED_OVERRIDES = {
    "generator": GENERATOR_HINT,
    "generator_device": "generator_device changes the noise stream; the seed alone must decide it",
    "latents": "caller latents mean the seed no longer decides the initial noise",
    "sigmas": "caller sigmas rewrite the schedule the seeded trajectory follows",
}


def validate_seed_contract(params: Any, *, batch_invariant: bool) -> None:
    """Raise SeedContractError listing every violation when invariance is on.

    `params` is a sampling-params model, a mapping, or any object with the fields.
    Greedy LLM requests (temperature 0) draw no random numbers, so they need no seed.
    With invariance off this accepts whatever the model accepts.
    """
    if not batch_invariant:
        return
    violations: list[str] = []
    first: str | None = None
    seed = _field(params, "seed")
    greedy = _field(params, "temperature") == 0
    if seed is None:
        if not greedy:
            violations.append("seed is required: pass an integer seed")
            first = "seed"
    elif not is_valid_seed(seed):
        violations.append(seed_range_message(seed))
        first = "seed"
    for name, why in _SEED_OVERRIDES.items():
        if _field(params, name) is not None:
            violations.append(f"{name} is not allowed: {why}")
            first = first or name
    if violations:
        raise SeedContractError(violations, param=first)
