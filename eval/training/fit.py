"""`--fit-minutes`: the token budget for which a fresh run takes about that long, from a few timed
steps at each curriculum stage's longest length (saved with the run so a resumed run keeps it)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from eval.fixtures.tokenizer import EOS_TOKEN
from eval.training.arch import SpecialIds, build_model
from eval.training.config import CURRICULUM, TrainConfig
from eval.training.loss import autocast_on, loss_terms
from eval.training.vocab import VOCAB_SIZE, train_vocab


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


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fitted(cfg: TrainConfig, run_dir: Path, minutes: float, device: str) -> TrainConfig:
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
