"""Learned per-token decay of every linear layer and head, and its half-life in tokens.

GDN (Qwen3-Next): decay_t = exp(g_t), g_t = -exp(A_log) * softplus(a_t + dt_bias).
Mamba-2 (Nemotron-H): decay_t = exp(dt_t * A), dt_t = softplus(dt_raw_t + dt_bias), A = -exp(A_log).

What a token written d steps ago keeps of its contribution is the product of the decays in
between, i.e. exp(d * mean log-decay) on average. So per head we report the distribution of
decay_t (percentiles) and the "half-life" ln 2 / mean(-log decay): after that many tokens a
write has half its weight left; `tokens_to_1pct` = ln 100 / mean(-log decay) bounds the replay
tail a head needs to forget everything older (a decay-aware replay budget can use it).

    python -m eval.training.decay --model trained_models/gdn-ruler --samples 8
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F

PERCENTILES = (0.1, 0.5, 0.9)


def _gdn_log_decay(layer, captured: list) -> callable:
    original = layer.fix_query_key_value_ordering

    def wrapped(qkvz, ba):
        out = original(qkvz, ba)
        a = out[-1].reshape(*ba.shape[:-1], layer.num_v_heads)
        captured.append((-layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)).reshape(-1, layer.num_v_heads))
        return out

    return wrapped


def _mamba2_hook(mixer, captured: list):
    def hook(_module, _inputs, projected):
        dt = projected[..., -mixer.num_heads:].float()
        dt = F.softplus(dt + mixer.dt_bias).clamp(min=mixer.time_step_limit[0])
        captured.append((dt * -mixer.A_log.float().exp()).reshape(-1, mixer.num_heads))

    return hook


def collect_log_decay(model, batches) -> dict[int, torch.Tensor]:
    """layer index -> log-decay of every token and head [tokens, heads] over `batches` of ids."""
    captured: dict[int, list] = {}
    handles = []
    for index, layer in enumerate(model.model.layers):
        mixer = getattr(layer, "linear_attn", None) or getattr(layer, "mixer", None)
        if mixer is None or not hasattr(mixer, "A_log"):
            continue
        captured[index] = []
        if hasattr(mixer, "fix_query_key_value_ordering"):
            mixer.fix_query_key_value_ordering = _gdn_log_decay(mixer, captured[index])
        else:
            handles.append(mixer.in_proj.register_forward_hook(_mamba2_hook(mixer, captured[index])))
    try:
        with torch.no_grad():
            for ids in batches:
                model(input_ids=torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return {i: torch.cat(v) for i, v in captured.items()}


def head_stats(log_decay: torch.Tensor) -> list[dict]:
    """Per head: decay percentiles, half-life and tokens to 1% (from the mean log-decay)."""
    stats = []
    decay = log_decay.exp()
    for h in range(log_decay.shape[1]):
        mean_neg = float(-log_decay[:, h].mean())
        q = torch.quantile(decay[:, h], torch.tensor(PERCENTILES))
        stats.append({
            "head": h, **{f"decay_p{int(p * 100)}": round(float(v), 5) for p, v in zip(PERCENTILES, q)},
            "half_life_tokens": round(math.log(2) / mean_neg, 1) if mean_neg > 0 else math.inf,
            "tokens_to_1pct": round(math.log(100) / mean_neg, 1) if mean_neg > 0 else math.inf,
        })
    return stats


def decay_report(model_dir: Path, samples: int, length: int) -> dict:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from eval.training import tasks

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    counter = tasks.TokenCounter(tokenizer)
    names = [t for t in tasks.ALL_TASKS if t != "qa_2"]
    batches = [tokenizer.encode(tasks.make_sample(names[i % len(names)], length, random.Random(f"decay-{i}"),
                                                  tokenizer, "eval", counter).prompt).ids for i in range(samples)]
    per_layer = collect_log_decay(model, batches)
    return {"samples": samples, "length": length, "tokens": sum(map(len, batches)),
            "layers": {str(i): head_stats(ld) for i, ld in per_layer.items()}}


def markdown(report: dict) -> str:
    lines = ["| layer | head | decay p10 | p50 | p90 | half-life (tokens) | tokens to 1% |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for layer, heads in report["layers"].items():
        for h in heads:
            lines.append(f"| {layer} | {h['head']} | {h['decay_p10']:.4f} | {h['decay_p50']:.4f} | {h['decay_p90']:.4f} "
                         f"| {h['half_life_tokens']} | {h['tokens_to_1pct']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    args = parser.parse_args(argv)
    report = decay_report(args.model, args.samples, args.length)
    (args.model / "decay.json").write_text(json.dumps(report, indent=2))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
