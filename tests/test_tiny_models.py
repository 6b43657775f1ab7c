"""The tiny Qwen3-Next fixtures: the default stays as the tests know it, "proportioned" has the
shape the TTFT benchmark needs (3 GDN : 1 attention, hidden >= 512, >= 8 layers)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.flops import PrefillCost, cost_of_checkpoint, qwen3_next_cost


def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_default_qwen3_next_fixture_is_unchanged(tiny_model_factory):
    cfg = _config(tiny_model_factory("qwen3-next"))
    want = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, intermediate_size=128, full_attention_interval=4)
    assert {k: cfg[k] for k in want} == want


def test_proportioned_fixture_has_qwen3_next_proportions(tiny_model_factory):
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig

    model_dir = tiny_model_factory("qwen3-next", "proportioned")
    cfg = _config(model_dir)
    h = cfg["hidden_size"]
    assert h >= 512 and cfg["num_hidden_layers"] >= 8
    sg = Qwen3NextConfig.from_pretrained(model_dir)          # how SGLang reads the layer pattern
    assert len(sg.linear_layer_ids) == 3 * len(sg.full_attention_layer_ids) >= 6
    assert cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] == h                 # Qwen3-Next: k = h
    assert cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"] == 2 * h         # v = 2h
    assert cfg["moe_intermediate_size"] == h // 4                                        # experts h / 4


def test_proportioned_fixture_runs_in_transformers(tiny_model_factory):
    from eval.reference import load_reference_model

    model = load_reference_model(tiny_model_factory("qwen3-next", "proportioned"))
    ids = torch.randint(10, 500, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 48, 512) and torch.isfinite(logits).all()
    assert logits[0, -1].std() > 0


def test_prefill_cost_counts_tokens_and_causal_pairs():
    cost = PrefillCost(per_token=10.0, per_pair=1.0, linear_layers=3, attention_layers=1)
    assert cost.flops(0, 4) == 4 * 10 + (4 * 5) / 2                      # 4 tokens, 10 causal pairs
    assert cost.flops(2, 2) == 2 * 10 + (2 * 2 + 3)                      # 2 new tokens see 3 and 4 keys
    assert cost.ceiling(matched=2, new=2, recomputed=0) == pytest.approx(50 / 27)
    assert cost.ceiling(matched=2, new=2, recomputed=2) == 1.0
    assert cost.attention_share(4) == pytest.approx(10 / 50)


def test_qwen3_next_cost_by_hand():
    cfg = dict(hidden_size=4, num_hidden_layers=4, full_attention_interval=4, num_attention_heads=1,
               num_key_value_heads=1, head_dim=2, linear_num_key_heads=1, linear_key_head_dim=1,
               linear_num_value_heads=1, linear_value_head_dim=1, linear_conv_kernel_dim=2, num_experts=2,
               num_experts_per_tok=1, moe_intermediate_size=1, shared_expert_intermediate_size=1,
               intermediate_size=3, decoder_sparse_step=1, mlp_only_layers=[])
    cost = qwen3_next_cost(cfg)
    # attention 80 (q+gate 32, k 16, v 16, o 16); GDN 74 (qkvz 32, ba 16, conv 12, recurrence 6,
    # out 8); MoE 72 per layer (router 16, 1 expert 24, shared 24, shared gate 8), 4 MoE layers
    assert cost.per_token == 80 + 3 * 74 + 4 * 72
    assert cost.per_pair == 2 * 2 * 2                                     # QK and PV, 1 head x 2 dims
    assert (cost.linear_layers, cost.attention_layers) == (3, 1)


def test_proportioned_fixture_ceiling_is_attention_aware(tiny_model_factory):
    """At 32K with a 5% window the FLOP ceiling lies between the attention-only bound
    L / (2 (W + n)) and the linear one (L + n) / (W + n)."""
    cost = cost_of_checkpoint(tiny_model_factory("qwen3-next", "proportioned"))
    L, n, W = 32768, 128, 1639
    assert L / (2 * (W + n)) < cost.ceiling(L, n, W) < (L + n) / (W + n)


@pytest.mark.parametrize(("layout", "real_tokens_per_token"), [("state-rate", 64), ("state-rate-8", 8)])
def test_state_rate_fixtures_trade_state_for_kv_at_the_real_models_rate(layout, real_tokens_per_token):
    """A state of the fixture costs the KV of as many of its tokens as a Qwen3-Next-80B state costs
    real tokens, over the replay's scale (SSM state + conv window per GDN layer; K and V per
    attention layer, all float32)."""
    from eval.fixtures.qwen3_next import FULL_ATTENTION_INTERVAL, SHAPES
    from eval.replay.real_models import MODELS

    s = SHAPES[layout]
    gdn = s["num_hidden_layers"] - s["num_hidden_layers"] // FULL_ATTENTION_INTERVAL
    ssm = s["linear_num_value_heads"] * s["linear_key_head_dim"] * s["linear_value_head_dim"]
    conv = (2 * s["linear_num_key_heads"] * s["linear_key_head_dim"]
            + s["linear_num_value_heads"] * s["linear_value_head_dim"]) * 3
    kv = (s["num_hidden_layers"] // FULL_ATTENTION_INTERVAL) * 2 * s["num_key_value_heads"] * s["head_dim"]
    real = MODELS["qwen3-next-80b-a3b"].slot_in_kv_tokens / real_tokens_per_token
    assert gdn * (ssm + conv) / kv == pytest.approx(real, rel=0.01)
