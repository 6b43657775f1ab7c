"""transformers as the reference for what a served model must output (greedy, fp32)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Reference:
    output_ids: list[int]
    output_logprobs: list[float]     # logprob of each output token
    input_logprobs: list[float]      # logprob of prompt tokens 1..L-1


def load_reference_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def greedy_reference(model, prompt_ids: list[int], max_new_tokens: int) -> Reference:
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):   # full recompute per step: no cache path involved
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    n = len(prompt_ids)
    out = ids[n:]
    return Reference(
        output_ids=out,
        output_logprobs=[logprobs[n - 1 + i, t].item() for i, t in enumerate(out)],
        input_logprobs=[logprobs[i - 1, prompt_ids[i]].item() for i in range(1, n)],
    )
