"""Gated DeltaNet (GDN) in pure torch: chunked and recurrent forward, chunk transition, composition.

State convention (flash-linear-attention's, `naive_recurrent_gated_delta_rule`): per value head
S [dk, dv], one sequence S [H, dk, dv], fp32. Per token t, with k_t L2-normalised:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T (scale q_t)

(equivalently S <- exp(g) S;  S <- S + beta k (v - S^T k)^T), scale = dk^-0.5 by default.
g [T, H] is the log decay (g = -exp(A_log) softplus(a + dt_bias) in Qwen3-Next), beta [T, H] in (0, 1).
Heads here are *value* heads: GQA models repeat key heads first (`expand_heads`).

SGLang 0.5.23's state pool stores the transpose, [slots, HV, dv, dk] ("K-last": see
`srt/layers/attention/linear/kernels/gdn_triton.py`, `ssm_states: [num_slots, HV, V, K]`). Use
`state_from_sglang` / `state_to_sglang` (a transpose of the last two dims) at that boundary. In
SGLang's layout a chunk maps S' -> S' M^T + s', so composition there is
`state_to_sglang(gdn_compose_ref(state_from_sglang(states), M, state_from_sglang(initial)))`.

Exact composition (LinearKV / HYPIC): the recurrence is affine in S, so a chunk of tokens maps
S_start -> M S_start + s, where M = prod_t exp(g_t)(I - beta_t k_t k_t^T) (latest token on the LEFT,
`gdn_chunk_transition_ref`) and s is the chunk's end state from a zero start. Chunks in order compose
by S <- M_i S + s_i (`gdn_compose_ref`).
"""

from __future__ import annotations

import torch

