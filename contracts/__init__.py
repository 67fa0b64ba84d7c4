"""Pure data and rules that cross every actor boundary. Never imports torch.

seeds       the seed range, the server's pick, each image's own seed
sampling    sampling params (diffusion, LLM) and every bound on their fields
invariance  the tri-state switch and the seed contract
admission   the checks every request passes (at the ingress and again in each stage)
images      an edit's input image: its bounds, decoding and size rule
config      one typed config per deployment
results     what the stages hand back
provenance  what a PNG records of how it was made: its text chunks, written and read back
scope       the verified scope as data: audit records, and whether a replica's configuration is covered
http        the HTTP API's request and response schemas
errors      typed errors, and the one pydantic-error-to-field mapping
envs        every environment variable the project reads
"""

from .invariance import SeedContractError, resolve_batch_invariant, validate_seed_contract
from .sampling import MAX_SEED, MIN_SEED, DiffusionSamplingParams, LLMSamplingParams

__all__ = [
    "MAX_SEED",
    "MIN_SEED",
    "SeedContractError",
    "resolve_batch_invariant",
    "validate_seed_contract",
    "DiffusionSamplingParams",
    "LLMSamplingParams",
]
