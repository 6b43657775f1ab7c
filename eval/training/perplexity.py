"""Held-out perplexity of a model folder at document lengths 1K-8K (transformers, fp32, CPU).

Documents are cut from the held-out text the quality harness's perplexity benchmark reads
(`eval.quality.perplexity.make_samples`: last 15% of the essays, every 7th SQuAD / HotpotQA
article), never trained on, including by the language-modelling mix (`eval.training.text`).
Per length L: perplexity over all L - 1 predicted tokens of each document, and over its last
`--tail` tokens only (those are predicted with the most context, so they show what long memory
buys), pooled over documents (exp of the mean NLL per token).

    python -m eval.training.perplexity --model trained_models/gdn-ruler --lengths 1024,2048,4096,8192 \
        --samples 2 --out runs/ppl-gdn.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from eval.quality.perplexity import SOURCES, make_samples


def token_nll(model: Any, ids: list[int]) -> torch.Tensor:
    """NLL [len(ids) - 1] of every token after the first, given all tokens before it."""
    from eval.training.loss import per_token_loss

    with torch.no_grad():
        return per_token_loss(model, torch.tensor([ids]))[0]


def perplexity_table(model: Any, tokenizer: Any, lengths: list[int], samples: int, tail: int,
                     sources: Iterable[str] = SOURCES) -> dict[str, dict]:
    """length -> {ppl, tail_ppl, documents, tokens}: pooled over `samples` documents per source."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text).ids

    table = {}
    for length in lengths:
        docs = make_samples(encode, [length], 0, samples, sources)
        nll = [token_nll(model, list(d.doc_ids)) for d in docs]
        every = torch.cat(nll)
        last = torch.cat([n[-tail:] for n in nll])
        table[str(length)] = {"ppl": round(math.exp(float(every.mean())), 3),
                              "tail_ppl": round(math.exp(float(last.mean())), 3),
                              "documents": len(docs), "tokens": int(every.numel())}
    return table


def load(model_dir: Path) -> tuple[Any, Any]:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if hasattr(model.config, "time_step_min"):
        from eval.training.arch import _unclamp_time_step

        _unclamp_time_step(model)   # serve-time recurrence (SGLang never clamps dt)
    return model, Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def markdown(tables: dict[str, dict], lengths: list[int], tail: int) -> str:
    """One row per labelled table: perplexity (all tokens / last `tail`) per length."""
    head = "| model | " + " | ".join(f"{n // 1024}K all / last {tail}" for n in lengths) + " |"
    rows = [f"| {label} | " + " | ".join(f"{t[str(n)]['ppl']:.2f} / {t[str(n)]['tail_ppl']:.2f}" for n in lengths) + " |"
            for label, t in tables.items()]
    return "\n".join([head, "|---|" + "---:|" * len(lengths), *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--samples", type=int, default=2, help="documents per source and length")
    parser.add_argument("--tail", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True, help="JSON file written")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not lengths or min(lengths) <= args.tail or args.samples <= 0:
        parser.error(f"--lengths must each exceed --tail {args.tail}, --samples > 0")
    model, tokenizer = load(args.model)
    table = perplexity_table(model, tokenizer, lengths, args.samples, args.tail)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(args.model), "samples_per_source": args.samples, "tail": args.tail,
                                    "lengths": table}, indent=2))
    print(markdown({str(args.model): table}, lengths, args.tail))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
