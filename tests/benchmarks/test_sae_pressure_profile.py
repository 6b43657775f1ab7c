"""benchmarks/sae_pressure_profile.py: the groups a profiled replay's stacks fall into."""

from __future__ import annotations

from pathlib import Path

from benchmarks.sae_pressure_profile import SAE_ALL, TR_ALL, profile

LOOP = "Scheduler.event_loop_normal (scheduler.py:1)"
MATCH = "Scheduler.get_new_batch_prefill (scheduler.py:2);UnifiedRadixCache.match_prefix (unified_radix_cache.py:3)"
TREE = "UnifiedTreeCore.match_prefix (unified_cache/unified_tree_core.py:4)"
PLAN = "MatchPlanner.apply (sglang_ext/tail_replay/matching.py:5)"
WRAPPED_FORWARD = ("ModelRunner.forward (model_runner.py:6);"
                   "_wrap_forward.<locals>.forward (patches/tail_replay/gdn_bound.py:7);GDN.forward (gdn.py:8)")


def test_tail_replay_code_the_tree_core_and_the_steps_before_the_first_token(tmp_path: Path):
    raw = tmp_path / "pyspy-0-tr.txt"
    raw.write_text("\n".join([
        f"{LOOP};{MATCH};{TREE} 7",                  # the Python tree core under the match
        f"{LOOP};{MATCH};{PLAN} 3",                  # Tail-Replay's own planning
        f"{LOOP};{WRAPPED_FORWARD} 50",              # a seam's wrapper around the forward: not its code
        f"{LOOP};Scheduler.process_batch_result_prefill (scheduler.py:9);"
        "KvPastTheState.insert (sglang_ext/tail_replay/kv_past_state.py:10) 2",
    ]) + "\n")
    got = profile(raw)
    groups = got["groups"]
    assert got["total"] == 62
    assert groups["Python tree core (UnifiedTreeCore.*)"] == 7
    assert groups[TR_ALL] == 5 and groups[SAE_ALL] == 0
    assert groups["Tail-Replay's KV past the state (second insert)"] == 2
    assert groups["before the first token: prefill scheduling (get_new_batch_prefill, with the match)"] == 10
    assert groups["before the first token: prefill result (process_batch_result_prefill, with its insert)"] == 2
    assert groups["match_prefix (all)"] == 10
