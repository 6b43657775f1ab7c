"""How far the router's predicted hit depth is from the one the worker served.

SGLang's router (`smg`, cache-aware policy) keeps its own prefix tree per worker and, for each
routing decision, records the best match it found as a share of the request
(`smg_cache_aware_match_ratio`, a histogram on its Prometheus port) and which way it went
(`smg_cache_aware_policy_branch_total{branch}`: `tree_match` to the worker holding that match,
`spill` elsewhere because the holder was busy, `expected_wait_fallback` by load below
`--cache-threshold`). It reports neither per request over HTTP, so the replay reads the counters
around each request when one request is in flight at a time: the histogram's sum moves by that
request's ratio, one branch counter by one. With more in flight only the run's totals are read.

The predicted depth is the ratio times the prompt's length; the served one is the worker's
`cached_tokens`. Pure parsing and arithmetic; the replay does the HTTP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_RATIO_SUM = re.compile(r"^smg_cache_aware_match_ratio_sum(?:\{[^}]*\})? (\S+)$", re.M)
_RATIO_COUNT = re.compile(r"^smg_cache_aware_match_ratio_count(?:\{[^}]*\})? (\S+)$", re.M)
_BRANCH = re.compile(r'^smg_cache_aware_policy_branch_total\{[^}]*branch="([^"]+)"[^}]*\} (\S+)$', re.M)


@dataclass(frozen=True)
class RouterCounters:
    """The router's cache-aware counters at one moment (summed over label sets)."""

    ratio_sum: float = 0.0
    decisions: int = 0
    branches: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> RouterCounters:
        branches: dict[str, int] = {}
        for name, value in _BRANCH.findall(text):
            branches[name] = branches.get(name, 0) + int(float(value))
        return cls(sum(float(v) for v in _RATIO_SUM.findall(text)),
                   int(sum(float(v) for v in _RATIO_COUNT.findall(text))), branches)

    def since(self, before: RouterCounters) -> RouterCounters:
        """What moved between `before` and this reading."""
        moved = {k: v - before.branches.get(k, 0) for k, v in self.branches.items()}
        return RouterCounters(self.ratio_sum - before.ratio_sum, self.decisions - before.decisions,
                              {k: v for k, v in moved.items() if v})


def one_decision(moved: RouterCounters) -> dict | None:
    """The request's decision (`match_ratio`, `branch`) when exactly one was recorded, else None."""
    if moved.decisions != 1:
        return None
    branch = next(iter(moved.branches)) if len(moved.branches) == 1 else None
    return {"match_ratio": round(moved.ratio_sum, 6), "branch": branch}


def prediction_summary(records: list[dict], moved: RouterCounters) -> dict:
    """The run's router prediction against what was served: the mean predicted share against the
    mean served share (`cached_tokens / prompt_tokens`) over answered requests, the decisions by
    branch, and, where each request's decision was read (`record["router"]`), the predicted depth
    (ratio x prompt tokens) against the served one: mean absolute gap in tokens, and how many
    requests were predicted deeper / shallower than served by more than `slack` tokens."""
    ok = [r for r in records if r["ok"] and r["prompt_tokens"]]
    out = {"decisions": moved.decisions, "branches": dict(sorted(moved.branches.items())),
           "predicted_share_mean": round(moved.ratio_sum / moved.decisions, 4) if moved.decisions else None,
           "served_share_mean": round(sum(r["cached_tokens"] / r["prompt_tokens"] for r in ok) / len(ok), 4)
           if ok else None}
    read = [r for r in ok if r.get("router")]
    if read:
        gaps = [r["router"]["match_ratio"] * r["prompt_tokens"] - r["cached_tokens"] for r in read]
        slack = 64
        out.update(per_request=len(read), mean_abs_gap_tokens=round(sum(abs(g) for g in gaps) / len(gaps), 1),
                   predicted_deeper=sum(g > slack for g in gaps), predicted_shallower=sum(g < -slack for g in gaps),
                   slack_tokens=slack)
    return out


def prediction_line(server: str, summary: dict) -> str:
    """One markdown line for the report."""
    text = (f"- {server}: router prediction, {summary['decisions']} decisions "
            f"({', '.join(f'{k} {v}' for k, v in summary['branches'].items()) or 'none'}); predicted share of the "
            f"prompt cached {_share(summary['predicted_share_mean'])}, served {_share(summary['served_share_mean'])}")
    if summary.get("per_request"):
        text += (f"; per request ({summary['per_request']}): mean |predicted - served| "
                 f"{summary['mean_abs_gap_tokens']:g} tokens, predicted deeper on {summary['predicted_deeper']}, "
                 f"shallower on {summary['predicted_shallower']} (by more than {summary['slack_tokens']} tokens)")
    return text


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"
