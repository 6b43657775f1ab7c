"""What a training run is: its config (`TrainConfig`), the length curriculum, the task mix and the
learning-rate schedule, each a function of the step so that a resumed run sees what an
uninterrupted one would."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

#: (fraction of the steps where the stage ends, sequence lengths drawn in it, weight of
#: the dense-recall task in it): short dense recall first, so copying is learned early
CURRICULUM = ((0.35, (128, 256), 24.0), (0.7, (512, 1024), 6.0), (1.0, (1024, 2048, 4096), 2.0))
TASK_WEIGHTS = {"niah_single_1": 1.0, "niah_single_2": 2.0, "niah_multikey_1": 2.0, "niah_multikey_2": 1.5,
                "niah_multivalue": 1.0, "niah_multiquery": 1.0, "vt": 1.0, "qa_1": 1.0}


@dataclass(frozen=True)
class TrainConfig:
    arch: str
    seed: int = 0
    tokens: int = 2_000_000
    tokens_per_step: int = 2048
    lr: float = 2e-3
    warmup_steps: int = 60
    weight_decay: float = 0.1
    answer_loss_weight: float = 1.0
    lm_loss_weight: float = 1.0
    #: probability that a row is a window of natural training text instead of a task sample
    text_fraction: float = 0.0
    #: model folder (exported by this trainer) whose weights and tokenizer the run starts from
    init_from: str = ""
    #: non-empty: one stage of these lengths (dense-recall weight `recall_weight`) instead of CURRICULUM
    lengths: tuple[int, ...] = ()
    recall_weight: float = 2.0

    def __post_init__(self):
        if not 0.0 <= self.text_fraction <= 1.0:
            raise ValueError(f"text_fraction must be in [0, 1], got {self.text_fraction}")
        if self.lm_loss_weight < 0 or self.answer_loss_weight < 0:
            raise ValueError(f"loss weights must be >= 0, got lm {self.lm_loss_weight}, answer {self.answer_loss_weight}")
        if any(n <= 0 for n in self.lengths):
            raise ValueError(f"lengths must be > 0, got {self.lengths}")

    def stage(self, progress: float) -> tuple[float, tuple[int, ...], float]:
        """(end, lengths, dense-recall weight) of the stage at `progress`."""
        return (1.0, self.lengths, self.recall_weight) if self.lengths else stage_at(progress)

    def as_json(self) -> dict:
        return json.loads(json.dumps(asdict(self)))

    @property
    def total_steps(self) -> int:
        return max(1, math.ceil(self.tokens / self.tokens_per_step))


def stage_at(progress: float) -> tuple[float, tuple[int, ...], float]:
    return next(stage for stage in CURRICULUM if progress < stage[0] or stage[0] == 1.0)


def lr_at(step: int, total_steps: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
