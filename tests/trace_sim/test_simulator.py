"""The simulator on hand-made traces with hand-computed hit counts."""

from __future__ import annotations

import pytest

from eval.trace_sim.cost_model import PrefillCostModel
from eval.trace_sim.simulate import prepare, replay
from eval.trace_sim.testing import random_paths, run, trace_from_paths
from sglang_ext.eviction import BeladyPolicy, LRUPolicy, make_policy

# A=[1,2,3], B=[1,2,4], A again: the shared prefix (1,2) is one node, 3 and 4 leaves.
HAND = [[1, 2, 3], [1, 2, 4], [1, 2, 3]]


def test_roomy_cache_hits_shared_prefix_and_repeat():
    cache = run(trace_from_paths(HAND), LRUPolicy(), capacity=4, check=True)
    assert cache.stats.prompt_blocks == 9
    assert cache.stats.hit_blocks == 0 + 2 + 3


def test_tight_cache_evicts_the_only_unlocked_leaf():
    # capacity 3: request 2 must evict leaf 3 (1,2 are locked), request 3 evicts 4.
    cache = run(trace_from_paths(HAND), LRUPolicy(), capacity=3, check=True)
    assert cache.stats.hit_blocks == 0 + 2 + 2
    assert cache.stats.evicted_blocks == 2


def test_lru_vs_belady_on_a_hand_trace():
    # leaves 3, 4, 5 under prefix (1,); capacity 3 = prefix + 2 leaves.
    paths = [[1, 3], [1, 4], [1, 5], [1, 3], [1, 4]]
    lru = run(trace_from_paths(paths), LRUPolicy(), capacity=3, check=True)
    opt = run(trace_from_paths(paths), BeladyPolicy(), capacity=3, check=True)
    # LRU: [1,5] evicts 3 -> [1,3] misses 3 and evicts 4 -> [1,4] misses 4.
    assert lru.stats.hit_blocks == 4
    # Belady: [1,5] evicts leaf 4 (next use farther than 3's), so [1,3] hits both blocks.
    assert opt.stats.hit_blocks == 5


def test_token_accounting_and_modeled_ttft():
    cost = PrefillCostModel(a=0.5, b=0.01, c=0.0, source="test")
    trace = trace_from_paths(HAND, block_tokens=10)
    cache = replay(prepare(trace), LRUPolicy(), 10, cost)
    assert cache.stats.hit_tokens == 50 and cache.stats.prompt_tokens == 90
    assert cache.stats.ttft_s == pytest.approx([0.5 + 0.3, 0.5 + 0.1, 0.5])


def test_request_larger_than_capacity_is_partially_cached():
    cache = run(trace_from_paths([[1, 2, 3, 4], [1, 2, 3, 4]]), LRUPolicy(), capacity=2, check=True)
    assert cache.stats.hit_blocks == 2


# ----- Belady against exhaustive search over eviction choices -------------------------
class ScriptedPolicy(LRUPolicy):
    """Follows a list of choice indices among the sorted evictable keys."""

    name = "scripted-test-only"

    def __init__(self, script):
        super().__init__()
        self.script, self.branching, self.calls = list(script), [], 0

    def victim(self, now):
        options = sorted(self._evictable)
        if not options:
            return None
        choice = self.script[self.calls] if self.calls < len(self.script) else 0
        self.branching.append(len(options))
        self.calls += 1
        return options[choice]


def _all_scripts_best(trace, capacity):
    """Exhaustive: expand every decision point (the default choice 0 included)."""
    best, stack = -1, [()]
    while stack:
        script = stack.pop()
        policy = ScriptedPolicy(script)
        hits = run(trace, policy, capacity).stats.hit_blocks
        if len(policy.branching) > len(script):
            stack.extend(script + (c,) for c in range(policy.branching[len(script)]))
        else:
            best = max(best, hits)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_belady_matches_exhaustive_search(seed):
    trace = trace_from_paths(random_paths(seed, n_requests=7, alphabet=3, max_len=3))
    for capacity in (2, 3, 4):
        optimum = _all_scripts_best(trace, capacity)
        belady = run(trace, BeladyPolicy(), capacity).stats.hit_blocks
        assert belady == optimum, (seed, capacity)


@pytest.mark.parametrize("name", ["lru", "lfu", "slru", "tlru", "marconi", "sae"])
def test_online_policies_never_beat_exhaustive_optimum(name):
    for seed in range(6):
        trace = trace_from_paths(random_paths(100 + seed, n_requests=7))
        optimum = _all_scripts_best(trace, 3)
        assert run(trace, make_policy(name), 3).stats.hit_blocks <= optimum

