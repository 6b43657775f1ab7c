"""LinearKV, at admission: every round's state slots budgeted, LinearKV loads included.

Target (SGLang 0.5.23): `srt/managers/schedule_policy.py::PrefillAdder.__init__` and
`PrefillAdder.add_one_req`. Only where the adder's tree cache is LinearKV's (it has
`open_admission_round`); every other adder passes untouched.

As a round begins, the cache opens its budget (`sglang_ext.linearkv.admission.RoundBudget`: SGLang's
`rem_mamba_slots` where SGLang keeps one, else SGLang's formula). Each request the round admits is
debited the state slots it takes in the round (its own, its ping-pong slots; the part SGLang
debits itself is left to it); a request they do not fit is answered NO_TOKEN before it is
admitted, as SGLang answers its own full budget (the scheduler frees a slot its match took and
tries again next round). A LinearKV load inside the admission debits the states its kept chunk
locks take out of the pool, or is declined (`sglang_ext.linearkv.assembly`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

TARGET = "srt/managers/schedule_policy.py: PrefillAdder.__init__, PrefillAdder.add_one_req"


def _wrap_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        open_round = getattr(self.tree_cache, "open_admission_round", None)
        if open_round is not None:
            open_round(self)

    return __init__


def _wrap_add_one_req(original: Callable) -> Callable:
    @functools.wraps(original)
    def add_one_req(self, req, *args, **kwargs):
        budget = getattr(self.tree_cache, "admission", None)
        if budget is None or budget.adder is not self:
            return original(self, req, *args, **kwargs)
        from sglang.srt.managers.schedule_policy import AddReqResult

        need = self.tree_cache.round_slots_of(req)
        if not budget.fits(need):
            return AddReqResult.NO_TOKEN
        ours = need - budget.counted_by_sglang(own_slot_free=not req.kv.holds_mamba)
        admitted = len(self.can_run_list)
        result = original(self, req, *args, **kwargs)
        if len(self.can_run_list) > admitted and self.can_run_list[-1] is req:
            budget.debit(ours)
        return result

    return add_one_req


def apply() -> None:
    from sglang.srt.managers.schedule_policy import PrefillAdder

    PrefillAdder.__init__ = _wrap_init(PrefillAdder.__init__)
    PrefillAdder.add_one_req = _wrap_add_one_req(PrefillAdder.add_one_req)
