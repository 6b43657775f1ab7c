"""Tiny Qwen3-Next: Gated DeltaNet layers + one full-attention layer, sparse-MoE MLPs."""

from __future__ import annotations

from sglang_ext.models.tiny import MAX_POSITIONS, VOCAB_SIZE, TokenIds, register_arch

FULL_ATTENTION_INTERVAL = 4
ROPE_THETA = 10000.0


def qwen3_next_config(ids: TokenIds, num_layers: int = 4):
    from transformers import Qwen3NextConfig

    layer_types = [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(num_layers)
    ]
    return Qwen3NextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=num_layers, layer_types=layer_types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        decoder_sparse_step=1, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[],
        max_position_embeddings=MAX_POSITIONS, initializer_range=0.08,
        # one rope_theta, inside rope_parameters: a second top-level value makes SGLang and
        # transformers disagree.
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.25},
        eos_token_id=ids.eos, pad_token_id=ids.pad, tie_word_embeddings=False,
        dtype="float32",
    )


@register_arch("qwen3-next", layouts=("moe",))
def build_qwen3_next(seed: int, layout: str, ids: TokenIds):
    from transformers import Qwen3NextForCausalLM

    model = Qwen3NextForCausalLM(qwen3_next_config(ids)).float()
    # SGLang derives the layer pattern from this key; transformers 5.x does not write it.
    return model, {"full_attention_interval": FULL_ATTENTION_INTERVAL}
