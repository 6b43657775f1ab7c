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

Loss = lm_loss_weight x next-token loss over the whole sequence + answer_loss_weight x next-token
loss over the answer tokens only (the answers are ~1% of the tokens; the second term is what
teaches retrieval).

Language-modelling mix (`--text-fraction F`): each row of a batch is, with probability F, a
window of natural training text (`eval.training.text`: training splits only) instead of a task
sample; its tokens count in the whole-sequence term only. `--init-from DIR` continues training
from a model folder this trainer exported (its weights and tokenizer), and `--lengths` replaces
the curriculum by one stage of those lengths (what continued training uses):

    python -m eval.training.train --arch gdn --run-dir runs/lm-gdn --init-from trained_models/gdn-ruler \
        --export runs/lm-gdn/model --text-fraction 0.5 --lengths 1024,2048,4096 --tokens 600000 --lr 5e-4
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
from eval.training.text import TextPool
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


def per_token_loss(model, ids) -> torch.Tensor:
    """Next-token cross-entropy [B, T - 1] of `ids` under `model`."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    target = ids[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none").view_as(target)


def masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `per_token` over `mask` ([B, T - 1]); 0 (not NaN) when the mask is empty."""
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def loss_terms(model, ids, answer_mask, valid) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-token loss over the valid tokens, over the answer tokens; 0 with no answer tokens)."""
    per_token = per_token_loss(model, ids)
    return masked_mean(per_token, valid[:, 1:]), masked_mean(per_token, answer_mask[:, 1:])


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
        self.tokenizer = _tokenizer(cfg)
        self.eos = self.tokenizer.token_to_id(EOS_TOKEN)
        if cfg.init_from:
            self.model = _load_model(cfg.arch, Path(cfg.init_from), SpecialIds(self.eos, self.eos))
        else:
            self.model = build_model(cfg.arch, VOCAB_SIZE, SpecialIds(self.eos, self.eos), cfg.seed)
        self.model.to(self.device)
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
        if saved_cfg != self.cfg.as_json():
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
        ids, answer_mask, valid, is_text = (t.to(self.device, non_blocking=True) for t in batch)
        lr = lr_at(self.step, self.cfg.total_steps, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with autocast_on(self.device):
            per_token = per_token_loss(self.model, ids)
        lm, answer = masked_mean(per_token, valid[:, 1:]), masked_mean(per_token, answer_mask[:, 1:])
        (self.cfg.lm_loss_weight * lm + self.cfg.answer_loss_weight * answer).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens += int(valid.sum())
        record = {"step": self.step, "tokens": self.tokens, "seq_len": ids.shape[1], "batch": ids.shape[0],
                  "lm_loss": round(lm.item(), 4), "answer_loss": round(answer.item(), 4), "lr": lr}
        if self.cfg.text_fraction > 0:
            text_mask = valid[:, 1:] & is_text[:, None]
            record["text_rows"] = int(is_text.sum())
            record["text_loss"] = round(masked_mean(per_token.detach(), text_mask).item(), 4) if text_mask.any() else None
        return record


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


def _tokenizer(cfg: TrainConfig):
    """The init model's tokenizer when continuing a run, else the trained vocabulary."""
    if not cfg.init_from:
        return train_vocab(VOCAB_SIZE)
    from tokenizers import Tokenizer

    path = Path(cfg.init_from) / "tokenizer.json"
    if not path.exists():
        raise SystemExit(f"--init-from {cfg.init_from}: {path} is missing (not a folder this trainer exported)")
    tokenizer = Tokenizer.from_file(str(path))
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"--init-from {cfg.init_from}: vocabulary {tokenizer.get_vocab_size()}, expected {VOCAB_SIZE}")
    return tokenizer


