"""RULER-style training / evaluation samples: budgets, answers, splits, determinism."""

from __future__ import annotations

import random

import pytest

from eval import corpus
from eval.training import tasks
from eval.training.vocab import train_vocab


@pytest.fixture(scope="module")
def tokenizer():
    return train_vocab()


@pytest.fixture(scope="module")
def counter(tokenizer):
    return tasks.TokenCounter(tokenizer)


def test_regex_sentence_splitter():
    text = 'He left. "Why?" she asked! Then 3 dogs ran. e.g. this stays. Mr. Smith came.'
    assert corpus.split_sentences(text) == ['He left.', '"Why?" she asked!', 'Then 3 dogs ran. e.g. this stays.',
                                            'Mr.', 'Smith came.']


def test_held_out_parts_are_disjoint_from_training():
    # the essays are cut at one point; a few short sentences ("Why?") recur across essays
    held_out, train = corpus.essay_sentences("eval"), set(corpus.essay_sentences("train"))
    assert sum(s in train for s in held_out) < 0.02 * len(held_out)
    train_q = {i.question for i in corpus.squad("train").items}
    assert not train_q & {i.question for i in corpus.squad("eval").items}


@pytest.mark.parametrize("task", tasks.ALL_TASKS)
@pytest.mark.parametrize("length", [1024, 4096])
def test_sample_fits_its_budget_and_holds_its_answers(task, length, tokenizer, counter):
    sample = tasks.make_sample(task, length, random.Random(f"t-{task}-{length}"), tokenizer, "eval", counter)
    prompt_tokens = len(tokenizer.encode(sample.prompt).ids)
    assert 0.75 * length <= prompt_tokens + sample.tokens_to_generate <= 1.1 * length
    if task.startswith("qa"):
        assert any(a.lower() in sample.prompt.lower() for a in sample.answers)
    else:
        assert all(a in sample.prompt for a in sample.answers)
        assert all(a in sample.target for a in sample.answers)


def test_multikey_needles_differ_and_only_the_asked_value_is_the_answer(tokenizer, counter):
    sample = tasks.make_sample("niah_multikey_1", 2048, random.Random(3), tokenizer, "train", counter)
    assert sample.prompt.count("One of the special magic numbers for") == 4
    assert len(sample.answers) == 1


def test_same_rng_same_sample(tokenizer):
    a = tasks.make_sample("niah_single_2", 1024, random.Random(5), tokenizer)
    b = tasks.make_sample("niah_single_2", 1024, random.Random(5), tokenizer)
    assert a == b


def test_unknown_task_is_named(tokenizer):
    with pytest.raises(ValueError, match="niah_triple"):
        tasks.make_sample("niah_triple", 1024, random.Random(0), tokenizer)


def test_held_out_variants_are_not_trained_on():
    from eval.training.config import TASK_WEIGHTS

    assert set(TASK_WEIGHTS) == set(tasks.TRAIN_TASKS)
    assert not set(TASK_WEIGHTS) & set(tasks.HELD_OUT_TASKS)


def test_dense_recall_asks_only_needles_it_holds(tokenizer, counter):
    pieces = tasks.dense_recall_segments(512, random.Random(2), tokenizer, "train", counter)
    context = pieces[0][0]
    answers = [text for text, is_answer in pieces if is_answer]
    assert len(answers) == 4
    assert all(f"is: {a.strip(' .')}." in context for a in answers)
    total = sum(len(tokenizer.encode(t).ids) for t, _ in pieces)
    assert 400 <= total <= 560
