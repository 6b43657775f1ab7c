"""The training data: batch i is a pure function of (seed, i) (`batch_at`), task samples mixed with
natural-text windows; `StepBatches` / `batches_from` let data-loader workers build them ahead."""

from __future__ import annotations

import random

import torch

from eval.training import tasks
from eval.training.config import TASK_WEIGHTS, TrainConfig
from eval.training.run import Run
from eval.training.text import TextPool
from sglang_ext.env import export_tokenizers_single_threaded


def _segments(task: str, length: int, rng: random.Random, tokenizer, counter, eos_text: str) -> list[tuple[str, bool]]:
    if task == tasks.DENSE_RECALL:
        return tasks.dense_recall_segments(length, rng, tokenizer, "train", counter) + [(eos_text, True)]
    sample = tasks.make_sample(task, length, rng, tokenizer, "train", counter)
    return [(sample.prompt, False), (sample.target + eos_text, True)]


def _encode(segments: list[tuple[str, bool]], tokenizer) -> tuple[list[int], list[bool]]:
    ids, mask = [], []
    for text, is_answer in segments:
        piece = tokenizer.encode(text).ids
        ids += piece
        mask += [is_answer] * len(piece)
    return ids, mask


def batch_at(step: int, progress: float, cfg: TrainConfig, tokenizer, counter, eos: int, text: TextPool | None = None):
    """(input_ids, answer mask, valid mask) [B, T] and is-text-row [B] of step `step`: a pure
    function of (seed, step). With `cfg.text_fraction` > 0 a row is a natural-text window from
    `text` with that probability (no answer tokens); at 0 the rng draws are those of the task-only mix."""
    if cfg.text_fraction > 0 and text is None:
        raise ValueError("cfg.text_fraction > 0 needs a TextPool")
    rng = random.Random(f"{cfg.seed}-{step}")
    _, lengths, recall_weight = cfg.stage(progress)
    length = rng.choice(lengths)
    weights = {**TASK_WEIGHTS, tasks.DENSE_RECALL: recall_weight}
    rows, is_text = [], []
    for _ in range(max(1, cfg.tokens_per_step // length)):
        if cfg.text_fraction > 0 and rng.random() < cfg.text_fraction:
            window = text.window(length, rng)  # type: ignore[union-attr]
            rows.append((window, [False] * len(window)))
            is_text.append(True)
            continue
        task = rng.choices(list(weights), weights=list(weights.values()))[0]
        rows.append(_encode(_segments(task, length, rng, tokenizer, counter, tokenizer.id_to_token(eos)), tokenizer))
        is_text.append(False)
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), eos, dtype=torch.long)
    answer_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row_ids, row_mask) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        answer_mask[i, : len(row_ids)] = torch.tensor(row_mask)
        valid[i, : len(row_ids)] = True
    return ids, answer_mask, valid, torch.tensor(is_text)


class StepBatches(torch.utils.data.Dataset):
    """Batch i = `batch_at(i, i / total_steps, ...)`: data-loader workers can build batches ahead."""

    def __init__(self, cfg: TrainConfig, tokenizer, eos: int):
        self.cfg, self.tokenizer, self.eos = cfg, tokenizer, eos
        self.counter = tasks.TokenCounter(tokenizer)
        self.text = TextPool(tokenizer, seed=cfg.seed) if cfg.text_fraction > 0 else None

    def __len__(self) -> int:
        return self.cfg.total_steps

    def __getitem__(self, step: int):
        return batch_at(step, step / self.cfg.total_steps, self.cfg, self.tokenizer, self.counter, self.eos, self.text)


def batches_from(run: Run, workers: int):
    """The batches of steps run.step .. total_steps - 1, in order, built by `workers` processes."""
    export_tokenizers_single_threaded()
    data = StepBatches(run.cfg, run.tokenizer, run.eos)
    return iter(torch.utils.data.DataLoader(
        data, batch_size=None, sampler=range(run.step, run.cfg.total_steps), num_workers=workers,
        pin_memory=run.device.type == "cuda", prefetch_factor=8 if workers else None,
        persistent_workers=False))
