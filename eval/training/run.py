"""One training run's state: model, optimizer and counters (`Run`), built fresh or from a model this
trainer exported, saved to and resumed from its run folder, and one optimizer step."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from eval.fixtures.tokenizer import EOS_TOKEN
from eval.training.arch import ARCHS, SpecialIds, build_model
from eval.training.config import TrainConfig, lr_at
from eval.training.loss import autocast_on, masked_mean, per_token_loss
from eval.training.vocab import VOCAB_SIZE, train_vocab


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
