"""hybrid_kernels.rope twin: re-rotated keys equal keys rotated at the new positions by transformers'
Qwen3-Next rotary embedding (partial rotary), built from a tiny local config."""

from __future__ import annotations

import pytest
import torch
from hybrid_kernels.rope import rerotate_keys_ref, rope_inv_freq
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding, apply_rotary_pos_emb

HEAD_DIM, HEADS, THETA = 32, 3, 10000.0


def _rotary(partial: float) -> Qwen3NextRotaryEmbedding:
    config = Qwen3NextConfig(hidden_size=64, head_dim=HEAD_DIM, num_attention_heads=4, num_key_value_heads=HEADS,
                             partial_rotary_factor=partial, rope_theta=THETA)
    return Qwen3NextRotaryEmbedding(config)


def _hf_keys(rotary, k_raw, positions):
    """k_raw [T, H, D] -> keys rotated at positions [T] by transformers."""
    cos, sin = rotary(k_raw, positions[None])
    _, k = apply_rotary_pos_emb(k_raw.transpose(0, 1)[None], k_raw.transpose(0, 1)[None], cos, sin)
    return k[0].transpose(0, 1)


def _atol(positions, k):
    """Both sides round angles p * theta in fp32 (|error| <= ulp(p)/2 rad each, theta_0 = 1), so
    keys at position p agree to about 2^-23 * p * |k|; plus a small floor."""
    return 2e-5 + 2.0 ** -23 * float(positions.abs().max()) * float(k.abs().max()) * 2


@pytest.mark.parametrize("partial", [0.25, 1.0])
@pytest.mark.parametrize("delta", [0, 1, 37, 1000, -5])
def test_rerotated_keys_equal_keys_at_new_positions(partial, delta):
    rotary = _rotary(partial)
    gen = torch.Generator().manual_seed(0)
    T = 11
    k_raw = torch.randn(T, HEADS, HEAD_DIM, generator=gen)
    positions = torch.arange(T) + 7
    moved = rerotate_keys_ref(_hf_keys(rotary, k_raw, positions), delta, int(HEAD_DIM * partial), THETA)
    torch.testing.assert_close(moved, _hf_keys(rotary, k_raw, positions + delta), atol=_atol(positions + delta, k_raw),
                               rtol=1e-4)


def test_per_token_deltas_and_partial_dims_pass_through():
    rotary = _rotary(0.25)
    gen = torch.Generator().manual_seed(1)
    k_raw = torch.randn(6, HEADS, HEAD_DIM, generator=gen)
    positions = torch.arange(6)
    deltas = torch.tensor([0, 3, 100, 2, 9, 50])
    keys = _hf_keys(rotary, k_raw, positions)
    moved = rerotate_keys_ref(keys, deltas, 8, THETA)
    torch.testing.assert_close(moved, _hf_keys(rotary, k_raw, positions + deltas), atol=2e-5, rtol=1e-4)
    assert torch.equal(moved[..., 8:], keys[..., 8:])


def test_inv_freq_matches_transformers_and_gptj_pairs_rotate_by_the_same_angles():
    torch.testing.assert_close(rope_inv_freq(8, THETA), _rotary(0.25).inv_freq)
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(4, 2, 16, generator=gen)
    perm = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2), torch.arange(8, 16)])  # gptj -> neox order
    neox = rerotate_keys_ref(k[..., perm], 13, 8, THETA, neox=True)
    gptj = rerotate_keys_ref(k, 13, 8, THETA, neox=False)
    torch.testing.assert_close(gptj[..., perm], neox)


def test_round_trip_and_bad_arguments():
    k = torch.randn(5, 2, 16)
    back = rerotate_keys_ref(rerotate_keys_ref(k, 21, 16, THETA), -21, 16, THETA)
    torch.testing.assert_close(back, k, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="delta must be"):
        rerotate_keys_ref(k, torch.tensor([1, 2]), 16, THETA)
    with pytest.raises(ValueError, match="rotary_dim 32 exceeds head dim 16"):
        rerotate_keys_ref(k, 1, 32, THETA)
    with pytest.raises(ValueError, match="rotary_dim must be a positive even"):
        rerotate_keys_ref(k, 1, 7, THETA)
