"""The committed trained hybrids load the normal way, SGLang agrees with transformers on them,
and they answer a fixed held-out needle question through the server."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from eval.harness import ServerProcess, start_servers, stop_servers
from eval.quality.ruler import ruler_score
from eval.reference import greedy_reference, load_reference_model
from eval.training import tasks
from eval.training.evaluate import SERVER_ARGS

MODELS = Path(__file__).resolve().parents[2] / "trained_models"
NAMES = ("gdn-ruler", "mamba2-ruler")
#: a held-out sample (eval split, a seed never used in training), as evaluate.py draws it
NEEDLE = ("niah_single_2", 2048, "eval-niah_single_2-2048-0")
NEW_TOKENS = 12


def _sample(name: str) -> tasks.Sample:
    task, length, seed = NEEDLE
    tokenizer = Tokenizer.from_file(str(MODELS / name / "tokenizer.json"))
    return tasks.make_sample(task, length, random.Random(seed), tokenizer, "eval")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("trained_logs")
    procs = {n: ServerProcess(str(MODELS / n), SERVER_ARGS, log_path=logs / f"{n}.log") for n in NAMES}
    start_servers(list(procs.values()))
    try:
        yield procs
    finally:
        stop_servers(list(procs.values()))


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_is_small_bf16_with_a_card(name):
    folder = MODELS / name
    assert (folder / "model.safetensors").stat().st_size <= 25 * 1024 * 1024
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    card = (folder / "README.md").read_text()
    assert "RULER-style accuracy" in card and "half-life" in card.lower()
    assert json.loads((folder / "ruler_scores.json").read_text())["scores"]


@pytest.mark.parametrize("name", NAMES)
def test_sglang_and_transformers_agree_on_greedy_output(servers, name):
    sample = _sample(name)
    ids = Tokenizer.from_file(str(MODELS / name / "tokenizer.json")).encode(sample.prompt).ids
    reference = greedy_reference(load_reference_model(MODELS / name), ids, NEW_TOKENS)
    out = servers[name].generate(input_ids=ids, return_logprob=True,
                                 sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
    assert out["output_ids"] == reference.output_ids
    logprobs = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(logprobs, reference.output_logprobs)) < 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_answers_a_held_out_needle_question(servers, name):
    sample = _sample(name)
    out = servers[name].generate(text=sample.prompt,
                                 sampling_params={"max_new_tokens": sample.tokens_to_generate, "temperature": 0})
    assert ruler_score(tasks.METRIC[sample.task], out["text"], sample.answers) == 100.0, (out["text"], sample.answers)
