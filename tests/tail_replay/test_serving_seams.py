"""The SGLang-facing adapters of the serving hardening, without a server: counters only on the
first rank of a replica (ranks faked through SGLang's own `get_parallel().override`), the request
check's per-server limits, and the plugin patching only servers that select tail_replay."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

from sglang_ext import patches

patches.apply_patches("cpu")  # before any SGLang import

import pytest  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_ext import env  # noqa: E402
from sglang_ext.patches.tail_replay import request as tail_replay_request  # noqa: E402
from sglang_ext.tail_replay.config import TailReplayConfig  # noqa: E402
from sglang_ext.tail_replay.metrics import answer_label, is_recording_rank, record_plan, replay_summary  # noqa: E402
from sglang_ext.tail_replay.planner import HitKind, ReplayPlan  # noqa: E402
from sglang_ext.tail_replay.provenance.bounds import TAINT, CarryBound  # noqa: E402
from sglang_ext.tail_replay.request import TailReplayRequest  # noqa: E402

PLAN = ReplayPlan(HitKind.APPROXIMATE, matched_tokens=100, prefix_len=90, replay_start=90)


def _matched_total() -> float:
    return REGISTRY.get_sample_value("sglang_ext:tail_replay_matched_tokens_total") or 0.0


@pytest.mark.parametrize("ranks, records", [
    ((0, 0, 0), True), ((1, 0, 0), False), ((3, 0, 0), False), ((0, 1, 0), False), ((0, 0, 1), False),
])
def test_counters_are_recorded_on_the_first_rank_only(ranks, records):
    assert is_recording_rank(*ranks) is records
    tp, cp, pp = ranks
    before = _matched_total()
    # sizes too: once another test has published a topology, override checks rank < size
    world = (tp + 1) * (cp + 1)
    with get_parallel().override(attn_tp_rank=tp, attn_tp_size=tp + 1, attn_cp_rank=cp, attn_cp_size=cp + 1,
                                 tp_size=world, moe_tp_size=world, moe_ep_size=1, moe_dp_size=1,
                                 pp_rank=pp, pp_size=pp + 1):
        record_plan(PLAN)
    assert _matched_total() - before == (100 if records else 0)


def test_request_limits_per_server(monkeypatch):
    monkeypatch.setenv(env.TAIL_REPLAY_CONFIG_VAR, '{"kv_mode": "recompute", "keep_checkpoints": false}')
    tail_replay_request._limits_for.cache_clear()
    try:
        assert tail_replay_request._limits_for("radix", "auto") is None   # not a Tail-Replay server
        config, limits = tail_replay_request._limits_for("tail_replay", "fp8_e4m3")
        assert config.knobs.kv_mode == "recompute" and limits.exact_kv_refused and limits.checkpoints_refused
    finally:
        tail_replay_request._limits_for.cache_clear()


def test_verify_refuses_through_the_servers_limits(monkeypatch):
    monkeypatch.setenv(env.TAIL_REPLAY_CONFIG_VAR, '{"keep_checkpoints": false}')
    tail_replay_request._limits_for.cache_clear()
    server = {"backend": "tail_replay"}
    monkeypatch.setattr(tail_replay_request, "_server_limits",
                        lambda: tail_replay_request._limits_for(server["backend"], "auto"))
    verify = tail_replay_request._wrap_verify(lambda self, vocab_size: None)
    try:
        for bad in ("x", {"tail_replay": {"keep_checkpoints": True}}):
            with pytest.raises(ValueError):
                verify(SamplingParams(custom_params=bad), 1000)
        verify(SamplingParams(custom_params={"tail_replay": {"budget": 0.5}}), 1000)
        server["backend"] = None          # another backend: SGLang's own checks only
        verify(SamplingParams(custom_params="x"), 1000)
    finally:
        tail_replay_request._limits_for.cache_clear()


PLUGIN_PROBE = textwrap.dedent("""
    import os
    from types import SimpleNamespace
    from sglang_ext.patches import apply_cpu_patches, applied_patches
    apply_cpu_patches()          # stands in for a GPU machine's SGLang import
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_ext import plugin
    cpu_only = applied_patches()
    plugin.register()
    assert [h[1] for h in HookRegistry._hooks[plugin.RESOLVE_TARGET]] == [plugin.before_resolve]
    assert applied_patches() == cpu_only, "register() alone must not patch"
    plugin.before_resolve(SimpleNamespace(radix_cache_backend=None, kv_cache_dtype="auto"))
    assert applied_patches() == cpu_only and "SGLANG_EXT_PATCH_MODE" not in os.environ
    plugin.before_resolve(SimpleNamespace(radix_cache_backend="tail_replay", kv_cache_dtype="auto"))
    assert "tail_replay.request" in applied_patches() and os.environ["SGLANG_EXT_PATCH_MODE"] == "gpu"
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    assert "tail_replay" in registered_radix_cache_backends()
    print("plugin-probe-ok")
