"""`--servers` specs and the per-server summary (busy labelling, withheld timings)."""

from __future__ import annotations

import pytest

from eval.replay.report import (
    compare_to_baseline,
    comparison_table,
    exact_split,
    hit_kinds,
    markdown_table,
    percentile,
    same_outputs,
    summarize,
)
from eval.replay.servers import ServerSpecError, parse_server_spec, parse_server_specs


def test_server_specs():
    stock = parse_server_spec("stock")
    assert (stock.label, stock.kind, stock.tail_replay_config, stock.extra_args) == ("stock", "stock", None, ())
    assert stock.launch_args(["--dtype", "float32"]) == ["--dtype", "float32"]

    tr = parse_server_spec('nockpt=tail_replay:{"keep_checkpoints": false} --radix-eviction-policy lfu')
    assert tr.label == "nockpt" and tr.tail_replay_config == {"keep_checkpoints": False}
    assert tr.launch_args([]) == ["--radix-cache-backend", "tail_replay", "--tail-replay-config",
                                  '{"keep_checkpoints": false}', "--radix-eviction-policy", "lfu"]
    lfu = parse_server_spec("stock --radix-eviction-policy lfu")
    assert lfu.label == "stock --radix-eviction-policy lfu" and lfu.extra_args == ("--radix-eviction-policy", "lfu")
    assert parse_server_spec('tail_replay:{"budget": 0.1}').label == 'tail_replay:{"budget": 0.1}'


@pytest.mark.parametrize("text, match", [
    ("vllm", "unknown kind"),
    ("stock:{}", "only tail_replay"),
    ("tail_replay:{bad", "not valid JSON"),
    ("tail_replay:[1]", "JSON object"),
    ('tail_replay:{"a": 1}x', "space after"),
    ("stock lfu", "start with a flag"),
    ("a b=stock", "unknown kind"),
    ("stock --x 'open", "quoting"),
])
def test_bad_server_specs_name_the_spec(text, match):
    with pytest.raises(ServerSpecError, match=match) as err:
        parse_server_spec(text)
    assert repr(text)[1:-1] in str(err.value) or text in str(err.value)


def test_duplicate_labels_refused():
    with pytest.raises(ServerSpecError, match="duplicate"):
        parse_server_specs(["stock", "stock"])
    assert [s.label for s in parse_server_specs(["stock", "s2=stock"])] == ["stock", "s2"]


def _rec(cached, kind=None, ok=True, ttft=0.1):
    tr = {"kind": kind, "matched_tokens": cached + 4, "reused_tokens": cached, "replayed_tokens": 4} if kind else None
    return {"ok": ok, "error": None if ok else "HTTP 500", "prompt_tokens": 100, "cached_tokens": cached if ok else 0,
            "tail_replay": tr, "ttft_s": ttft if ok else None, "latency_s": ttft}


def test_background_runs_are_read_from_the_servers_metrics_by_kind():
    from eval.replay.metrics import background_runs

    texts = ['sglang_ext:tail_replay_repairs_total{kind="shared_state",model_name="m"} 2.0\n'
             'sglang_ext:tail_replay_repairs_total{kind="answer",model_name="m"} 0.0\n',
             'sglang_ext:tail_replay_repairs_total{kind="shared_state",model_name="m"} 1.0\n'
             'sglang:prompt_tokens_total{model_name="m"} 5.0\n']
    assert background_runs(texts) == {"repair shared_state": 3}
    assert background_runs(['sglang:prompt_tokens_total{model_name="m"} 5.0\n']) == {}


