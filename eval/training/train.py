"""Train a small hybrid on RULER-style tasks (CPU or one GPU): seeded, resumable, logged.

    python -m eval.training.train --arch gdn --run-dir runs/train-gdn \
        --export trained_models/gdn-ruler-7m --tokens 3000000 --max-minutes 55

On a GPU (`--device cuda`) the model runs under bf16 autocast with fp32 weights, batches are
built by `--workers` data-loader processes, and `--fit-minutes M` sizes the token budget of a
fresh run so that it ends after about M minutes (it times a few forward/backward passes at
each curriculum stage's longest length first; the chosen budget is saved with the run).

The data stream is a pure function of (seed, step), and the curriculum and learning rate are
functions of step / total steps, so a resumed run sees exactly the samples an uninterrupted
run would. State (model, optimizer, step, tokens, wall time) is saved to
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
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from eval.fixtures.tokenizer import EOS_TOKEN
from eval.training import tasks
from eval.training.arch import ARCHS, MAX_POSITIONS, SpecialIds, build_model
from eval.training.vocab import VOCAB_SIZE, train_vocab, write_vocab
from sglang_ext.env import export_tokenizers_single_threaded

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

    @property
    def total_steps(self) -> int:
        return max(1, math.ceil(self.tokens / self.tokens_per_step))


def stage_at(progress: float) -> tuple[float, tuple[int, ...], float]:
    return next(stage for stage in CURRICULUM if progress < stage[0] or stage[0] == 1.0)


def lengths_at(progress: float) -> tuple[int, ...]:
    return stage_at(progress)[1]


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


def batch_at(step: int, progress: float, cfg: TrainConfig, tokenizer, counter, eos: int):
    """(input_ids, answer mask, valid mask), each [B, T], of step `step`: a pure function of (seed, step)."""
    rng = random.Random(f"{cfg.seed}-{step}")
    _, lengths, recall_weight = stage_at(progress)
    length = rng.choice(lengths)
    weights = {**TASK_WEIGHTS, tasks.DENSE_RECALL: recall_weight}
    rows = []
    for _ in range(max(1, cfg.tokens_per_step // length)):
        task = rng.choices(list(weights), weights=list(weights.values()))[0]
        rows.append(_encode(_segments(task, length, rng, tokenizer, counter, tokenizer.id_to_token(eos)), tokenizer))
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), eos, dtype=torch.long)
    answer_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row_ids, row_mask) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        answer_mask[i, : len(row_ids)] = torch.tensor(row_mask)
        valid[i, : len(row_ids)] = True
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


def autocast_on(device: torch.device):
    """bf16 autocast on a GPU (weights and optimizer stay fp32); nothing on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


