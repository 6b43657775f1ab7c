"""hybrid_kernels.gdn twins: chunked vs recurrent vs transformers, transition operator, exact composition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hybrid_kernels.gdn import (
    CHUNK,
    gdn_chunk_ref,
    gdn_chunk_transition_ref,
    gdn_chunk_transition_via_chunked,
    gdn_compose_ref,
    gdn_gating_ref,
    gdn_recurrent_ref,
    l2norm,
    state_from_sglang,
    state_to_sglang,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

ATOL, RTOL = 2e-5, 1e-4


def _inputs(T: int, H: int = 3, dk: int = 16, dv: int = 8, seed: int = 0):
    """q, k [T, H, dk] (L2-normalised), v [T, H, dv], g, beta [T, H] as the model makes them."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(T, H, dk, generator=gen))
    k = l2norm(torch.randn(T, H, dk, generator=gen))
    v = torch.randn(T, H, dv, generator=gen)
    g, beta = gdn_gating_ref(torch.randn(H, generator=gen) * 0.5, torch.randn(T, H, generator=gen),
                             torch.randn(T, H, generator=gen), torch.randn(H, generator=gen))
    return q, k, v, g, beta


def _hf_recurrent(q, k, v, g, beta, state):
    o, final = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                initial_state=state[None], output_final_state=True)
    return o[0], final[0]


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 150])
@pytest.mark.parametrize("dk,dv", [(16, 8), (8, 24)])
def test_chunked_and_recurrent_match_transformers(T, dk, dv):
    q, k, v, g, beta = _inputs(T, dk=dk, dv=dv, seed=T)
    state = torch.randn(3, dk, dv, generator=torch.Generator().manual_seed(7))
    ref_o, ref_s = _hf_recurrent(q, k, v, g, beta, state)
    o, s, h = gdn_chunk_ref(q, k, v, g, beta, state)
    torch.testing.assert_close(o, ref_o, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(s, ref_s, atol=ATOL, rtol=RTOL)
    assert h.shape == (-(-T // CHUNK), 3, dk, dv)
    ro, rs = gdn_recurrent_ref(q, k, v, g, beta, state)
    torch.testing.assert_close(ro, ref_o, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(rs, ref_s, atol=ATOL, rtol=RTOL)


def test_chunked_matches_transformers_chunked_path():
    q, k, v, g, beta = _inputs(150, seed=1)
    o, s, _ = gdn_chunk_ref(q, k, v, g, beta, torch.zeros(3, 16, 8))
    ref_o, ref_s = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                output_final_state=True)
    torch.testing.assert_close(o, ref_o[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(s, ref_s[0], atol=ATOL, rtol=RTOL)


def test_chunk_start_states_are_states_after_whole_chunks():
    q, k, v, g, beta = _inputs(130, seed=3)
    state = torch.randn(3, 16, 8)
    _, _, h = gdn_chunk_ref(q, k, v, g, beta, state)
    for j in range(3):
        _, ref = _hf_recurrent(q[: j * CHUNK], k[: j * CHUNK], v[: j * CHUNK], g[: j * CHUNK], beta[: j * CHUNK], state)
        torch.testing.assert_close(h[j], ref, atol=ATOL, rtol=RTOL)


def test_gating_is_softplus_decay_and_sigmoid_beta():
    a, b = torch.tensor([[0.5, 30.0]]), torch.tensor([[0.0, 2.0]])
    A_log, dt_bias = torch.tensor([0.0, 1.0]), torch.tensor([0.1, -1.0])
    g, beta = gdn_gating_ref(A_log, a, b, dt_bias)
    expected_g = -A_log.exp() * torch.tensor([F.softplus(torch.tensor(0.6)).item(), 29.0])
    torch.testing.assert_close(g[0], expected_g)
    torch.testing.assert_close(beta[0], torch.sigmoid(b[0]))


def _dense_product(k, g, beta):
    """prod_t exp(g_t)(I - beta_t k_t k_t^T), latest on the left, from explicit [dk, dk] matrices."""
    T, H, dk = k.shape
    M = torch.eye(dk, dtype=torch.float64).repeat(H, 1, 1)
    for t in range(T):
        kt = k[t].double()
        step = torch.eye(dk, dtype=torch.float64) - beta[t].double()[:, None, None] * kt[:, :, None] * kt[:, None, :]
        M = g[t].double().exp()[:, None, None] * step @ M
    return M.float()


@pytest.mark.parametrize("T", [0, 1, 7, 64, 65, 150])
def test_transition_is_product_of_per_token_matrices_and_equals_the_trick(T):
    _, k, _, g, beta = _inputs(T, seed=11)
    M = gdn_chunk_transition_ref(k, g, beta)
    assert M.shape == (3, 16, 16) and M.dtype == torch.float32
    torch.testing.assert_close(M, _dense_product(k, g, beta), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gdn_chunk_transition_via_chunked(k, g, beta), M, atol=1e-5, rtol=1e-4)


def test_a_chunk_is_affine_in_its_start_state():
    q, k, v, g, beta = _inputs(77, seed=5)
    start = torch.randn(3, 16, 8)
    _, from_zero, _ = gdn_chunk_ref(q, k, v, g, beta, torch.zeros(3, 16, 8))
    _, from_start, _ = gdn_chunk_ref(q, k, v, g, beta, start)
    torch.testing.assert_close(from_start, gdn_chunk_transition_ref(k, g, beta) @ start + from_zero,
                               atol=ATOL, rtol=RTOL)


def _chunk_pieces(q, k, v, g, beta, bounds):
    states, transitions = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        zero = torch.zeros(q.shape[1], q.shape[2], v.shape[2])
        _, s, _ = gdn_chunk_ref(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], zero)
        states.append(s)
        transitions.append(gdn_chunk_transition_ref(k[a:b], g[a:b], beta[a:b]))
    return torch.stack(states), torch.stack(transitions)


@pytest.mark.parametrize("bounds", [[0, 200], [0, 1, 200], [0, 37, 38, 101, 200], [0, 64, 128, 192, 200]])
@pytest.mark.parametrize("with_initial", [False, True])
def test_composition_in_order_equals_sequential_recurrence(bounds, with_initial):
    q, k, v, g, beta = _inputs(200, H=2, dk=12, dv=20, seed=len(bounds))
    initial = torch.randn(2, 12, 20) if with_initial else None
    states, transitions = _chunk_pieces(q, k, v, g, beta, bounds)
    composed = gdn_compose_ref(states, transitions, initial)
    _, sequential = gdn_recurrent_ref(q, k, v, g, beta, torch.zeros(2, 12, 20) if initial is None else initial)
    torch.testing.assert_close(composed, sequential, atol=1e-4, rtol=1e-4)


def test_composing_one_chunk_is_the_identity_on_its_state():
    q, k, v, g, beta = _inputs(40, seed=9)
    states, transitions = _chunk_pieces(q, k, v, g, beta, [0, 40])
    torch.testing.assert_close(gdn_compose_ref(states, transitions), states[0], atol=0, rtol=0)


def test_composition_in_sglang_pool_layout():
    """SGLang keeps [H, dv, dk]: transposing in and out gives S'_end = S'_start M^T + s'."""
    gen = torch.Generator().manual_seed(2)
    states, M = torch.randn(3, 2, 6, 5, generator=gen), torch.randn(3, 2, 6, 6, generator=gen)
    init = torch.randn(2, 6, 5, generator=gen)
    pool_states, pool_init = state_to_sglang(states), state_to_sglang(init)
    got = state_to_sglang(gdn_compose_ref(state_from_sglang(pool_states), M, state_from_sglang(pool_init)))
    expected = pool_init
    for i in range(3):
        expected = expected @ M[i].transpose(-1, -2) + pool_states[i]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_compose_refuses_mismatched_counts():
    with pytest.raises(ValueError, match="2 states but 3 transitions"):
        gdn_compose_ref(torch.zeros(2, 1, 4, 4), torch.zeros(3, 1, 4, 4))
