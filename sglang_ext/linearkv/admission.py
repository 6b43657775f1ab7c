"""The state slots of one admission round (pure core: no SGLang import).

SGLang admits a round's requests in its `PrefillAdder` and takes their state slots afterwards, all
at once (`alloc_req_slots`, which asserts when the pool cannot give them). With the unified memory
pool it budgets those slots in the round (`PrefillAdder.rem_mamba_slots`: free slots plus the tree's
evictable states when the round began, debited by each admitted request's own state slot); with
the plain state pool it keeps no budget at all and relies on every tree state being evictable.
A LinearKV load breaks that: it takes its request's state and ping-pong slots at the load, and
keeps chunk states locked (unevictable) until the request's first forward has read them, so plain
requests, audits or repairs admitted in the same round could find the pool exhausted.

On `--radix-cache-backend linearkv` every round therefore has a `RoundBudget`: SGLang's own where
it keeps one (the same counter, `rem_mamba_slots`), else one started by SGLang's formula. Every
admitted request is debited the state slots it takes in the round (its own state slot and, under
`extra_buffer`, its ping-pong slots), a request that does not fit is not admitted this round (as
SGLang answers a full budget), and a LinearKV load is debited the evictable states its kept
locks take out of the pool, or declined (served as a plain prefill) when they do not fit.
"""

from __future__ import annotations

from typing import Any


class RoundBudget:
    """State slots one round can still give. May be mutated by: `debit` (the admission seam, the
    LinearKV load); where SGLang keeps the budget (`adder.rem_mamba_slots` not None), that
    attribute is the counter."""

    def __init__(self, adder: Any, start: int):
        self.adder = adder
        self.sglang_keeps = getattr(adder, "rem_mamba_slots", None) is not None
        self._remaining = start
        #: slots debited in the round (requests admitted, loads' locks): the round's accounting
        self.debited = 0

    @property
    def remaining(self) -> int:
        return int(self.adder.rem_mamba_slots) if self.sglang_keeps else self._remaining

    def fits(self, slots: int) -> bool:
        return slots <= self.remaining

    def debit(self, slots: int) -> None:
        if slots <= 0:
            return
        self.debited += slots
        if self.sglang_keeps:
            self.adder.rem_mamba_slots -= slots
        else:
            self._remaining -= slots

    def counted_by_sglang(self, own_slot_free: bool) -> int:
        """Slots of a request SGLang debits from its own budget by itself: its own state slot when
        it held none as its admission began (`_mamba_gap_budget_for_req`); none without a budget."""
        return int(self.sglang_keeps and own_slot_free)


def round_slots(holds_state: bool, in_session: bool, tracking_slots: int) -> int:
    """State slots a request takes from the round's pool: its own (unless a streaming session
    held it before the round; a slot taken at this round's match counts, as the round began
    before it) and its ping-pong slots not yet taken."""
    own = 0 if holds_state and in_session else 1
    return own + tracking_slots
