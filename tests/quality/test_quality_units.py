"""Quality harness pieces without a server: configs, reuse checks, resume, report arithmetic."""

from __future__ import annotations

import json
import re

import pytest

from eval.quality import cli, configs, report, runner
from eval.quality.longbench import shared_chars
from eval.quality.samples import EvalSample, cut_before_last

SAMPLE = EvalSample("ruler", "niah_single_2", "4096-0", "DOC\nWhat is it?", 3, ("7",), 8, 4000, group="4K")


def test_full_prefill_is_always_the_reference():
    names = [c.name for c in configs.parse_configs("tr-5,stock")]
    assert names == ["full", "tr-5", "stock"]


@pytest.mark.parametrize("name", ["tr-x", "tr-101", "tr-5-exact", "replay-5", "tr--1"])
def test_unknown_config_is_named(name):
    with pytest.raises(ValueError, match=name):
        configs.parse_configs(f"full,{name}")


def test_any_tail_replay_budget_by_name():
    zero, half, seven = configs.parse_configs("tr-0,tr-0.5-recompute,tr-7")[1:]
    assert (zero.name, zero.overrides) == ("tr-0", {"budget": 0.0, "kv_mode": "exact", "min_replay_tokens": 0})
    assert (half.name, half.budget, half.kv_mode) == ("tr-0.5-recompute", 0.005, "recompute")
    assert seven.budget == 0.07 and seven.must_hit
    assert configs.config_named("tr-5") is configs.CONFIGS["tr-5"]


def test_report_orders_stock_then_exact_then_recomputed_by_budget():
    names = ["tr-10-recompute", "tr-20", "stock", "tr-0.5", "full", "tr-2.5-recompute", "tr-5"]
    ordered = sorted(names, key=lambda n: configs.report_order(configs.config_named(n)))
    assert ordered == ["full", "stock", "tr-0.5", "tr-5", "tr-20", "tr-2.5-recompute", "tr-10-recompute"]


def test_tail_replay_configs_carry_budget_and_kv_mode():
    c = configs.CONFIGS["tr-2.5-recompute"]
    assert c.overrides == {"budget": 0.025, "kv_mode": "recompute", "min_replay_tokens": 0}
    assert c.must_hit and c.warm


def _tr(kind, matched, replayed, cached=None):
    cached = matched - replayed if cached is None else cached
    return {"cached_tokens": cached, "cached_tokens_details": {"tail_replay": {
        "kind": kind, "matched_tokens": matched, "reused_tokens": cached, "replayed_tokens": replayed}}}


SHARED = runner.SharedPrefix(tokens=1000, page_size=1)
PAGED = runner.SharedPrefix(tokens=1000, page_size=16)


