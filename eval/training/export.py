"""A trained model written out as an ordinary Hugging Face folder (bf16 safetensors, config,
tokenizer, generation config) with its training summary and loss log."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eval.training.arch import ARCHS, MAX_POSITIONS
from eval.training.run import Run
from eval.training.vocab import write_vocab


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


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
