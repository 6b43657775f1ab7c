"""SAE decides which recurrent-state checkpoints to free, on SGLang's real pools
(Full + Mamba components from `sglang.test.kits.unified_radix_cache`), in both backends:
SGLang's default `MambaComponent` and Tail-Replay's `TailReplayMambaComponent`.

The rule (`ServerSAE.state_order`, config key `state_order: "sae"`, passed explicitly here except
where a test checks the per-backend default): states go lowest keep value first (the value SAE gives the
entry the state sits on), ties and nodes SAE does not know least recently used first; locked
states never go. The workload: a session whose conversation comes back after several one-off
requests. LRU frees the session's end state (the oldest); SAE keeps it.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_ext import patches  # noqa: E402

patches.apply_patches("cpu")  # before any SGLang import

from array import array  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.allocation import ensure_mamba_capacity  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.test.kits.unified_radix_cache import fixtures as kit  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402

from sglang_ext.eviction.base import RequestInfo  # noqa: E402
from sglang_ext.eviction.serving import PathNode, SAERequest, ServerConfig, ServerSAE  # noqa: E402
from sglang_ext.eviction.sglang_adapter import SAEStrategy, state_eviction_order, strategy_of  # noqa: E402
from sglang_ext.tail_replay import TailReplayConfig, TailReplayMambaComponent, TailReplayRadixCache  # noqa: E402
from tests.tail_replay.tree_walk import assert_slots_accounted, tree_nodes  # noqa: E402

MAMBA, FULL = ComponentType.MAMBA, ComponentType.FULL
BACKENDS = ["default", "tail_replay"]
SESSION = "conv-1"


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


class Pools:
    """A radix cache on the kit's pools (default backend or Tail-Replay) with ``policy``, and the
    scheduler's steps around it (match, lock, state reclaim, row + KV, release at finish)."""

    def __init__(self, backend: str, policy: str, *, mamba_size: int = 4, kv_size: int = 2048,
                 state_order: str | None = "sae"):
        cfg = CacheConfig(page_size=1, components=(FULL, MAMBA), kv_size=kv_size, mamba_cache_size=mamba_size,
                          max_num_reqs=2, max_context_len=512, num_layers=2, full_attention_layer_ids=(1,),
                          head_num=1, head_dim=8, mamba_intermediate_size=32, mamba_num_heads=2,
                          mamba_head_dim=16, mamba_state_size=4, eviction_policy=policy)
        if backend == "tail_replay":
            cls = type("TailReplayRadixCache", (TailReplayRadixCache,), {"tail_replay_config": TailReplayConfig()})
            with mock.patch.object(kit, "UnifiedRadixCache", cls):
                self.cache, self.alloc, self.pool = kit.build_fixture(
                    cfg, component_registry_override={MAMBA: TailReplayMambaComponent})
        else:
            self.cache, self.alloc, self.pool = kit.build_fixture(cfg)
        if policy == "sae":   # the request clock: decisions depend only on the request sequence
            config = {"clock": "requests"} if state_order is None else {"clock": "requests", "state_order": state_order}
            self.cache.tree_core.eviction_strategy = SAEStrategy(**config)
        self.kv_total = self.alloc.available_size()
        self.mamba_total = self.pool.mamba_allocator.available_size()
        self.running: list[Req] = []
        self._rid = 0

    def admit(self, tokens, session: str | None = None) -> Req:
        self._rid += 1
        custom = {"session": session} if session is not None else None
        req = Req(rid=f"r{self._rid}", origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=8, custom_params=custom))
        req.init_next_round_input(self.cache)
        req.lock = self.cache.lock(req.last_node)
        assert ensure_mamba_capacity(self.pool, [req], self.cache)
        assert self.pool.alloc([req]) is not None
        prefix = (self.cache.prefix_device_indices(req) if req.prefix_len
                  else torch.empty(0, dtype=torch.int64))
        new = self.alloc.alloc(len(tokens) - req.prefix_len)
        row = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
        self.pool.write((req.kv.req_pool_idx, slice(0, len(tokens))), row.to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = len(tokens)
        req.extend_end = len(tokens)
        self.running.append(req)
        return req

    def finish(self, req: Req) -> None:
        req.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(req, self.cache, checkpoint=True)
        self.running.remove(req)

    def run(self, tokens, session: str | None = None) -> Req:
        req = self.admit(tokens, session)
        self.finish(req)
        return req

    def state_depths(self) -> list[int]:
        """Depths (tokens) of the nodes holding a device state, sorted."""
        return sorted(d for n, d in tree_nodes(self.cache) if n.component_data[MAMBA].value is not None)

    def assert_no_leak(self) -> None:
        assert_slots_accounted(self.cache, self.pool, self.alloc, self.running, self.kv_total, self.mamba_total)
        self.cache.sanity_check()


#: a session's two turns with a one-off request between (so SAE sees the session return), then
#: one-off requests (distinct lengths 30, 31, ..., so each end state sits at its own depth), then the
#: session's third turn
TURN_1 = seq(1, 60)
TURN_2 = TURN_1 + seq(500, 20)
TURN_3 = TURN_2 + seq(600, 20)
ONE_OFFS = [seq(10_000 * (i + 1), 30 + i) for i in range(6)]


def _workload(pools: Pools) -> list[list[int]]:
    """Runs the session's first two turns and the one-offs; the state depths after each request."""
    seen = []
    for tokens, session in [(TURN_1, SESSION), (ONE_OFFS[0], None), (TURN_2, SESSION),
                            *[(doc, None) for doc in ONE_OFFS[1:]]]:
        pools.run(tokens, session)
        seen.append(pools.state_depths())
        pools.assert_no_leak()
    return seen


def _third_turn(pools: Pools) -> int:
    req = pools.admit(TURN_3, SESSION)
    matched = req.prefix_len
    pools.finish(req)
    pools.assert_no_leak()
    return matched


@pytest.mark.parametrize("backend", BACKENDS)
def test_lru_frees_the_session_end_state(backend):
    """Stock order, for comparison: four state slots; the session's end states are older than
    the one-offs', so they go, and its third turn cannot resume exactly at 80."""
    pools = Pools(backend, "lru")
    seen = _workload(pools)
    assert seen == [[60], [30, 60], [30, 60, 80], [30, 31, 60, 80], [31, 32, 60, 80], [31, 32, 33, 80],
                    [31, 32, 33, 34], [32, 33, 34, 35]]
    assert _third_turn(pools) == 0   # no state left on its path: the whole prompt is computed


@pytest.mark.parametrize("backend", BACKENDS)
def test_sae_keeps_the_end_state_of_the_session_it_expects_back(backend):
    """Under SAE, once the session has come back, the one-off requests' states go first (least
    recently used first among them), the session's end state survives, and its third turn
    resumes on it exactly."""
    pools = Pools(backend, "sae")
    seen = _workload(pools)
    assert seen == [[60], [30, 60], [30, 60, 80], [30, 31, 60, 80], [31, 32, 60, 80], [31, 33, 60, 80],
                    [31, 34, 60, 80], [31, 34, 35, 80]]
    server = strategy_of(pools.cache.tree_core).server
    assert server.stats.state_orders >= 4
    assert _third_turn(pools) == 80  # resumes exactly on the session's latest checkpoint


LRU_DEPTHS = [[60], [30, 60], [30, 60, 80], [30, 31, 60, 80], [31, 32, 60, 80], [31, 32, 33, 80],
              [31, 32, 33, 34], [32, 33, 34, 35]]


@pytest.mark.parametrize("backend, orders", [("default", False), ("tail_replay", True)])
def test_state_order_default_is_lru_on_the_default_backend_sae_under_tail_replay(backend, orders):
    """Without ``state_order`` in the config: on the default backend (a freed state takes its
    leaf) SAE leaves the state walk to SGLang, so the states go exactly as under LRU and the
    third turn misses; under Tail-Replay SAE's rule orders them (as with ``"sae"``)."""
    pools = Pools(backend, "sae", state_order=None)
    seen = _workload(pools)
    assert (seen != LRU_DEPTHS) is orders
    server = strategy_of(pools.cache.tree_core).server
    assert (server.stats.state_orders > 0) is orders
    assert _third_turn(pools) == (80 if orders else 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_lru_state_order_keeps_sglangs_walk(backend):
    pools = Pools(backend, "sae", state_order="lru")
    assert _workload(pools) == LRU_DEPTHS
    assert strategy_of(pools.cache.tree_core).server.stats.state_orders == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_sae_never_frees_a_locked_state(backend):
    """A reader locks the state SAE would free first; state pressure then takes the next one of
    SAE's order and leaves the locked state in place."""
    pools = Pools(backend, "sae", mamba_size=3)
    pools.run(TURN_1, SESSION)
    pools.run(ONE_OFFS[0])
    pools.run(ONE_OFFS[1])
    assert pools.state_depths() == [30, 31, 60]
    core = pools.cache.tree_core
    first, second, _ = state_eviction_order(core, core.lru_lists[MAMBA])
    lock = pools.cache.lock(first.id)           # a reader holds SAE's first choice
    assert first not in state_eviction_order(core, core.lru_lists[MAMBA])
    req = pools.admit(ONE_OFFS[2])              # needs a slot
    assert first.component_data[MAMBA].value is not None
    assert second.component_data[MAMBA].value is None    # the next one went instead
    pools.finish(req)
    pools.cache.unlock(lock)
    pools.assert_no_leak()


# ----- the rule itself (pure)
def _node(node_id: int, start: int, n: int) -> PathNode:
    return PathNode(handle=None, node_id=node_id, key=bytes([node_id]) * 16, start=start, n_tokens=n)


def test_state_order_is_lowest_value_first_ties_and_unknown_in_lru_order():
    server = ServerSAE(ServerConfig(block_tokens=16, clock="requests"))
    session = server.request("s1", SAERequest(session="a"), 64)
    server.referenced([_node(1, 0, 64)], ["user"], session, hit=False)
    for i in (2, 3):
        server.referenced([_node(i, 0, 64)], ["user"], server.request(f"r{i}", None, 64), hit=False)
    values = {i: server.state_keep_value(i, server.now()) for i in (1, 2, 3)}
    assert values[1] != -math.inf and server.state_keep_value(7, server.now()) == -math.inf
    order = server.state_order([7, 1, 2, 3])
    assert order[0] == 0                                       # unknown first
    ranked = sorted([1, 2, 3], key=lambda i: (values[i], [1, 2, 3].index(i)))
    assert [[7, 1, 2, 3][i] for i in order[1:]] == ranked      # then by value, ties in LRU order
    assert server.stats.state_orders == 1
    assert isinstance(session, RequestInfo)