@pytest.mark.parametrize("meta, config, shared, error", [
    # full prefill: reuses nothing
    ({"cached_tokens": 0}, "full", None, None),
    ({"cached_tokens": 3}, "full", None, "full prefill reused 3"),
    # stock: no Tail-Replay decision, at most the shared prefix (often nothing)
    ({"cached_tokens": 0}, "stock", SHARED, None),
    ({"cached_tokens": 512}, "stock", SHARED, None),
    ({"cached_tokens": 1001}, "stock", SHARED, "more than the 1000 shared"),
    (_tr("approximate", 1000, 50), "stock", SHARED, "stock row carries a Tail-Replay decision"),
    # Tail-Replay: the planned kind, L about the shared prefix, replayed <= budget x L + one page
    (_tr("approximate", 1000, 50), "tr-5", SHARED, None),
    (_tr("approximate", 1001, 51), "tr-5", SHARED, None),           # the warm-up's token continues it
    (_tr("approximate", 992, 64), "tr-5", PAGED, None),             # W 50, start cut to page 928
    ({"cached_tokens": 0}, "tr-5", SHARED, "reused no cached tokens"),            # reuse disabled
    ({"cached_tokens": 100}, "tr-5", SHARED, "reused no cached tokens"),          # not a Tail-Replay server
    (_tr("miss", 1000, 0, cached=0), "tr-5", SHARED, "reused no cached tokens"),
    (_tr("approximate", 600, 30), "tr-5", SHARED, "matched 600 tokens, not about the 1000"),
    (_tr("approximate", 1002, 51), "tr-5", SHARED, "matched 1002"),
    (_tr("approximate", 984, 50), "tr-5", PAGED, "matched 984"),                   # a page short
    (_tr("exact_checkpoint", 1000, 10), "tr-5", SHARED, "hit kind 'exact_checkpoint', planned 'approximate'"),
    (_tr("exact_replay", 1000, 1000), "tr-5", SHARED, "planned 'approximate'"),
    (_tr("approximate", 1000, 120), "tr-5", SHARED, "replayed 120 > the replay window 50 (budget 0.05"),
    (_tr("approximate", 1000, 50, cached=900), "tr-5", SHARED, "reused 900 + replayed 50 != matched 1000"),
    # the window covers L: an exact replay that reuses 0 tokens is what tr-100 plans
    (_tr("exact_replay", 1000, 1000), "tr-100", SHARED, None),
    (_tr("approximate", 1000, 0), "tr-0", SHARED, None),
])
def test_reuse_check(meta, config, shared, error):
    reuse = runner.reuse_of(meta)
    cfg = configs.config_named(config)
    if error:
        with pytest.raises(runner.ReuseCheckFailed, match=re.escape(error)) as failure:
            runner.check_reuse(cfg, SAMPLE, reuse, shared)
        assert config in str(failure.value)
    else:
        runner.check_reuse(cfg, SAMPLE, reuse, shared)


def test_common_prefix():
    assert runner.common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert runner.common_prefix([1, 2], [1, 2, 3]) == 2
    assert runner.common_prefix([], [1]) == 0


