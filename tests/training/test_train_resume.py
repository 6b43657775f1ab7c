"""Training is a pure function of (seed, step): an interrupted, resumed run equals a straight one."""

from __future__ import annotations

import json

import pytest
import torch

from eval.training import tasks
from eval.training.batches import batch_at, batches_from
from eval.training.config import TrainConfig, stage_at
from eval.training.export import export
from eval.training.run import Run

CFG = TrainConfig(arch="mamba2", tokens=1200, tokens_per_step=512, warmup_steps=2)


def _steps(run: Run, n: int, workers: int = 0) -> None:
    batches = batches_from(run, workers)
    for _ in range(n):
        run.train_step(next(batches))


def test_batches_depend_only_on_seed_and_step(tmp_path):
    run = Run(CFG, tmp_path)
    counter = tasks.TokenCounter(run.tokenizer)
    a = batch_at(7, 0.1, CFG, run.tokenizer, counter, run.eos)
    b = batch_at(7, 0.1, CFG, run.tokenizer, counter, run.eos)
    c = batch_at(8, 0.1, CFG, run.tokenizer, counter, run.eos)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0]) or a[0].shape != c[0].shape
    assert a[1].sum() > 0 and (a[1] <= a[2]).all()   # answer tokens are inside the valid tokens


def test_curriculum_grows_lengths_and_starts_with_dense_recall():
    assert max(stage_at(0.0)[1]) < max(stage_at(0.99)[1])
    assert stage_at(0.0)[2] > stage_at(0.99)[2]


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    straight = Run(CFG, tmp_path / "a")
    _steps(straight, 2)
    first = Run(CFG, tmp_path / "b")
    _steps(first, 1, workers=1)   # batches built in a data-loader process: the same data
    first.save()
    resumed = Run(CFG, tmp_path / "b")
    assert resumed.step == 1
    _steps(resumed, 1)
    for (name, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(p, q), name
    assert straight.tokens == resumed.tokens


def test_resume_with_another_config_is_refused(tmp_path):
    run = Run(CFG, tmp_path / "r")
    run.save()
    with pytest.raises(SystemExit, match="different config"):
        Run(TrainConfig(arch="mamba2", tokens=999), tmp_path / "r")


def test_export_is_a_bf16_hf_folder_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    run = Run(CFG, tmp_path / "run")
    export(run, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert next(model.parameters()).dtype == torch.bfloat16
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["time_step_min"] == 0.0 and config["hybrid_override_pattern"]
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == run.eos


def test_fit_tokens_sizes_the_budget_from_timed_passes():
    from eval.training.fit import fit_tokens

    curriculum = ((0.25, (32, 64), 1.0), (1.0, (128,), 1.0))
    cfg = TrainConfig(arch="mamba2", tokens_per_step=256)
    tokens, seconds_per_token = fit_tokens(cfg, minutes=1.0, device="cpu", passes=1, curriculum=curriculum)
    assert list(seconds_per_token) == ["0.00-0.25:64", "0.25-1.00:128"]
    assert all(s > 0 for s in seconds_per_token.values())
    ends = [0.0] + [stage[0] for stage in curriculum]
    per_token = sum((b - a) * s for a, b, s in zip(ends, ends[1:], seconds_per_token.values()))
    assert tokens == int(60 / per_token)


def test_progress_is_counted_in_steps():
    cfg = TrainConfig(arch="mamba2", tokens=1000, tokens_per_step=300)
    assert cfg.total_steps == 4   # the last, partial step is taken


@pytest.mark.parametrize("flags", [["--tokens-per-step", "0"], ["--fit-minutes", "-1"], ["--workers", "-2"]])
def test_bad_numeric_flags_are_refused_by_name(flags, tmp_path, capsys):
    from eval.training.train import main

    with pytest.raises(SystemExit):
        main(["--arch", "mamba2", "--run-dir", str(tmp_path / "r"), *flags])
    assert flags[0] in capsys.readouterr().err
    assert not (tmp_path / "r").exists()   # nothing was started or written
