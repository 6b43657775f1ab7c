"""The modeled goodput queue (`eval/replay/goodput.py`): FCFS TTFTs by hand, the load scaling,
the highest rate within the SLO, and a report directory end to end."""

from __future__ import annotations

import json

import pytest

from eval.replay.goodput import (
    add_modeled_goodput,
    arrivals_at,
    fcfs_ttfts,
    goodput_table,
    main,
    max_rate_within,
    pressure_ttfts,
    share_within,
    unit_gaps,
)


def test_fcfs_ttft_is_wait_plus_service():
    # arrivals 0, 1, 1.5, 10; services 2, 2, 1, 1: starts 0, 2, 4, 10
    assert fcfs_ttfts([0, 1, 1.5, 10], [2, 2, 1, 1]) == [2, 3, 3.5, 1]
    with pytest.raises(ValueError):
        fcfs_ttfts([0, 1], [1])


def test_the_pressure_model_takes_the_pressed_service_while_the_oldest_waiting_request_waits_long():
    # exact services 2 each, pressed 0.5 each; threshold 1 s. Arrivals 0, 0.5, 1.0, 1.2, 6:
    # r0 starts at 0 (nobody waits), r1 arrives 0.5 (oldest waiting: none, r0 started) -> exact, starts 2;
    # r2 at 1.0: r1 waiting 0.5 s -> exact, starts 4; r3 at 1.2: r1 waiting 0.7 s -> exact, starts 6;
    # at 6 r3 just started, nobody waits -> r4 exact
    ttfts, flags = pressure_ttfts([0, 0.5, 1.0, 1.2, 6.0], [2] * 5, [0.5] * 5, 1.0)
    assert flags == [False] * 5 and ttfts == fcfs_ttfts([0, 0.5, 1.0, 1.2, 6.0], [2] * 5)
    # r3 at 1.6: r1 (arrived 0.5, starts 2) has waited 1.1 s -> pressed: starts 6, served in 0.5
    ttfts, flags = pressure_ttfts([0, 0.5, 1.0, 1.6, 6.0], [2] * 5, [0.5] * 5, 1.0)
    assert flags == [False, False, False, True, False]
    assert ttfts == pytest.approx([2, 3.5, 5, 4.9, 2.5])   # r4 starts at 6.5
    # threshold 0: always pressed (as live: met at or above); a huge one: never, the exact queue
    assert pressure_ttfts([0, 0.1], [2, 2], [0.5, 0.5], 0.0) == ([0.5, 0.9], [True, True])
    assert pressure_ttfts([0, 0.1, 0.2], [2] * 3, [0.5] * 3, 1e9)[0] == fcfs_ttfts([0, 0.1, 0.2], [2] * 3)


def test_the_modeled_policy_serves_more_within_the_slo_than_its_exact_server_under_load():
    services = {"stock": [0.4] * 400, "exact": [0.4] * 400, "pressed": [0.1] * 400}
    table = goodput_table(services, "stock", slo_s=1.0, loads=(0.3, 0.95),
                          pressure=[("policy", "exact", "pressed", 0.3)])
    policy, exact = table["servers"]["policy"], table["servers"]["exact"]
    assert policy["pressure"] == {"exact": "exact", "pressed": "pressed", "queue_wait_s": 0.3}
    low, high = policy["at_load"]
    assert low["pressed_share"] < 0.1 and high["pressed_share"] > 0.2
    assert high["goodput_per_s"] > exact["at_load"][1]["goodput_per_s"]
    assert policy["max_rate_within_slo_per_s"] > exact["max_rate_within_slo_per_s"]
    with pytest.raises(ValueError, match="needs servers 'exact' and 'nope'"):
        goodput_table(services, "stock", pressure=[("p", "exact", "nope", 0.3)])
    with pytest.raises(ValueError, match="has a server of that name"):
        goodput_table(services, "stock", pressure=[("exact", "exact", "pressed", 0.3)])


def test_arrivals_scale_with_the_rate_and_are_seeded():
    gaps = unit_gaps(1000, seed=3)
    assert gaps == unit_gaps(1000, seed=3) and gaps != unit_gaps(1000, seed=4)
    assert 0.9 < sum(gaps) / len(gaps) < 1.1
    assert arrivals_at([1.0, 2.0, 0.5], 2.0) == [0.5, 1.5, 1.75]
    with pytest.raises(ValueError, match="rate"):
        arrivals_at([1.0], 0)


