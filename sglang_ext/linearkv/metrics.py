"""Prometheus counters for LinearKV (served on SGLang's /metrics with --enable-metrics), recorded
once per request when its row is released (EPIC's pre-pass: per worker forward), in the scheduler
process, on the replica's first rank only (the rule `sglang_ext.tail_replay.metrics.is_recording_rank`
states)."""

from __future__ import annotations

import functools

from sglang_ext.linearkv.serving import LinearKVRequest


@functools.lru_cache(maxsize=1)
def _counters() -> dict:
    from prometheus_client import Counter

    return {
        "hit": Counter("sglang_ext:linearkv_chunks_hit", "Declared chunks served from the chunk cache"),
        "missed": Counter("sglang_ext:linearkv_chunks_missed",
                          "Declared chunks not served (the request was prefilled in full)"),
        "reused": Counter("sglang_ext:linearkv_reused_tokens", "Chunk tokens whose KV was reused at a new offset"),
        "recomputed": Counter("sglang_ext:linearkv_recomputed_tokens",
                              "Prompt tokens computed by assembled requests' forwards"),
        "requests": Counter("sglang_ext:linearkv_requests", "Requests with chunks, by state source", ["state_source"]),
        "prepass_forwards": Counter("sglang_ext:linearkv_prepass_forwards",
                                    "Extend forwards run by EPIC pre-passes (one per head index and batch)"),
        "prepass_heads": Counter("sglang_ext:linearkv_prepass_heads",
                                 "Chunk head spans recomputed in context by EPIC pre-passes"),
    }


def _this_rank_records() -> bool:
    from sglang.srt.runtime_context import get_parallel

    from sglang_ext.tail_replay import is_recording_rank

    parallel = get_parallel()
    return is_recording_rank(parallel.attn_tp_rank, parallel.attn_cp_rank, parallel.pp_rank)


def record_request(record: LinearKVRequest) -> None:
    """Count a request with chunks once (a retracted and re-matched request is counted at its end)."""
    if record.recorded or record.register or (record.plan is None and not record.fallback) or not _this_rank_records():
        return
    record.recorded = True
    counters = _counters()
    counters["hit"].inc(record.chunks_hit)
    counters["missed"].inc(record.chunks_missed)
    counters["reused"].inc(record.reused_tokens)
    counters["recomputed"].inc(record.recomputed_tokens)
    counters["requests"].labels(state_source=record.state_source).inc()


def record_prepass(forwards: int, heads: int) -> None:
    """Count one batch's EPIC pre-pass: its forwards and the head spans they ran."""
    if not _this_rank_records():
        return
    counters = _counters()
    counters["prepass_forwards"].inc(forwards)
    counters["prepass_heads"].inc(heads)