def test_summary_counts_and_busy_labels():
    records = [_rec(0, "miss", ttft=0.1), _rec(60, "approximate", ttft=0.2), _rec(0, ok=False),
               _rec(30, "exact_checkpoint", ttft=0.3)]
    load = {"loadavg_1m": 1.0, "cpu_count": 2, "other_cpu_percent": 60.0, "omp_num_threads": None,
            "torch_threads": 2, "sampled_at": "x"}
    timing = {"wall_s": 2.0, "machine_load": load, "other_cpu_percent_during": 55.0, "busy": True,
              "timings_withheld": None, "server_threads": 9, "server_env": {}}
    row = summarize("tr", records, ideal_total=120, lru_total=100, timing=timing)
    assert (row["requests"], row["errors"], row["prompt_tokens"], row["reused_tokens"]) == (4, 1, 400, 90)
    assert row["reuse_of_ideal"] == 0.75 and row["lru_bound_of_ideal"] == 100 / 120
    assert row["hit_kinds"] == {"approximate": 1, "error": 1, "exact_checkpoint": 1, "miss": 1}
    assert (row["matched_tokens"], row["replayed_tokens"]) == (102, 12)
    assert row["ttft_s"]["mean"] == pytest.approx(0.2) and row["ttft_s"]["p50"] == pytest.approx(0.2)
    assert "(busy)" in markdown_table([row]) and "background" not in markdown_table([row])
    repaired = summarize("tr", records, 120, 100, {**timing, "background_runs": {"repair shared_state": 2}})
    assert "| approximate 1, error 1, exact_checkpoint 1, miss 1; background: repair shared_state 2 |" \
        in markdown_table([repaired])

    withheld = summarize("tr", records, 120, 100, {**timing, "timings_withheld": "machine busy"})
    assert withheld["ttft_s"] is None and withheld["wall_s"] is None
    assert withheld["reused_tokens"] == 90          # reuse is still reported
    assert "withheld (busy)" in markdown_table([withheld])


def test_stock_kinds_and_percentile():
    assert hit_kinds([_rec(0), _rec(5), _rec(0, ok=False)]) == {"error": 1, "hit": 1, "miss": 1}
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 95) == 5.0


@pytest.mark.parametrize("argv, match", [
    (["--trace", "no-such-trace"], "--trace 'no-such-trace'"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--servers", "stock", "stock"], "duplicate"),
    (["--trace", "mooncake-conversation", "--traces-root", "/nonexistent"], "does not exist"),
])
def test_cli_bad_input_exits_2_naming_it(tmp_path, capsys, argv, match):
    from eval.replay.cli import main

    assert main([*argv, "--out", str(tmp_path / "o"), "--allow-busy", "--load-sample-s", "0.1"]) == 2
    assert match in capsys.readouterr().err


def test_cli_refuses_a_busy_machine_without_allow_busy(tmp_path, capsys, monkeypatch):
    import eval.replay.cli as cli
    import eval.replay.runner as runner
    from eval.machine import MachineLoad

    busy = MachineLoad(9.0, 2, 95.0, None, 1, "t")
    monkeypatch.setattr(runner, "sample_load", lambda **kw: busy)
    assert cli.main(["--out", str(tmp_path / "o"), "--load-sample-s", "0.1"]) == 2
    assert "--allow-busy" in capsys.readouterr().err


def _served(cached, kind=None, exact=None, ttft=0.1, out=(1, 2)):
    details = None if kind is None else {"kind": kind, "matched_tokens": cached, "replayed_tokens": 0,
                                         **({} if exact is None else {"exact": exact})}
    return {"ok": True, "cached_tokens": cached, "tail_replay": details, "ttft_s": ttft, "output_ids": list(out),
            "prompt_tokens": 10}


def test_per_request_comparison_with_the_baseline_and_the_reference():
    stock = [_served(0), _served(8, ttft=0.05), _served(6, ttft=0.07), _served(5, ttft=0.06)]
    ours = [_served(9, "approximate", False, out=(1, 3)), _served(8, "exact_checkpoint", True, ttft=0.04),
            _served(4, "approximate", False, ttft=0.09), _served(7, "approximate_checkpoint", True, ttft=0.05)]
    c = compare_to_baseline(ours, stock)
    # stock hit requests 1-3; ours reused fewer on request 2 and served it approximately
    assert c["baseline_hits"] == 3 and c["reuse_below_baseline"] == 1 and c["exact_hits_lost"] == 1
    assert c["ttft_p50_on_baseline_hits"] == pytest.approx(0.05) and c["baseline_ttft_p50_on_its_hits"] == 0.06
    assert exact_split(ours) == {"exact": 2, "approximate": 2} and exact_split(stock) == {"exact": 4, "approximate": 0}
    assert same_outputs(ours, stock) == 0.75
    row = {"server": "tr", "requests": 4, "replayed_tokens": 8, "vs_baseline": c, "same_output": 0.75}
    table = comparison_table([row], "stock-eb", "nocache")
    assert "| tr | 3 | 1 | 1 | 0.050 / 0.060 | 2.0 | 75.0 % |" in table
