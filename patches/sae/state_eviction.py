"""SAE chooses which recurrent-state checkpoints to free.

Target (SGLang 0.5.23): `srt/mem_cache/unified_cache/components/mamba.py: MambaComponent.
_evict_device_start / _evict_device_next_node / _evict_device_end`, the walk that frees state
slots least recently used first, and Tail-Replay's `TailReplayMambaComponent._next_state_victim`
(its state-only walk's choice of the next state). Under SAE with the config's `state_order`
`"sae"` (the default under Tail-Replay; on the default backend the default is `"lru"`, which
keeps SGLang's walk, see `serving.DEFAULT_STATE_ORDER`) the walk's start orders every
unlocked device state by the rule beside the policy (`ServerSAE.state_order`: the state whose
node SAE values least goes first; ties and nodes SAE does not know least recently used first),
and each step takes the next state of that order that is still held and unlocked. What a step
does with it is SGLang's (default backend: a state on an evictable leaf hands back the whole
leaf, otherwise the state alone goes with its cascade) or Tail-Replay's (the state alone).
Locked states are never in the order. Other policies, HiCache and the session radix cache keep
SGLang's walk.
"""

from __future__ import annotations

import functools
from collections import deque

TARGET = ("srt/mem_cache/unified_cache/components/mamba.py: MambaComponent._evict_device_start, "
          "_evict_device_next_node, _evict_device_end; "
          "sglang_ext.tail_replay.TailReplayMambaComponent._next_state_victim")

_ORDER = "_sae_state_order"   # the walk's remaining order (a deque of nodes), on the component


def _wrap_start(original):
    @functools.wraps(original)
    def _evict_device_start(self, request_cnt: int) -> None:
        original(self, request_cnt)
        self.__dict__.pop(_ORDER, None)
        core = self.tree_core
        if core.enable_session_radix_cache or core.enable_hicache:
            return
        from sglang_ext.eviction.sglang_adapter import orders_states, state_eviction_order
        from sglang_ext.tail_replay import TailReplayMambaComponent

        if orders_states(core, "tail_replay" if isinstance(self, TailReplayMambaComponent) else "default"):
            self.__dict__[_ORDER] = deque(state_eviction_order(core, core.lru_lists[self.component_type]))

    return _evict_device_start


def _next_in_order(component):
    """The next node of the walk's order still holding an unlocked device state, or None."""
    order = component.__dict__[_ORDER]
    ct = component.component_type
    lru = component.tree_core.lru_lists[ct]
    while order:
        node = order.popleft()
        data = node.component_data[ct]
        if lru.in_list(node) and data.value is not None and data.lock_ref == 0:
            return node
    return None


def _wrap_next(original):
    @functools.wraps(original)
    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        if _ORDER not in self.__dict__:
            return original(self, tracker, device_frees, host_frees, cache_actions)
        if tracker[self.component_type] >= self._evict_device_request_cnt:
            return None
        node = _next_in_order(self)
        if node is None:
            return None
        core = self.tree_core
        if node in core.evictable_device_leaves:
            return node.id   # SGLang's rule: a leaf whose state goes is evicted whole
        kwargs = dict(tracker=tracker, device_frees=device_frees, host_frees=host_frees, cache_actions=cache_actions)
        from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

        core._evict_component_and_detach_lru(node, self, target=EvictLayer.DEVICE, **kwargs)
        core._cascade_evict(node, self, **kwargs)
        return None

    return _evict_device_next_node


def _wrap_end(original):
    @functools.wraps(original)
    def _evict_device_end(self) -> None:
        if self.__dict__.pop(_ORDER, None) is not None:
            from sglang_ext.eviction.sglang_adapter import publish_metrics, strategy_of

            publish_metrics(strategy_of(self.tree_core))   # the ordering time reaches /metrics
        return original(self)

    return _evict_device_end


def _wrap_tail_replay_next(original):
    @functools.wraps(original)
    def _next_state_victim(self):
        if _ORDER not in self.__dict__:
            return original(self)
        return _next_in_order(self)

    return _next_state_victim


def apply() -> None:
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    from sglang_ext.tail_replay import TailReplayMambaComponent

    MambaComponent._evict_device_start = _wrap_start(MambaComponent._evict_device_start)
    MambaComponent._evict_device_next_node = _wrap_next(MambaComponent._evict_device_next_node)
    MambaComponent._evict_device_end = _wrap_end(MambaComponent._evict_device_end)
    TailReplayMambaComponent._next_state_victim = _wrap_tail_replay_next(TailReplayMambaComponent._next_state_victim)
