"""In-batch prefix caching on a Tail-Replay cache (`sglang_ext.tail_replay.in_batch`): a waiting
request whose own hit is shallower than what a request ahead of it in the queue will leave in the
tree waits a round, as SGLang's rule does for short hits.

Target (SGLang 0.5.23): `srt/managers/schedule_policy.py::SchedulePolicy._compute_prefix_matches`.
On a cache without a Tail-Replay config the original runs. On a Tail-Replay cache the wrapper runs
the same loop (each waiting request matched against the tree, adopting the hit as SGLang's
`match_kv_cache` does; a simulated radix tree of the requests not deferred) with the rule of
`waits_for_sibling`: stock's below the check threshold, the extended one above it. SGLang's
thresholds are read from its module at each call (its environment variables set them; -1 turns
the check off), and `SGLANG_RADIX_FORCE_MISS` is honoured as there. Returns the deferred rids, which
SGLang's sort puts last.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

TARGET = "srt/managers/schedule_policy.py: SchedulePolicy._compute_prefix_matches"


def _grid(cache: Any, req: Any) -> int:
    """The grid the request's replayed tail starts on (where the states a sibling tracks lie);
    the page where the request has no record yet."""
    from sglang_ext.tail_replay import record_of

    record = record_of(req)
    return cache.planner.start_grid(record.config) if record is not None else cache.page_size


def compute_prefix_matches(policy: Any, waiting_queue: list[Any]) -> set[Any]:
    """SGLang's loop with `waits_for_sibling` (see the module docstring). Mutates: each waiting
    request's hit (`match_kv_cache`), the policy's simulated waiting-queue tree."""
    import torch
    from sglang.srt.environ import envs
    from sglang.srt.managers import schedule_policy as sp
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams, zero_match_result
    from sglang.srt.mem_cache.common import match_kv_cache
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_ext.tail_replay import waits_for_sibling

    check, deprioritize = sp.IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD, sp.IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD
    cache, deferred = policy.tree_cache, set()
    siblings = policy.waiting_queue_radix_tree
    siblings.reset()
    for r in waiting_queue:
        prefix_ids = r.origin_input_ids + r.output_ids
        match_kv_cache(r, cache, prefix_ids)
        if check < 0:
            continue
        key = RadixKey(token_ids=prefix_ids, extra_key=r.extra_key, cache_salt=r.cache_salt)
        shared = siblings.match_prefix(MatchPrefixParams(key=key))
        if envs.SGLANG_RADIX_FORCE_MISS.get():
            shared = zero_match_result(siblings, shared, extra_key=r.extra_key)
        if waits_for_sibling(r.prefix_len, shared.device_prefix_len, _grid(cache, r), check, deprioritize):
            deferred.add(r.rid)
        else:
            siblings.insert(InsertParams(key=key, value=torch.empty(len(prefix_ids), dtype=torch.bool)))
    return deferred


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def _compute_prefix_matches(self, waiting_queue, policy):
        if getattr(self.tree_cache, "tail_replay_config", None) is None:
            return original(self, waiting_queue, policy)
        return compute_prefix_matches(self, waiting_queue)

    return _compute_prefix_matches


def apply() -> None:
    from sglang.srt.managers.schedule_policy import SchedulePolicy

    SchedulePolicy._compute_prefix_matches = _wrap(SchedulePolicy._compute_prefix_matches)
