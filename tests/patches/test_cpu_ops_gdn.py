"""GDN / conv1d CPU ops (SGLang signatures: packed sequences, pool slots, [slots, HV, V, K] layout) vs
independent references (outputs and final states). The math itself: tests/kernels/."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from sglang_ext.patches.cpu.ops.conv1d import causal_conv1d_fwd_cpu, causal_conv1d_update_cpu
from sglang_ext.patches.cpu.ops.gdn import (
    CHUNK,
    chunk_gated_delta_rule_cpu,
    chunk_gated_delta_rule_with_h,
    fused_gdn_gating_cpu,
    fused_sigmoid_gating_delta_rule_update_cpu,
)

HK, HV, K, V = 2, 4, 16, 8
ATOL = 2e-5


def _gdn_inputs(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(1, T, HK, K, generator=gen)
    k = torch.randn(1, T, HK, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    a = torch.randn(T, HV, generator=gen)
    b = torch.randn(T, HV, generator=gen)
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV, generator=gen)
    return q, k, v, a, b, A_log, dt_bias


def _reference_sequence(q, k, v, g, beta, state_vk):
    """transformers' token-by-token recurrence; SGLang state layout [H, V, K] <-> HF [H, K, V]."""
    rep = HV // HK
    o, final = torch_recurrent_gated_delta_rule(
        q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta,
        initial_state=state_vk.transpose(-1, -2).unsqueeze(0), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    return o[0], final[0].transpose(-1, -2)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


@pytest.mark.parametrize("lengths", [[1], [63], [64], [65, 1, 130], [200, 37]])
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_chunk_gdn_matches_recurrent_reference(lengths, with_initial_state):
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(lengths)
    g, beta = fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    slots = torch.tensor([5, 2, 7][: len(lengths)])
    pool = torch.randn(8, HV, V, K) if with_initial_state else torch.zeros(8, HV, V, K)
    before = pool.clone()
    o, finals = chunk_gated_delta_rule_cpu(q, k, v, g, beta, pool, True, _cu(lengths), False, True, slots)
    bounds = _cu(lengths).tolist()
    for i, slot in enumerate(slots.tolist()):
        sl = slice(bounds[i], bounds[i + 1])
        ref_o, ref_state = _reference_sequence(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], before[slot])
        torch.testing.assert_close(o[0, sl], ref_o, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(pool[slot], ref_state, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(finals[i], ref_state, atol=ATOL, rtol=1e-4)
    untouched = [s for s in range(8) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_chunk_start_states_are_the_states_after_whole_chunks():
    lengths = [130, 64]
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(lengths, seed=3)
    g, beta = fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    pool = torch.randn(4, HV, V, K)
    start = pool.clone()
    _, _, h = chunk_gated_delta_rule_with_h(q, k, v, g, beta, pool, _cu(lengths),
                                            initial_state_indices=torch.tensor([0, 3]))
    assert h.shape == (1, 3 + 1, HV, V, K)  # ceil(130/64) + ceil(64/64)
    for j, expected_len in enumerate([0, CHUNK, 2 * CHUNK]):
        sl = slice(0, expected_len)
        _, ref = _reference_sequence(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], start[0])
        torch.testing.assert_close(h[0, j], ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(h[0, 3], start[3])


def test_decode_update_matches_recurrence_and_touches_only_its_slots():
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs([3])   # three sequences, one token each
    pool = torch.randn(6, HV, V, K)
    before = pool.clone()
    slots = torch.tensor([4, 0, 2])
    o = fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, pool, slots,
                                                   torch.arange(4), True)
    g, beta = fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    for i, slot in enumerate(slots.tolist()):
        sl = slice(i, i + 1)
        ref_o, ref_state = _reference_sequence(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], before[slot])
        torch.testing.assert_close(o[0, i], ref_o[0], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(pool[slot], ref_state, atol=ATOL, rtol=1e-4)
    assert torch.equal(pool[[1, 3, 5]], before[[1, 3, 5]])


def test_gating_op_adds_the_batch_dim():
    a, b = torch.randn(3, 2), torch.randn(3, 2)
    A_log, dt_bias = torch.tensor([0.0, 1.0]), torch.tensor([0.1, -1.0])
    g, beta = fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    assert g.shape == beta.shape == (1, 3, 2)
    torch.testing.assert_close(beta[0], torch.sigmoid(b))
    torch.testing.assert_close(g[0], -A_log.exp() * F.softplus(a + dt_bias))


def _conv_reference(x, weight, bias, history):
    """Plain loop: out[t] = silu(bias + sum_w weight[:, w] * seq[t + w]) over [history, x]."""
    seq = torch.cat([history, x], dim=-1)
    width = weight.shape[1]
    cols = [(seq[:, t:t + width] * weight).sum(-1) + bias for t in range(x.shape[1])]
    return F.silu(torch.stack(cols, dim=-1))


@pytest.mark.parametrize("lengths", [[1], [2, 70], [5, 1, 33]])
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_conv1d_prefill_matches_loop_and_rolls_state(lengths, with_initial_state):
    gen = torch.Generator().manual_seed(1)
    D, W = 6, 4
    x = torch.randn(D, sum(lengths), generator=gen)
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    states = torch.randn(5, D, W - 1, generator=gen)
    before = states.clone()
    slots = torch.tensor([3, 0, 4][: len(lengths)])
    has_init = torch.tensor([with_initial_state] * len(lengths))
    out = causal_conv1d_fwd_cpu(x, weight, bias, states, _cu(lengths), slots, has_init, True, -1)
    bounds = _cu(lengths).tolist()
    for i, slot in enumerate(slots.tolist()):
        seg = x[:, bounds[i]:bounds[i + 1]]
        history = before[slot] if with_initial_state else torch.zeros(D, W - 1)
        torch.testing.assert_close(out[:, bounds[i]:bounds[i + 1]], _conv_reference(seg, weight, bias, history))
        torch.testing.assert_close(states[slot], torch.cat([history, seg], -1)[:, -(W - 1):])


def test_conv1d_decode_steps_equal_one_prefill():
    gen = torch.Generator().manual_seed(2)
    D, W, T = 5, 4, 11
    x = torch.randn(D, T, generator=gen)
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    whole, stepped = torch.zeros(2, D, W - 1), torch.zeros(2, D, W - 1)
    full = causal_conv1d_fwd_cpu(x, weight, bias, whole, _cu([T]), torch.tensor([1]), torch.tensor([False]), True, -1)
    causal_conv1d_fwd_cpu(x[:, :6], weight, bias, stepped, _cu([6]), torch.tensor([1]), torch.tensor([False]), True, -1)
    steps = [causal_conv1d_update_cpu(x[:, t][None], stepped, weight, bias, True, None, torch.tensor([1]), -1)[0]
             for t in range(6, T)]
    torch.testing.assert_close(torch.stack(steps, -1), full[:, 6:])
    torch.testing.assert_close(stepped, whole)
