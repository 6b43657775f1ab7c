"""Tree nodes as SAE sees them: a node's content key (the digest of its tokens from the root,
so an evicted node inserted again is the same key) and its description (``PathNode``), and
what the policy is told about it (``entry_info``: blocks, tokens, depth, type, recompute
cost). Pure Python: the SGLang adapter builds PathNodes from tree nodes."""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ..base import EntryInfo

#: recompute cost of a token at depth d is 1 + d / ATTENTION_TOKENS (attention grows with depth)
ATTENTION_TOKENS = 8192


def content_keys(token_ids: Sequence[int], ends: Sequence[int], namespace: str = "") -> list[bytes]:
    """Digests of ``token_ids[:end]`` for each of the increasing ``ends`` (one pass)."""
    h = hashlib.blake2b(namespace.encode(), digest_size=16)
    out, pos = [], 0
    for end in ends:
        h.update(array("q", token_ids[pos:end]).tobytes())
        pos = end
        out.append(h.copy().digest())
    return out


@dataclass(frozen=True)
class PathNode:
    """A tree node as SAE sees it. ``handle``: the cache's node object (opaque here);
    ``node_id``: its id (hashable, unique while it exists); ``key``: its content key."""

    handle: object
    node_id: Hashable
    key: bytes
    start: int
    n_tokens: int


def entry_info(node: PathNode, token_type: str, block_tokens: int) -> EntryInfo:
    """What the policy is told about ``node``: ``ceil(n / block_tokens)`` blocks (at least
    one) and the recompute cost of its n tokens at its depth."""
    n = node.n_tokens
    cost = n * (1.0 + (node.start + n / 2) / ATTENTION_TOKENS)
    return EntryInfo(n_blocks=max(1, math.ceil(n / block_tokens)), n_tokens=n, start_token=node.start,
                     token_type=token_type, compute_cost=cost)
