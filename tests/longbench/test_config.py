"""LongBench v1 config: official tables and prompt formatting."""

from __future__ import annotations

import pytest

from eval.longbench import config as c


def test_tables_cover_the_21_datasets_in_official_order():
    assert len(c.DATASETS) == 21
    assert list(c.DATASET2PROMPT) == list(c.DATASETS)
    assert list(c.DATASET2MAXLEN) == list(c.DATASETS)
    assert set(c.LONGBENCH_E_DATASETS) <= set(c.DATASETS)
    assert len(c.LONGBENCH_E_DATASETS) == 13
    assert not c.CHINESE_DATASETS & set(c.LONGBENCH_E_DATASETS)


def test_official_generation_lengths():
    assert c.max_new_tokens("gov_report") == 512
    assert c.max_new_tokens("samsum") == 128
    assert c.max_new_tokens("hotpotqa") == 32
    assert c.max_new_tokens("lcc") == 64
    counts = {n: sum(1 for v in c.DATASET2MAXLEN.values() if v == n) for n in (32, 64, 128, 512)}
    assert counts == {32: 7, 64: 6, 128: 4, 512: 4}


def test_every_prompt_uses_context_and_known_fields():
    for dataset, template in c.DATASET2PROMPT.items():
        assert "{context}" in template, dataset
        rendered = template.format(context="<C>", input="<I>")
        assert "<C>" in rendered


def test_build_prompt_hotpotqa():
    sample = {"context": "Passage 1:\nParis is in France.", "input": "Where is Paris?", "answers": ["France"]}
    instruction = (
        "Answer the question based on the given passages. "
        "Only give me the answer and do not output any other words."
    )
    expected = (
        f"{instruction}\n\nThe following are given passages.\nPassage 1:\nParis is in France."
        f"\n\n{instruction}\n\nQuestion: Where is Paris?\nAnswer:"
    )
    assert c.build_prompt("hotpotqa", sample) == expected


def test_build_prompt_trec_and_braces_in_context():
    sample = {
        "context": "Question: What is {x}?\nType: Abbreviation",
        "input": "Question: Who wrote Hamlet?\nType:",
    }
    expected = (
        "Please determine the type of the question below. Here are some examples of questions.\n\n"
        "Question: What is {x}?\nType: Abbreviation\nQuestion: Who wrote Hamlet?\nType:"
    )
    assert c.build_prompt("trec", sample) == expected


def test_build_prompt_without_input_field():
    # gov_report's template has no {input}; the field is not needed
    prompt = c.build_prompt("gov_report", {"context": "REPORT"})
    assert prompt == (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\nREPORT\n\nNow, write a one-page summary of the report.\n\nSummary:"
    )


def test_build_prompt_errors_name_the_problem():
    with pytest.raises(ValueError, match="lacks field 'input'"):
        c.build_prompt("hotpotqa", {"context": "x"})
    with pytest.raises(ValueError, match="valid names: narrativeqa"):
        c.build_prompt("hotpot", {"context": "x", "input": "y"})


def test_check_dataset_e_list():
    assert c.check_dataset("qasper", e=True) == "qasper"
    with pytest.raises(ValueError, match="unknown LongBench-E dataset 'narrativeqa'; valid names: qasper"):
        c.check_dataset("narrativeqa", e=True)
