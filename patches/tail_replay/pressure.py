"""Stamp each request with the pressure decision of `exactness: "exact_unless_pressed"` where
SGLang already synchronises its ranks: on the replica's first rank, before the received requests
are broadcast to the others.

Targets (SGLang 0.5.23): `srt/managers/scheduler.py::Scheduler.init_request_receiver` (the
scheduler registers its load reader for its receiver, when its Tail-Replay cache has a
`pressure` policy) and `srt/managers/scheduler_components/request_receiver.py::
SchedulerRequestReceiver._broadcast_reqs_across_ranks`. That method gets the requests the scheduler
pulled from the tokenizer on the rank that pulls them (TP / attention-TP rank 0 of pipeline stage
0; `recv_reqs` is None on every other rank) and broadcasts them with `broadcast_pyobj`; the
wrapper writes each new generate request's stamp (`sglang_ext.tail_replay.pressure.stamp`: the
thresholds met and the load seen) into its sampling params' `custom_params`, under
`PRESSURE_PARAM_KEY`, before that broadcast. Every rank then plans the request from the same stamp
(`planner.pressure_config` reads it when the request is first matched); no rank reads its own
clock or queue for it. A request is stamped once: a later pipeline stage receives it stamped and
leaves it so.

The load is SGLang's own: the waiting queue (`Scheduler.waiting_queue`: requests and their prompt
tokens, and how long its oldest request has waited, from SGLang's queue-entry stamps), plus the
requests pulled before it in the same poll, and the pool use SGLang reports
(`pool_stats_observer.get_pool_stats()`: `full_token_usage`, `mamba_usage`). It is read once per
poll that brings a generate request, not on empty polls. The decision is the request's arrival's:
a request that then waits in the queue keeps it (documented staleness).

A client cannot send the stamp: `sglang_ext.tail_replay.check_request` refuses the key with a 400
in the tokenizer process (`patches/tail_replay/request.py`), before the request reaches a scheduler.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_ext.tail_replay import LoadSample, PressurePolicy

TARGET = ("srt/managers/scheduler.py: Scheduler.init_request_receiver; srt/managers/scheduler_components/"
          "request_receiver.py: SchedulerRequestReceiver._broadcast_reqs_across_ranks")

#: id(receiver) -> (the policy, its scheduler's load reader); one scheduler per process
_ARRIVALS: dict[int, tuple[PressurePolicy, Callable[[], LoadSample]]] = {}


def stamp_arrivals(reqs: Iterable[Any], policy: PressurePolicy, load: Callable[[], LoadSample]) -> int:
    """Stamp each request of `reqs` (tokenized generate requests, in arrival order) that has no
    stamp yet: request i sees the load `load()` read once (only if a request needs a stamp) plus
    the i requests before it in `reqs`. Mutates: the requests' `sampling_params.custom_params`.
    Returns how many were stamped."""
    from sglang_ext.tail_replay import PRESSURE_PARAM_KEY, stamp

    base, ahead, ahead_tokens = None, 0, 0
    for req in reqs:
        params = req.sampling_params
        custom = params.custom_params
        if custom is not None and (not isinstance(custom, dict) or PRESSURE_PARAM_KEY in custom):
            continue   # stamped already (an earlier stage), or no object to stamp (refused on arrival)
        base = base if base is not None else load()
        seen = replace(base, num_queue_reqs=base.num_queue_reqs + ahead,
                       num_queue_tokens=base.num_queue_tokens + ahead_tokens)
        params.custom_params = {**(custom or {}), PRESSURE_PARAM_KEY: stamp(policy, seen)}
        ahead, ahead_tokens = ahead + 1, ahead_tokens + len(req.input_ids or ())
    return ahead


def oldest_wait_s(queue: Iterable[Any], now: float) -> float:
    """How long the oldest request of a waiting queue has waited (seconds, from SGLang's
    `time_stats.wait_queue_entry_time`, a `time.perf_counter` stamp; unstamped ones, 0, skipped);
    0 for an empty queue."""
    entries = [t for r in queue if (t := r.time_stats.wait_queue_entry_time) > 0.0]
    return max(0.0, now - min(entries)) if entries else 0.0


def scheduler_load(scheduler: Any) -> LoadSample:
    """The load a scheduler reports now: its waiting queue and its pools' use (SGLang's figures)."""
    from sglang_ext.tail_replay import LoadSample

    stats = scheduler.pool_stats_observer.get_pool_stats()
    queue = scheduler.waiting_queue
    return LoadSample(num_queue_reqs=len(queue), num_queue_tokens=sum(len(r.origin_input_ids) for r in queue),
                      token_usage=float(stats.full_token_usage),
                      mamba_usage=None if stats.mamba_usage is None else float(stats.mamba_usage),
                      queue_wait_s=oldest_wait_s(queue, time.perf_counter()))


def _generate_reqs(recv_reqs: Iterable[Any]) -> Iterable[Any]:
    from sglang.srt.managers.io_struct import BatchTokenizedGenerateReqInput, TokenizedGenerateReqInput

    for recv in recv_reqs:
        if isinstance(recv, TokenizedGenerateReqInput):
            yield recv
        elif isinstance(recv, BatchTokenizedGenerateReqInput):
            yield from recv.batch


def _wrap_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def init_request_receiver(self, *args, **kwargs):
        original(self, *args, **kwargs)
        config = getattr(self.tree_cache, "tail_replay_config", None)   # a Tail-Replay cache's config
        if config is not None and config.server.pressure is not None:
            _ARRIVALS[id(self.request_receiver)] = (config.server.pressure, functools.partial(scheduler_load, self))

    return init_request_receiver


def _wrap_broadcast(original: Callable) -> Callable:
    @functools.wraps(original)
    def _broadcast_reqs_across_ranks(self, recv_reqs, *args, **kwargs):
        arrivals = _ARRIVALS.get(id(self))
        if arrivals is not None and recv_reqs:   # the rank that pulled them: stamp, then broadcast
            stamp_arrivals(_generate_reqs(recv_reqs), *arrivals)
        return original(self, recv_reqs, *args, **kwargs)

    return _broadcast_reqs_across_ranks


def apply() -> None:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.request_receiver import SchedulerRequestReceiver

    Scheduler.init_request_receiver = _wrap_init(Scheduler.init_request_receiver)
    SchedulerRequestReceiver._broadcast_reqs_across_ranks = _wrap_broadcast(
        SchedulerRequestReceiver._broadcast_reqs_across_ranks)
