"""Decay statistics: which layers are read, and the half-life arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from eval.training.decay import collect_log_decay, head_stats


def test_half_life_of_a_constant_decay():
    log_decay = torch.full((100, 2), -math.log(2) / 10)
    log_decay[:, 1] = -math.log(2) / 250
    stats = head_stats(log_decay)
    assert [s["half_life_tokens"] for s in stats] == [10.0, 250.0]
    assert stats[0]["tokens_to_1pct"] == pytest.approx(10 * math.log(100) / math.log(2), abs=0.1)
    assert stats[0]["decay_p50"] == pytest.approx(2 ** -0.1, abs=1e-5)


@pytest.mark.parametrize("arch, linear_layers, heads", [("qwen3-next", [0, 1, 2], 4), ("nemotron-h", [0, 3], 8)])
def test_every_linear_layer_and_head_is_measured(tiny_model_factory, arch, linear_layers, heads):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory(arch), dtype=torch.float32).eval()
    per_layer = collect_log_decay(model, [list(range(5, 45)), list(range(7, 20))])
    assert sorted(per_layer) == linear_layers
    for log_decay in per_layer.values():
        assert log_decay.shape == (53, heads)
        assert torch.isfinite(log_decay).all() and (log_decay <= 0).all()
