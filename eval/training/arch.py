"""The two trained model architectures, as transformers configs SGLang also serves.

Both are hybrids of 6 linear layers + 2 full-attention layers, hidden 256:
- `gdn`: Qwen3-Next (Gated DeltaNet), attention at layers 3 and 7. SGLang's Qwen3-Next
  always builds sparse-MoE MLPs, so the MLP is one routed expert (softmax over one expert = 1)
  plus the shared expert: a dense MLP in an architecture that insists on MoE.
- `mamba2`: Nemotron-H (Mamba-2 mixers, relu2 MLPs, NoPE attention), pattern `M-M*-M-M-M*-M-`
  minus MLPs after attention, i.e. 6 Mamba-2 + 2 attention + 6 MLP blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

HIDDEN = 256
ROPE_THETA = 100000.0
MAX_POSITIONS = 32768


@dataclass(frozen=True)
class SpecialIds:
    eos: int
    pad: int


def gdn_config(vocab_size: int, ids: SpecialIds):
    from transformers import Qwen3NextConfig

    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)]
    return Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=768,
        num_hidden_layers=8, layer_types=layer_types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4,
        decoder_sparse_step=1, num_experts=1, num_experts_per_tok=1, norm_topk_prob=True,
        moe_intermediate_size=512, shared_expert_intermediate_size=256, mlp_only_layers=[],
        max_position_embeddings=MAX_POSITIONS, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.25},
        eos_token_id=ids.eos, pad_token_id=ids.pad, tie_word_embeddings=False, dtype="float32",
    )


#: config.json fields SGLang reads but transformers 5.x does not write: the layer pattern, and
#: rope_theta at top level (SGLang's Qwen3NextConfig ignores rope_parameters' theta, defaulting
#: to 10000; transformers reads rope_parameters).
GDN_SGLANG_FIELDS = {"full_attention_interval": 4, "rope_theta": ROPE_THETA}

MAMBA2_PATTERN = "M-M*M-M-M*M-"
MAMBA2_GROUPS = 1


def mamba2_config(vocab_size: int, ids: SpecialIds):
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, hybrid_override_pattern=MAMBA2_PATTERN,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=768, mlp_hidden_act="relu2",
        mamba_num_heads=8, mamba_head_dim=64, n_groups=MAMBA2_GROUPS, ssm_state_size=64,
        conv_kernel=4, expand=2, chunk_size=128,
        max_position_embeddings=MAX_POSITIONS, initializer_range=0.02,
        eos_token_id=ids.eos, pad_token_id=ids.pad, bos_token_id=None,
        tie_word_embeddings=False, dtype="float32",
    )


#: see eval/fixtures/nemotron_h.py for why each field is needed
MAMBA2_SGLANG_FIELDS = {
    "layers_block_type": None, "hybrid_override_pattern": MAMBA2_PATTERN,
    "mamba_n_groups": MAMBA2_GROUPS, "n_groups": MAMBA2_GROUPS, "time_step_min": 0.0,
}

ARCHS = {"gdn": (gdn_config, GDN_SGLANG_FIELDS), "mamba2": (mamba2_config, MAMBA2_SGLANG_FIELDS)}


def build_model(arch: str, vocab_size: int, ids: SpecialIds, seed: int):
    """A freshly initialized fp32 model of `arch` ("gdn" or "mamba2")."""
    import torch
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    torch.manual_seed(seed)
    config = ARCHS[arch][0](vocab_size, ids)
    model = AutoModelForCausalLM.from_config(config).float()
    if arch == "mamba2":
        _unclamp_time_step(model)
    return model


def _unclamp_time_step(model) -> None:
    """Train with the recurrence SGLang serves: no lower clamp on the Mamba-2 time step.

    transformers clamps dt to `time_step_min` in prefill (not in decode); SGLang never clamps.
    `time_step_min` is only needed for initialization, done by now."""
    model.config.time_step_min = 0.0
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.0, float("inf"))
