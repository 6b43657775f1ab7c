"""Tiny Nemotron-H: Mamba-2 mixers + one attention layer, with relu2 MLP or MoE layers.

Layouts:
- "dense": `M-*M-` (Mamba-2, MLP, attention, Mamba-2, MLP), like Nemotron-H 4B/8B;
- "moe":   `ME*ME` (MoE in place of the MLPs), the layout of real Nemotron-3 checkpoints:
  non-gated relu2 experts, sigmoid routing with a score-correction bias, renormalized
  top-k, `routed_scaling_factor != 1` and one shared expert.

config.json traps (SGLang 0.5.23 vs transformers 5.19), fixed by `_sglang_config_fields`:
- transformers writes `layers_block_type` with its own names ("linear_attention", ...),
  which SGLang's `NemotronHConfig` rejects (`srt/configs/nemotron_h.py:187`); both accept
  `hybrid_override_pattern`, so the list is dropped and the pattern written.
- SGLang's mixer reads the group count from `mamba_n_groups` (default 8) but the cache
  shape from `n_groups`: both are written.
- transformers clamps the prefill time step to `time_step_min` (decode does not);
  SGLang never clamps (`dt_limit=(0, inf)`). `time_step_min` is written as 0 so the two
  compute the same recurrence (it only matters for initialization, done by then).
Attention layers have no positional embedding (NoPE) in both implementations.
"""

from __future__ import annotations

import torch

from sglang_ext.models.tiny import MAX_POSITIONS, VOCAB_SIZE, TokenIds, register_arch

PATTERNS = {"dense": "M-*M-", "moe": "ME*ME"}
MAMBA_GROUPS = 2
#: SSD chunk length: small, so prompts of a few hundred tokens cross several chunks.
MAMBA_CHUNK_SIZE = 64
ROUTED_SCALING_FACTOR = 2.5


def nemotron_h_config(ids: TokenIds, layout: str):
    """A transformers `NemotronHConfig` for `layout` ("dense" or "moe")."""
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, hybrid_override_pattern=PATTERNS[layout],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, mlp_hidden_act="relu2",
        mamba_num_heads=8, mamba_head_dim=16, n_groups=MAMBA_GROUPS, ssm_state_size=16,
        conv_kernel=4, expand=2, chunk_size=MAMBA_CHUNK_SIZE,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, moe_shared_expert_intermediate_size=64,
        routed_scaling_factor=ROUTED_SCALING_FACTOR, n_group=1, topk_group=1,
        norm_topk_prob=True,
        max_position_embeddings=MAX_POSITIONS, initializer_range=0.08,
        eos_token_id=ids.eos, pad_token_id=ids.pad, bos_token_id=None,
        tie_word_embeddings=False, dtype="float32",
    )


def _randomize_router_bias(model: torch.nn.Module) -> None:
    """Give every MoE router a non-zero score-correction bias [n_routed_experts] (it
    shifts expert choice but not the weights, so a dropped bias shows up in outputs)."""
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn_like(buffer) * 0.05)


def _sglang_config_fields(layout: str) -> dict:
    """config.json fields that make SGLang and transformers read the same model."""
    return {
        "layers_block_type": None,
        "hybrid_override_pattern": PATTERNS[layout],
        "mamba_n_groups": MAMBA_GROUPS,
        "n_groups": MAMBA_GROUPS,
        "time_step_min": 0.0,
    }


@register_arch("nemotron-h", layouts=("dense", "moe"))
def build_nemotron_h(seed: int, layout: str, ids: TokenIds):
    from transformers import NemotronHForCausalLM

    model = NemotronHForCausalLM(nemotron_h_config(ids, layout)).float()
    with torch.no_grad():
        _randomize_router_bias(model)
    return model, _sglang_config_fields(layout)
