"""Where a profiled replay's scheduler time goes, SAE or Tail-Replay against its baseline.

    .venv/bin/python -m benchmarks.sae_pressure_profile docs/results/replay-sae-load --baseline lru
    .venv/bin/python -m benchmarks.sae_pressure_profile docs/results/replay-leisure-profile --baseline stock

Reads a `eval.replay --profile` run folder (no servers): report.json, pyspy-<i>-<server>.txt[.gz] and
requests-<i>-<server>.jsonl[.gz]. Prints per server ms per request (250 Hz samples) of SGLang's tree work,
the tree core that ran it (Python or Rust), SAE's code (hooks, pre-walk sync, victims, state order) and
Tail-Replay's (all of it; the steps on a request's way to its first token: the prefill scheduling with its
match, the prefill result with its insert); SAE's time by innermost function; the largest self-time differences outside the forward; and, request by
request against the baseline, requests reusing more / fewer / the same tokens, TTFT p50 on the same."""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

from eval.replay.profile import FORWARD, RATE, _function
from eval.replay.report import percentile, read_requests

SAE = re.compile(r"sglang_ext/eviction/|patches/sae_")
WRAPPER = re.compile(r"^_wrap_\w*\.<locals>\.\w+ \(")   # a seam's wrapper itself: on every server
SAE_ALL = "SAE, all its code (not the seams' wrappers)"
TAIL_REPLAY = re.compile(r"sglang_ext/tail_replay/|patches/tail_replay_")
TR_ALL = "Tail-Replay, all its code (not the seams' wrappers)"
GROUPS = (  # inclusive: a stack counts once per group whose pattern one of its frames matches
    ("match_prefix (all)", r"\.match_prefix \("),
    ("checkpoint_into_tree (insert)", r"UnifiedRadixCache\.checkpoint_into_tree \("),
    ("eviction (UnifiedRadixCache._evict)", r"UnifiedRadixCache\._evict \("),
    ("Python tree core (UnifiedTreeCore.*)", r"^UnifiedTreeCore\.|unified_tree_core\.py"),
    ("Rust tree core (RustUnifiedTreeCore.*)", r"^RustUnifiedTreeCore\."),
    (SAE_ALL, None),
    ("SAE match / insert hooks (on_request_path)", r"^on_request_path \("),
    ("SAE pre-walk sync (ServerSAE.sync)", r"ServerSAE\.sync \("),
    ("SAE victim choices (ServerSAE.victim)", r"ServerSAE\.victim \("),
    ("SAE eviction feedback (ServerSAE.evicted)", r"ServerSAE\.evicted \("),
    ("SAE state order (state_eviction_order)", r"^state_eviction_order \("),
    ("SAE /metrics (publish_metrics)", r"^publish_metrics \("),
    (TR_ALL, None),
    ("Tail-Replay's KV past the state (second insert)", r"KvPastTheState\.insert \("),
    ("before the first token: prefill scheduling (get_new_batch_prefill, with the match)",
     r"\.get_new_batch_prefill \("),
    ("before the first token: prefill result (process_batch_result_prefill, with its insert)",
     r"\.process_batch_result_prefill \("),
)


def stacks(path: Path):
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            yield stack.split(";"), int(count)


def _own_frames(frames: list[str], wing: re.Pattern) -> list[str]:
    """A stack's frames in a wing's code, not its seams' wrappers (a wrapper's own self time counts)."""
    ours = [f for f in frames if wing.search(f) and not WRAPPER.search(f)]
    return ours or (frames[-1:] if wing.search(frames[-1]) else [])


def profile(path: Path) -> dict:
    groups: collections.Counter[str] = collections.Counter()
    sae_self: collections.Counter[str] = collections.Counter()
    leaf_outside: collections.Counter[str] = collections.Counter()
    total = forward = 0
    patterns = [(name, re.compile(p)) for name, p in GROUPS if p]
    for frames, n in stacks(path):
        total += n
        inside = any(FORWARD.search(f) for f in frames)
        forward += n if inside else 0
        for name, pattern in patterns:
            if any(pattern.search(f) for f in frames):
                groups[name] += n
        ours = _own_frames(frames, SAE)
        if ours:
            groups[SAE_ALL] += n
            sae_self[_function(ours[-1])] += n
        if _own_frames(frames, TAIL_REPLAY):
            groups[TR_ALL] += n
        if not inside:
            leaf_outside[_function(frames[-1])] += n
    return {"total": total, "forward": forward, "groups": groups, "sae_self": sae_self, "leaf": leaf_outside}