""")


def test_plugin_patches_only_servers_that_select_tail_replay():
    environ = {k: v for k, v in os.environ.items() if k != env.PATCH_MODE_VAR}
    proc = subprocess.run([sys.executable, "-c", PLUGIN_PROBE], capture_output=True, text=True, timeout=300,
                          env={**environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plugin-probe-ok" in proc.stdout


def _kv_exact_total(value: str) -> float:
    return REGISTRY.get_sample_value("sglang_ext:tail_replay_kv_exact_requests_total", {"kv_exact": value}) or 0.0


@pytest.mark.parametrize("exactness, carry_bound, floor, exact, kv_exact", [
    ("exact_first", None, 0.0, True, True),      # read only exact KV from an exact state
    ("exact_first", None, TAINT, True, False),   # an exact state, but it read KV of bound > 0
    ("exact_first", TAINT, 0.0, True, False),    # resumed from a state a request that read such KV stored
    ("exact_first", 1e-7, 0.0, True, False),     # a checkpoint's float-noise bound
    ("exact", None, TAINT, False, False),        # the exact mode: exact and kv_exact are one
    ("approximate", 0.5, 0.0, False, False),
])
def test_kv_exact_is_kept_apart_from_exact(exactness, carry_bound, floor, exact, kv_exact):
    """`exact` (the state counts as exact) and `kv_exact` (everything the answer
    read was exact) in meta_info's summary and in /metrics, once per request."""
    record = TailReplayRequest(config=TailReplayConfig.of(exactness=exactness))
    carry = None if carry_bound is None else CarryBound(100, math.log(carry_bound))
    record.set_plan(ReplayPlan(HitKind.EXACT_CHECKPOINT, 100, 100, 100), carry, floor)
    before = {v: _kv_exact_total(v) for v in ("true", "false")}
    with get_parallel().override(attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0, attn_cp_size=1, tp_size=1,
                                 moe_tp_size=1, moe_ep_size=1, moe_dp_size=1, pp_rank=0, pp_size=1):
        summary = replay_summary(record, 101)
        assert replay_summary(record, 101) == summary   # counted once
    assert summary["exact"] is exact and summary["kv_exact"] is kv_exact, summary
    assert _kv_exact_total(str(kv_exact).lower()) - before[str(kv_exact).lower()] == 1
    assert _kv_exact_total(str(not kv_exact).lower()) == before[str(not kv_exact).lower()]


def test_an_answer_without_a_plan_is_labelled_not_exact_with_the_reason():
    """Every answer of a Tail-Replay server carries a label: one never planned (no record) or
    whose plan another wing replaced (LinearKV's assembly) or that read what has no known
    provenance says `exact: false, kv_exact: false`, with the kind saying why (fail closed); a
    planned one is `replay_summary`'s. A record's label is counted once, as not exact."""
    unplanned = {"exact": False, "kv_exact": False, "bound": None}
    assert answer_label(None, 40) == {"kind": "untracked", **unplanned}
    assembled = TailReplayRequest(config=TailReplayConfig())
    assembled.set_plan(ReplayPlan(HitKind.EXACT_CHECKPOINT, 16, 16, 16))
    assembled.drop_plan("assembled")
    before = _kv_exact_total("false")
    with get_parallel().override(attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0, attn_cp_size=1, tp_size=1,
                                 moe_tp_size=1, moe_ep_size=1, moe_dp_size=1, pp_rank=0, pp_size=1):
        assert answer_label(assembled, 40) == {"kind": "assembled", **unplanned}
        assert answer_label(assembled, 40) == {"kind": "assembled", **unplanned}   # counted once
        assert _kv_exact_total("false") - before == 1
        dropped = TailReplayRequest(config=TailReplayConfig())
        dropped.drop_plan()
        assert answer_label(dropped, 40)["kind"] == "untracked"
        dropped.set_plan(ReplayPlan(HitKind.EXACT_CHECKPOINT, 16, 16, 16))   # a re-match plans it again
        assert answer_label(dropped, 40) == replay_summary(dropped, 40) and dropped.served_as is None


