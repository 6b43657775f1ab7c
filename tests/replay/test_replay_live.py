"""One small live replay: 12 requests of a hand-made Mooncake-format trace through a stock and a
tail_replay server (tiny Qwen3-Next fixture, CPU), checking the report against the per-request
records and the offline references."""

from __future__ import annotations

import gzip
import json

import pytest

from eval.replay.bound import ideal_curve, lru_curve
from eval.replay.cli import main
from eval.replay.tokens import block_tokens

TOKENS_PER_BLOCK = 64
DOC, DOC2 = [0, 1, 2, 3], [50, 51, 52]
# (time ms, block ids): branches of two shared documents, multi-turn extensions, repeats
REQUESTS = [
    (0, DOC + [10]), (100, DOC + [11]), (200, DOC + [10, 20]), (300, DOC2 + [30]),
    (400, DOC + [12]), (500, DOC2 + [31]), (600, DOC + [10, 20, 21]), (700, [90, 91]),
    (800, DOC2 + [30, 32]), (900, DOC + [13]), (1000, DOC2 + [33]), (1100, DOC + [11]),
]


def test_live_replay_stock_vs_tail_replay(tmp_path, tiny_model_factory):
    trace = tmp_path / "trace.jsonl.gz"
    with gzip.open(trace, "wt") as handle:
        for t, ids in REQUESTS:
            handle.write(json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 1,
                                     "hash_ids": ids}) + "\n")
    out = tmp_path / "out"
    rc = main(["--trace", str(trace), "--requests", "12", "--tokens-per-block", str(TOKENS_PER_BLOCK),
               "--max-total-tokens", "16384", "--max-mamba-cache-size", "8", "--boot", "together",
               "--servers", "stock", "tail_replay", "--model", str(tiny_model_factory("qwen3-next")),
               "--out", str(out), "--allow-busy", "--load-sample-s", "0.5", "--profile", "--baseline", "stock"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.md").read_text().count("\n| ") >= 3
    assert (out / "replay.png").stat().st_size > 10_000

    # the offline references: on the same token sequences, computed here independently of the run
    # (the loader interns blocks in first-seen order: that is the id each block's tokens come from)
    order, seqs = {}, []
    for _, ids in REQUESTS:
        for b in ids:
            order.setdefault(b, len(order))
    for _, ids in REQUESTS:
        seqs.append(tuple(int(x) for x in block_tokens([order[b] for b in ids], TOKENS_PER_BLOCK)))
    ideal = ideal_curve(seqs)
    # block-level: r1 4 blocks, r2 5, r4 4, r5 3, r6 6, r8 4, r9 4, r10 3, r11 5 blocks - 1 token
    assert ideal.total >= 64 * (4 + 5 + 4 + 3 + 6 + 4 + 4 + 3) + 5 * 64 - 1
    assert report["references"] == {"ideal_tokens": ideal.total, "lru_capacity_tokens": 16384,
                                    "lru_bound_tokens": lru_curve(seqs, 16384).total}
    assert report["trace"]["prompt_tokens"] == sum(len(s) for s in seqs)

    rows = {r["server"]: r for r in report["servers"]}
    assert list(rows) == ["stock", "tail_replay"]
    # the modeled GPU goodput at the SLO, per server, against the first stock server's
    assert set(report["modeled_gpu_goodput"]["servers"]) == {"stock", "tail_replay"}
    assert rows["stock"]["modeled_gpu_goodput"]["goodput_x_baseline"] == [1.0, 1.0, 1.0]
    for label, row in rows.items():
        records = [json.loads(line) for line in
                   (out / f"requests-{list(rows).index(label)}-{label}.jsonl").read_text().splitlines()]
        assert len(records) == row["requests"] == 12 and row["errors"] == 0
        assert [r["prompt_tokens"] for r in records] == [len(s) for s in seqs]
        assert row["reused_tokens"] == sum(r["cached_tokens"] for r in records)
        assert row["reuse_of_ideal"] == row["reused_tokens"] / ideal.total
        assert sum(row["hit_kinds"].values()) == 12
        assert all(r["cached_tokens"] < r["prompt_tokens"] for r in records)
        assert all(0 < r["ttft_s"] <= r["latency_s"] for r in records)
        ttft = row["ttft_s"]
        assert 0 < ttft["p50"] <= ttft["p95"] and row["wall_s"] > 0
        assert set(row["machine_load"]) >= {"loadavg_1m", "cpu_count", "other_cpu_percent", "omp_num_threads",
                                            "torch_threads", "sampled_at"}
        assert row["server_threads"] > 0
    assert rows["stock"]["background_runs"] == {}        # read from /metrics: stock sends none
    tr = rows["tail_replay"]
    assert set(tr["background_runs"]) <= {"repair shared_state", "repair answer"}
    assert tr["reused_tokens"] > 0 and tr["reused_tokens"] >= rows["stock"]["reused_tokens"]
    assert tr["replayed_tokens"] is not None and rows["stock"]["replayed_tokens"] is None
    assert set(tr["hit_kinds"]) <= {"miss", "approximate", "exact_checkpoint", "exact_replay"}
    assert tr["hit_kinds"].get("approximate", 0) > 0

    # --profile: py-spy sampled each scheduler over its own replay; the report splits the time
    for i, (label, row) in enumerate(rows.items()):
        p = row["profile"]
        assert (out / f"pyspy-{i}-{label}.txt").stat().st_size > 0
        assert p["requests"] == 12 and p["samples"] > 0
        ms = p["ms_per_request"]
        assert 0 < ms["forward"] <= ms["sampled"] and ms["outside_forward"] == pytest.approx(ms["sampled"] - ms["forward"])
        assert 0 < ms["forward_extend"] <= ms["forward"]      # one output token each: prefill only
        assert p["outside_forward"] and all("forward_batch_generation" not in name for name, _ in p["outside_forward"])
        assert max(v for _, v in p["outside_forward"]) <= ms["outside_forward"] + 1e-3
        cpu = row["process_cpu_ms_per_request"]                # psutil, every replay
        assert cpu["http"] > 0 and cpu["sglang::scheduler"] > 0 and "sglang::detokenizer" in cpu
    assert "Scheduler time per request" in (out / "report.md").read_text()
    assert "CPU per request of each server's processes" in (out / "report.md").read_text()
    assert "tail_replay against stock" in (out / "report.md").read_text()

    # the pools each server says it holds (/server_info) are the flags it was given
    assert all(row["server_pools"] == [{"kv_tokens": 16384, "state_slots": 8, "max_running_requests":
                                        row["server_pools"][0]["max_running_requests"]}] for row in rows.values())
    # modeled GPU TTFT beside the measured one (eval/replay/gpu_model.py; CPU beyond the baseline's)
    assert report["gpu_model"]["gpu"] == "h100-sxm" and 0.3 < report["gpu_model"]["efficiency"] < 0.7
    for row in rows.values():
        m = row["modeled_gpu_ttft_s"]
        assert 0 < m["p50"] <= m["p95"] and m["cpu_beyond_baseline_ms"] >= 0
    assert rows["stock"]["modeled_gpu_ttft_s"]["cpu_beyond_baseline_ms"] == 0
    assert "Modeled GPU TTFT" in (out / "report.md").read_text()
