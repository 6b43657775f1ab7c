"""LongBench sample loading: local JSONL files, the Hub mirror (faked, no network) and errors."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from eval.longbench import data as d
from eval.longbench.config import build_prompt

REPO_ROOT = Path(__file__).resolve().parents[2]


def _record(**overrides):
    record = {
        "input": "Where is Paris?",
        "context": "Paris is in France.",
        "answers": ["France"],
        "length": 5,
        "dataset": "hotpotqa",
        "language": "en",
        "all_classes": None,
        "_id": "abc",
    }
    record.update(overrides)
    return record


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- local files


def test_load_local_jsonl_reads_samples_and_skips_blank_lines(tmp_path):
    path = _write_jsonl(
        tmp_path / "hotpotqa.jsonl",
        [json.dumps(_record()), "", json.dumps(_record(_id="def", answers=["FR", "France"], length=9000))],
    )
    samples = d.load_local_jsonl(path)
    assert [s["_id"] for s in samples] == ["abc", "def"]
    assert samples[1]["answers"] == ["FR", "France"]
    assert samples[1]["length"] == 9000
    assert samples[0]["all_classes"] is None


def test_optional_fields_get_defaults(tmp_path):
    minimal = {"input": "q", "context": "c", "answers": ["a"], "length": 1}
    path = _write_jsonl(tmp_path / "x.jsonl", [json.dumps(minimal)])
    (sample,) = d.load_local_jsonl(path)
    assert sample["all_classes"] is None
    assert sample["dataset"] is None and sample["language"] is None
    assert sample["_id"] == f"{path}, line 1"


def test_missing_field_names_file_line_and_field(tmp_path):
    bad = _record()
    del bad["answers"]
    path = _write_jsonl(tmp_path / "qasper.jsonl", [json.dumps(_record()), "", json.dumps(bad)])
    with pytest.raises(ValueError) as info:
        d.load_local_jsonl(path)
    message = str(info.value)
    assert str(path) in message
    assert "line 3" in message
    assert "missing required field 'answers'" in message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"length": "12"}, "field 'length' must be a non-negative integer"),
        ({"length": True}, "field 'length' must be a non-negative integer"),
        ({"answers": "France"}, "field 'answers' must be a non-empty list of strings"),
        ({"answers": []}, "field 'answers' must be a non-empty list of strings"),
        ({"context": None}, "field 'context' must be a string"),
        ({"all_classes": "City"}, "field 'all_classes' must be a list of strings or null"),
        ({"_id": 7}, "field '_id' must be a string"),
    ],
)
def test_bad_field_types_are_named(tmp_path, overrides, expected):
    path = _write_jsonl(tmp_path / "trec.jsonl", [json.dumps(_record(**overrides))])
    with pytest.raises(ValueError, match=f"line 1: {expected}"):
        d.load_local_jsonl(path)


def test_invalid_json_and_non_object_lines(tmp_path):
    path = _write_jsonl(tmp_path / "lcc.jsonl", [json.dumps(_record()), '{"input": "x",'])
    with pytest.raises(ValueError, match=r"lcc\.jsonl, line 2: not valid JSON"):
        d.load_local_jsonl(path)
    path = _write_jsonl(tmp_path / "lsht.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match="line 1: expected a JSON object, got list"):
        d.load_local_jsonl(path)


def test_empty_and_missing_files(tmp_path):
    empty = _write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match="no samples"):
        d.load_local_jsonl(empty)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        d.load_local_jsonl(tmp_path / "nope.jsonl")


def test_load_samples_from_directory_file_and_e_variant(tmp_path):
    _write_jsonl(tmp_path / "qasper.jsonl", [json.dumps(_record(_id="plain"))])
    _write_jsonl(tmp_path / "qasper_e.jsonl", [json.dumps(_record(_id="e1")), json.dumps(_record(_id="e2"))])
    assert [s["_id"] for s in d.load_samples("qasper", tmp_path)] == ["plain"]
    assert [s["_id"] for s in d.load_samples("qasper", str(tmp_path), e=True)] == ["e1", "e2"]
    assert [s["_id"] for s in d.load_samples("qasper", tmp_path / "qasper_e.jsonl")] == ["e1", "e2"]
    with pytest.raises(FileNotFoundError, match="no hotpotqa.jsonl in"):
        d.load_samples("hotpotqa", tmp_path)
    with pytest.raises(FileNotFoundError, match="neither 'hub'"):
        d.load_samples("hotpotqa", tmp_path / "missing_dir")


def test_unknown_dataset_lists_valid_names(tmp_path):
    with pytest.raises(ValueError) as info:
        d.load_samples("hotpot_qa", tmp_path)
    message = str(info.value)
    assert "'hotpot_qa'" in message
    assert "hotpotqa" in message and "repobench-p" in message and "passage_retrieval_zh" in message
    with pytest.raises(ValueError, match="unknown LongBench-E dataset 'musique'"):
        d.load_samples("musique", tmp_path, e=True)


# ----------------------------------------------------------------------------- hub mirror rows


def _mirror_row(dataset: str, context: str, input_text: str, split_before: str, answer_prefix: str) -> dict:
    """A row laid out like the kvpress mirror: the official prompt cut before `split_before`,
    the remainder minus `answer_prefix` as `question`."""
    prompt = build_prompt(dataset, {"context": context, "input": input_text})
    cut = prompt.index(split_before, prompt.index(context) + len(context))
    assert prompt.endswith(answer_prefix)
    return {
        "context": prompt[:cut],
        "question": prompt[cut : len(prompt) - len(answer_prefix)],
        "answer_prefix": answer_prefix,
        "answers": ["x"],
        "length": 1234,
        "all_classes": None,
        "dataset": dataset,
        "language": "en",
        "_id": "id0",
        "task": dataset,
        "max_new_tokens": 148,
    }


@pytest.mark.parametrize(
    ("dataset", "context", "input_text", "split_before", "answer_prefix"),
    [
        ("narrativeqa", "Once upon a time.", "Who?", "Question: Who?", "Answer:"),
        # context ends with the same "\n" that separates it from the input in the template
        (
            "trec",
            "Question: What is NASA?\nType: Abbreviation\n",
            "Question: Who wrote Hamlet?\nType:",
            "Question: Who wrote",
            "Type:",
        ),
        ("gov_report", "REPORT BODY", "", "Now, write", "Summary:"),
        ("repobench-p", "import os\n", "def f():\n", "def f():", "Next line of code:\n"),
        ("passage_retrieval_en", "Paragraph 1: a\n\nParagraph 2: b", "ABS", "ABS", "The answer is: "),
    ],
)
def test_from_mirror_row_recovers_official_fields(dataset, context, input_text, split_before, answer_prefix):
    row = _mirror_row(dataset, context, input_text, split_before, answer_prefix)
    sample = d.from_mirror_row(dataset, row, "row 0")
    assert sample["context"] == context
    assert sample["input"] == input_text
    assert "question" not in sample and "answer_prefix" not in sample
    assert build_prompt(dataset, sample) == row["context"] + row["question"] + row["answer_prefix"]


def test_from_mirror_row_rejects_foreign_layout():
    row = {"context": "Other: doc", "question": "Q", "answer_prefix": "A:", "answers": ["x"], "length": 1}
    with pytest.raises(ValueError, match="does not match the official 'hotpotqa' template"):
        d.from_mirror_row("hotpotqa", row, "row 3")


def test_from_mirror_row_passes_official_rows_through():
    sample = d.from_mirror_row("hotpotqa", _record(), "row 0")
    assert sample["input"] == "Where is Paris?"


# ----------------------------------------------------------------------------- hub loading (faked)


def _fake_datasets(monkeypatch, load_dataset) -> None:
    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_load_hub_uses_mirror_config_and_split(monkeypatch):
    calls = []
    row = _mirror_row("qasper", "ARTICLE", "Is it?", "Question: Is it?", "Answer:")

    def load_dataset(repo, config, split, revision=None):
        calls.append((repo, config, split, revision))
        return [row, row]

    _fake_datasets(monkeypatch, load_dataset)
    samples = d.load_samples("qasper", "hub", e=True)
    assert calls == [("Xnhyacinth/LongBench", "qasper_e", "test", None)]
    assert [s["context"] for s in samples] == ["ARTICLE", "ARTICLE"]
    assert samples[0]["input"] == "Is it?"


def test_load_hub_failure_is_one_clear_runtime_error(monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Xnhyacinth/LongBench' on the Hub (offline)\nsecond line")

    _fake_datasets(monkeypatch, load_dataset)
    with pytest.raises(RuntimeError) as info:
        d.load_hub("hotpotqa")
    message = str(info.value)
    assert "Xnhyacinth/LongBench" in message and "'hotpotqa'" in message
    assert "ConnectionError: Couldn't reach" in message
    assert "second line" not in message
    assert "instead of 'hub'" in message and ".jsonl" in message
    assert info.value.__suppress_context__  # raised "from None": no chained traceback


def test_load_hub_layout_mismatch_and_chinese_hint(monkeypatch):
    _fake_datasets(monkeypatch, lambda *a, **k: [{"context": "?", "question": "?", "answer_prefix": "?"}])
    expected = "does not match the official 'dureader' template.*may not carry 'dureader'"
    with pytest.raises(RuntimeError, match=expected):
        d.load_hub("dureader")


def test_load_hub_without_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(RuntimeError, match="`datasets` package is not importable"):
        d.load_hub("hotpotqa")


def test_importing_the_package_is_cheap():
    code = (
        "import sys, eval.longbench.data, eval.longbench.metrics, eval.longbench.scoring, eval.longbench.config;"
        "print(sorted(m for m in ('datasets', 'jieba', 'rouge_score', 'nltk') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