def _label(record, prompt_len, logprob_start=-1):
    with get_parallel().override(attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0, attn_cp_size=1, tp_size=1,
                                 moe_tp_size=1, moe_ep_size=1, moe_dp_size=1, pp_rank=0, pp_size=1):
        return answer_label(record, prompt_len, logprob_start)


def test_a_retracted_request_is_labelled_by_its_last_match_and_never_becomes_exact_again():
    """A retracted request is matched again over its prompt and the output so far: its label
    reads the bound where that match ended (not the last prompt position), and keeps the bound of
    what it generated under its earlier plan, so a stream that said false never says true."""
    config = TailReplayConfig.of(exactness="approximate")
    exact_then_approximate = TailReplayRequest(config=config)
    exact_then_approximate.begin_match(101)
    exact_then_approximate.set_plan(ReplayPlan(HitKind.EXACT_CHECKPOINT, 100, 100, 100))
    assert _label(exact_then_approximate, 101)["exact"] is True
    exact_then_approximate.begin_match(105)   # retracted after 4 tokens; re-planned past the prompt
    exact_then_approximate.set_plan(ReplayPlan(HitKind.APPROXIMATE, 104, 102, 102), CarryBound(102, math.log(0.5)))
    label = _label(exact_then_approximate, 101)
    assert label["exact"] is False and label["bound"] == pytest.approx(0.5)   # read at 104, not at 100
    approximate_then_exact = TailReplayRequest(config=config)
    approximate_then_exact.begin_match(101)
    approximate_then_exact.set_plan(ReplayPlan(HitKind.APPROXIMATE, 100, 90, 90), CarryBound(90, math.log(0.25)))
    assert _label(approximate_then_exact, 101)["exact"] is False
    approximate_then_exact.begin_match(105)
    approximate_then_exact.set_plan(ReplayPlan(HitKind.EXACT_CHECKPOINT, 104, 104, 104))
    label = _label(approximate_then_exact, 101)
    assert label["exact"] is False and label["bound"] == pytest.approx(0.25)   # its first tokens were approximate
    assembled_then_planned = TailReplayRequest(config=config)   # (LinearKV's assembly served its first tokens)
    assembled_then_planned.begin_match(101)
    assembled_then_planned.set_plan(ReplayPlan(HitKind.EXACT_CHECKPOINT, 16, 16, 16))
    assembled_then_planned.drop_plan("assembled")
    assembled_then_planned.begin_match(105)   # retracted; its chunks gone: planned over the prompt
    assembled_then_planned.set_plan(ReplayPlan(HitKind.EXACT_CHECKPOINT, 104, 104, 104))
    assert _label(assembled_then_planned, 101) == {"kind": "assembled", "exact": False, "kv_exact": False,
                                                   "bound": None}


def test_input_logprobs_are_labelled_by_every_position_they_read():
    """Input logprobs from `logprob_start_len` on are computed from the states there, whose
    bounds are larger than the last position's (bounds shrink along a replay)."""
    import torch

    record = TailReplayRequest(config=TailReplayConfig.of(exactness="approximate"))
    record.begin_match(101)
    carry = CarryBound(60, 0.0)
    carry.add_rows(3, 60, torch.full((41, 2), -0.1))
    record.set_plan(ReplayPlan(HitKind.APPROXIMATE, 100, 60, 60), carry)
    assert _label(record, 101)["bound"] == pytest.approx(math.exp(-4.1), rel=1e-5)
    record.acc.output_bound = None   # (computed once per plan: a fresh look with input logprobs)
    assert _label(record, 101, logprob_start=70)["bound"] == pytest.approx(math.exp(-1.1), rel=1e-5)
