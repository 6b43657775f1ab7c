"""Tail-Replay state bound: each request's replayed-tail log-decay, from its linear layers' own gates,
for every registered linear-layer kind (`sglang_ext.tail_replay.linear_kinds`).

Targets (SGLang 0.5.23): each registered kind's replay path, one wrapper per SGLang call however
many kinds go through it: GDN `srt/layers/radix_linear_attention.py::RadixLinearAttention.forward`;
Mamba-2 `srt/layers/attention/hybrid_linear_attn_backend.py::Mamba2AttnBackend.forward` and
`srt/layers/attention/mamba/mamba.py: mamba_chunk_scan_combined` (after `patches/cpu/mamba2.py`,
which rebinds that global on CPU). A kind's `GateSeam.scope` call opens the running layer's scope
for an extend batch holding approximate replays' tails (`patches/tail_replay/batch.py::
bound_segments_of`) or rows computed after an approximate start (`carry_segments_of`); its
`GateSeam.gates` call (the same call or a nested one) hands over the gate inputs, and the kind's
`BoundHook.log_decay` of those rows only is added into each request's record
(`BoundSegments.accumulate`: one gather and one segment sum per layer, no host sync), then the
carried rows' provenance bounds (`CarrySegments.accumulate`: one gather, one cumsum per request).

Not covered: extends inside a prefill CUDA graph where a seam says `outside_prefill_graph` (GDN:
the forward is only captured there); layers a kind's `gates` does not recognise (KDA through
GDN's class). Such a request's bound is reported as None, since its sums then miss tokens
(`provenance.forward.summarize`). Where the running forward's batch has no row to bound
(`patches/tail_replay/forward_scope.py`, set per `ModelRunner.forward`) a wrapper calls straight
through, before any kind parses its call; outside a `ModelRunner.forward` it does so while no
remembered batch has one (`batch.any_bound_rows`). The wrappers read the registry on every call: a kind registered later
at an already wrapped target is served, an unregistered one is passed through.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_ext.patches.tail_replay.batch import any_bound_rows, bound_segments_of, carry_segments_of
from sglang_ext.patches.tail_replay.forward_scope import forward_bound_rows
from sglang_ext.tail_replay import (
    BoundSegments,
    CarrySegments,
    Gates,
    LinearKind,
    Scope,
    linear_seam_owner,
    linear_seam_targets,
    linear_seams_at,
)

TARGET = ("every registered linear kind's replay path (sglang_ext.tail_replay.linear_kinds): "
          "srt/layers/radix_linear_attention.py: RadixLinearAttention.forward (GDN), "
          "srt/layers/attention/hybrid_linear_attn_backend.py: Mamba2AttnBackend.forward and "
          "srt/layers/attention/mamba/mamba.py: mamba_chunk_scan_combined (Mamba-2)")

#: set on the installed wrappers, so `apply()` is idempotent
MARK = "_sglang_ext_tail_bound"


@dataclass(frozen=True)
class OpenScope:
    """The layer running now: which kinds opened its scope, its segments and carries, its id."""

    kinds: frozenset[str]
    segments: BoundSegments | None
    carries: CarrySegments | None
    layer_id: int
    layer: Any


_CURRENT: contextvars.ContextVar[OpenScope | None] = contextvars.ContextVar("sglang_ext_tail_bound", default=None)


def open_scope(kinds: frozenset[str], scope: Scope) -> OpenScope | None:
    """The layer's scope, or None where its batch has no row to bound (not an extend, a target
    verify, no approximate tail and no carried row)."""
    mode = scope.forward_batch.forward_mode
    if not mode.is_extend() or mode.is_target_verify():
        return None
    segments, carries = bound_segments_of(scope.forward_batch), carry_segments_of(scope.forward_batch)
    if segments is None and carries is None:
        return None
    return OpenScope(kinds, segments, carries, int(scope.layer_id), scope.layer)


def accumulate_bound(kind: LinearKind, scope: OpenScope, gates: Gates) -> bool:
    """Add this batch's replayed-tail log-decay at the scope's layer into the requests' records,
    then the carried rows' provenance bounds. Returns whether anything was added. May mutate: the
    records' `TailDecay` and carry bounds (through the segments)."""
    values = gates.values.reshape(-1, gates.values.shape[-1])
    if values.shape[-1] != kind.hook.heads(gates.params):
        return False
    added = False
    for segments in (scope.segments, scope.carries):
        if segments is not None and values.shape[0] >= segments.end:
            segments.accumulate(scope.layer_id, kind.hook.log_decay(values.index_select(0, segments.rows), gates.params))
            added = True
    return added


@functools.cache
def _prefill_graph_scope() -> Callable[[], bool]:
    from sglang.srt.model_executor.runner_utils.prefill_graph import is_in_prefill_graph_scope

    return is_in_prefill_graph_scope


def _in_prefill_graph() -> bool:
    return bool(_prefill_graph_scope()())


def _hook(target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> contextvars.Token | None:
    """The bound hook of one call at `target`: opens its layer's scope (returned as the token to
    reset after the call) and adds its gates' log-decay. May mutate: the context's open scope."""
    here = [(kind, seam) for kind, seam in linear_seams_at(target)
            if not (seam.outside_prefill_graph and _in_prefill_graph())]
    token = None
    scopes = [(kind, found) for kind, seam in here if seam.scope is not None
              for found in (seam.scope(args, kwargs),) if found is not None]
    if scopes:
        opened = open_scope(frozenset(kind.name for kind, _ in scopes), scopes[0][1])
        if opened is not None:
            token = _CURRENT.set(opened)
    current = _CURRENT.get()
    if current is not None:
        for kind, seam in here:
            if seam.gates is not None and kind.name in current.kinds:
                gates = seam.gates(args, kwargs, current.layer)
                if gates is not None:
                    accumulate_bound(kind, current, gates)
                    break   # a layer is one kind's
    return token


def _wrap(original: Callable, target: str) -> Callable:
    @functools.wraps(original)
    def seam(*args: Any, **kwargs: Any) -> Any:
        bounded = forward_bound_rows()   # the running forward's batch, where a ModelRunner.forward runs
        if bounded is False or (bounded is None and not any_bound_rows()):
            return original(*args, **kwargs)   # nothing to sum
        token = _hook(target, args, kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            if token is not None:
                _CURRENT.reset(token)

    setattr(seam, MARK, True)
    return seam


def install(target: str) -> bool:
    """Wrap the function or instance method at `target` ("module:Attr.path") once; returns whether
    it was wrapped now. May mutate: the target's owner (a module global or a class attribute)."""
    owner, attr = linear_seam_owner(target)
    if inspect.isclass(owner) and isinstance(inspect.getattr_static(owner, attr), (staticmethod, classmethod)):
        raise ValueError(f"linear bound seam {target!r}: wrap a function or an instance method")
    original = getattr(owner, attr)
    if getattr(original, MARK, False):
        return False
    setattr(owner, attr, _wrap(original, target))
    return True


def apply() -> None:
    for target in linear_seam_targets():
        install(target)
