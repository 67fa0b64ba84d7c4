"""Seeds: the range, the type, the server's pick, and the rule that gives each image of a request its own seed.

    s_0 = seed
    s_i = int.from_bytes(sha256(f"omniserve/seed_for_image/v1/{seed}/{i}").digest()[:8], "big") >> 11   (i >= 1)

Image i of a request is a pure function of (prompt, parameters, s_i), so a request with `n=1` and
`seed=s_i` reproduces it. Derived seeds (and seeds the server picks when a request has none) lie in
[0, 2**53 - 1]: inside [MIN_SEED, MAX_SEED], and exact as JSON numbers even in JavaScript clients.
Hashing the decimal text keeps every seed of the range distinct (no int64/uint64 wrap-around aliasing).
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Annotated, Any

from pydantic import Field, StrictInt

# The range torch.Generator.manual_seed accepts (it takes int64 and uint64 values).
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
#: A seed as every contract types it: an integer, never a bool, a string or a float (`7.0` included: integers mean
#: integers, in JSON and in every model whatever its strictness).
Seed = Annotated[StrictInt, Field(ge=MIN_SEED, le=MAX_SEED)]

#: Derived and server-picked seeds stay below 2**53: JSON numbers that every client parses exactly.
SAFE_SEED_BITS = 53
MAX_SAFE_SEED = 2**SAFE_SEED_BITS - 1
# Bump the version tag only together with a documented, deliberate change of every derived seed.
_DOMAIN = "omniserve/seed_for_image/v1"


def is_valid_seed(seed: Any) -> bool:
    """A seed is a real int (never a bool) inside [MIN_SEED, MAX_SEED]."""
    return isinstance(seed, int) and not isinstance(seed, bool) and MIN_SEED <= seed <= MAX_SEED


def seed_range_message(seed: Any) -> str:
    return f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}], got {seed!r}"


def seed_for_image(seed: int, index: int) -> int:
    """The seed of image `index` of a request whose seed is `seed` (index 0 keeps `seed` itself)."""
    if not is_valid_seed(seed):
        raise ValueError(seed_range_message(seed))
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be a non-negative integer, got {index!r}")
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{_DOMAIN}/{seed}/{index}".encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SAFE_SEED_BITS)


def seeds_for_request(seed: int, n: int) -> list[int]:
    """[s_0, ..., s_{n-1}] for a request of `n` images."""
    return [seed_for_image(seed, i) for i in range(n)]


def pick_seed() -> int:
    """A fresh seed for a request that has none (only allowed with that stage's invariance off)."""
    return secrets.randbits(SAFE_SEED_BITS)


def seed_or_picked(seed: int | None) -> int:
    """The one rule for a request without a seed: the server picks one and reports it, so the result can be reproduced
    (with the stage's invariance on the seed contract refuses such a request before it gets here)."""
    return seed if seed is not None else pick_seed()
