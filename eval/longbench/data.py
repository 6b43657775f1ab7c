"""Loading LongBench v1 / LongBench-E samples from local JSONL files or the Hugging Face Hub.

A sample is a dict in the official LongBench format: `input`, `context`, `answers` (list of
str), `length` (int), `all_classes` (list of str or None), `dataset`, `language`, `_id`.

Sources:
* a local directory holding the official files (`<dataset>.jsonl`, `<dataset>_e.jsonl`, as in
  LongBench's data.zip), or one such file;
* "hub": the Parquet mirror `Xnhyacinth/LongBench` (config `<dataset>` or `<dataset>_e`, split
  "test"). `THUDM/LongBench` itself is a loading script, which `datasets` >= 4 refuses. The
  mirror (built by NVIDIA kvpress) stores each prompt pre-split into `context` (prompt text up to
  and around the document), `question` and `answer_prefix`; `load_hub` turns those rows back
  into the official `context` / `input` fields by matching them against the official prompt
  template, so `config.build_prompt` gives the official prompt for either source. The mirror
  was built for the English datasets; Chinese ones may be missing there.

`datasets` is imported only inside `load_hub`, so importing this module is cheap.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from string import Formatter
from typing import Any

from eval.longbench.config import CHINESE_DATASETS, DATASET2PROMPT, check_dataset

__all__ = [
    "HUB_REPO",
    "HUB_SPLIT",
    "Sample",
    "from_mirror_row",
    "load_hub",
    "load_local_jsonl",
    "load_samples",
    "local_file_for",
    "validate_sample",
]

Sample = dict[str, Any]

HUB_REPO = "Xnhyacinth/LongBench"
HUB_SPLIT = "test"

_OFFLINE_HINT = (
    "To run without the Hub, download the official LongBench data (data.zip in the THUDM/LongBench "
    "dataset repository: one <dataset>.jsonl and <dataset>_e.jsonl per dataset) and pass its "
    "directory (or one .jsonl file) as the source instead of 'hub'."
)


# ----------------------------------------------------------------------------- validation


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def validate_sample(record: Any, where: str) -> Sample:
    """Check one record against the LongBench format and return it as a sample dict.

    Required: `input` and `context` (str), `answers` (non-empty list of str), `length`
    (non-negative int). Optional: `all_classes` (list of str or null; default None), `_id`,
    `dataset`, `language` (str or null; `_id` defaults to `where`). Any other keys are kept.
    Raises ValueError naming `where` and the missing or bad field.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for field in ("input", "context", "answers", "length"):
        if field not in record:
            raise ValueError(f"{where}: missing required field {field!r}")
    for field in ("input", "context"):
        if not isinstance(record[field], str):
            raise ValueError(f"{where}: field {field!r} must be a string, got {type(record[field]).__name__}")
    answers = record["answers"]
    if not _is_str_list(answers) or not answers:
        raise ValueError(f"{where}: field 'answers' must be a non-empty list of strings, got {answers!r:.80}")
    length = record["length"]
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"{where}: field 'length' must be a non-negative integer, got {length!r:.80}")
    all_classes = record.get("all_classes")
    if all_classes is not None and not _is_str_list(all_classes):
        raise ValueError(
            f"{where}: field 'all_classes' must be a list of strings or null, got {all_classes!r:.80}"
        )
    for field in ("_id", "dataset", "language"):
        value = record.get(field)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    sample: Sample = dict(record)
    sample["all_classes"] = all_classes
    sample.setdefault("dataset", None)
    sample.setdefault("language", None)
    if sample.get("_id") is None:
        sample["_id"] = where
    return sample


# ----------------------------------------------------------------------------- local files


