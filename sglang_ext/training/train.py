"""Train a small hybrid on RULER-style tasks on the CPU: seeded, resumable, logged.

    python -m sglang_ext.training.train --arch gdn --run-dir runs/train-gdn \
        --export trained_models/gdn-ruler-7m --tokens 3000000 --max-minutes 55

The data stream is a pure function of (seed, step), so a resumed run sees exactly the samples
an uninterrupted run would. State (model, optimizer, step, tokens, wall time) is saved to
`run-dir/state.pt` every few minutes and at exit; rerunning the same command resumes. When the
token budget is reached the model is exported (bf16 safetensors + tokenizer + config) to
`--export`. Every step appends a line to `run-dir/loss_log.jsonl`.

Loss = next-token loss over the whole sequence + next-token loss over the answer tokens only
(the answers are ~1% of the tokens; the second term is what teaches retrieval).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sglang_ext.training import tasks
from sglang_ext.training.arch import ARCHS, MAX_POSITIONS, SpecialIds, build_model
from sglang_ext.training.vocab import VOCAB_SIZE, train_vocab, write_vocab
from sglang_ext.models.tokenizer import EOS_TOKEN

#: (fraction of the token budget where the stage ends, sequence lengths drawn in it)
CURRICULUM = ((0.25, (512, 1024)), (0.6, (1024, 2048)), (1.0, (1024, 2048, 4096)))
TASK_WEIGHTS = {"niah_single_1": 1.0, "niah_single_2": 2.0, "niah_multikey_1": 2.0, "niah_multikey_2": 1.5,
                "niah_multivalue": 1.0, "niah_multiquery": 1.0, "vt": 1.0, "qa_1": 1.0}


@dataclass(frozen=True)
class TrainConfig:
    arch: str
    seed: int = 0
    tokens: int = 2_800_000
    tokens_per_step: int = 2048
    lr: float = 1.5e-3
    warmup_steps: int = 60
    weight_decay: float = 0.1
    answer_loss_weight: float = 1.0


def lengths_at(progress: float) -> tuple[int, ...]:
    return next(lengths for end, lengths in CURRICULUM if progress < end or end == 1.0)


def batch_at(step: int, progress: float, cfg: TrainConfig, tokenizer, counter, eos: int):
    """(input_ids [B, T], answer mask [B, T]) of step `step`: a pure function of (seed, step)."""
    rng = random.Random(f"{cfg.seed}-{step}")
    length = rng.choice(lengths_at(progress))
    names = list(TASK_WEIGHTS)
    rows = []
    for _ in range(max(1, cfg.tokens_per_step // length)):
        task = rng.choices(names, weights=[TASK_WEIGHTS[n] for n in names])[0]
        sample = tasks.make_sample(task, length, rng, tokenizer, "train", counter)
        prompt = tokenizer.encode(sample.prompt).ids
        answer = tokenizer.encode(sample.target).ids + [eos]
        rows.append((prompt, answer))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), eos, dtype=torch.long)
    answer_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        answer_mask[i, len(p): len(p) + len(a)] = True
        valid[i, : len(p) + len(a)] = True
    return ids, answer_mask, valid


def loss_terms(model, ids, answer_mask, valid) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids).logits[:, :-1].float()
    target = ids[:, 1:]
    per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none").view_as(target)
    lm_mask, ans_mask = valid[:, 1:], answer_mask[:, 1:]
    return (per_token * lm_mask).sum() / lm_mask.sum(), (per_token * ans_mask).sum() / ans_mask.sum()


def lr_at(step: int, total_steps: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Run:
    """Model, optimizer and counters of one training run, saved to / resumed from run_dir."""

    def __init__(self, cfg: TrainConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = train_vocab(VOCAB_SIZE)
        self.eos = self.tokenizer.token_to_id(EOS_TOKEN)
        self.model = build_model(cfg.arch, VOCAB_SIZE, SpecialIds(self.eos, self.eos), cfg.seed)
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2 and "embed" not in n]
        other = [p for n, p in self.model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                            {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        self.step, self.tokens, self.seconds = 0, 0, 0.0
        self._resume()

    @property
    def state_path(self) -> Path:
        return self.run_dir / "state.pt"

    def _resume(self) -> None:
        if not self.state_path.exists():
            (self.run_dir / "train_config.json").write_text(json.dumps(asdict(self.cfg), indent=2))
            return
        saved_cfg = json.loads((self.run_dir / "train_config.json").read_text())
        if saved_cfg != asdict(self.cfg):
            raise SystemExit(f"{self.run_dir} holds a run with a different config: {saved_cfg}")
        state = torch.load(self.state_path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.tokens, self.seconds = state["step"], state["tokens"], state["seconds"]
        torch.set_rng_state(state["torch_rng"])

    def save(self) -> None:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                 "tokens": self.tokens, "seconds": self.seconds, "torch_rng": torch.get_rng_state()}
        tmp = self.state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.state_path)

    @property
    def done(self) -> bool:
        return self.tokens >= self.cfg.tokens

    def train_step(self, counter, total_steps: int) -> dict:
        ids, answer_mask, valid = batch_at(self.step, self.tokens / self.cfg.tokens, self.cfg, self.tokenizer, counter, self.eos)
        lr = lr_at(self.step, total_steps, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        lm, answer = loss_terms(self.model, ids, answer_mask, valid)
        (lm + self.cfg.answer_loss_weight * answer).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += int(valid.sum())
        return {"step": self.step, "tokens": self.tokens, "seq_len": ids.shape[1], "batch": ids.shape[0],
                "lm_loss": round(lm.item(), 4), "answer_loss": round(answer.item(), 4), "lr": lr}


def export(run: Run, out: Path) -> None:
    """bf16 safetensors + config + tokenizer + generation config: an ordinary HF folder."""
    out.mkdir(parents=True, exist_ok=True)
    write_vocab(run.tokenizer, out, MAX_POSITIONS)
    run.model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    run.model.float()
    config = json.loads((out / "config.json").read_text())
    config.update(ARCHS[run.cfg.arch][1])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"eos_token_id": run.eos, "pad_token_id": run.eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    summary = {"arch": run.cfg.arch, "steps": run.step, "tokens_seen": run.tokens,
               "train_seconds": round(run.seconds, 1), "train_config": asdict(run.cfg)}
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    log = run.run_dir / "loss_log.jsonl"
    if log.exists():
        (out / "loss_log.jsonl").write_text(log.read_text())


def train(cfg: TrainConfig, run_dir: Path, export_dir: Path | None, max_minutes: float, save_every_min: float,
          threads: int | None = None) -> Run:
    if threads:
        torch.set_num_threads(threads)
    run = Run(cfg, run_dir)
    counter = tasks.TokenCounter(run.tokenizer)
    total_steps = cfg.tokens // cfg.tokens_per_step
    start = last_save = time.time()
    run.model.train()
    with open(run_dir / "loss_log.jsonl", "a") as log, tqdm(total=cfg.tokens, initial=run.tokens, unit="tok",
                                                             desc=f"train {cfg.arch}") as bar:
        while not run.done and time.time() - start < max_minutes * 60:
            t0 = time.time()
            record = run.train_step(counter, total_steps)
            run.seconds += time.time() - t0
            record["seconds"] = round(run.seconds, 1)
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.update(record["tokens"] - bar.n)
            bar.set_postfix(lm=record["lm_loss"], ans=record["answer_loss"], L=record["seq_len"])
            if time.time() - last_save > save_every_min * 60:
                run.save()
                last_save = time.time()
    run.save()
    if run.done and export_dir is not None:
        export(run, export_dir)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, choices=sorted(ARCHS))
    parser.add_argument("--run-dir", type=Path, required=True, help="state, loss log (resumed if present)")
    parser.add_argument("--export", type=Path, help="where the finished model is written")
    parser.add_argument("--tokens", type=int, default=TrainConfig.tokens, help="token budget of the whole run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--max-minutes", type=float, default=110.0, help="stop (and save) after this long")
    parser.add_argument("--save-every-min", type=float, default=5.0)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    cfg = TrainConfig(arch=args.arch, seed=args.seed, tokens=args.tokens, lr=args.lr)
    run = train(cfg, args.run_dir, args.export, args.max_minutes, args.save_every_min, args.threads)
    print(json.dumps({"step": run.step, "tokens": run.tokens, "seconds": round(run.seconds), "done": run.done}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