def p50(values: list[float]) -> float:
    value = percentile(values, 50)
    return float("nan") if value is None else value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    report = json.loads((args.run / "report.json").read_text())
    rows = report["servers"]
    names = [r["server"] for r in rows]
    if args.baseline not in names:
        raise SystemExit(f"--baseline {args.baseline!r} is none of the run's servers {names}")
    profiles, per_request = {}, {}
    for i, row in enumerate(rows):
        (raw,) = sorted(args.run.glob(f"pyspy-{i}-*.txt*"))
        profiles[row["server"]] = profile(raw)
        per_request[row["server"]] = read_requests(args.run, i)
    print(f"run: {args.run} ({report['command']})\n")
    print("| server | requests | reused of ideal | TTFT p50 s | wall s | scheduler CPU ms/request |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        cpu = (r.get("process_cpu_ms_per_request") or {}).get("sglang::scheduler")
        print(f"| {r['server']} | {r['requests']} | {100 * r['reuse_of_ideal']:.1f} % | {r['ttft_s']['p50']:.3f} | "
              f"{r['wall_s']:.1f} | {cpu} |")
    print("\nms per request, py-spy samples (inclusive; a stack counts once per line):\n")
    print("| group | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    ms = {r["server"]: 1e3 / RATE / max(r["requests"], 1) for r in rows}
    for label, get in (("sampled", lambda p: p["total"]), ("forward", lambda p: p["forward"]),
                       ("outside the forward", lambda p: p["total"] - p["forward"])):
        print(f"| {label} | " + " | ".join(f"{get(profiles[n]) * ms[n]:.2f}" for n in names) + " |")
    for group, _ in GROUPS:
        print(f"| {group} | " + " | ".join(f"{profiles[n]['groups'][group] * ms[n]:.2f}" for n in names) + " |")
    for n in names:
        if profiles[n]["sae_self"]:
            print(f"\n{n}: SAE time by its innermost function (ms per request):\n")
            for fn, c in profiles[n]["sae_self"].most_common(args.top):
                print(f"- {c * ms[n]:.2f} `{fn}`")
    base = args.baseline
    for n in names:
        if n == base:
            continue
        here, there = profiles[n]["leaf"], profiles[base]["leaf"]
        diffs = sorted(((here[f] * ms[n] - there[f] * ms[base], f) for f in set(here) | set(there)),
                       key=lambda d: (-abs(d[0]), d[1]))[:args.top]
        print(f"\n{n} against {base}: self time outside the forward, largest differences (ms per request):\n")
        for d, f in diffs:
            print(f"- {d:+.2f} `{f}` ({here[f] * ms[n]:.2f} vs {there[f] * ms[base]:.2f})")
        recs, brecs = per_request[n], per_request[base]
        pairs = [(r, b) for r, b in zip(recs, brecs) if r["ok"] and b["ok"]]
        assert all(r["index"] == b["index"] for r, b in pairs), "per-request files not in the same order"
        more = sum(r["cached_tokens"] > b["cached_tokens"] for r, b in pairs)
        fewer = sum(r["cached_tokens"] < b["cached_tokens"] for r, b in pairs)
        same = [(r, b) for r, b in pairs if r["cached_tokens"] == b["cached_tokens"]]
        hits = sum(r["cached_tokens"] > 0 for r, _ in pairs), sum(b["cached_tokens"] > 0 for _, b in pairs)
        print(f"\nper request, {n} against {base}: {len(pairs)} requests; reused more {more}, fewer {fewer}, "
              f"same {len(same)}; requests with any reuse {hits[0]} vs {hits[1]}; TTFT p50 on the same-reuse "
              f"requests {p50([r['ttft_s'] for r, _ in same]):.3f} vs {p50([b['ttft_s'] for _, b in same]):.3f} s; "
              f"TTFT p50 on the others {p50([r['ttft_s'] for r, b in pairs if r['cached_tokens'] != b['cached_tokens']]):.3f}"
              f" vs {p50([b['ttft_s'] for r, b in pairs if r['cached_tokens'] != b['cached_tokens']]):.3f} s")


if __name__ == "__main__":
    main()
