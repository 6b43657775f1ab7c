"""SAE chooses which recurrent-state checkpoints SGLang's own state walk frees.

Target (SGLang 0.5.23): `srt/mem_cache/unified_cache/components/mamba.py: MambaComponent.
_evict_device_start / _evict_device_next_node / _evict_device_end`, the walk that frees state
slots least recently used first. Under SAE with the config's `state_order` `"sae"` for the default
backend (there the default is `"lru"`, which keeps SGLang's walk, see
`serving.DEFAULT_STATE_ORDER`) the walk's start orders every unlocked device state by the rule
beside the policy (`SAEStateOrder`: the state whose node SAE values least goes first; ties and
nodes SAE does not know least recently used first), and each step takes the next state of that
order that is still held and unlocked; what a step does with it is SGLang's (a state on an
evictable leaf hands back the whole leaf, otherwise the state alone goes with its cascade). Locked
states are never in the order. Other policies, HiCache and the session radix cache keep SGLang's
walk. A component whose class overrides the walk's step runs its own order: Tail-Replay's
state-only walk takes SAE's as the state order `"sae"` that the eviction wing registers
(`sglang_ext.eviction.sglang_adapter.register_state_order`, through `sglang_ext.hooks`), not here.
"""

from __future__ import annotations

import functools

TARGET = ("srt/mem_cache/unified_cache/components/mamba.py: MambaComponent._evict_device_start, "
          "_evict_device_next_node, _evict_device_end")

_ORDER = "_sae_state_order"   # the walk's SAEStateOrder, on the component


def _runs_sglangs_step(component) -> bool:
    """Whether the component's walk step is SGLang's own (this patch's wrapper)."""
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    return type(component)._evict_device_next_node is MambaComponent._evict_device_next_node


def _wrap_start(original):
    @functools.wraps(original)
    def _evict_device_start(self, request_cnt: int) -> None:
        original(self, request_cnt)
        self.__dict__.pop(_ORDER, None)
        core = self.tree_core
        if core.enable_session_radix_cache or core.enable_hicache or not _runs_sglangs_step(self):
            return
        from sglang_ext.eviction.sglang_adapter import SAEStateOrder, orders_states

        if orders_states(core, "default"):
            order = SAEStateOrder(core, self.component_type)
            order.start(request_cnt)
            self.__dict__[_ORDER] = order

    return _evict_device_start


def _wrap_next(original):
    @functools.wraps(original)
    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        order = self.__dict__.get(_ORDER)
        if order is None:
            return original(self, tracker, device_frees, host_frees, cache_actions)
        if tracker[self.component_type] >= self._evict_device_request_cnt:
            return None
        node = order.next_victim()
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
        order = self.__dict__.pop(_ORDER, None)
        if order is not None:
            order.end()   # the ordering time reaches /metrics
        return original(self)

    return _evict_device_end


def apply() -> None:
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    MambaComponent._evict_device_start = _wrap_start(MambaComponent._evict_device_start)
    MambaComponent._evict_device_next_node = _wrap_next(MambaComponent._evict_device_next_node)
    MambaComponent._evict_device_end = _wrap_end(MambaComponent._evict_device_end)
