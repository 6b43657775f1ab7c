"""Compact, policy-independent representation of a request trace.

A trace is a forest of prefix-chained blocks plus a time-ordered list of requests.
Block ids are dense ints assigned in first-seen order, so ``parent[b] < b`` always
holds; a request is fully described by the id of its last block (prefix chaining:
equal id means equal prefix), which keeps even the 71M block references of the
agentic-coding trace in a few MB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sglang_ext.eviction.base import TOKEN_TYPES

NO_BLOCK = -1
TYPE_INDEX = {name: i for i, name in enumerate(TOKEN_TYPES)}


@dataclass(frozen=True)
class Request:
    """One prefill. ``last_block`` ends the prompt path; ``output_last_block`` (or
    NO_BLOCK) ends the path after the generated tokens SGLang caches at finish."""

    time: float
    last_block: int
    prompt_tokens: int
    session: int = NO_BLOCK
    output_last_block: int = NO_BLOCK


@dataclass(frozen=True)
class Trace:
    name: str
    block_tokens: int
    parent: np.ndarray  # int64[n_blocks], NO_BLOCK for roots
    block_type: np.ndarray  # int8[n_blocks], index into TOKEN_TYPES
    requests: tuple[Request, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def n_blocks(self) -> int:
        return int(self.parent.shape[0])


class BlockTable:
    """Builds the block forest: maps (namespace, local id) keys to dense global ids."""

    def __init__(self) -> None:
        self._ids: dict[object, int] = {}
        self.parent: list[int] = []
        self.block_type: list[int] = []

    def intern_path(self, keys, types) -> int:
        """Register a root-to-leaf path of block keys; returns the last global id."""
        prev = NO_BLOCK
        for key, type_name in zip(keys, types):
            prev = self.intern(key, prev, type_name)
        return prev

    def intern(self, key, parent: int, type_name: str) -> int:
        """Global id of ``key``; a new key becomes a child of ``parent``."""
        found = self._ids.get(key)
        if found is not None:
            return found
        new_id = len(self.parent)
        self._ids[key] = new_id
        self.parent.append(parent)
        self.block_type.append(TYPE_INDEX[type_name])
        return new_id

    def known(self, key) -> bool:
        return key in self._ids

    def freeze(self, name, block_tokens, requests, notes=()) -> Trace:
        ordered = tuple(sorted(requests, key=lambda r: r.time))
        return Trace(
            name=name,
            block_tokens=block_tokens,
            parent=np.asarray(self.parent, dtype=np.int64),
            block_type=np.asarray(self.block_type, dtype=np.int8),
            requests=ordered,
            notes=tuple(notes),
        )
