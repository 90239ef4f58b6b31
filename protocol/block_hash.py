"""Content hashes of full KV blocks, the keys of the prefix cache.

Block i of a token sequence hashes to h_i = blake2b(h_{i-1} + its token ids as little-endian
int64, digest 16 bytes), with h_{-1} = ROOT: equal hashes mean equal tokens at equal positions
with equal history, hence equal KV. A trailing partial block has no hash. Deterministic across
processes and machines, so the router can hash a prompt to find the worker that caches it.

A request's `cache_salt` (docs/security.md, "Prefix cache side channel") replaces ROOT with
`salt_root(salt)`: every block of a salted request then hashes apart from those of any request with
another (or no) salt, so the prefix cache never shares KV, nor reveals by a hit, across salts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT = b""
_TOKEN = np.dtype("<i8")


def salt_root(cache_salt: str) -> bytes:
    """The parent of a request's first block: ROOT unsalted, else a digest of the salt (never ROOT,
    whatever the salt: a 16-byte digest cannot be the empty string)."""
    if not cache_salt:
        return ROOT
    return hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=16, person=b"pdserve-salt").digest()


def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT) -> list[bytes]:
    """One hash per full block of `token_ids`, chained from `parent` (the hash of the block before)."""
    n = len(token_ids) // block_size
    # one conversion for all blocks: per-token Python work would dominate a long prompt
    raw = np.asarray(token_ids[:n * block_size], dtype=_TOKEN).tobytes()
    step = block_size * _TOKEN.itemsize
    out: list[bytes] = []
    for i in range(n):
        parent = hashlib.blake2b(parent + raw[i * step:(i + 1) * step], digest_size=16).digest()
        out.append(parent)
    return out


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, upto_tokens: int,
                  root: bytes = ROOT) -> None:
    """Append to `hashes` (those of the leading blocks of `token_ids`, chained from `root`) the
    hashes of the further full blocks among the first `upto_tokens` tokens; a no-op when they are
    there already."""
    start, end = len(hashes) * block_size, upto_tokens // block_size * block_size
    if end > start:
        hashes.extend(block_hashes(token_ids[start:end], block_size, hashes[-1] if hashes else root))