#: tokens per chunk of the chunked (WY) form; SGLang's Triton kernel and its `h` output use 64
CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's / SGLang's `use_qk_l2norm_in_kernel`)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[T, HK, D] -> [T, HV, D]: value head h reads key head h // (HV // HK)."""
    return x.repeat_interleave(num_v_heads // x.shape[1], dim=1)


def gdn_gating_ref(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
                   softplus_beta: float = 1.0, threshold: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [..., H]; A_log, dt_bias [H] -> (g, beta) fp32: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float(), beta=softplus_beta,
                                                            threshold=threshold)
    return g, torch.sigmoid(b.float())


def state_from_sglang(state: torch.Tensor) -> torch.Tensor:
    """SGLang pool layout [..., H, dv, dk] -> this package's [..., H, dk, dv] (a transposed view)."""
    return state.transpose(-1, -2)


def state_to_sglang(state: torch.Tensor) -> torch.Tensor:
    """This package's [..., H, dk, dv] -> SGLang pool layout [..., H, dv, dk] (a transposed view)."""
    return state.transpose(-1, -2)


def gdn_chunk_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, scale: float | None = None, chunk_size: int = CHUNK
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked (WY) GDN over one sequence, fp32.

    q, k [T, H, dk] (already L2-normalised and expanded to value heads); v [T, H, dv];
    g, beta [T, H]; state [H, dk, dv] (the initial state). Returns (o [T, H, dv], final state
    [H, dk, dv], h [ceil(T / chunk_size), H, dk, dv]: the state at each chunk's start, FLA's `h`).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    s_vk = state.float().transpose(-1, -2)                   # internal layout [H, dv, dk]
    outs, starts = [], []
    for c0 in range(0, q.shape[0], chunk_size):
        sl = slice(c0, min(c0 + chunk_size, q.shape[0]))
        starts.append(s_vk)
        o, s_vk = _one_chunk(q[sl] * scale, k[sl], v[sl], g[sl], beta[sl], s_vk)
        outs.append(o)
    h = torch.stack(starts) if starts else s_vk.new_zeros((0, *s_vk.shape))
    o = torch.cat(outs) if outs else v.new_zeros(v.shape)
    return o, s_vk.transpose(-1, -2), h.transpose(-1, -2)


def _one_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (scaled), k [C, H, dk]; v [C, H, dv]; g, beta [C, H]; state [H, dv, dk] -> (o [C, H, dv], state)."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))         # [H, C, *]
    g_cum = g.transpose(0, 1).cumsum(-1)                     # [H, C]
    b = beta.transpose(0, 1).unsqueeze(-1)                   # [H, C, 1]
    C = q.shape[1]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    # WY form: T = (I + strict_lower(beta K K^T * decay))^-1 ; u = T (beta V - beta exp(G) K S^T)
    kk = (b * k) @ k.transpose(-1, -2) * decay
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    lhs = eye + kk.tril(-1)
    w = torch.linalg.solve_triangular(lhs, b * k * g_cum.exp().unsqueeze(-1), upper=False)
    u = torch.linalg.solve_triangular(lhs, b * v, upper=False)
    v_new = u - w @ state.transpose(-1, -2)                  # [H, C, dv]
    attn = (q @ k.transpose(-1, -2)) * decay                 # includes the diagonal
    o = (q * g_cum.exp().unsqueeze(-1)) @ state.transpose(-1, -2) + attn @ v_new
    g_last = g_cum[:, -1:]
    k_decayed = k * (g_last - g_cum).exp().unsqueeze(-1)     # [H, C, dk]
    state = state * g_last.exp().unsqueeze(-1) + v_new.transpose(-1, -2) @ k_decayed
    return o.transpose(0, 1), state


def gdn_recurrent_step_ref(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, scale: float | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token, any leading batch dims: state [..., H, dk, dv]; q, k [..., H, dk]; v [..., H, dv];
    g, beta [..., H]. Returns (o [..., H, dv], new state), fp32."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = state.float() * g.exp()[..., None, None]
    pred = torch.einsum("...kv,...k->...v", state, k)
    delta = (v - pred) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    o = torch.einsum("...kv,...k->...v", state, q * scale)
    return o, state


def gdn_recurrent_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token GDN over one sequence: shapes as `gdn_chunk_ref`. Returns (o [T, H, dv], final state)."""
    outs = []
    for t in range(q.shape[0]):
        o, state = gdn_recurrent_step_ref(state, q[t], k[t], v[t], g[t], beta[t], scale)
        outs.append(o)
    o = torch.stack(outs) if outs else v.new_zeros(v.shape, dtype=torch.float32)
    return o, state.float()


def gdn_chunk_transition_ref(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Transition operator of a chunk: k [T, H, dk] (L2-normalised, value heads), g, beta [T, H].

    Returns M [H, dk, dk] fp32 = exp(g_T)(I - beta_T k_T k_T^T) ... exp(g_1)(I - beta_1 k_1 k_1^T),
    so that the chunk maps S_start -> M S_start + (its end state from zero). T = 0 gives I.
    """
    T, H, dk = k.shape
    M = torch.eye(dk, dtype=torch.float32, device=k.device).expand(H, dk, dk).clone()
    k, g, beta = k.float(), g.float(), beta.float()
    for t in range(T):
        kM = torch.einsum("hk,hkn->hn", k[t], M)                    # k_t^T M
        M = g[t].exp()[:, None, None] * (M - beta[t][:, None, None] * k[t][:, :, None] * kM[:, None, :])
    return M


def gdn_chunk_transition_via_chunked(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                                     chunk_size: int = CHUNK) -> torch.Tensor:
    """The same M by the "v = 0, initial state = I" trick: run the chunked forward (`gdn_chunk_ref`)
    with zero values from S_0 = I [H, dk, dk]; its final state is M. (Any chunked GDN kernel that
    takes an initial state gives M this way; with dv != dk use blocks of I's columns.)"""
    T, H, dk = k.shape
    eye = torch.eye(dk, dtype=torch.float32, device=k.device).expand(H, dk, dk).contiguous()
    zeros = k.new_zeros((T, H, dk), dtype=torch.float32)
    _, final, _ = gdn_chunk_ref(zeros, k, zeros, g, beta, eye, chunk_size=chunk_size)
    return final


def gdn_compose_ref(states: torch.Tensor, transitions: torch.Tensor, initial: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Exact composition of K chunks in order: states [K, H, dk, dv] (each chunk's end state from
    zero), transitions [K, H, dk, dk]; initial [H, dk, dv] or None (zero).

    Returns S [H, dk, dv] fp32 from S = initial; for i in 0..K-1: S <- M_i S + s_i.
    """
    if states.shape[0] != transitions.shape[0]:
        raise ValueError(f"gdn_compose_ref: {states.shape[0]} states but {transitions.shape[0]} transitions")
    S = states.new_zeros(states.shape[1:], dtype=torch.float32) if initial is None else initial.float()
    for s_i, m_i in zip(states.float(), transitions.float()):
        S = m_i @ S + s_i
    return S
