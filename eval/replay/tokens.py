"""Turn a block trace into the token sequences a live server is sent (pure: numpy only).

A `Trace` (from `eval.trace_sim.loaders`) describes each request as a path of prefix-chained
blocks. Scaling replaces every block by `tokens_per_block` synthetic token ids drawn
deterministically from the block's id (a splitmix64 hash of (seed, block id, position in the
block)), uniformly in [TOKEN_LO, TOKEN_HI). Hence:

* equal block => equal tokens, so two requests with a common block prefix share exactly
  `shared_blocks * tokens_per_block` leading tokens (the prefix chains of the trace become
  token prefixes);
* different blocks get independent tokens (two different blocks can still agree on their first
  token by chance, p = 1 / (TOKEN_HI - TOKEN_LO); the ideal and LRU references are computed on the
  tokens themselves, so such accidental matches are counted the same way the server counts them).

Every block is scaled to the same size, including a trace's partial last block (Mooncake's
`input_length` is not a multiple of 512), so a request's length is `blocks * tokens_per_block`.
Block ids are the loader's dense ids, a one-to-one renaming of the trace's hash ids (for
kv-cache-tester with the tools+system prefix mapped to one shared id space).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eval.trace_sim.trace import NO_BLOCK, Trace

#: synthetic ids avoid the lowest ids (special tokens of the tiny fixtures) and stay inside any
#: vocabulary of >= 500 ids (the tiny fixtures have 512)
TOKEN_LO, TOKEN_HI = 10, 500

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True)
class ScaledRequest:
    """One request to send: `tokens` is the prompt; `index` its position in the replay order."""

    index: int
    time: float
    session: int
    blocks: int
    tokens: tuple[int, ...]
    #: typed spans [start, end, token type] of the prompt (runs of equal block type, "unknown"
    #: left out): what `--typed` sends as `sampling_params.custom_params.token_types`
    spans: tuple[tuple[int, int, str], ...] = ()


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def block_tokens(block_ids: np.ndarray, tokens_per_block: int, seed: int = 0) -> np.ndarray:
    """Token ids for a sequence of blocks: shape (len(block_ids) * tokens_per_block,), each
    block's `tokens_per_block` ids a pure function of (seed, block id, offset)."""
    if tokens_per_block < 1:
        raise ValueError(f"--tokens-per-block must be >= 1, got {tokens_per_block}")
    ids = np.asarray(block_ids, dtype=np.uint64)
    offsets = np.arange(tokens_per_block, dtype=np.uint64)
    with np.errstate(over="ignore"):
        keys = _splitmix64(ids * np.uint64(0x100000001B3) ^ np.uint64(seed & 0xFFFFFFFF))
        mixed = _splitmix64(keys[:, None] + offsets[None, :])
    tokens = TOKEN_LO + (mixed % np.uint64(TOKEN_HI - TOKEN_LO)).astype(np.int64)
    return tokens.reshape(-1)


def block_path(trace: Trace, last_block: int) -> np.ndarray:
    """Root-to-leaf block ids ending at `last_block` (empty for NO_BLOCK)."""
    path = []
    block = int(last_block)
    while block != NO_BLOCK:
        path.append(block)
        block = int(trace.parent[block])
    return np.asarray(path[::-1], dtype=np.int64)


def scale_trace(trace: Trace, tokens_per_block: int, limit: int | None = None,
                seed: int = 0) -> list[ScaledRequest]:
    """The first `limit` requests of `trace` (time order) that have at least one block, as token
    sequences. Requests without a block (a kv-cache-tester turn under 64 tokens) are skipped:
    they have no hash to synthesise from."""
    out: list[ScaledRequest] = []
    for request in trace.requests:
        if limit is not None and len(out) >= limit:
            break
        if request.last_block == NO_BLOCK:
            continue
        path = block_path(trace, request.last_block)
        tokens = block_tokens(path, tokens_per_block, seed)
        out.append(ScaledRequest(index=len(out), time=request.time, session=request.session,
                                 blocks=len(path), tokens=tuple(int(t) for t in tokens),
                                 spans=typed_spans(trace.block_type[path], tokens_per_block)))
    return out


def typed_spans(block_types: np.ndarray, tokens_per_block: int) -> tuple[tuple[int, int, str], ...]:
    """Runs of equal block type as token spans (TOKEN_TYPES names), "unknown" runs left out."""
    from sglang_ext.eviction import TOKEN_TYPES

    spans, start = [], 0
    types = [int(t) for t in block_types]
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            name = TOKEN_TYPES[types[start]]
            if name != "unknown":
                spans.append((start * tokens_per_block, i * tokens_per_block, name))
            start = i
    return tuple(spans)
