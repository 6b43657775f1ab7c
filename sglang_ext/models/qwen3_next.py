"""Tiny Qwen3-Next: Gated DeltaNet layers + full-attention layers (3 : 1), sparse-MoE MLPs.

Layouts: "moe" (the default test fixture: 4 layers, hidden 64) and "proportioned" (8 layers,
hidden 512, head / expert widths in Qwen3-Next-80B-A3B's proportions, for timings whose ratio
should not be set by a hidden size of 64; see PROPORTIONED).
"""

from __future__ import annotations

from sglang_ext.models.tiny import MAX_POSITIONS, VOCAB_SIZE, TokenIds, register_arch

FULL_ATTENTION_INTERVAL = 4
ROPE_THETA = 10000.0


#: Qwen3-Next-80B-A3B: hidden 2048, 48 layers (36 GDN + 12 attention), attention 16 heads x 256
#: (2 KV heads), GDN 16 key heads x 128 and 32 value heads x 128, 512 experts (10 routed + 1
#: shared, intermediate 512 = hidden / 4). "proportioned" keeps the layer pattern, GDN key / value
#: widths of hidden and 2 x hidden, expert width hidden / 4 and the active MLP width (10 routed +
#: 1 shared expert: 2.75 x hidden), at hidden 512 and 8 layers (6 GDN + 2 attention). Its attention query
#: width is hidden (real: 2 x hidden): with hidden 4x smaller, linear FLOPs per token shrink ~16x
#: but attention FLOPs per (token, context) pair only ~4x, so attention already weighs ~2x more
#: than in the real model (context where attention FLOPs equal the rest: ~15K vs ~30K tokens).
SHAPES: dict[str, dict] = {
    "moe": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    ),
    "proportioned": dict(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=8, linear_num_value_heads=16,
        num_experts=16, num_experts_per_tok=10, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    ),
}
PROPORTIONED = "proportioned"


def qwen3_next_config(ids: TokenIds, layout: str = "moe"):
    from transformers import Qwen3NextConfig

    shape = SHAPES[layout]
    layer_types = [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(shape["num_hidden_layers"])
    ]
    return Qwen3NextConfig(
        vocab_size=VOCAB_SIZE, **shape, layer_types=layer_types,
        linear_conv_kernel_dim=4, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=MAX_POSITIONS, initializer_range=0.08,
        # one rope_theta, inside rope_parameters: a second top-level value makes SGLang and
        # transformers disagree.
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.25},
        eos_token_id=ids.eos, pad_token_id=ids.pad, tie_word_embeddings=False,
        dtype="float32",
    )


@register_arch("qwen3-next", layouts=tuple(SHAPES))
def build_qwen3_next(seed: int, layout: str, ids: TokenIds):
    from transformers import Qwen3NextForCausalLM

    model = Qwen3NextForCausalLM(qwen3_next_config(ids, layout)).float()
    # SGLang derives the layer pattern from this key; transformers 5.x does not write it.
    return model, {"full_attention_interval": FULL_ATTENTION_INTERVAL}
