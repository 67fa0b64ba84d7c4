"""Pure data and rules that cross every actor boundary. Never imports torch."""

from .invariance import (
    MAX_SEED,
    MIN_SEED,
    SeedContractError,
    resolve_batch_invariant,
    validate_seed_contract,
)
from .sampling import DiffusionSamplingParams, LLMSamplingParams

__all__ = [
    "MAX_SEED",
    "MIN_SEED",
    "SeedContractError",
    "resolve_batch_invariant",
    "validate_seed_contract",
    "DiffusionSamplingParams",
    "LLMSamplingParams",
]
