"""A fix to SGLang itself: under `--enable-unified-memory` with the extra buffer, admission reserves
the shared bytes of a new request's state slot but not of its tracking slots, and the extend's KV
allocation then fails under memory pressure ("Out of memory. Try to lower your batch size." from
`alloc_for_extend`, the scheduler dies).

Target (SGLang 0.5.23): `srt/managers/schedule_policy.py::PrefillAdder._mamba_gap_budget_for_req`.
On the unified pool a state slot takes bytes the KV allocator counts as free, so SGLang's prefill
adder reserves `mamba_slot_full_token_cost` tokens per slot a request will take ("Tracking buffers
and radix CoW headroom are not included here", its docstring says). A request without its
ping-pong tracking buffer yet (the extra buffer: `HybridReqToTokenPool.alloc` gives it
`mamba_initial_tracking_slots`, 1 or 2) takes those slots from the same bytes in the same
allocation: the wrapper adds them to the reserve, which also counts them against the adder's
`rem_mamba_slots`. Without the unified pool the reserve stays 0, as SGLang's. Seen on the CPU
server at 8 GiB of Qwen3-Next-80B bytes under load, on stock SGLang with `--enable-unified-memory`
and on Tail-Replay's default, which turns it on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

TARGET = "srt/managers/schedule_policy.py: PrefillAdder._mamba_gap_budget_for_req"


def tracking_slots_due(pool: Any, req: Any) -> int:
    """The tracking slots `pool.alloc` will take for `req` (0 without the extra buffer, or once the
    request holds its buffer: a continuing chunk, a retracted request brought back)."""
    if not getattr(pool, "enable_mamba_extra_buffer", False):
        return 0
    return int(pool.mamba_initial_tracking_slots) if getattr(req.kv, "mamba_ping_pong_track_buffer", None) is None else 0


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def _mamba_gap_budget_for_req(self, req, *, include_host_hit: bool = False) -> int:
        reserve = original(self, req, include_host_hit=include_host_hit)
        if not self._mamba_slot_cost:
            return reserve
        return reserve + tracking_slots_due(self.tree_cache.req_to_token_pool, req) * self._mamba_slot_cost

    return _mamba_gap_budget_for_req


def apply() -> None:
    from sglang.srt.managers.schedule_policy import PrefillAdder

    PrefillAdder._mamba_gap_budget_for_req = _wrap(PrefillAdder._mamba_gap_budget_for_req)
