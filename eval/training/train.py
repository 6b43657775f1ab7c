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
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eval.training.arch import ARCHS
from eval.training.batches import batches_from
from eval.training.config import TrainConfig
from eval.training.export import export
from eval.training.fit import fitted
from eval.training.run import Run


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
        cfg = fitted(cfg, args.run_dir, args.fit_minutes, args.device)
    run = train(cfg, args.run_dir, args.export, args.max_minutes, args.save_every_min, args.threads,
                args.export_unfinished, args.device, args.workers)
    print(json.dumps({"step": run.step, "tokens": run.tokens, "seconds": round(run.seconds), "done": run.done}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
