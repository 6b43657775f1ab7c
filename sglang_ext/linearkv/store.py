"""Chunk cache for position-independent caching (pure core: torch only, no SGLang import).

A chunk is a run of token ids that may appear anywhere in later prompts. It is registered once,
prefilled on its own at positions 0..n-1 from a zero linear state, and stores

- per attention layer: K (post-RoPE at chunk-local positions) and V, each [kv_heads, n, head_dim];
- per linear layer: the end state (from zero) and the conv window (the last conv_kernel inputs of the
  causal conv, transformers' convention: [conv_dim, conv_kernel]);
- per linear layer, for exact composition only: the chunk's transition, i.e. the affine map's linear
  part (GDN: [H, dk, dk] fp32 product of exp(g_t)(I - beta_t k_t k_t^T); Mamba-2: [H] decay).

Chunks are keyed by content: `chunk_id(model_id, token_ids)` hashes the model identity with the
ids, so a chunk of another model (another tokenizer or weights) never matches, and looking one up
with the wrong model is refused with an error naming both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch


class ChunkReferenceError(ValueError):
    """A request names a chunk the cache cannot serve (unknown id, another model's, wrong dtype)."""


def chunk_id(model_id: str, token_ids: Sequence[int]) -> str:
    """Content key: sha256 over the model identity and the token ids (hex, 32 chars)."""
    h = hashlib.sha256(model_id.encode())
    h.update(b"\0")
    h.update(",".join(str(int(t)) for t in token_ids).encode())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class LinearLayerState:
    """One linear layer's cached quantities for one chunk (all tensors on the chunk's device).

    state: end state from a zero start (GDN [H, dk, dv] fp32; Mamba-2 [H, head_dim, d_state]).
    conv: conv window [conv_dim, conv_kernel] (the last conv_kernel conv inputs, zero-padded on the
        left when the chunk is shorter).
    transition: None, or the chunk's transition (GDN [H, dk, dk] fp32; Mamba-2 [H] fp32).
    """

    state: torch.Tensor
    conv: torch.Tensor
    transition: torch.Tensor | None = None


@dataclass(frozen=True)
class ChunkEntry:
    """A registered chunk. `kv[layer] = (K, V)`, each [kv_heads, n, head_dim], K rotated at 0..n-1."""

    chunk_id: str
    model_id: str
    token_ids: tuple[int, ...]
    dtype: torch.dtype
    kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]]
    linear: Mapping[int, LinearLayerState]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def has_transitions(self) -> bool:
        return all(s.transition is not None for s in self.linear.values())

    def nbytes(self) -> int:
        """Bytes held by this entry's tensors (the memory cost of caching it)."""
        total = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv.values())
        for s in self.linear.values():
            for t in (s.state, s.conv, s.transition):
                total += 0 if t is None else t.numel() * t.element_size()
        return total


@dataclass
class ChunkStore:
    """Chunks of one model (`model_id`, `dtype`), keyed by `chunk_id`. Not thread-safe."""

    model_id: str
    dtype: torch.dtype
    _entries: dict[str, ChunkEntry] = field(default_factory=dict)

    def __contains__(self, cid: str) -> bool:
        return cid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, token_ids: Sequence[int]) -> str:
        return chunk_id(self.model_id, token_ids)

    def add(self, entry: ChunkEntry) -> str:
        """Store `entry` (it must be this store's model and dtype); returns its id."""
        self._check(entry, where=f"chunk {entry.chunk_id}")
        if entry.chunk_id != chunk_id(entry.model_id, entry.token_ids):
            raise ChunkReferenceError(f"chunk {entry.chunk_id}: id does not match its model and token ids")
        self._entries[entry.chunk_id] = entry
        return entry.chunk_id

    def get(self, ref: str | ChunkEntry) -> ChunkEntry:
        """The entry for a chunk id (or a check of an entry handed in directly).

        Raises ChunkReferenceError naming the reference when it is unknown, belongs to another
        model, or holds another dtype than the store's."""
        if isinstance(ref, ChunkEntry):
            self._check(ref, where=f"chunk {ref.chunk_id}")
            return ref
        if not isinstance(ref, str):
            raise ChunkReferenceError(f"chunk reference {ref!r}: expected a chunk id string")
        entry = self._entries.get(ref)
        if entry is None:
            raise ChunkReferenceError(f"chunk {ref!r}: unknown id for model {self.model_id!r} "
                                      f"({len(self._entries)} chunks registered)")
        return entry

    def lookup(self, token_ids: Sequence[int]) -> ChunkEntry | None:
        return self._entries.get(self.key(token_ids))

    def _check(self, entry: ChunkEntry, where: str) -> None:
        if entry.model_id != self.model_id:
            raise ChunkReferenceError(f"{where}: belongs to model {entry.model_id!r}, not {self.model_id!r}")
        if entry.dtype != self.dtype:
            raise ChunkReferenceError(f"{where}: dtype {entry.dtype} does not match the model's {self.dtype}")
        for layer, (k, v) in entry.kv.items():
            if k.dtype != self.dtype or v.dtype != self.dtype:
                raise ChunkReferenceError(f"{where}: layer {layer} KV dtype {k.dtype}/{v.dtype}, "
                                          f"model dtype {self.dtype}")