def test_faster_service_serves_more_within_the_slo_at_the_same_load():
    services = {"stock": [0.4] * 400, "fast": [0.2] * 400, "slow": [0.6] * 400}
    table = goodput_table(services, "stock", slo_s=1.0, loads=(0.5, 0.85))
    assert table["baseline_mean_service_s"] == pytest.approx(0.4)
    stock, fast, slow = (table["servers"][k] for k in ("stock", "fast", "slow"))
    assert [r["rate_per_s"] for r in stock["at_load"]] == pytest.approx([1.25, 2.125])
    assert [r["utilisation"] for r in fast["at_load"]] == pytest.approx([0.25, 0.425])
    for i in range(2):
        assert fast["at_load"][i]["goodput_per_s"] >= stock["at_load"][i]["goodput_per_s"] \
            >= slow["at_load"][i]["goodput_per_s"]
    assert fast["at_load"][1]["share_within_slo"] == 1.0 > slow["at_load"][1]["share_within_slo"]
    assert stock["goodput_x_baseline"] == [1.0, 1.0]
    assert fast["max_rate_within_slo_per_s"] > stock["max_rate_within_slo_per_s"] > slow["max_rate_within_slo_per_s"]
    assert stock["max_rate_x_baseline"] == 1.0


def test_the_highest_rate_within_the_slo_is_where_the_share_crosses():
    services, gaps = [0.3] * 300, unit_gaps(300, seed=1)
    rate = max_rate_within(services, gaps, slo_s=1.0, within=0.9)
    assert share_within(fcfs_ttfts(arrivals_at(gaps, rate), services), 1.0) >= 0.9
    assert share_within(fcfs_ttfts(arrivals_at(gaps, rate * 1.01), services), 1.0) < 0.9
    assert max_rate_within([2.0] * 10, unit_gaps(10), slo_s=1.0, within=0.9) == 0.0   # service alone misses it
    assert max_rate_within([0.1] * 3, unit_gaps(3), slo_s=1.0, within=0.9) is None    # a burst of 3 still meets it


def test_a_report_directory_gets_its_goodput_json(tmp_path, capsys):
    rows = [{"ok": True, "prompt_tokens": 100, "cached_tokens": c} for c in (0, 50, 90)]
    report = {"gpu_model": {"model": "qwen3-next-80b-a3b", "gpu": "h100-sxm", "efficiency": 0.5,
                            "baseline": "stock", "real_tokens_per_replayed_token": 64.0},
              "servers": [{"server": "stock", "modeled_gpu_ttft_s": {"cpu_beyond_baseline_ms": 0.0}},
                          {"server": "tr", "modeled_gpu_ttft_s": {"cpu_beyond_baseline_ms": 2.0}}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    for i, name in enumerate(("stock", "tr")):
        shifted = [dict(r, cached_tokens=r["cached_tokens"] + 5 * i) for r in rows]
        (tmp_path / f"requests-{i}-{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shifted))
    main([str(tmp_path), "--slo-s", "2", "--loads", "0.5"])
    out = json.loads((tmp_path / "goodput.json").read_text())
    assert out["slo_s"] == 2.0 and out["baseline"] == "stock" and set(out["servers"]) == {"stock", "tr"}
    assert out["command"].startswith(f"python -m eval.replay.goodput {tmp_path} --slo-s 2 --loads 0.5")
    assert out["servers"]["tr"]["mean_service_s"] != out["servers"]["stock"]["mean_service_s"]
    assert "max rate within SLO" in capsys.readouterr().out


def test_the_replay_report_carries_each_servers_goodput():
    spec = {"model": "qwen3-next-80b-a3b", "gpu": "h100-sxm", "efficiency": 0.5, "real_tokens_per_replayed_token": 64.0}
    rows = [{"server": "stock", "modeled_gpu_ttft_s": {"cpu_beyond_baseline_ms": 0.0}},
            {"server": "tr", "modeled_gpu_ttft_s": {"cpu_beyond_baseline_ms": 0.0}},
            {"server": "dead", "modeled_gpu_ttft_s": None}]
    answered = [{"ok": True, "prompt_tokens": 200, "cached_tokens": c} for c in (0, 100, 150, 190)]
    per_server = {"stock": answered, "tr": [dict(r, cached_tokens=min(199, r["cached_tokens"] + 40)) for r in answered],
                  "dead": [{"ok": False, "prompt_tokens": 200, "cached_tokens": 0}]}
    table = add_modeled_goodput(rows, per_server, spec, "stock")
    assert set(table["servers"]) == {"stock", "tr"} and rows[2]["modeled_gpu_goodput"] is None
    assert rows[0]["modeled_gpu_goodput"]["goodput_x_baseline"] == [1.0, 1.0, 1.0]
    assert all(x >= 1.0 for x in rows[1]["modeled_gpu_goodput"]["goodput_x_baseline"])   # reused more
    assert add_modeled_goodput(rows, per_server, spec, None) is None
    assert add_modeled_goodput(rows, per_server, spec, "dead") is None
