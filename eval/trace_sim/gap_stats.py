"""How predictable is the next request of an agentic session? Statistics of the gaps
between consecutive main-agent requests of the kv-cache-tester conversations, the
numbers behind docs/saecache.md section 5:

* standard deviation of the log gap after each stop reason (``tool_use``, ``end_turn``),
  and what is left within log2 classes of the output size (what SAE's classes see);
* correlation of consecutive log gaps of a conversation (the per-session pace signal);
* share of consecutive requests whose prompt diverges from the previous prompt.

``python -m eval.trace_sim.gap_stats [--every 2]`` (``--every N``: every N-th file).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from .loaders import DEFAULT_TRACE_ROOT, _read_json_gz, kv_trace_files

MAX_SIZE_CLASS = 12  # log2 output-token classes, capped


def main_requests(conversation: dict) -> list[dict]:
    """The main agent's requests (sub-agent records and sub-agent requests left out)."""
    return [r for r in conversation["requests"] if "hash_ids" in r and not r.get("agent_id")]


def _common_prefix(a: list, b: list) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def gap_stats(conversations) -> dict:
    by_stop, by_class, pairs = defaultdict(list), defaultdict(list), defaultdict(list)
    consecutive = diverging = 0
    for conversation in conversations:
        requests, previous_log_gap = main_requests(conversation), None
        for before, after in zip(requests, requests[1:]):
            consecutive += 1
            diverging += _common_prefix(before["hash_ids"], after["hash_ids"]) < len(before["hash_ids"])
            gap = after["t"] - before["t"]
            if gap <= 0:
                previous_log_gap = None
                continue
            x, stop = math.log(gap), before["stop"]
            by_stop[stop].append(x)
            by_class[(stop, min(int(math.log2(max(before["out"], 1))), MAX_SIZE_CLASS))].append(x)
            if previous_log_gap is not None:
                pairs[stop].append((previous_log_gap, x))
            previous_log_gap = x
    return {"pairs_of_requests": consecutive, "diverging_share": diverging / max(consecutive, 1),
            "after": {stop: _spread(stop, xs, by_class, pairs[stop]) for stop, xs in by_stop.items()}}


def _spread(stop: str, log_gaps: list[float], by_class: dict, pairs: list) -> dict:
    residuals = [x - np.mean(xs) for (s, _), xs in by_class.items() if s == stop and len(xs) >= 5
                 for x in xs]
    pair = np.asarray(pairs) if len(pairs) > 2 else None
    return {"gaps": len(log_gaps), "log_gap_sd": float(np.std(log_gaps)),
            "log_gap_sd_within_output_size_class": float(np.std(residuals)) if residuals else None,
            "consecutive_log_gap_correlation":
                float(np.corrcoef(pair[:, 0], pair[:, 1])[0, 1]) if pair is not None else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.trace_sim.gap_stats")
    parser.add_argument("--traces-root", type=Path, default=DEFAULT_TRACE_ROOT,
                        help="folder of the named traces (default: the committed sample eval/traces, or $SGLANG_EXT_TRACES)")
    parser.add_argument("--every", type=int, default=1, help="use every N-th conversation file")
    args = parser.parse_args(argv)
    if args.every < 1:
        parser.error(f"--every must be >= 1, got {args.every}")
    files = kv_trace_files(args.traces_root / "kv-cache-tester")[:: args.every]
    stats = gap_stats(_read_json_gz(f) for f in files)
    print(json.dumps({"files": len(files), **stats}, indent=1))


if __name__ == "__main__":
    main()
