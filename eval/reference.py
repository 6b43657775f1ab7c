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


@torch.no_grad()
def zero_state_reference(model, prompt_ids: list[int], replay_start: int, max_new_tokens: int) -> Reference:
    """What Tail-Replay with recomputed KV (`kv_mode: "recompute"`) computes, by construction:
    the prefix [0, replay_start) as a full prefill, then the linear layers' state (conv and
    recurrent) zeroed at replay_start, then [replay_start, ...) and every decode step on top,
    attending to all earlier KV. `input_logprobs` covers prompt tokens replay_start+1..n-1
    (earlier ones are not what the request computes). Cached greedy decode."""
    cache = (model(torch.tensor([prompt_ids[:replay_start]], dtype=torch.long), use_cache=True).past_key_values
             if replay_start else None)
    for layer in (cache.layers if cache is not None else ()):
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            for state in (states.values() if isinstance(states, dict) else states or ()):
                if torch.is_tensor(state):
                    state.zero_()
    result = model(torch.tensor([prompt_ids[replay_start:]]), past_key_values=cache, use_cache=True)
    logits, cache = result.logits[0], result.past_key_values
    logprobs = torch.log_softmax(logits.float(), -1)
    tail = prompt_ids[replay_start:]
    input_logprobs = [logprobs[i - 1, tail[i]].item() for i in range(1, len(tail))]
    out, out_lp = [], []
    last = logprobs[-1]
    for _ in range(max_new_tokens):
        token = int(last.argmax())
        out.append(token)
        out_lp.append(last[token].item())
        step = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        cache = step.past_key_values
        last = torch.log_softmax(step.logits[0, -1].float(), -1)
    return Reference(output_ids=out, output_logprobs=out_lp, input_logprobs=input_logprobs)