def _load_model(arch: str, folder: Path, ids: SpecialIds):
    """The exported model in `folder` as an fp32 model of `arch` (its config must be `arch`'s
    type and vocabulary), with the training-time settings `build_model` applies."""
    from transformers import AutoModelForCausalLM

    from eval.training.arch import _unclamp_time_step

    if not (folder / "model.safetensors").exists() or not (folder / "config.json").exists():
        raise SystemExit(f"--init-from {folder}: model.safetensors / config.json missing (not an exported model)")
    expected = ARCHS[arch][0](VOCAB_SIZE, ids)
    saved = json.loads((folder / "config.json").read_text())
    if saved.get("model_type") != expected.model_type or saved.get("vocab_size") != VOCAB_SIZE:
        raise SystemExit(f"--init-from {folder}: a {saved.get('model_type')} model of vocabulary "
                         f"{saved.get('vocab_size')}, not --arch {arch} ({expected.model_type}, {VOCAB_SIZE})")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if arch == "mamba2":
        _unclamp_time_step(model)
    return model


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _base_history(init_from: str) -> tuple[dict | None, list[dict]]:
    """The training summary and loss log of the model a continued run started from (if present)."""
    folder = Path(init_from)
    summary_file, log_file = folder / "training_summary.json", folder / "loss_log.jsonl"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
    rows = [json.loads(line) for line in log_file.read_text().splitlines() if line.strip()] if log_file.exists() else []
    return summary, rows


def export(run: Run, out: Path) -> None:
    """bf16 safetensors + config + tokenizer + generation config: an ordinary HF folder.

    A continued run (`init_from`) also records the base model's summary (`base` in
    training_summary.json) and writes one loss log: the base run's rows, then this run's with
    steps and tokens counted on from the base's (marked `"phase": "continued"`)."""
    base_summary, base_rows = _base_history(run.cfg.init_from) if run.cfg.init_from else (None, [])
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
               "train_seconds": round(run.seconds, 1), "train_config": run.cfg.as_json(), "device": _device_name(run.device)}
    fit_file = run.run_dir / "fit.json"
    if fit_file.exists():
        summary["fit"] = json.loads(fit_file.read_text())
    if base_summary is not None:
        summary["base"] = base_summary
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    log = run.run_dir / "loss_log.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    if base_summary is not None:
        steps, tokens = base_summary["steps"], base_summary["tokens_seen"]
        rows = base_rows + [{**r, "step": r["step"] + steps, "tokens": r["tokens"] + tokens, "phase": "continued"}
                            for r in rows]
    if rows:
        (out / "loss_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


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
    parser.add_argument("--text-fraction", type=float, default=0.0,
                        help="probability that a row is natural training text (language-modelling mix)")
    parser.add_argument("--lm-loss-weight", type=float, default=TrainConfig.lm_loss_weight,
                        help="weight of the next-token loss over all tokens")
    parser.add_argument("--answer-loss-weight", type=float, default=TrainConfig.answer_loss_weight,
                        help="weight of the next-token loss over the answer tokens")
    parser.add_argument("--init-from", default="", help="continue from this exported model folder")
    parser.add_argument("--lengths", default="",
                        help="comma-separated lengths: one stage instead of the curriculum")
    parser.add_argument("--recall-weight", type=float, default=TrainConfig.recall_weight,
                        help="dense-recall task weight in the --lengths stage")
    parser.add_argument("--export-unfinished", action="store_true",
                        help="export at stop even before the token budget is reached (the card says how far)")
    args = parser.parse_args(argv)
    for flag in ("tokens", "tokens_per_step", "fit_minutes", "max_minutes"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.workers < 0:
        parser.error(f"--workers must be >= 0, got {args.workers}")
    try:
        lengths = tuple(int(x) for x in args.lengths.split(",") if x.strip())
        cfg = TrainConfig(arch=args.arch, seed=args.seed, tokens=args.tokens, lr=args.lr,
                          tokens_per_step=args.tokens_per_step, warmup_steps=args.warmup_steps,
                          text_fraction=args.text_fraction, lm_loss_weight=args.lm_loss_weight,
                          answer_loss_weight=args.answer_loss_weight, init_from=args.init_from,
                          lengths=lengths, recall_weight=args.recall_weight)
    except ValueError as err:
        parser.error(f"--text-fraction / --lm-loss-weight / --answer-loss-weight / --lengths: {err}")
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
    curriculum = ((1.0, cfg.lengths, cfg.recall_weight),) if cfg.lengths else CURRICULUM
    tokens, seconds_per_token = fit_tokens(cfg, minutes, device, curriculum=curriculum)
    run_dir.mkdir(parents=True, exist_ok=True)
    fit_file.write_text(json.dumps({"minutes": minutes, "device": device, "tokens": tokens,
                                    "seconds_per_token": seconds_per_token}, indent=2))
    print(f"fit: {tokens} tokens in about {minutes} min on {device}", flush=True)
    return replace(cfg, tokens=tokens)


if __name__ == "__main__":
    raise SystemExit(main())
