"""LongBench v1 task configuration: dataset names, official prompts and generation lengths.

The prompt templates and max-new-token limits are THUDM/LongBench's `config/dataset2prompt.json`
and `config/dataset2maxlen.json`, kept verbatim in the JSON files next to this module
(including the upstream "asconcisely" typo of the narrativeqa prompt, which every published
LongBench v1 result was produced with). `build_prompt` formats a template with a sample's
fields exactly as the official pred.py does (`template.format(**sample)`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CHINESE_DATASETS",
    "DATASETS",
    "DATASET2MAXLEN",
    "DATASET2PROMPT",
    "LONGBENCH_E_DATASETS",
    "NO_CHAT_TEMPLATE_DATASETS",
    "build_prompt",
    "check_dataset",
    "max_new_tokens",
]

_HERE = Path(__file__).resolve().parent
PROMPT_FILE = _HERE / "dataset2prompt.json"
MAXLEN_FILE = _HERE / "dataset2maxlen.json"

# The 21 LongBench v1 datasets, in the order of the official pred.py.
DATASETS: tuple[str, ...] = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "multifieldqa_zh",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "dureader",
    "gov_report",
    "qmsum",
    "multi_news",
    "vcsum",
    "trec",
    "triviaqa",
    "samsum",
    "lsht",
    "passage_count",
    "passage_retrieval_en",
    "passage_retrieval_zh",
    "lcc",
    "repobench-p",
)

# The 13 datasets that LongBench-E ("<name>_e") provides, in the order of the official pred.py --e.
LONGBENCH_E_DATASETS: tuple[str, ...] = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)

CHINESE_DATASETS: frozenset[str] = frozenset(
    {"multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"}
)

# Official pred.py sends these prompts without the chat template ("chat models are better off
# without build prompts on these tasks"): few-shot continuation and code completion.
NO_CHAT_TEMPLATE_DATASETS: frozenset[str] = frozenset(
    {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
)


def _load_table(path: Path, value_type: type) -> dict[str, Any]:
    """Load one of the JSON tables and check it covers exactly the 21 datasets."""
    with path.open(encoding="utf-8") as handle:
        table = json.load(handle)
    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected a JSON object mapping dataset name to value")
    missing = [name for name in DATASETS if name not in table]
    extra = [name for name in table if name not in DATASETS]
    if missing or extra:
        raise ValueError(f"{path}: missing datasets {missing}, unexpected keys {extra}")
    bad = [name for name, value in table.items() if not isinstance(value, value_type)]
    if bad:
        raise ValueError(f"{path}: values for {bad} are not {value_type.__name__}")
    return {name: table[name] for name in DATASETS}


DATASET2PROMPT: dict[str, str] = _load_table(PROMPT_FILE, str)
DATASET2MAXLEN: dict[str, int] = _load_table(MAXLEN_FILE, int)


def check_dataset(dataset: str, e: bool = False) -> str:
    """Return `dataset` if it is a LongBench v1 name (a LongBench-E one when `e`), else ValueError."""
    valid = LONGBENCH_E_DATASETS if e else DATASETS
    if dataset not in valid:
        kind = "LongBench-E" if e else "LongBench v1"
        raise ValueError(f"unknown {kind} dataset {dataset!r}; valid names: {', '.join(valid)}")
    return dataset


def max_new_tokens(dataset: str) -> int:
    """Official generation budget (dataset2maxlen.json) for `dataset`."""
    return DATASET2MAXLEN[check_dataset(dataset)]


def build_prompt(dataset: str, sample: Mapping[str, Any]) -> str:
    """The official prompt of `dataset` filled with the sample's fields (`context`, `input`, ...).

    Same as the official pred.py's `dataset2prompt[dataset].format(**sample)`; the context is
    not truncated here (pred.py truncates the tokenized prompt in the middle afterwards).
    """
    template = DATASET2PROMPT[check_dataset(dataset)]
    try:
        return template.format(**sample)
    except KeyError as exc:
        raise ValueError(
            f"sample for {dataset!r} lacks field {exc.args[0]!r} needed by its prompt "
            f"(sample has: {', '.join(sorted(sample)) or 'no fields'})"
        ) from None