class Run:
    """Model, optimizer and counters of one training run, saved to / resumed from run_dir."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, device: str = "cpu"):
        self.cfg, self.run_dir, self.device = cfg, run_dir, torch.device(device)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = train_vocab(VOCAB_SIZE)
        self.eos = self.tokenizer.token_to_id(EOS_TOKEN)
        self.model = build_model(cfg.arch, VOCAB_SIZE, SpecialIds(self.eos, self.eos), cfg.seed).to(self.device)
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
        state = torch.load(self.state_path, weights_only=False, map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.tokens, self.seconds = state["step"], state["tokens"], state["seconds"]
        torch.set_rng_state(state["torch_rng"].cpu())

    def save(self) -> None:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                 "tokens": self.tokens, "seconds": self.seconds, "torch_rng": torch.get_rng_state()}
        tmp = self.state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.state_path)

    @property
    def done(self) -> bool:
        return self.step >= self.cfg.total_steps

    def train_step(self, batch: tuple[torch.Tensor, ...]) -> dict:
        """One optimizer step on `batch` (the batch of step `self.step`, see `StepBatches`)."""
        ids, answer_mask, valid = (t.to(self.device, non_blocking=True) for t in batch)
        lr = lr_at(self.step, self.cfg.total_steps, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with autocast_on(self.device):
            lm, answer = loss_terms(self.model, ids, answer_mask, valid)
        (lm + self.cfg.answer_loss_weight * answer).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += int(valid.sum())
        return {"step": self.step, "tokens": self.tokens, "seq_len": ids.shape[1], "batch": ids.shape[0],
                "lm_loss": round(lm.item(), 4), "answer_loss": round(answer.item(), 4), "lr": lr}


class StepBatches(torch.utils.data.Dataset):
    """Batch i = `batch_at(i, i / total_steps, ...)`: data-loader workers can build batches ahead."""

    def __init__(self, cfg: TrainConfig, tokenizer, eos: int):
        self.cfg, self.tokenizer, self.eos = cfg, tokenizer, eos
        self.counter = tasks.TokenCounter(tokenizer)

    def __len__(self) -> int:
        return self.cfg.total_steps

    def __getitem__(self, step: int):
        return batch_at(step, step / self.cfg.total_steps, self.cfg, self.tokenizer, self.counter, self.eos)


def batches_from(run: Run, workers: int):
    """The batches of steps run.step .. total_steps - 1, in order, built by `workers` processes."""
    export_tokenizers_single_threaded()
    data = StepBatches(run.cfg, run.tokenizer, run.eos)
    return iter(torch.utils.data.DataLoader(
        data, batch_size=None, sampler=range(run.step, run.cfg.total_steps), num_workers=workers,
        pin_memory=run.device.type == "cuda", prefetch_factor=8 if workers else None,
        persistent_workers=False))


def fit_tokens(cfg: TrainConfig, minutes: float, device: str, passes: int = 3,
               curriculum=CURRICULUM) -> tuple[int, dict]:
    """Token budget for which the curriculum takes about `minutes` on `device`, and the measured
    seconds per token per stage: times whole steps (forward, backward, AdamW) at each stage's
    longest length on a scratch model (the run's own model is built afterwards, untouched)."""
    tokenizer = train_vocab(VOCAB_SIZE)
    eos = tokenizer.token_to_id(EOS_TOKEN)
    model = build_model(cfg.arch, VOCAB_SIZE, SpecialIds(eos, eos), cfg.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    seconds_per_token, start = {}, 0.0
    for end, lengths, _ in curriculum:
        length = max(lengths)
        ids = torch.randint(0, VOCAB_SIZE, (max(1, cfg.tokens_per_step // length), length), device=device)
        mask = torch.ones_like(ids, dtype=torch.bool)
        times = []
        for _ in range(passes + 1):
            _sync(device)
            t0 = time.time()
            with autocast_on(torch.device(device)):
                lm, answer = loss_terms(model, ids, mask, mask)
            (lm + answer).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lm.item(), answer.item()
            times.append(time.time() - t0)
        seconds_per_token[f"{start:.2f}-{end:.2f}:{length}"] = min(times[1:]) / ids.numel()
        start = end
    fractions = [end - begin for (end, *_), begin in zip(curriculum, [0.0] + [c[0] for c in curriculum[:-1]])]
    per_token = sum(f * spt for f, spt in zip(fractions, seconds_per_token.values()))
    del model
    return int(minutes * 60 / per_token), seconds_per_token


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def export(run: Run, out: Path) -> None:
    """bf16 safetensors + config + tokenizer + generation config: an ordinary HF folder."""
    out.mkdir(parents=True, exist_ok=True)
    write_vocab(run.tokenizer, out, MAX_POSITIONS)
    run.model.to("cpu", torch.bfloat16).save_pretrained(out, safe_serialization=True)
    run.model.to(run.device, torch.float32)
    config = json.loads((out / "config.json").read_text())
    config.update(ARCHS[run.cfg.arch][1])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"eos_token_id": run.eos, "pad_token_id": run.eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    summary = {"arch": run.cfg.arch, "steps": run.step, "tokens_seen": run.tokens, "finished": run.done,
               "train_seconds": round(run.seconds, 1), "train_config": asdict(run.cfg), "device": _device_name(run.device)}
    fit_file = run.run_dir / "fit.json"
    if fit_file.exists():
        summary["fit"] = json.loads(fit_file.read_text())
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    log = run.run_dir / "loss_log.jsonl"
    if log.exists():
        (out / "loss_log.jsonl").write_text(log.read_text())


def train(cfg: TrainConfig, run_dir: Path, export_dir: Path | None, max_minutes: float, save_every_min: float,
          threads: int | None = None, export_unfinished: bool = False, device: str = "cpu", workers: int = 0) -> Run:
    if threads:
        torch.set_num_threads(threads)
    run = Run(cfg, run_dir, device)
    batches = batches_from(run, workers)
    start = last_save = time.time()
    run.model.train()
    with open(run_dir / "loss_log.jsonl", "a") as log, tqdm(total=cfg.total_steps, initial=run.step, unit="step",
                                                             desc=f"train {cfg.arch}") as bar:
        while not run.done and time.time() - start < max_minutes * 60:
            t0 = time.time()
            record = run.train_step(next(batches))
            run.seconds += time.time() - t0
            record["seconds"] = round(run.seconds, 1)
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(lm=record["lm_loss"], ans=record["answer_loss"], L=record["seq_len"], tok=record["tokens"])
            if time.time() - last_save > save_every_min * 60:
                run.save()
                last_save = time.time()
    run.save()
    if export_dir is not None and (run.done or export_unfinished):
        export(run, export_dir)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, choices=sorted(ARCHS))
    parser.add_argument("--run-dir", type=Path, required=True, help="state, loss log (resumed if present)")
    parser.add_argument("--export", type=Path, help="where the finished model is written")
    parser.add_argument("--tokens", type=int, default=TrainConfig.tokens, help="token budget of the whole run")
    parser.add_argument("--fit-minutes", type=float,
                        help="fresh run: choose --tokens so that the run takes about this long (timed first)")
    parser.add_argument("--tokens-per-step", type=int, default=TrainConfig.tokens_per_step)
    parser.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--workers", type=int, default=0, help="data-loader processes building batches ahead")
    parser.add_argument("--max-minutes", type=float, default=110.0, help="stop (and save) after this long")
    parser.add_argument("--save-every-min", type=float, default=5.0)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--export-unfinished", action="store_true",
                        help="export at stop even before the token budget is reached (the card says how far)")
    args = parser.parse_args(argv)
    for flag in ("tokens", "tokens_per_step", "fit_minutes", "max_minutes"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.workers < 0:
        parser.error(f"--workers must be >= 0, got {args.workers}")
    cfg = TrainConfig(arch=args.arch, seed=args.seed, tokens=args.tokens, lr=args.lr,
                      tokens_per_step=args.tokens_per_step, warmup_steps=args.warmup_steps)
    if args.fit_minutes is not None:
        cfg = _fitted(cfg, args.run_dir, args.fit_minutes, args.device)
    run = train(cfg, args.run_dir, args.export, args.max_minutes, args.save_every_min, args.threads,
                args.export_unfinished, args.device, args.workers)
    print(json.dumps({"step": run.step, "tokens": run.tokens, "seconds": round(run.seconds), "done": run.done}))
    return 0


def _fitted(cfg: TrainConfig, run_dir: Path, minutes: float, device: str) -> TrainConfig:
    """`cfg` with the token budget of `fit_tokens`; a run being resumed keeps its saved budget."""
    fit_file = run_dir / "fit.json"
    if fit_file.exists():
        return replace(cfg, tokens=json.loads(fit_file.read_text())["tokens"])
    tokens, seconds_per_token = fit_tokens(cfg, minutes, device)
    run_dir.mkdir(parents=True, exist_ok=True)
    fit_file.write_text(json.dumps({"minutes": minutes, "device": device, "tokens": tokens,
                                    "seconds_per_token": seconds_per_token}, indent=2))
    print(f"fit: {tokens} tokens in about {minutes} min on {device}", flush=True)
    return replace(cfg, tokens=tokens)


if __name__ == "__main__":
    raise SystemExit(main())
