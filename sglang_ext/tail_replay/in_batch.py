"""In-batch prefix caching for Tail-Replay: which waiting request waits a round for a sibling
(pure, no SGLang import).

SGLang's scheduler (cache-aware policies: `lpm`, the default, and `hrrn`, shortest-prefill-first)
defers a waiting request for one scheduling round when its cache hit is short (prefix length <=
`IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`, 32) and it shares at least
`IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD` (32) tokens with a request ahead of it in the
queue: once the one ahead is prefilled, the deferred one hits its KV and, under the extra buffer,
the states it tracked. It sorts the deferred ones last; it does not hold them out of the batch.

On a hybrid model stock's hit there is often 0 (KV in the tree, no state on the path), so the rule
applies. A Tail-Replay hit is a replayed tail of the same match (a prefix of 128 on a shared system
prompt, say), above the check threshold, so stock's rule never deferred it: conversations whose
turns arrived together each replayed the shared prompt, where stock's waited and resumed from the
state the first one stored (the default reused fewer tokens than stock on such requests under load).

`waits_for_sibling` keeps stock's rule and extends it past the threshold: a request also waits
when what it shares with a request ahead, cut to the grid its states lie on, is at least the
deprioritize threshold beyond its own hit. Every request that does not wait is a sibling for
the ones after it (stock enters only short hits).
"""

from __future__ import annotations


def waits_for_sibling(prefix_len: int, shared_len: int, grid: int, check: int, deprioritize: int) -> bool:
    """Whether a waiting request with a hit of `prefix_len` tokens, which shares `shared_len`
    tokens with a request ahead of it in the queue, is deferred behind it for this round.
    `grid`: where the sibling's states lie (the request's replay start grid, >= 1); `check` and
    `deprioritize`: SGLang's two in-batch thresholds (`check` < 0 turns the rule off, as in SGLang)."""
    if check < 0:
        return False
    if prefix_len <= check:          # stock's rule
        return shared_len >= deprioritize
    return shared_len // grid * grid - prefix_len >= deprioritize