def load_local_jsonl(path: str | Path) -> list[Sample]:
    """Samples of one LongBench-format JSONL file (blank lines are skipped).

    Raises FileNotFoundError if the file is missing and ValueError naming the file, the line
    number and the problem for a line that is not JSON or not a valid sample.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"LongBench data file not found: {path}")
    samples: list[Sample] = []
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            samples.append(validate_sample(record, where))
    if not samples:
        raise ValueError(f"{path}: no samples in file")
    return samples


def local_file_for(directory: str | Path, dataset: str, e: bool = False) -> Path:
    """Path of the official file for `dataset` in `directory`: `<dataset>.jsonl` or `<dataset>_e.jsonl`."""
    return Path(directory) / f"{dataset}{'_e' if e else ''}.jsonl"


# ----------------------------------------------------------------------------- hub mirror


def _template_parts(dataset: str) -> tuple[list[str], list[str]]:
    """Literal pieces and field names of the official template: (["A", "B", "C"], ["context", "input"])."""
    literals: list[str] = []
    fields: list[str] = []
    for literal, field, _spec, _conv in Formatter().parse(DATASET2PROMPT[dataset]):
        literals.append(literal)
        if field is not None:
            fields.append(field)
    if len(literals) == len(fields):  # template ends with a field: empty trailing literal
        literals.append("")
    return literals, fields


def from_mirror_row(dataset: str, row: Mapping[str, Any], where: str) -> Sample:
    """Turn one row of the kvpress-style mirror back into an official LongBench sample.

    The mirror row's `context + question + answer_prefix` is the official prompt; its raw
    `context` and `input` are recovered by matching that prompt against the official template,
    using the length of the row's `context` to place the context/question boundary. A row that
    already has `input` is taken as being in the official format. Raises ValueError if the row
    does not fit the template.
    """
    if "input" in row:
        return validate_sample(row, where)
    for field in ("context", "question", "answer_prefix"):
        if not isinstance(row.get(field), str):
            raise ValueError(f"{where}: mirror row lacks string field {field!r}")
    full = row["context"] + row["question"] + row["answer_prefix"]
    literals, fields = _template_parts(dataset)
    head, tail = literals[0], literals[-1]
    if not full.startswith(head) or not full.endswith(tail) or len(full) < len(head) + len(tail):
        raise ValueError(f"{where}: prompt text does not match the official {dataset!r} template")
    if fields == ["context"]:
        context, input_text = full[len(head) : len(full) - len(tail)], ""
    elif fields == ["context", "input"]:
        between = literals[1]
        row_context_end = len(row["context"])
        # The mirror keeps a prefix of `between` at the end of its `context` field.
        candidates = [
            end
            for end in range(max(len(head), row_context_end - len(between)), row_context_end + 1)
            if full.startswith(between, end) and end + len(between) <= len(full) - len(tail)
        ]
        if not candidates:
            raise ValueError(f"{where}: cannot find where the context ends in the {dataset!r} prompt")
        end = candidates[0]
        context = full[len(head) : end]
        input_text = full[end + len(between) : len(full) - len(tail)]
    else:
        raise ValueError(f"{where}: unsupported template fields {fields} for {dataset!r}")
    if DATASET2PROMPT[dataset].format(context=context, input=input_text) != full:
        raise ValueError(f"{where}: recovered fields do not rebuild the official {dataset!r} prompt")
    record = {key: value for key, value in row.items() if key not in ("question", "answer_prefix")}
    record["context"], record["input"] = context, input_text
    return validate_sample(record, where)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else '(no message)'}"


def load_hub(
    dataset: str, e: bool = False, *, repo: str = HUB_REPO, revision: str | None = None
) -> list[Sample]:
    """Samples of `dataset` (LongBench-E when `e`) from the Parquet mirror on the Hugging Face Hub.

    Any failure (no `datasets` package, no network, missing config, unexpected layout) is raised
    as one RuntimeError saying what failed and how to use local files instead.
    """
    check_dataset(dataset, e)
    config = f"{dataset}_e" if e else dataset
    what = f"LongBench {config!r} from the Hugging Face Hub ({repo}, config {config!r}, split {HUB_SPLIT!r})"
    hint = _OFFLINE_HINT
    if dataset in CHINESE_DATASETS:
        hint = f"The mirror was built for the English datasets and may not carry {dataset!r}. " + hint
    try:
        import datasets  # lazy: heavy import
    except ImportError as exc:
        raise RuntimeError(
            f"could not load {what}: the `datasets` package is not importable ({_short(exc)}). {hint}"
        ) from None
    try:
        rows = datasets.load_dataset(repo, config, split=HUB_SPLIT, revision=revision)
        samples = [
            from_mirror_row(dataset, row, f"{repo}/{config} row {index}") for index, row in enumerate(rows)
        ]
    except Exception as exc:  # noqa: BLE001 - every hub failure becomes one clear message
        raise RuntimeError(f"could not load {what}: {_short(exc)}. {hint}") from None
    if not samples:
        raise RuntimeError(f"could not load {what}: the split is empty. {hint}")
    return samples


# ----------------------------------------------------------------------------- entry point


def load_samples(dataset: str, source: str | Path, e: bool = False) -> list[Sample]:
    """Samples of `dataset` (LongBench-E when `e`) from `source`.

    `source` is "hub", a directory holding `<dataset>.jsonl` / `<dataset>_e.jsonl`, or a JSONL
    file. Unknown dataset names raise ValueError listing the valid ones.
    """
    check_dataset(dataset, e)
    if isinstance(source, str) and source == "hub":
        return load_hub(dataset, e)
    path = Path(source)
    if path.is_dir():
        file = local_file_for(path, dataset, e)
        if not file.is_file():
            raise FileNotFoundError(
                f"no {file.name} in {path} (expected the official LongBench file for {dataset!r})"
            )
        return load_local_jsonl(file)
    if path.is_file():
        return load_local_jsonl(path)
    raise FileNotFoundError(
        f"LongBench source {str(source)!r} is neither 'hub', an existing directory nor a file"
    )
