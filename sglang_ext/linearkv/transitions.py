"""Chunk transitions for the `compose` state rule (pure core: no SGLang import): each registered
chunk's per-layer decay (Mamba-2: exp(A sum dt) per head), keyed by a digest of the chunk's key
(its namespace, cache salt and token ids), not by the ids themselves, and held only as long as the
tree node holding the chunk's end state holds it: the adapter ties a kept transition to that node
(`node_attr`) and drops it when the node's state is freed; one kept without a node (the insert
stored no state) is dropped at once. A bound (`limit`) stays as a last guard: beyond it the least
recently kept go."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

#: transitions held at most (each a few KiB: one decay vector per Mamba-2 layer)
MAX_TRANSITIONS = 65536
#: the attribute of a tree node holding the digest of its chunk's transition
NODE_ATTR = "sglang_ext_linearkv_transition"


def transition_key(namespace: str | None, cache_salt: str | None, token_ids: Sequence[int]) -> bytes:
    """The digest a chunk's transition is kept under: blake2b-128 of its namespace, its cache
    salt and its token ids (fixed size, whatever the chunk's length)."""
    h = hashlib.blake2b(digest_size=16)
    for part in (namespace, cache_salt):
        text = "" if part is None else part
        h.update(b"\x01" if part is None else b"\x00")
        h.update(len(text.encode()).to_bytes(8, "little"))
        h.update(text.encode())
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids))
    return h.digest()


class ChunkTransitions:
    """Digest -> {layer id: decay}. May be mutated by: `keep`, `drop` (the adapter: a
    registration's end, its node's state freed)."""

    def __init__(self, limit: int = MAX_TRANSITIONS):
        self.limit = limit
        self._by_key: OrderedDict[bytes, dict[int, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def get(self, key: bytes) -> dict[int, Any] | None:
        return self._by_key.get(key)

    def keep(self, key: bytes, decays: dict[int, Any]) -> None:
        self._by_key[key] = decays
        self._by_key.move_to_end(key)
        while len(self._by_key) > self.limit:
            self._by_key.popitem(last=False)

    def drop(self, key: bytes | None) -> None:
        if key is not None:
            self._by_key.pop(key, None)

    def tie(self, key: bytes, node: Any) -> None:
        """Tie a kept transition to the tree node that holds its chunk's end state (None: the
        tree holds no such state, so the transition goes). May mutate: the node's mark."""
        if node is None:
            self.drop(key)
        elif key in self._by_key:
            setattr(node, NODE_ATTR, key)

    def drop_with(self, node: Any) -> None:
        """The node's state is being freed: its transition goes with it. May mutate: the node's mark."""
        key = getattr(node, NODE_ATTR, None)
        if key is not None:
            delattr(node, NODE_ATTR)
            self.drop(key)
