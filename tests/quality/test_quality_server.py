"""The quality harness end to end against patched servers (stock + Tail-Replay) on a fixture model."""

from __future__ import annotations

import json
import shutil

import pytest

from eval.harness import ServerProcess, start_servers, stop_servers
from eval.quality import cli, configs
from eval.quality.servers import DEFAULT_LAUNCH_ARGS, server_args

ROW_FIELDS = {"key", "benchmark", "dataset", "sample_id", "length", "group", "config", "budget", "kv_mode",
              "prompt_tokens", "shared_tokens", "cached_tokens", "hit_kind", "matched_tokens", "replayed_tokens", "answers",
              "prediction", "score", "output_ids", "output_logprobs", "state_bound"}


#: the fixture model's decay profile (the servers find <model>/decay.json at start-up): the slowest
#: head's p90 decay 0.9 certifies 44 tokens for tolerance 0.01 and 22 for 0.1; p10 0.5 -> 0.01: 7
PROFILE = {"layers": {"0": [{"head": 0, "decay_p10": 0.5, "decay_p50": 0.6, "decay_p90": 0.9}]}}


@pytest.fixture(scope="module")
def served(tiny_model_factory, tmp_path_factory):
    model = tmp_path_factory.mktemp("quality_model") / "qwen3-next"
    shutil.copytree(tiny_model_factory("qwen3-next"), model)
    (model / "decay.json").write_text(json.dumps(PROFILE))
    logs = tmp_path_factory.mktemp("quality_logs")
    procs = {k: ServerProcess(str(model), server_args(k, DEFAULT_LAUNCH_ARGS), log_path=logs / f"{k}.log")
             for k in (configs.STOCK, configs.TAIL_REPLAY)}
    start_servers(list(procs.values()))
    try:
        yield model, ["--stock-url", procs[configs.STOCK].url, "--tail-replay-url", procs[configs.TAIL_REPLAY].url]
    finally:
        stop_servers(list(procs.values()))


@pytest.fixture(scope="module")
def ruler_data(tmp_path_factory):
    """RULER's generators are slow on 2 cores: one cache of generated samples for the module."""
    return ["--data-dir", str(tmp_path_factory.mktemp("ruler_data"))]


def _rows(out):
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_ruler_runs_every_configuration_from_a_verified_hit(served, ruler_data, tmp_path):
    model, urls = served
    out = tmp_path / "ruler"
    # niah_single_1 (repeated-sentence haystack): RULER grows essay haystacks in 500-word steps, too
    # coarse for 1K tokens with the fixture tokenizer
    assert cli.main(["run", "--benchmark", "ruler", "--tasks", "niah_single_1", "--lengths", "1024", "--samples", "2",
                     "--tokenizer", str(model), "--out", str(out), *ruler_data, *urls]) == 0
    rows = _rows(out)
    assert len(rows) == 2 * len(configs.CONFIGS)
    assert all(set(r) == ROW_FIELDS for r in rows)
    for r in rows:
        if r["config"] == "full":
            assert r["cached_tokens"] == 0
        elif r["config"].startswith("tr-"):
            assert r["hit_kind"] == "approximate" and r["matched_tokens"] > 0.8 * r["prompt_tokens"]
            assert r["cached_tokens"] + r["replayed_tokens"] == r["matched_tokens"]
            assert 0 < r["replayed_tokens"] <= r["budget"] * r["matched_tokens"] + 1
    summary = json.loads((out / "summary.json").read_text())["1K"]
    assert set(summary) == set(configs.CONFIGS)
    assert (out / "retention.png").stat().st_size > 0 and "% of full" in (out / "summary.md").read_text()


def test_a_zero_budget_reuses_all_kv_and_replays_nothing(served, ruler_data, tmp_path):
    """tr-0 (the negative control): the question starts from a zero linear state at the match end."""
    model, urls = served
    out = tmp_path / "zero"
    assert cli.main(["run", "--benchmark", "ruler", "--tasks", "niah_single_1", "--lengths", "1024", "--samples", "1",
                     "--tokenizer", str(model), "--out", str(out), "--configs", "tr-0", *ruler_data, *urls]) == 0
    (row,) = [r for r in _rows(out) if r["config"] == "tr-0"]
    assert row["hit_kind"] == "approximate" and row["replayed_tokens"] == 0
    assert row["cached_tokens"] == row["matched_tokens"] > 0.8 * row["prompt_tokens"]


def test_a_partially_written_output_resumes(served, ruler_data, tmp_path):
    model, urls = served
    out = tmp_path / "resume"
    args = ["run", "--benchmark", "ruler", "--tasks", "niah_single_1", "--lengths", "1024", "--samples", "2",
            "--tokenizer", str(model), "--out", str(out), *ruler_data, *urls]
    assert cli.main([*args, "--configs", "full"]) == 0
    with (out / "samples.jsonl").open("a") as f:
        f.write('{"key": "ruler/niah_single_1/1024-1", "conf')        # an interrupted write
    assert cli.main([*args, "--configs", "full,tr-10"]) == 0
    rows = _rows(out)
    assert sorted((r["sample_id"], r["config"]) for r in rows) == [
        ("1024-0", "full"), ("1024-0", "tr-10"), ("1024-1", "full"), ("1024-1", "tr-10")]


