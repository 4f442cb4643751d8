"""The prefix cache's keys: a hash chain over a prompt's full blocks, rooted in a namespace
(the model and its KV dtype, the tenant's cache salt, the adapter and its version). One
definition, used by the scheduler to find cached blocks and by gateways to find the worker
that holds a prompt's blocks: a chain computed with another tenant's salt matches nothing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def namespace(cache_namespace: str, cache_salt: str, lora_key: str) -> str:
    """The root namespace of one request's chain: the engine's (model, KV dtype), the
    tenant's salt and the adapter (`name@version`, or empty for the base model)."""
    return f"{cache_namespace}|{cache_salt}|{lora_key}"


def root_hash(space: str) -> bytes:
    """The chain's root for one namespace."""
    return hashlib.blake2b(space.encode(), digest_size=16).digest()


def chain_hashes(
    parent: bytes, token_ids: Sequence[int], block_size: int, start: int
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` from block index `start` on, continuing the
    chain from `parent` (the hash of block `start - 1`, or the root)."""
    out: list[bytes] = []
    for b in range(start, len(token_ids) // block_size):
        block = array("q", token_ids[b * block_size : (b + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


def block_key(block_hash: bytes) -> int:
    """A block hash as the 64-bit key the fleet's KV index uses (its first 8 bytes)."""
    return int.from_bytes(block_hash[:8], "little")


def prompt_keys(
    cache_namespace: str, cache_salt: str, lora_key: str, token_ids: Sequence[int], block_size: int
) -> list[int]:
    """The index keys of a prompt's full blocks, in order, as the engine would hash them."""
    root = root_hash(namespace(cache_namespace, cache_salt, lora_key))
    return [block_key(h) for h in chain_hashes(root, token_ids, block_size, 0)]
