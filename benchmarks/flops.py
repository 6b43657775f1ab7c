"""Attention-aware FLOP counts of a hybrid's prefill, for the TTFT benchmark's ceiling (pure).

A forward over `new` tokens after `prefix` tokens whose KV is cached costs
    new x per_token + pairs(prefix, new) x per_pair
where `per_token` counts every context-independent matmul of one token (projections, GDN
recurrence, MLP / routed + shared experts; 2 FLOPs per multiply-add) and `per_pair` the
attention score and value products of one (query, key) pair summed over attention layers
(2 x heads x head_dim each). Causal: new token j (0-based) sees prefix + j + 1 keys, so
pairs = new x prefix + new (new + 1) / 2. Not counted: norms, activations, rotary, the LM head of
the one sampled token, and per-request overheads (HTTP, scheduling, the radix match).

Full prefill of L + n tokens vs a Tail-Replay hit replaying W of L matched tokens:
    ceiling = flops(0, L + n) / flops(L - W, W + n).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PrefillCost:
    per_token: float     # FLOPs per token, independent of context
    per_pair: float      # FLOPs per (query, key) pair, all attention layers together
    linear_layers: int
    attention_layers: int

    def flops(self, prefix: int, new: int) -> float:
        """FLOPs of a forward over `new` tokens that attend to `prefix` cached tokens before them."""
        pairs = new * prefix + new * (new + 1) / 2
        return new * self.per_token + pairs * self.per_pair

    def ceiling(self, matched: int, new: int, recomputed: int) -> float:
        """Full prefill of matched + new tokens over a forward that recomputes `recomputed` of
        the matched tokens (reusing the other matched - recomputed) plus the new ones."""
        return self.flops(0, matched + new) / self.flops(matched - recomputed, recomputed + new)

    def attention_share(self, tokens: int) -> float:
        """Share of a full prefill of `tokens` tokens spent in attention scores / values."""
        attention = (tokens * (tokens + 1) / 2) * self.per_pair
        return attention / self.flops(0, tokens)


def _mm(n_in: int, n_out: int) -> float:
    return 2.0 * n_in * n_out


def qwen3_next_cost(cfg: dict) -> PrefillCost:
    """PrefillCost of a Qwen3-Next config.json (Gated DeltaNet + gated full attention, MoE)."""
    h = cfg["hidden_size"]
    layers = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval", 4)
    attention_ids = [i for i in range(layers) if (i + 1) % interval == 0]
    n_attn, n_lin = len(attention_ids), layers - len(attention_ids)
    # full attention: q_proj also yields the output gate (2 x heads x head_dim)
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    attn = _mm(h, 2 * nh * hd) + 2 * _mm(h, nkv * hd) + _mm(nh * hd, h)
    # Gated DeltaNet: in_proj_qkvz, in_proj_ba, depthwise conv over q, k, v, the delta-rule
    # recurrence (S^T k, the rank-1 update and S^T q: 3 multiply-adds per state entry), out_proj
    nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    nv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    conv_channels = 2 * nk * dk + nv * dv
    gdn = (_mm(h, 2 * nk * dk + 2 * nv * dv) + _mm(h, 2 * nv)
           + 2.0 * conv_channels * cfg["linear_conv_kernel_dim"]
           + 3 * 2.0 * nv * dk * dv + _mm(nv * dv, h))
    # sparse MoE (every layer unless mlp_only_layers / decoder_sparse_step say otherwise)
    sparse = set(range(layers)) - set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1)
    sparse = {i for i in sparse if cfg.get("num_experts", 0) > 0 and (i + 1) % step == 0}
    moe = (_mm(h, cfg["num_experts"]) + cfg["num_experts_per_tok"] * 3 * _mm(h, cfg["moe_intermediate_size"])
           + 3 * _mm(h, cfg["shared_expert_intermediate_size"]) + _mm(h, 1))
    dense = 3 * _mm(h, cfg["intermediate_size"])
    mlp = len(sparse) * moe + (layers - len(sparse)) * dense
    per_token = n_attn * attn + n_lin * gdn + mlp
    per_pair = n_attn * 2 * (2.0 * nh * hd)
    return PrefillCost(per_token=per_token, per_pair=per_pair, linear_layers=n_lin, attention_layers=n_attn)


def cost_of_checkpoint(model_dir: str | Path) -> PrefillCost:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.get("model_type") != "qwen3_next":
        raise ValueError(f"{model_dir}: FLOP model covers qwen3_next only, got {cfg.get('model_type')!r}")
    return qwen3_next_cost(cfg)
