"""The language-modelling mix: natural-text rows in the batch, the loss weights, continued training."""

from __future__ import annotations

import random

import pytest
import torch

from eval.training import tasks
from eval.training.batches import batch_at
from eval.training.config import TrainConfig
from eval.training.export import export
from eval.training.loss import loss_terms
from eval.training.run import Run
from eval.training.text import TextPool
from eval.training.train import main

CFG = TrainConfig(arch="mamba2", tokens=4096, tokens_per_step=512, warmup_steps=1, lengths=(128,), weight_decay=0.0)
PASSAGES = {"a": ["alpha beta gamma delta. " * 40], "b": ["one two three four five. " * 30, "six seven eight. " * 20]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return Run(CFG, tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def pool(run):
    return TextPool(run.tokenizer, PASSAGES)


def _batch(run, pool, step, **changes):
    cfg = TrainConfig(**{**CFG.__dict__, **changes})
    return batch_at(step, 0.5, cfg, run.tokenizer, tasks.TokenCounter(run.tokenizer), run.eos, pool)


def _is_window(pool, ids: list[int]) -> bool:
    return any(ids == s[i:i + len(ids)] for s in pool.streams.values() for i in range(len(s) - len(ids) + 1))


def test_text_rows_are_windows_of_the_pool_without_answer_tokens(run, pool):
    ids, answer, valid, is_text = _batch(run, pool, 3, text_fraction=1.0)
    assert is_text.all() and ids.shape == (4, 128)
    assert not answer.any() and valid.all()
    assert all(_is_window(pool, row.tolist()) for row in ids)
    again = _batch(run, pool, 3, text_fraction=1.0)
    assert torch.equal(ids, again[0])          # a pure function of (seed, step)


def test_mixed_batches_hold_both_kinds_and_task_rows_keep_their_answers(run, pool):
    kinds = []
    for step in range(6):
        ids, answer, valid, is_text = _batch(run, pool, step, text_fraction=0.5)
        for row in range(ids.shape[0]):
            kinds.append(bool(is_text[row]))
            assert answer[row].any() != bool(is_text[row])   # task rows have answers, text rows none
    assert 0.2 < sum(kinds) / len(kinds) < 0.8


def test_fraction_zero_is_the_task_only_mix(run, pool):
    with_pool = _batch(run, pool, 5, text_fraction=0.0)
    without = batch_at(5, 0.5, CFG, run.tokenizer, tasks.TokenCounter(run.tokenizer), run.eos)
    assert all(torch.equal(a, b) for a, b in zip(with_pool, without)) and not with_pool[3].any()
    with pytest.raises(ValueError, match="TextPool"):
        batch_at(5, 0.5, TrainConfig(**{**CFG.__dict__, "text_fraction": 0.5}), run.tokenizer,
                 tasks.TokenCounter(run.tokenizer), run.eos)


def test_loss_without_answer_tokens_is_finite_and_text_loss_is_logged(run, pool):
    ids, answer, valid, is_text = _batch(run, pool, 1, text_fraction=1.0)
    lm, ans = loss_terms(run.model, ids, answer, valid)
    assert torch.isfinite(lm) and ans.item() == 0.0
    text_run = Run(TrainConfig(**{**CFG.__dict__, "text_fraction": 1.0}), run.run_dir.parent / "text")
    record = text_run.train_step((ids, answer, valid, is_text))
    assert record["text_rows"] == 4 and record["text_loss"] == pytest.approx(record["lm_loss"], abs=1e-3)


@pytest.mark.parametrize("lm_weight, changes", [(0.0, False), (1.0, True)])
def test_the_lm_loss_weight_scales_the_update(tmp_path, run, pool, lm_weight, changes):
    """A text-only batch has no answer tokens, so with lm weight 0 the loss is 0 and nothing moves
    (no weight decay); with weight 1 the weights move."""
    cfg = TrainConfig(**{**CFG.__dict__, "text_fraction": 1.0, "lm_loss_weight": lm_weight})
    fresh = Run(cfg, tmp_path / "r")
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    fresh.train_step(_batch(run, pool, 2, text_fraction=1.0))
    moved = any(not torch.equal(before[k], v) for k, v in fresh.model.state_dict().items())
    assert moved == changes


def test_continued_training_starts_from_the_exported_weights(tmp_path, run):
    export(run, tmp_path / "model")
    cont = Run(TrainConfig(**{**CFG.__dict__, "init_from": str(tmp_path / "model")}), tmp_path / "cont")
    for (name, p), q in zip(run.model.state_dict().items(), cont.model.state_dict().values()):
        assert torch.equal(p.to(torch.bfloat16).float(), q), name
    assert cont.tokenizer.to_str() == run.tokenizer.to_str()
    with pytest.raises(SystemExit, match="not --arch gdn"):
        Run(TrainConfig(arch="gdn", init_from=str(tmp_path / "model")), tmp_path / "wrong")


def test_a_continued_export_carries_the_base_history(tmp_path, run):
    import json

    export(run, tmp_path / "model")
    base = {"step": 5, "tokens": 2000, "seq_len": 128, "lm_loss": 2.0, "answer_loss": 1.0}
    (tmp_path / "model" / "loss_log.jsonl").write_text(json.dumps(base) + "\n")
    summary = json.loads((tmp_path / "model" / "training_summary.json").read_text())
    summary.update(steps=5, tokens_seen=2000)
    (tmp_path / "model" / "training_summary.json").write_text(json.dumps(summary))
    cont = Run(TrainConfig(**{**CFG.__dict__, "init_from": str(tmp_path / "model")}), tmp_path / "cont")
    (cont.run_dir / "loss_log.jsonl").write_text(json.dumps({**base, "step": 1, "tokens": 300}) + "\n")
    export(cont, tmp_path / "out")
    rows = [json.loads(line) for line in (tmp_path / "out" / "loss_log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["tokens"], r.get("phase")) for r in rows] == [(5, 2000, None), (6, 2300, "continued")]
    out_summary = json.loads((tmp_path / "out" / "training_summary.json").read_text())
    assert out_summary["base"]["tokens_seen"] == 2000 and out_summary["train_config"]["init_from"]


def test_training_text_is_disjoint_from_the_held_out_text():
    from eval import corpus
    from eval.training.text import train_passages

    for source, qa in (("squad", corpus.squad), ("hotpotqa", corpus.hotpotqa)):
        assert not set(train_passages(source)) & set(qa("eval").paragraphs), source
    essays = train_passages("essays")[0]
    held = corpus.essay_sentences("eval")
    assert all(s not in essays for s in random.Random(0).sample(held, 50) if len(s) > 60)


@pytest.mark.parametrize("flags, named", [(["--text-fraction", "1.5"], "--text-fraction"),
                                          (["--lm-loss-weight", "-1"], "--lm-loss-weight"),
                                          (["--lengths", "0,128"], "--lengths")])
def test_bad_mix_flags_are_refused_by_name(tmp_path, capsys, flags, named):
    with pytest.raises(SystemExit):
        main(["--arch", "mamba2", "--run-dir", str(tmp_path / "r"), *flags])
    assert named in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_fit_minutes_times_the_lengths_stage(tmp_path):
    import json

    from eval.training.fit import fitted as _fitted

    cfg = TrainConfig(arch="mamba2", tokens_per_step=256, lengths=(64, 128))
    fitted = _fitted(cfg, tmp_path, 1.0, "cpu")
    timed = json.loads((tmp_path / "fit.json").read_text())["seconds_per_token"]
    assert list(timed) == ["0.00-1.00:128"] and fitted.tokens == int(60 / timed["0.00-1.00:128"])


def test_the_card_describes_a_continued_run_and_only_then():
    from eval.training.card import continued_text

    cfg = TrainConfig(arch="mamba2", text_fraction=0.25, lengths=(1024, 2048), init_from="trained_models/m").as_json()
    summary = {"arch": "mamba2", "steps": 15, "tokens_seen": 59210, "finished": True, "train_seconds": 121.0,
               "train_config": cfg, "device": "cpu"}
    assert continued_text("m", summary) == ""
    text = continued_text("m", {**summary, "base": {"steps": 3616}})
    assert "--init-from trained_models/m" in text and "--text-fraction 0.25" in text and "--lengths 1024,2048" in text
    assert "59,210 of a 2,000,000-token schedule (finished)" in text