def test_longbench_path_on_a_locally_built_set(served, tmp_path):
    _, urls = served
    data = tmp_path / "lb"
    assert cli.main(["make-longbench", "--out", str(data), "--words", "250", "--samples", "2"]) == 0
    out = tmp_path / "lbout"
    assert cli.main(["run", "--benchmark", "longbench", "--datasets", "hotpotqa,multifieldqa_en", "--source", str(data),
                     "--configs", "full,tr-10,tr-10-recompute", "--samples", "2", "--out", str(out), *urls]) == 0
    rows = _rows(out)
    assert len(rows) == 12 and {r["group"] for r in rows} == {"0-4k"}
    assert all(0.0 <= r["score"] <= 100.0 for r in rows)


def test_no_tail_replay_reuse_fails_loudly(served, ruler_data, tmp_path, capsys):
    model, urls = served
    stock_url = urls[1]
    code = cli.main(["run", "--benchmark", "ruler", "--tasks", "niah_single_1", "--lengths", "1024", "--samples", "1",
                     "--tokenizer", str(model), "--out", str(tmp_path / "x"), "--configs", "tr-5", *ruler_data,
                     "--stock-url", stock_url, "--tail-replay-url", stock_url])
    assert code == 3
    assert "reused no cached tokens" in capsys.readouterr().err
    assert not (tmp_path / "x" / "summary.md").exists()


def test_continuation_perplexity_matches_transformers_and_sees_the_state(served, tmp_path):
    """Full prefill's continuation log-likelihoods equal transformers' (hand-computed); a 100 %
    budget replays everything (equal to full); a zero budget reuses every token's KV and loses
    the linear state, which the continuation shows."""
    import torch

    from eval.quality import perplexity
    from eval.reference import load_reference_model

    model, urls = served
    out = tmp_path / "ppl"
    assert cli.main(["run", "--benchmark", "perplexity", "--doc-tokens", "200", "--continuation-tokens", "24",
                     "--samples", "1", "--sources", "essays", "--configs", "full,tr-0,tr-100",
                     "--tokenizer", str(model), "--out", str(out), *urls]) == 0
    rows = {r["config"]: r for r in _rows(out)}
    assert set(rows) == {"full", "tr-0", "tr-100"}
    assert rows["full"]["cached_tokens"] == 0 and rows["tr-0"]["replayed_tokens"] == 0
    assert rows["tr-0"]["cached_tokens"] == rows["tr-0"]["matched_tokens"] == 199
    assert rows["tr-100"]["hit_kind"] == "exact_replay"

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    (sample,) = perplexity.make_samples(lambda t: tok.encode(t, add_special_tokens=False), [200], 24, 1, ["essays"])
    ids = list(sample.doc_ids + sample.cont_ids)
    with torch.no_grad():
        logp = torch.log_softmax(load_reference_model(model)(torch.tensor([ids])).logits[0].float(), -1)
    expected = [logp[199 + i, t].item() for i, t in enumerate(sample.cont_ids)]
    assert rows["full"]["logprobs"] == pytest.approx(expected, abs=2e-3)
    assert rows["tr-100"]["logprobs"] == pytest.approx(rows["full"]["logprobs"], abs=2e-3)
    assert max(abs(a - b) for a, b in zip(rows["tr-0"]["logprobs"], rows["full"]["logprobs"])) > 1e-2
    table = json.loads((out / perplexity.SUMMARY_JSON).read_text())["0.2K"]
    assert abs(table["tr-100"]["delta_nats"]) < 1e-3 and (out / perplexity.PLOT).stat().st_size > 0



def test_decay_certified_budgets_replay_the_window_the_profile_certifies(served, tmp_path):
    """tr-auto-*: the eval plans the reuse check with the server's own config (the model's
    decay.json), and the server replays exactly the certified window, whatever L is."""
    model, urls = served
    out = tmp_path / "auto"
    assert cli.main(["run", "--benchmark", "perplexity", "--doc-tokens", "200", "--continuation-tokens", "8",
                     "--samples", "1", "--sources", "essays", "--configs", "tr-auto-0.01,tr-auto-0.1,tr-auto-0.01-p10",
                     "--tokenizer", str(model), "--out", str(out), *urls]) == 0
    rows = {r["config"]: r for r in _rows(out)}
    assert {n: (r["hit_kind"], r["replayed_tokens"], r["budget"]) for n, r in rows.items() if n != "full"} == {
        "tr-auto-0.01": ("approximate", 44, "auto"), "tr-auto-0.1": ("approximate", 22, "auto"),
        "tr-auto-0.01-p10": ("approximate", 7, "auto")}
    assert all(r["cached_tokens"] + r["replayed_tokens"] == r["matched_tokens"] == 199
               for n, r in rows.items() if n != "full")
    assert "tr-auto-0.1" in (out / "perplexity-summary.md").read_text()
