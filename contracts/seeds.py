"""Per-image seeds: the one rule that turns a request's seed into the seed of each image it asks for.

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

from .invariance import MAX_SEED, MIN_SEED, is_valid_seed

#: Derived and server-picked seeds stay below 2**53: JSON numbers that every client parses exactly.
SAFE_SEED_BITS = 53
MAX_SAFE_SEED = 2**SAFE_SEED_BITS - 1
# Bump the version tag only together with a documented, deliberate change of every derived seed.
_DOMAIN = "omniserve/seed_for_image/v1"


def seed_for_image(seed: int, index: int) -> int:
    """The seed of image `index` of a request whose seed is `seed` (index 0 keeps `seed` itself)."""
    if not is_valid_seed(seed):
        raise ValueError(f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}], got {seed!r}")
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
    """A fresh seed for a request that has none (only allowed with diffusion invariance off)."""
    return secrets.randbits(SAFE_SEED_BITS)
