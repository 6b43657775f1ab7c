"""The training loss: next-token cross-entropy per token, its means over the whole sequence and
over the answer tokens, and the autocast a step runs under."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F


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


def autocast_on(device: torch.device):
    """bf16 autocast on a GPU (weights and optimizer stay fp32); nothing on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
