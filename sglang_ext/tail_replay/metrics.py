"""Prometheus counters for Tail-Replay (served on SGLang's /metrics with --enable-metrics),
and the per-request summary put into `meta_info`. Recorded once per request, at its first
forward, in the scheduler process (SGLang runs prometheus_client in multiprocess mode)."""

from __future__ import annotations

import functools

from sglang_ext.tail_replay.planner import ReplayPlan


@functools.lru_cache(maxsize=1)
def _counters():
    from prometheus_client import Counter

    return {
        "matched": Counter("sglang_ext:tail_replay_matched_tokens",
                           "Prompt tokens whose attention KV was found in the radix tree"),
        "reused": Counter("sglang_ext:tail_replay_reused_tokens",
                          "Matched tokens skipped by the forward (SGLang's prefix length)"),
        "replayed": Counter("sglang_ext:tail_replay_replayed_tokens",
                            "Matched tokens run through the model again to rebuild linear-layer state"),
        "hits": Counter("sglang_ext:tail_replay_hits", "Requests by hit kind", ["kind"]),
    }


def record_plan(plan: ReplayPlan) -> None:
    counters = _counters()
    counters["matched"].inc(plan.matched_tokens)
    counters["reused"].inc(plan.prefix_len)
    counters["replayed"].inc(plan.replayed_tokens)
    counters["hits"].labels(kind=plan.kind.value).inc()


def plan_summary(plan: ReplayPlan) -> dict:
    return {"kind": plan.kind.value, "matched_tokens": plan.matched_tokens,
            "reused_tokens": plan.prefix_len, "replayed_tokens": plan.replayed_tokens}