def test_truncated_last_line_is_dropped_and_a_bad_middle_line_is_an_error(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"key": "a", "config": "full"}\n{"key": "b", "conf')
    assert runner.read_rows(path) == [{"key": "a", "config": "full"}]
    assert path.read_text() == '{"key": "a", "config": "full"}\n'
    path.write_text('{"key": "a"}\nnot json\n{"key": "c"}\n')
    with pytest.raises(ValueError, match=r"samples.jsonl:2"):
        runner.read_rows(path)


def _row(config, dataset, score, key, cached=100, replayed=10, group="4K", prediction=None):
    return {"config": config, "dataset": dataset, "score": score, "key": key, "group": group,
            "cached_tokens": 0 if config == "full" else cached, "replayed_tokens": replayed,
            "prediction": prediction if prediction is not None else f"{key}:{score}"}


def test_retention_is_the_ratio_of_dataset_means():
    rows = [_row("full", "a", 100, "1"), _row("full", "a", 50, "2"), _row("full", "b", 40, "3"),
            _row("tr-5", "a", 75, "1"), _row("tr-5", "a", 25, "2"), _row("tr-5", "b", 40, "3"),
            _row("stock", "a", 100, "1", cached=0), _row("stock", "a", 50, "2", cached=0), _row("stock", "b", 40, "3", cached=0)]
    table = report.summarize(rows)["4K"]
    # full: mean(a)=75, mean(b)=40 -> 57.5; tr-5: mean(a)=50, b=40 -> 45; 45/57.5 = 78.3%
    assert table["full"]["mean"] == 57.5 and table["tr-5"]["mean"] == 45.0
    assert table["tr-5"]["retention"] == 78.3
    assert table["stock"]["retention"] == "n/a: no reuse"
    assert table["tr-5"]["reused"] == 100.0
    # same output as full prefill: sample 3 only (same score -> same prediction text here)
    assert table["tr-5"]["agreement"] == 33.3 and table["full"]["agreement"] == 100.0


def test_drift_averages_logprob_gaps_over_the_shared_leading_tokens():
    full = {"output_ids": [5, 6, 7], "output_logprobs": [-0.1, -0.2, -0.3]}
    assert report.logprob_drift({"output_ids": [5, 6, 9], "output_logprobs": [-0.2, -0.4, -5.0]}, full) == \
        pytest.approx((0.1 + 0.2) / 2)
    assert report.logprob_drift(dict(full), full) == 0.0
    assert report.logprob_drift({"output_ids": [8], "output_logprobs": [-0.1]}, full) is None
    rows = [{**_row("full", "a", 100, "1"), **full},
            {**_row("tr-0", "a", 100, "1"), "output_ids": [5, 6, 7], "output_logprobs": [-0.1, -0.5, -0.3]}]
    table = report.summarize(rows)["4K"]
    assert table["tr-0"]["drift"] == 0.1 and table["full"]["drift"] == 0.0
    assert "logprob drift" in report.markdown(report.summarize(rows))
    assert report.summarize([_row("full", "a", 100, "1")])["4K"]["full"]["drift"] == "n/a"   # older rows


def test_question_cut_points():
    assert cut_before_last("intro\nWhat a doc\nWhat is x?", "\nWhat ") == len("intro\nWhat a doc")
    with pytest.raises(ValueError, match="not found"):
        cut_before_last("no question here", "\nWhat ")
    assert shared_chars("Q: read\nCTX\nQuestion: q", "CTX") == len("Q: read\nCTX")
    assert SAMPLE.warm_prompt().startswith("DOC") and "What is it?" not in SAMPLE.warm_prompt()


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["run", "--benchmark", "ruler", "--out", str(tmp_path), "--tasks", "niah_triple",
                     "--tokenizer", "x", "--stock-url", "http://127.0.0.1:9", "--tail-replay-url", "http://127.0.0.1:9"]) == 2
    assert "niah_triple" in capsys.readouterr().err
    assert cli.main(["run", "--benchmark", "longbench", "--out", str(tmp_path), "--datasets", "nosuchset",
                     "--source", str(tmp_path)]) == 2
    assert "nosuchset" in capsys.readouterr().err
    (tmp_path / "hotpotqa.jsonl").write_text('{"input": "q"}\n')
    assert cli.main(["run", "--benchmark", "longbench", "--out", str(tmp_path), "--source", str(tmp_path),
                     "--stock-url", "http://127.0.0.1:9", "--tail-replay-url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "hotpotqa.jsonl" in err and "line 1" in err


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    from eval.harness import free_port

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "hotpotqa.jsonl").write_text(json.dumps(
        {"input": "q", "context": "c", "answers": ["a"], "length": 1}) + "\n")
    url = f"http://127.0.0.1:{free_port()}"
    code = cli.main(["run", "--benchmark", "longbench", "--out", str(tmp_path / "o"), "--source", str(tmp_path / "data"),
                     "--stock-url", url, "--tail-replay-url", url])
    assert code == 2
    assert f"cannot reach the server at {url}" in capsys.readouterr().err


def test_middle_truncation_keeps_head_and_question(tiny_model_factory):
    from transformers import AutoTokenizer

    from eval.quality.longbench import truncate_middle

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_factory("qwen3-next"))
    doc = "Intro line. " + " ".join(f"word{i}" for i in range(400))
    sample = EvalSample("longbench", "hotpotqa", "0", doc + "\nQuestion: who?\nAnswer:", len(doc), ("x",), 8, 400)
    short = truncate_middle(sample, tokenizer, 64)
    assert len(tokenizer.encode(short.prompt, add_special_tokens=False)) <= 66
    assert short.prompt.startswith("Intro line.") and short.prompt.endswith("\nQuestion: who?\nAnswer:")
    assert short.prompt[short.shared_chars:] == "\nQuestion: who?\nAnswer:"
    assert truncate_middle(sample, tokenizer, 10_000) is sample
